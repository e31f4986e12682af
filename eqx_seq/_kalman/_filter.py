"""The filter: one step (covariance and square-root form), the sequential loop and
the steady-state tail (the exact diffuse start built on the step is `_diffuse`).

The step is the square-root one (`sqrt_update` in `_linalg`) unless the layer's
private `_square_root` is off; then it is the covariance form kept for comparisons:
predict, then condition on the whitened observations one scalar at a time (Koopman &
Durbin, J. Time Series Analysis 2000), so that the update needs no matrix solve.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from ._interface import (
    filter_result,
    KalmanFilterResult,
)
from ._linalg import (
    bmm,
    gram,
    LOG_2PI,
    mm,
    mT,
    mv,
    sandwich,
    sqrt_affine_update,
    sqrt_update,
    sym,
    tria,
    tril_inverse_by_rows,
    whitened_log_density,
)
from ._model import (
    Model,
    per_step,
    Problem,
)


# --- one filter step, and the sequential filter's loop body built from it ---


def _predict_cov(P: Array, F: Array, L_Q: Array) -> Array:
    return sym(sandwich(F, P) + mm(L_Q, L_Q.T))


def predict(m: Array, P: Array, F: Array, L_Q: Array, c: Array | None):
    m = mv(F, m)
    if c is not None:
        m = m + c
    return m, _predict_cov(P, F, L_Q)


def first_prediction(model: Model, c: Array | None) -> tuple[Array, Array]:
    """The predicted moments of `x_1`: the prior itself with `prior_at="x1"`, else
    the prior of `x_0` pushed through step 1's transition."""
    P0 = gram(model.L_P0)
    if model.prior_at == "x1":
        return model.m0, P0
    F1 = model.F[0] if per_step(model.F, 2) else model.F
    L_Q1 = model.L_Q[0] if per_step(model.L_Q, 2) else model.L_Q
    return predict(model.m0, P0, F1, L_Q1, None if c is None else c[0])


def first_factor(model: Model, c: Array | None) -> tuple[Array, Array]:
    """`first_prediction` in square-root form: the predicted mean of `x_1` and a
    factor of its covariance, `tria([F_1 L_P0, L_Q1])` (no cancellation)."""
    if model.prior_at == "x1":
        return model.m0, model.L_P0
    F1 = model.F[0] if per_step(model.F, 2) else model.F
    L_Q1 = model.L_Q[0] if per_step(model.L_Q, 2) else model.L_Q
    m = mv(F1, model.m0) if c is None else mv(F1, model.m0) + c[0]
    return m, tria(jnp.concatenate([mm(F1, model.L_P0), L_Q1], axis=1))


def update(m: Array, P: Array, y: Array, Hw: Array, obs: Array):
    """Condition `N(m, P)` on `y = Hw x + e`, `e ~ N(0, I)`, one entry at a time.

    Returns the filtered mean and covariance, the log-density of the observed
    entries of `y` (without the whitening log-determinant), and each scalar
    update's gain `k_j`, innovation `e_j` and innovation variance `s_j`.
    """
    ll = jnp.zeros((), m.dtype)
    ks, es, ss = [], [], []
    for j in range(y.shape[0]):
        h = Hw[j]
        Ph = mv(P, h)
        s = jnp.sum(h * Ph) + 1  # >= 1: the whitened noise has unit variance
        e = y[j] - jnp.sum(h * m)
        k = Ph / s
        m = m + k * e
        P = P - k[:, None] * Ph[None, :]
        ll = ll + jnp.where(obs[j], -0.5 * (LOG_2PI + jnp.log(s) + e * e / s), 0)
        ks.append(k)
        es.append(e)
        ss.append(s)
    return m, sym(P), ll, (jnp.stack(ks), jnp.stack(es), jnp.stack(ss))


@jax.custom_jvp
def _complete_update(m: Array, P: Array, y: Array, Hw: Array):
    """`update` with every entry observed: the filtered mean and covariance and the
    log-density, with a derivative rule in matrix form.

    Reverse-mode autodiff through the unrolled scalar updates is a chain of small
    operations per observed entry; the rule is a dozen products. It
    differentiates the joint update `m' = m + C v`, `P' = P - C S^{-1} C^T`,
    `ll = -(p log 2pi + log|S| + e^T v) / 2`, with `C = P Hw^T`, `S = Hw C + I`,
    `e = y - Hw m`, `v = S^{-1} e`, which the scalar updates compute exactly: they
    factor `S = L diag(s) L^T` (`L` unit lower triangular, `L[j, i] = h_j . k_i`)
    and return `L^{-1} e`.
    """
    m, P, ll, _ = update(m, P, y, Hw, jnp.ones(y.shape, bool))
    return m, P, ll


