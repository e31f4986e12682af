"""One filter step, and the sequential filter's loop body built from it.

The step is the square-root one (`_sqrt`) unless the layer's private
`_square_root` is off; then it is the covariance form kept for comparisons: predict,
then condition on the whitened observations one scalar at a time (Koopman & Durbin,
J. Time Series Analysis 2000), so that the update needs no matrix solve.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from ._linalg import (
    _bmm,
    _gram,
    _LOG_2PI,
    _mm,
    _mT,
    _mv,
    _sandwich,
    _sym,
    tria,
    tril_inverse_by_rows,
)
from ._problem import _Model, _per_step, _Problem
from ._sqrt import sqrt_affine_update, sqrt_update, whitened_log_density


def _predict_cov(P: Array, F: Array, L_Q: Array) -> Array:
    return _sym(_sandwich(F, P) + _mm(L_Q, L_Q.T))


def _predict(m: Array, P: Array, F: Array, L_Q: Array, c: Array | None):
    m = _mv(F, m)
    if c is not None:
        m = m + c
    return m, _predict_cov(P, F, L_Q)


def first_prediction(model: _Model, c: Array | None) -> tuple[Array, Array]:
    """The predicted moments of `x_1`: the prior itself with `prior_at="x1"`, else
    the prior of `x_0` pushed through step 1's transition."""
    P0 = _gram(model.L_P0)
    if model.prior_at == "x1":
        return model.m0, P0
    F1 = model.F[0] if _per_step(model.F, 2) else model.F
    L_Q1 = model.L_Q[0] if _per_step(model.L_Q, 2) else model.L_Q
    return _predict(model.m0, P0, F1, L_Q1, None if c is None else c[0])


def first_factor(model: _Model, c: Array | None) -> tuple[Array, Array]:
    """`first_prediction` in square-root form: the predicted mean of `x_1` and a
    factor of its covariance, `tria([F_1 L_P0, L_Q1])` (no cancellation)."""
    if model.prior_at == "x1":
        return model.m0, model.L_P0
    F1 = model.F[0] if _per_step(model.F, 2) else model.F
    L_Q1 = model.L_Q[0] if _per_step(model.L_Q, 2) else model.L_Q
    m = _mv(F1, model.m0) if c is None else _mv(F1, model.m0) + c[0]
    return m, tria(jnp.concatenate([_mm(F1, model.L_P0), L_Q1], axis=1))


def _update(m: Array, P: Array, y: Array, Hw: Array, obs: Array):
    """Condition `N(m, P)` on `y = Hw x + e`, `e ~ N(0, I)`, one entry at a time.

    Returns the filtered mean and covariance, the log-density of the observed
    entries of `y` (without the whitening log-determinant), and each scalar
    update's gain `k_j`, innovation `e_j` and innovation variance `s_j`.
    """
    ll = jnp.zeros((), m.dtype)
    ks, es, ss = [], [], []
    for j in range(y.shape[0]):
        h = Hw[j]
        Ph = _mv(P, h)
        s = jnp.sum(h * Ph) + 1  # >= 1: the whitened noise has unit variance
        e = y[j] - jnp.sum(h * m)
        k = Ph / s
        m = m + k * e
        P = P - k[:, None] * Ph[None, :]
        ll = ll + jnp.where(obs[j], -0.5 * (_LOG_2PI + jnp.log(s) + e * e / s), 0)
        ks.append(k)
        es.append(e)
        ss.append(s)
    return m, _sym(P), ll, (jnp.stack(ks), jnp.stack(es), jnp.stack(ss))


@jax.custom_jvp
def _complete_update(m: Array, P: Array, y: Array, Hw: Array):
    """`_update` with every entry observed: the filtered mean and covariance and the
    log-density, with a derivative rule in matrix form.

    Reverse-mode autodiff through the unrolled scalar updates is a chain of small
    operations per observed entry; the rule is a dozen products. It
    differentiates the joint update `m' = m + C v`, `P' = P - C S^{-1} C^T`,
    `ll = -(p log 2pi + log|S| + e^T v) / 2`, with `C = P Hw^T`, `S = Hw C + I`,
    `e = y - Hw m`, `v = S^{-1} e`, which the scalar updates compute exactly: they
    factor `S = L diag(s) L^T` (`L` unit lower triangular, `L[j, i] = h_j . k_i`)
    and return `L^{-1} e`.
    """
    m, P, ll, _ = _update(m, P, y, Hw, jnp.ones(y.shape, bool))
    return m, P, ll


@_complete_update.defjvp
@full_precision
def _complete_update_jvp(primals, tangents):
    # `@` here, not the loop body's broadcast products: faster in reverse mode
    m, P, y, Hw = primals
    dm, dP, dy, dHw = tangents
    m_f, P_f, ll, (ks, es, ss) = _update(m, P, y, Hw, jnp.ones(y.shape, bool))
    p = y.shape[0]
    L = jnp.tril(Hw @ ks.T, -1) + jnp.eye(p, dtype=P.dtype)
    L_inv = tril_inverse_by_rows(L)
    S_inv = L_inv.T @ (L_inv / ss[:, None])
    C = P @ Hw.T
    K = C @ S_inv  # the joint gain
    v = L_inv.T @ (es / ss)
    dC = dP @ Hw.T + P @ dHw.T
    dS = Hw @ dC + dHw @ C
    de = dy - dHw @ m - Hw @ dm
    dv = S_inv @ (de - dS @ v)
    dm_f = dm + dC @ v + C @ dv
    dCK = dC @ K.T
    dP_f = dP - dCK - dCK.T + K @ dS @ K.T
    dll = -0.5 * jnp.sum(S_inv * dS) - jnp.sum(v * de) + 0.5 * jnp.sum(v * (dS @ v))
    return (m_f, P_f, ll), (dm_f, dP_f, dll)


def _affine_update(square_root: bool, S: Array, F: Array, L_Q: Array, Hw: Array):
    """The update after `S` (the previous filtered factor, or covariance), which
    for a fixed `S` is affine in the predicted mean and the observation:
    `(M, G, E_m, E_y, S_filt, log_s)` with `m_f = M m_pred + G y` and whitened
    innovations `E_m m_pred + E_y y` of log-variances `log_s` (the steady state's
    map). The covariance form takes the Jacobian of its own update."""
    if square_root:
        return sqrt_affine_update(_mm(F, S), L_Q, Hw)
    n, p = Hw.shape[1], Hw.shape[0]
    P_pred = _predict_cov(S, F, L_Q)
    obs = jnp.ones((p,), bool)

    def affine(m, y):
        m, _, _, (_, es, ss) = _update(m, P_pred, y, Hw, obs)
        return m, es / jnp.sqrt(ss)

    zeros = (jnp.zeros((n,), S.dtype), jnp.zeros((p,), S.dtype))
    (M, G), (E_m, E_y) = jax.jacfwd(affine, argnums=(0, 1))(*zeros)
    _, P_filt, _, (_, _, ss) = _update(*zeros[:1], P_pred, zeros[1], Hw, obs)
    return M, G, E_m, E_y, P_filt, jnp.log(ss)


def _initial(model: _Model, square_root: bool) -> Array:
    """The carry's factor (covariance) of `x_0`."""
    return model.L_P0 if square_root else _gram(model.L_P0)


def _covariances(S: Array, square_root: bool) -> Array:
    """Covariances from the carries, batched over the steps."""
    return _sym(_bmm(S, _mT(S))) if square_root else S


def _predicted_covs(model: _Model, covs: Array, prev: Array | None = None) -> Array:
    """The one-step predicted covariances of every step from the filtered ones of
    the previous, batched over the steps (additions only: no cancellation): of
    steps `1..T` (step 1's from the prior, `first_prediction`), or with `prev`
    (the filtered covariances before each step) of later steps."""
    P0 = _gram(model.L_P0)
    F_ax = 0 if _per_step(model.F, 2) else None
    Q_ax = 0 if _per_step(model.L_Q, 2) else None
    predict = jax.vmap(_predict_cov, in_axes=(0, F_ax, Q_ax))
    if prev is not None:
        return predict(prev, model.F, model.L_Q)
    Pps = predict(jnp.concatenate([P0[None], covs[:-1]]), model.F, model.L_Q)
    return Pps.at[0].set(P0) if model.prior_at == "x1" else Pps


def _sequential_step(problem: _Problem, *, square_root: bool, complete: bool = False):
    """The filter's loop body and its inputs: `(steps, xs, Hw_const)`.

    The body maps the carry `(m, S)` (mean and factor, or covariance, of the
    filtered state) to the next, and outputs `(m, S, m_pred, ll)`; `steps[True]`
    is rematerialised in the backward pass, `steps[False]` stores its
    intermediates (the steady state's few exact steps). With `complete` (every
    entry observed) the covariance form updates by `_complete_update`.
    """
    model, W = problem.model, problem.W
    F_v, Q_v, H_v, W_v = (
        _per_step(model.F, 2),
        _per_step(model.L_Q, 2),
        _per_step(model.H, 2),
        _per_step(W, 2),
    )
    Hw_const = None if (H_v or W_v) else W @ model.H
    xs = {"y": problem.yw, "obs": problem.obs}
    if F_v:
        xs["F"] = model.F
    if Q_v:
        xs["L_Q"] = model.L_Q
    if H_v:
        xs["H"] = model.H
    if W_v:
        xs["W"] = W
    if problem.c is not None:
        xs["c"] = problem.c
    if model.prior_at == "x1":
        # the carry into step 1 is the prior of x_1 itself: no transition
        xs["first"] = jnp.arange(problem.num_steps) == 0

    def step(carry, x):
        m, S = carry
        F = x["F"] if F_v else model.F
        L_Q = x["L_Q"] if Q_v else model.L_Q
        m_pred = _mv(F, m)
        if "c" in x:
            m_pred = m_pred + x["c"]
        if "first" in x:  # prior_at="x1": no transition into step 1
            m_pred = jnp.where(x["first"], m, m_pred)
        if Hw_const is None:
            Hw = _mm(x["W"] if W_v else W, x["H"] if H_v else model.H)
        else:
            Hw = Hw_const
        if square_root:
            FL = _mm(F, S)
            if "first" in x:  # the factor of the prior itself, no noise
                FL = jnp.where(x["first"], S, FL)
                L_Q = jnp.where(x["first"], 0, L_Q)
            m, S, nu, log_s = sqrt_update(m_pred, FL, L_Q, Hw, x["y"], loop=True)
            ll = whitened_log_density(nu, log_s, x["obs"])
            return (m, S), (m, S, m_pred, ll)
        P_pred = _predict_cov(S, F, L_Q)
        if "first" in x:
            P_pred = jnp.where(x["first"], S, P_pred)
        if complete:
            m, S, ll = _complete_update(m_pred, P_pred, x["y"], Hw)
        else:
            m, S, ll, _ = _update(m_pred, P_pred, x["y"], Hw, x["obs"])
        return (m, S), (m, S, m_pred, ll)

    # over all steps, rematerialised in the backward pass: storing every
    # intermediate of the unrolled updates made reverse mode slower; the steady
    # state's few exact steps (`_steady._head`) store theirs, which is faster
    steps = {True: jax.checkpoint(step), False: step}
    return steps, xs, Hw_const