@_complete_update.defjvp
@full_precision
def _complete_update_jvp(primals, tangents):
    # `@` here, not the loop body's broadcast products: faster in reverse mode
    m, P, y, Hw = primals
    dm, dP, dy, dHw = tangents
    m_f, P_f, ll, (ks, es, ss) = update(m, P, y, Hw, jnp.ones(y.shape, bool))
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
        return sqrt_affine_update(mm(F, S), L_Q, Hw)
    n, p = Hw.shape[1], Hw.shape[0]
    P_pred = _predict_cov(S, F, L_Q)
    obs = jnp.ones((p,), bool)

    def affine(m, y):
        m, _, _, (_, es, ss) = update(m, P_pred, y, Hw, obs)
        return m, es / jnp.sqrt(ss)

    zeros = (jnp.zeros((n,), S.dtype), jnp.zeros((p,), S.dtype))
    (M, G), (E_m, E_y) = jax.jacfwd(affine, argnums=(0, 1))(*zeros)
    _, P_filt, _, (_, _, ss) = update(*zeros[:1], P_pred, zeros[1], Hw, obs)
    return M, G, E_m, E_y, P_filt, jnp.log(ss)


def _initial(model: Model, square_root: bool) -> Array:
    """The carry's factor (covariance) of `x_0`."""
    return model.L_P0 if square_root else gram(model.L_P0)


def covariances(S: Array, square_root: bool) -> Array:
    """Covariances from the carries, batched over the steps."""
    return sym(bmm(S, mT(S))) if square_root else S


def predicted_covs(model: Model, covs: Array, prev: Array | None = None) -> Array:
    """The one-step predicted covariances of every step from the filtered ones of
    the previous, batched over the steps (additions only: no cancellation): of
    steps `1..T` (step 1's from the prior, `first_prediction`), or with `prev`
    (the filtered covariances before each step) of later steps."""
    P0 = gram(model.L_P0)
    F_ax = 0 if per_step(model.F, 2) else None
    Q_ax = 0 if per_step(model.L_Q, 2) else None
    predict = jax.vmap(_predict_cov, in_axes=(0, F_ax, Q_ax))
    if prev is not None:
        return predict(prev, model.F, model.L_Q)
    Pps = predict(jnp.concatenate([P0[None], covs[:-1]]), model.F, model.L_Q)
    return Pps.at[0].set(P0) if model.prior_at == "x1" else Pps


def sequential_step(problem: Problem, *, square_root: bool, complete: bool = False):
    """The filter's loop body and its inputs: `(steps, xs, Hw_const)`.

    The body maps the carry `(m, S)` (mean and factor, or covariance, of the
    filtered state) to the next, and outputs `(m, S, m_pred, ll)`; `steps[True]`
    is rematerialised in the backward pass, `steps[False]` stores its
    intermediates (the steady state's few exact steps). With `complete` (every
    entry observed) the covariance form updates by `_complete_update`.
    """
    model, W = problem.model, problem.W
    F_v, Q_v, H_v, W_v = (
        per_step(model.F, 2),
        per_step(model.L_Q, 2),
        per_step(model.H, 2),
        per_step(W, 2),
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
        m_pred = mv(F, m)
        if "c" in x:
            m_pred = m_pred + x["c"]
        if "first" in x:  # prior_at="x1": no transition into step 1
            m_pred = jnp.where(x["first"], m, m_pred)
        if Hw_const is None:
            Hw = mm(x["W"] if W_v else W, x["H"] if H_v else model.H)
        else:
            Hw = Hw_const
        if square_root:
            FL = mm(F, S)
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
            m, S, ll, _ = update(m_pred, P_pred, x["y"], Hw, x["obs"])
        return (m, S), (m, S, m_pred, ll)

    # over all steps, rematerialised in the backward pass: storing every
    # intermediate of the unrolled updates made reverse mode slower; the steady
    # state's few exact steps (`run_head`) store theirs, which is faster
    steps = {True: jax.checkpoint(step), False: step}
    return steps, xs, Hw_const


# --- the sequential filter: a `lax.scan` of the step, with the steady-state
# shortcut (below) where it applies ---


def filter_exact(
    problem: Problem, *, square_root: bool
) -> tuple[KalmanFilterResult, Array]:
    """The filter with every step exact, and its carries: the filtered covariances'
    factors (square-root form) or the covariances themselves."""
    steps, xs, _ = sequential_step(problem, square_root=square_root)
    init = (problem.model.m0, _initial(problem.model, square_root))
    _, (ms, Ss, mps, lls) = lax.scan(steps[True], init, xs)
    covs = covariances(Ss, square_root)
    result = filter_result(
        ms, covs, mps, predicted_covs(problem.model, covs), lls, problem.logdet
    )
    return result, Ss


def filter_sequential(
    problem: Problem, *, steady_state: bool = True, square_root: bool = True
) -> KalmanFilterResult:
    """The filter in a `lax.scan`. With `steady_state`, for a time-invariant model
    with complete data (`W` one matrix), the steps after the covariance has settled
    are the steady-state filter (`filter_steady`); until then, and otherwise, every step
    is exact."""
    if steady_state and may_settle(problem):
        return filter_steady(problem, square_root=square_root)[0]
    return filter_exact(problem, square_root=square_root)[0]


# --- the steady-state filter: time-invariant model, complete data ---
#
# The covariance recursion then does not depend on the data and converges. After `K`
# exact steps `settle` estimates the distance of the covariance from its fixed point;
# when it is within a few units of round-off, the remaining steps are the
# steady-state filter (`steady_tail`): the means are a loop of one matrix-vector
# product, innovations and log-likelihoods are batched, the covariances are the fixed
# ones. See `docs/devdocs/kalman.md`, "Steady state".


def head_steps(dtype) -> int:
    """Exact steps before the steady state is tried: enough for most models to
    settle in this precision (one that has not runs every step exactly), few
    enough that a gradient does not pay for many exact steps."""
    return 32 if jnp.finfo(dtype).bits <= 32 else 128


# The covariance counts as settled when the estimated distance to the fixed point of
# its recursion is at most this many units of round-off (relative, Frobenius).
_SETTLED_ULPS = 8


def may_settle(problem: Problem) -> bool:
    """Static part of the test: a time-invariant model, complete data (one
    whitening matrix), and steps to spare after the exact head."""
    model, W = problem.model, problem.W
    varies = any(per_step(a, 2) for a in (model.F, model.L_Q, model.H, W))
    return not varies and problem.num_steps > head_steps(W.dtype) + 1


def run_head(step, init, xs, dtype):
    """The exact steps `1..K`: their outputs, the carry after them, and the
    remaining inputs."""
    K = head_steps(dtype)
    head_xs = jax.tree.map(lambda a: a[:K], xs)
    tail_xs = jax.tree.map(lambda a: a[K:], xs)
    carry, head = lax.scan(step, init, head_xs)
    return head, carry, tail_xs


class _Settled(eqx.Module):
    """The filter's update once its covariance has settled, as an affine map:
    `m_filt = M m_pred + G y` with whitened innovations `nu = E_m m_pred + E_y y`
    of log-variances `log_s` (for whitened `y`), and the fixed covariances (and
    the filtered one's factor, or the covariance itself in covariance form)."""

    P_pred: Array
    P_filt: Array
    S_filt: Array
    M: Array
    G: Array
    E_m: Array
    E_y: Array
    log_s: Array
    ok: Array


def settle(model: Model, m: Array, S: Array, Hw: Array, square_root: bool):
    """One more exact step from the filtered factor (covariance) `S` at step `K`,
    the update after it as an affine map, and whether the covariance has settled.

    The affine map is the step's own update for a fixed covariance
    (`_affine_update`), so the steady-state steps compute what the exact steps
    compute. Settled: near the fixed point the change `D = P_{K+1} - P_K`
    propagates as `A D A^T` with the closed-loop matrix `A = M F`, so the distance
    of `P_{K+1}` from the fixed point is about `sum_{j >= 1} A^j D A^jT` (summed by
    doubling to `j = 256`, which also checks that `A` contracts); `ok` when that is
    within `_SETTLED_ULPS` units of round-off of `P_{K+1}`.
    """
    M, G, E_m, E_y, S_filt, log_s = _affine_update(
        square_root, S, model.F, model.L_Q, Hw
    )
    P = gram(S) if square_root else S
    P_filt = sym(gram(S_filt)) if square_root else S_filt
    A = M @ model.F
    D = A @ (P_filt - P) @ A.T
    for _ in range(8):
        D = D + A @ D @ A.T
        A = A @ A
    eps = jnp.finfo(S.dtype).eps
    norm = lambda X: jnp.sqrt(jnp.sum(X * X))
    ok = (norm(D) <= _SETTLED_ULPS * eps * norm(P_filt)) & (norm(A) < 0.5)
    P_pred = _predict_cov(P, model.F, model.L_Q)
    return _Settled(P_pred, P_filt, S_filt, M, G, E_m, E_y, log_s, ok)


def affine_scan(A: Array, z: Array, m: Array) -> Array:
    """`m_t = A m_{t-1} + z_t` for `t = 1..T` from `m_0 = m`: all `m_t`."""

    def step(m, z_t):
        m = mv(A, m) + z_t
        return m, m

    return lax.scan(step, m, z)[1]


@jax.custom_jvp
def dense_recurrence(A: Array, z: Array, m: Array) -> Array:
    """`affine_scan`, differentiated as the same recurrence driven by
    `dA m_{t-1} + dz_t` (one batched product): reverse mode then transposes a loop
    with `A` fixed, instead of accumulating `dA` one outer product per step."""
    return affine_scan(A, z, m)


@dense_recurrence.defjvp
@full_precision
def _dense_recurrence_jvp(primals, tangents):
    A, z, m = primals
    dA, dz, dm = tangents
    ms = affine_scan(A, z, m)
    prev = jnp.concatenate([m[None], ms[:-1]])
    return ms, affine_scan(A, prev @ dA.T + dz, dm)


def steady_tail(model: Model, st: _Settled, m: Array, xs) -> tuple:
    """Steps `K+1..T` with the settled covariance: the means are the linear
    recurrence `m_t = M F m_{t-1} + M c_t + G y_t` (a loop of one small matrix-vector
    product), everything else is batched over the steps."""
    y, c = xs["y"], xs.get("c")
    A = st.M @ model.F
    z = y @ st.G.T if c is None else y @ st.G.T + c @ st.M.T

    ms = dense_recurrence(A, z, m)
    mps = jnp.concatenate([m[None], ms[:-1]]) @ model.F.T
    if c is not None:
        mps = mps + c
    nus = mps @ st.E_m.T + y @ st.E_y.T
    log_s = st.log_s[None, :]
    lls = jnp.sum(-0.5 * (LOG_2PI + log_s + nus * nus), axis=-1)
    T = y.shape[0]
    Ps = jnp.broadcast_to(st.P_filt, (T, *st.P_filt.shape))
    Pps = jnp.broadcast_to(st.P_pred, (T, *st.P_pred.shape))
    return ms, Ps, mps, Pps, lls


def filter_steady(
    problem: Problem,
    *,
    square_root: bool = True,
    exact_fallback: bool = True,
    factors: bool = False,
) -> tuple:
    """The filter of a problem that `may_settle`, and whether its covariance settled.

    The `K` exact steps, then the steady-state tail if the covariance settled, else
    (a `lax.cond`) the exact tail. The gradient's and the smoother's paths
    (`exact_fallback=False`) run the steady-state tail in any case, and use the
    result only if settled. With `factors`, also the head's filtered factors
    (covariances in covariance form) and the tail's fixed one.
    """
    model = problem.model
    steps, xs, Hw = sequential_step(problem, square_root=square_root, complete=True)
    init = (model.m0, _initial(model, square_root))
    head, (m, S), tail_xs = run_head(steps[False], init, xs, problem.yw.dtype)
    head_factors = head[1]
    head_covs = covariances(head_factors, square_root)
    head = (head[0], head_covs, head[2], predicted_covs(model, head_covs), head[3])
    settled = settle(model, m, S, Hw, square_root)
    steady = lambda: steady_tail(model, settled, m, tail_xs)
    if exact_fallback:

        def exact():
            ms, Ss, mps, lls = lax.scan(steps[True], (m, S), tail_xs)[1]
            covs = covariances(Ss, square_root)
            prev = jnp.concatenate([head_covs[-1:], covs[:-1]])
            return ms, covs, mps, predicted_covs(model, covs, prev), lls

        tail = lax.cond(settled.ok, steady, exact)
    else:
        tail = steady()
    outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), head, tail)
    result = filter_result(*outs, problem.logdet)
    if factors:
        return result, settled.ok, (head_factors, settled.S_filt)
    return result, settled.ok
