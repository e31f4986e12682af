"""Kalman filter and RTS smoother for a linear-Gaussian state-space model.

The model, for `t = 1, ..., T` (array row `t - 1`), from `x_0 ~ N(m0, P0)`:

    x_t = F_t x_{t-1} + B u_t + q_t,    q_t ~ N(0, Q_t)
    y_t = H_t x_t     + D u_t + r_t,    r_t ~ N(0, R_t)

How it is computed (see `KalmanFilter` for the user-facing account):

- Observations are whitened by the Cholesky factor of `R_t` (`L_t^{-1} y_t`), then
  conditioned on one scalar at a time (Koopman & Durbin, J. Time Series Analysis
  2000): the update needs no matrix solve inside the sequential loop. A NaN entry
  becomes a zero row of the whitened emission, which conditions on nothing, and is
  masked out of the log-likelihood; the masked `R_t` is then factored per step.
- `SequentialScan`: the standard filter in a `lax.scan`. `AssociativeScan`: the
  Särkkä & García-Fernández (IEEE TAC 2021) elements in an associative scan
  (`_level_scan.level_scan`: all its stages are one loop, so the heavy combine is
  traced once and compile time stays flat in `T`),
  then the log-likelihood from the filtered states (never inside the scan element,
  which cancels catastrophically when the state drifts far from zero).
- Smoother, `SequentialScan`: Bryson-Frazier form, backwards over the filter's
  scalar updates in information form (`_smooth_sequential`): no matrix is
  factored. `AssociativeScan`: the RTS elements `(E_t, g_t, L_t)`, which depend on
  filtered moments only, computed for all steps at once, then the affine
  recurrence `(m, P) <- (E m + g, E P E^T + L)` as an associative scan.
- Steady state (`SequentialScan`, time-invariant model, complete data): the
  covariance recursion does not depend on the data and converges. After `K`
  exact steps (32 in float32, 128 in float64) `_settle` estimates the distance
  of the covariance from its fixed point; when it is within a few units of
  round-off, the remaining steps are the steady-state filter (`_steady_tail`):
  the means are a loop of one matrix-vector product, innovations and
  log-likelihoods are batched, the covariances are the fixed ones. Otherwise (a
  `lax.cond`) every step stays exact. The smoother always runs the exact filter.
- `KalmanFilter.log_likelihood` is differentiated by Fisher's identity,
  `d/dθ log p(y) = E[d/dθ log p(x, y) | y]`: a `jax.custom_jvp` whose tangent is
  the gradient of the expected complete-data log-likelihood at the smoother's
  moments (`_expected_log_joint`, scan-free), so reverse mode costs one filter,
  one smoother and a batched gradient, with no autodiff through the loop. When
  the steady state applies, plain autodiff through the steady-state filter is
  cheaper (the loop left to differentiate is `K` exact steps and one
  matrix-vector product per step), and is used instead.
  `KalmanFilter.filter` (and so the filtered means) is plain autodiff.
"""

import functools as ft
import math
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg as jsl
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from . import _small_linalg as small_linalg
from ._level_scan import level_scan
from ._misc import (
    check_parameter_dtype,
    check_positive_int,
    error_if_any,
    full_precision,
    vary_like,
    zeros_like_inputs,
)
from ._scan import AbstractScan, AssociativeScan, AutoScan


# --- small linear-algebra helpers -------------------------------------------------


def _sym(P: Array) -> Array:
    return 0.5 * (P + jnp.swapaxes(P, -1, -2))


def _mT(A: Array) -> Array:
    return jnp.swapaxes(A, -1, -2)


def _eye_like(A: Array) -> Array:
    return jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)


def _chol(A: Array) -> Array:
    """Cholesky factor of a symmetric PSD matrix, with jitter scaled to its dtype.

    The jitter is `eps(dtype) * mean(diag(A))` on the diagonal: invisible in float64,
    enough in float32 to keep a matrix that is PD up to rounding factorable.
    """
    A = _sym(A)
    scale = jnp.mean(jnp.diagonal(A, axis1=-2, axis2=-1), axis=-1)
    jitter = jnp.finfo(A.dtype).eps * jnp.abs(scale)
    return jnp.linalg.cholesky(A + jitter[..., None, None] * _eye_like(A))


def _cho_solve(L: Array, B: Array) -> Array:
    """`(L L^T)^{-1} B` from a lower Cholesky factor `L`."""
    Z = jsl.solve_triangular(L, B, lower=True)
    return jsl.solve_triangular(L, Z, lower=True, trans=1)


def _factor(raw: Array) -> Array:
    """Unconstrained `raw` -> lower-triangular factor with diagonal `exp(diag(raw))`.

    The upper triangle of `raw` is ignored (and receives zero gradient).
    """
    eye = jnp.broadcast_to(jnp.eye(raw.shape[-1], dtype=bool), raw.shape)
    # double where: exp of an off-diagonal entry may overflow, its gradient must not
    return jnp.where(eye, jnp.exp(jnp.where(eye, raw, 0)), jnp.tril(raw))


def _unfactor(L: Array) -> Array:
    """The inverse of `_factor` on lower-triangular `L` with a positive diagonal."""
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=bool), L.shape)
    return jnp.where(eye, jnp.log(jnp.where(eye, L, 1)), jnp.tril(L))


@full_precision
def _gram(L: Array) -> Array:
    return L @ _mT(L)


_LOG_2PI = math.log(2 * math.pi)


# --- results ---


class KalmanFilterResult(eqx.Module):
    """What [`eqx_seq.KalmanFilter.filter`][] returns.

    Row `t - 1` of each array is about step `t`: `means[t-1]` and `covs[t-1]` are
    the filtered `E[x_t | y_1..y_t]` and `Cov[x_t | y_1..y_t]`; `predicted_means` and
    `predicted_covs` the one-step predictions given `y_1..y_{t-1}`;
    `log_likelihoods[t-1]` is `log p(y_t | y_1..y_{t-1})` over the observed (non-NaN)
    entries of `y_t` (zero for a step with none); `log_likelihood` is their sum,
    `log p(y_1..y_T)`.
    """

    means: Float[Array, "T n"]
    covs: Float[Array, "T n n"]
    predicted_means: Float[Array, "T n"]
    predicted_covs: Float[Array, "T n n"]
    log_likelihoods: Float[Array, " T"]
    log_likelihood: Float[Array, ""]


class KalmanSmootherResult(eqx.Module):
    """What [`eqx_seq.KalmanFilter.smooth`][] returns.

    `means[t-1]` and `covs[t-1]` are the smoothed `E[x_t | y_1..y_T]` and
    `Cov[x_t | y_1..y_T]`; `cross_covs[t-1]` is `Cov[x_t, x_{t+1} | y_1..y_T]` for
    `t < T` (what EM needs); `filtered` is the filter's result, log-likelihood
    included.
    """

    means: Float[Array, "T n"]
    covs: Float[Array, "T n n"]
    cross_covs: Float[Array, "T-1 n n"]
    filtered: KalmanFilterResult


# --- the model in computational form ---


class _Model(eqx.Module):
    """Matrices of one model, each `(..)` or `(T, ..)` (time-varying)."""

    F: Array
    L_Q: Array
    H: Array
    L_R: Array
    m0: Array
    L_P0: Array


def _per_step(x: Array, ndim: int) -> bool:
    return x.ndim > ndim


def _bt(x: Array, T: int) -> Array:
    """A `(..)` or `(T, ..)` matrix as `(T, ..)`."""
    return x if x.ndim == 3 else jnp.broadcast_to(x, (T, *x.shape))


def _whiten(L_R: Array, obs: Array, R_varies: bool) -> tuple[Array, Array]:
    """Per-step whitening matrices `W_t` (missing columns zeroed) and log-dets.

    `W_t = L_t^{-1} M_t`, with `L_t` the Cholesky factor of `R_t` restricted to the
    observed entries (identity on the missing ones) and `M_t` the 0/1 mask. Then
    `W_t (y_t - D u_t)` is a vector of independent unit-variance observations of
    `W_t H_t x_t` (a missing entry gives `0 = 0 x + noise`, which conditions on
    nothing), and `log det L_t` counts observed entries only.
    """
    T, p = obs.shape
    dtype = L_R.dtype
    R = _gram(L_R)
    if not R_varies:
        R = jnp.broadcast_to(R, (T, p, p))
    both = obs[:, :, None] & obs[:, None, :]
    eye = jnp.broadcast_to(jnp.eye(p, dtype=bool), (T, p, p))
    R = jnp.where(both, R, jnp.where(eye, jnp.ones((), dtype), 0))
    # a factorisation per step, not batched LAPACK, which can deadlock (see
    # `_small_linalg`)
    W = small_linalg.inverse_cholesky(R)
    logdet = -jnp.sum(jnp.log(jnp.diagonal(W, axis1=-2, axis2=-1)), axis=-1)
    W = jnp.where(obs[:, None, :], W, 0)
    return W, logdet


# --- one filter step (shared by both backends) ---


# Up to this size the sequential step multiplies matrices as broadcast products and
# sums, which XLA fuses into a few loop kernels; `@` becomes a library call per
# product whose overhead dominates at these sizes (measured 3x faster at n=4, on par
# at n=16; benchmarks/README.md).
_ELEMENTWISE_MAX = 16


def _mm(A: Array, B: Array) -> Array:
    if max(A.shape[-1], A.shape[-2], B.shape[-1]) > _ELEMENTWISE_MAX:
        return A @ B
    return jnp.sum(A[:, :, None] * B[None, :, :], axis=1)


# Up to this state size `A X A^T` in the sequential loops is one broadcast product
# summed over two axes (n^4 terms, one fused kernel: 10x faster at n=4); beyond
# it, two matrix products (the n^4 form was 6x slower at n=8, 15x at n=16).
_SANDWICH_4D_MAX = 4


def _sandwich(A: Array, X: Array) -> Array:
    """`A X A^T` for small matrices."""
    if A.shape[-1] <= _SANDWICH_4D_MAX and A.shape[-2] <= _SANDWICH_4D_MAX:
        out = jnp.sum(
            A[:, :, None, None] * X[None, :, :, None] * A.T[None, None], axis=(1, 2)
        )
        return out
    return _mm(_mm(A, X), A.T)


def _bmm(A: Array, B: Array) -> Array:
    """`A @ B` over leading batch axes; small matrices as a broadcast product and
    sum (XLA:CPU's batched dot is slow for them: measured 10x at n=4, 2x at 16)."""
    if max(A.shape[-1], A.shape[-2], B.shape[-1]) > _ELEMENTWISE_MAX:
        return A @ B
    return jnp.sum(A[..., :, :, None] * B[..., None, :, :], axis=-2)


def _mv(A: Array, x: Array) -> Array:
    if max(A.shape) > _ELEMENTWISE_MAX:
        return A @ x
    return jnp.sum(A * x[None, :], axis=1)


def _predict(m: Array, P: Array, F: Array, L_Q: Array, c: Array | None):
    m = _mv(F, m)
    if c is not None:
        m = m + c
    P = _sym(_sandwich(F, P) + _mm(L_Q, L_Q.T))
    return m, P


def _update(m: Array, P: Array, y: Array, Hw: Array, obs: Array):
    """Condition `N(m, P)` on `y = Hw x + e`, `e ~ N(0, I)`, one entry at a time.

    Returns the filtered mean and covariance, the log-density of the observed
    entries of `y` (without the whitening log-determinant), and what the
    smoother needs of each scalar update: the gains `k_j`, innovations `e_j` and
    innovation variances `s_j`.
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

    Reverse-mode autodiff through the unrolled scalar updates, a chain of small
    operations per observed entry, measured about 140 us per step at state 16 /
    obs 8 (with rematerialisation); the rule is a dozen products. It
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
    # `@` here, not the loop body's broadcast products: 1.2x faster in reverse mode
    # (measured, n=16, p=8)
    m, P, y, Hw = primals
    dm, dP, dy, dHw = tangents
    m_f, P_f, ll, (ks, es, ss) = _update(m, P, y, Hw, jnp.ones(y.shape, bool))
    p = y.shape[0]
    L = jnp.tril(Hw @ ks.T, -1) + jnp.eye(p, dtype=P.dtype)
    L_inv = small_linalg.tril_inverse_by_rows(L)
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


# --- filters ---


def _sequential_step(model: _Model, c, yw, obs, W, complete: bool = False):
    """The filter's loop body and its inputs: `(steps, xs, Hw_const)`, with
    `steps[record]` for long scans and `steps["head"]` for `_head`; with `complete`
    (every entry observed), the steps without `record` update by
    `_complete_update`."""
    F_v, Q_v, H_v, W_v = (
        _per_step(model.F, 2),
        _per_step(model.L_Q, 2),
        _per_step(model.H, 2),
        _per_step(W, 2),
    )
    Hw_const = None if (H_v or W_v) else W @ model.H
    xs = {"y": yw, "obs": obs}
    if F_v:
        xs["F"] = model.F
    if Q_v:
        xs["L_Q"] = model.L_Q
    if H_v:
        xs["H"] = model.H
    if W_v:
        xs["W"] = W
    if c is not None:
        xs["c"] = c

    def step(carry, x, record=False):
        m, P = carry
        F = x["F"] if F_v else model.F
        L_Q = x["L_Q"] if Q_v else model.L_Q
        m_pred, P_pred = _predict(m, P, F, L_Q, x.get("c"))
        if Hw_const is None:
            Hw = _mm(x["W"] if W_v else W, x["H"] if H_v else model.H)
        else:
            Hw = Hw_const
        if complete and not record:
            m, P, ll = _complete_update(m_pred, P_pred, x["y"], Hw)
            rec = None
        else:
            m, P, ll, rec = _update(m_pred, P_pred, x["y"], Hw, x["obs"])
        out = (m, P, m_pred, P_pred, ll)
        return (m, P), (out, rec) if record else out

    # over all steps, rematerialised in the backward pass: storing every
    # intermediate of the unrolled scalar updates made reverse mode 5x slower
    # (measured, n=16, p=8); the steady state's `K` exact steps (`_head`) store
    # theirs (1.2x faster in reverse mode, measured)
    steps = {r: jax.checkpoint(ft.partial(step, record=r)) for r in (False, True)}
    steps["head"] = step
    return steps, xs, Hw_const


def _filter_sequential(model: _Model, c, yw, obs, W, logdet, record: bool = False):
    """The filter in a `lax.scan`; with `record`, also what the smoother needs.

    Without `record`, for a time-invariant model with complete data (`W` one
    matrix), the steps after the covariance has settled are the steady-state
    filter (`_settle`); until then, and otherwise, every step is exact.
    """
    may_settle = not record and _may_settle(model, W, yw.shape[0])
    steps, xs, Hw_const = _sequential_step(model, c, yw, obs, W, complete=may_settle)
    step = steps[False]
    init = (model.m0, _gram(model.L_P0))
    if record:
        _, ((ms, Ps, mps, Pps, lls), rec) = lax.scan(steps[True], init, xs)
    elif may_settle:
        head, (m, P), tail_xs = _head(steps["head"], init, xs, yw.dtype)
        settled = _settle(model, m, P, Hw_const)
        tail = lax.cond(
            settled.ok,
            lambda: _steady_tail(model, settled, m, tail_xs),
            lambda: lax.scan(step, (m, P), tail_xs)[1],
        )
        ms, Ps, mps, Pps, lls = jax.tree.map(
            lambda a, b: jnp.concatenate([a, b]), head, tail
        )
    else:
        _, (ms, Ps, mps, Pps, lls) = lax.scan(step, init, xs)
    lls = lls - logdet
    result = KalmanFilterResult(ms, Ps, mps, Pps, lls, jnp.sum(lls))
    if not record:
        return result
    Hw = (
        Hw_const
        if Hw_const is not None
        else _bt(W, yw.shape[0]) @ _bt(model.H, yw.shape[0])
    )
    return result, (Hw, *rec)


# --- the steady-state filter ---


def _head_steps(dtype) -> int:
    """Exact steps before the steady state is tried. Measured, steps to settle
    (`_settle`) in float32: random models of state 3-16, 8-46 (most below 32); a
    barely observed state-8 / obs-1 model, 119. In float64, 96-128. A model still
    moving at `K` runs every step exactly; a larger `K` makes every gradient pay
    for more exact steps (about 70 us each in reverse mode at state 16 / obs 8)."""
    return 32 if jnp.finfo(dtype).bits <= 32 else 128


# The covariance counts as settled when the estimated distance to the fixed point of
# its recursion is at most this many units of round-off (relative, Frobenius).
_SETTLED_ULPS = 8


def _may_settle(model: _Model, W: Array, T: int) -> bool:
    """Static part of the test: a time-invariant model, complete data (one
    whitening matrix), and steps to spare after the exact head."""
    varies = any(_per_step(a, 2) for a in (model.F, model.L_Q, model.H, model.L_R, W))
    return not varies and T > _head_steps(W.dtype) + 1


def _head(step, init, xs, dtype):
    """The exact steps `1..K`: their outputs, the carry after them, and the
    remaining inputs."""
    K = _head_steps(dtype)
    head_xs = jax.tree.map(lambda a: a[:K], xs)
    tail_xs = jax.tree.map(lambda a: a[K:], xs)
    carry, head = lax.scan(step, init, head_xs)
    return head, carry, tail_xs


class _Settled(eqx.Module):
    """The filter's update once its covariance has settled, as an affine map:
    `m_filt = M m_pred + G y` with innovations `e = E_m m_pred + E_y y` of
    variances `s` (for whitened `y`), and the fixed covariances."""

    P_pred: Array
    P_filt: Array
    M: Array
    G: Array
    E_m: Array
    E_y: Array
    s: Array
    ok: Array


def _settle(model: _Model, m: Array, P: Array, Hw: Array) -> _Settled:
    """One more exact covariance step from the filtered `P` at step `K`, the update
    at its predicted covariance as an affine map, and whether `P` has settled.

    The affine map is the Jacobian of `_update` itself (which is affine in the mean
    and the observation for a fixed covariance), so the steady-state steps compute
    what the exact steps compute. Settled: near the fixed point the change
    `D = P_{K+1} - P_K` propagates as `A D A^T` with the closed-loop matrix
    `A = M F`, so the distance of `P_{K+1}` from the fixed point is about
    `sum_{j >= 1} A^j D A^jT` (summed by doubling to `j = 256`, which also checks
    that `A` contracts); `ok` when that is within `_SETTLED_ULPS` units of
    round-off of `P_{K+1}`.
    """
    n, p = Hw.shape[1], Hw.shape[0]
    dtype = P.dtype
    _, P_pred = _predict(m, P, model.F, model.L_Q, None)
    obs = jnp.ones((p,), bool)

    def affine(m, y):
        m, _, _, (_, es, _) = _update(m, P_pred, y, Hw, obs)
        return m, es

    zeros = (jnp.zeros((n,), dtype), jnp.zeros((p,), dtype))
    (M, G), (E_m, E_y) = jax.jacfwd(affine, argnums=(0, 1))(*zeros)
    _, P_filt, _, (_, _, s) = _update(*zeros[:1], P_pred, zeros[1], Hw, obs)
    A = M @ model.F
    D = A @ (P_filt - P) @ A.T
    for _ in range(8):
        D = D + A @ D @ A.T
        A = A @ A
    eps = jnp.finfo(dtype).eps
    norm = lambda X: jnp.sqrt(jnp.sum(X * X))
    ok = (norm(D) <= _SETTLED_ULPS * eps * norm(P_filt)) & (norm(A) < 0.5)
    return _Settled(P_pred, P_filt, M, G, E_m, E_y, s, ok)


def _affine_scan(A: Array, z: Array, m: Array) -> Array:
    """`m_t = A m_{t-1} + z_t` for `t = 1..T` from `m_0 = m`: all `m_t`."""

    def step(m, z_t):
        m = _mv(A, m) + z_t
        return m, m

    return lax.scan(step, m, z)[1]


@jax.custom_jvp
def _dense_recurrence(A: Array, z: Array, m: Array) -> Array:
    """`_affine_scan`, differentiated as the same recurrence driven by
    `dA m_{t-1} + dz_t` (one batched product): reverse mode then transposes a loop
    with `A` fixed, instead of accumulating `dA` one outer product per step."""
    return _affine_scan(A, z, m)


@_dense_recurrence.defjvp
@full_precision
def _dense_recurrence_jvp(primals, tangents):
    A, z, m = primals
    dA, dz, dm = tangents
    ms = _affine_scan(A, z, m)
    prev = jnp.concatenate([m[None], ms[:-1]])
    return ms, _affine_scan(A, prev @ dA.T + dz, dm)


def _steady_tail(model: _Model, st: _Settled, m: Array, xs) -> tuple:
    """Steps `K+1..T` with the settled covariance: the means are the linear
    recurrence `m_t = M F m_{t-1} + M c_t + G y_t` (a loop of one small matrix-vector
    product), everything else is batched over the steps."""
    y, c = xs["y"], xs.get("c")
    A = st.M @ model.F
    z = y @ st.G.T if c is None else y @ st.G.T + c @ st.M.T

    ms = _dense_recurrence(A, z, m)
    mps = jnp.concatenate([m[None], ms[:-1]]) @ model.F.T
    if c is not None:
        mps = mps + c
    es = mps @ st.E_m.T + y @ st.E_y.T
    s = st.s[None, :]
    lls = jnp.sum(-0.5 * (_LOG_2PI + jnp.log(s) + es * es / s), axis=-1)
    T = y.shape[0]
    Ps = jnp.broadcast_to(st.P_filt, (T, *st.P_filt.shape))
    Pps = jnp.broadcast_to(st.P_pred, (T, *st.P_pred.shape))
    return ms, Ps, mps, Pps, lls


def _filter_elements(model: _Model, c, yw, obs, W):
    """Särkkä & García-Fernández filtering elements `(A, b, C, eta, J)`, all steps.

    Element `t` is `p(x_t | x_{t-1}, y_t) = N(A x_{t-1} + b, C)` together with the
    information `(eta, J)` that `y_t` carries about `x_{t-1}`; element 1 has the
    prior folded in (`A = 0`, `eta = 0`, `J = 0`).
    """
    T, p = yw.shape
    n = model.m0.shape[0]
    dtype = yw.dtype
    F = jnp.broadcast_to(model.F, (T, n, n))
    Q = jnp.broadcast_to(_gram(model.L_Q), (T, n, n))
    mu = jnp.zeros((T, n), dtype) if c is None else c
    Hw = _bt(W, T) @ _bt(model.H, T)
    # step 1: predict from the prior, and no dependence on x_0
    m_pred0, P_pred0 = _predict(
        model.m0,
        _gram(model.L_P0),
        F[0],
        model.L_Q[0] if _per_step(model.L_Q, 2) else model.L_Q,
        None if c is None else c[0],
    )
    mu = mu.at[0].set(m_pred0)
    Sigma = Q.at[0].set(P_pred0)
    F = F.at[0].set(0)

    def element(F, mu, Sigma, Hw, y):
        HS = Hw @ Sigma
        S = _sym(HS @ Hw.T) + jnp.eye(p, dtype=dtype)  # eigenvalues >= 1
        L_S = jnp.linalg.cholesky(S)
        Kt = _cho_solve(L_S, HS)  # K^T = S^{-1} H Sigma
        HF = Hw @ F
        v = y - Hw @ mu
        A = F - Kt.T @ HF
        b = mu + Kt.T @ v
        C = _sym(Sigma - Kt.T @ HS)
        Sinv_HF = _cho_solve(L_S, HF)
        eta = HF.T @ _cho_solve(L_S, v[:, None])[:, 0]
        J = _sym(HF.T @ Sinv_HF)
        return A, b, C, eta, J

    return jax.vmap(element)(F, mu, Sigma, Hw, yw)


def _combine_filter(earlier, later):
    """`p(x_k | x_i, y_{i+1..k})` from the elements over `(i, j]` and `(j, k]`.

    The paper's `(I + C_i J_j)^{-1}` is applied through Cholesky factors only:
    with `C_i = U U^T` and `W = I + U^T J_j U` (symmetric, eigenvalues >= 1),
    `(I + C_i J_j)^{-1} = I - U W^{-1} U^T J_j`, `(I + C_i J_j)^{-1} C_i =
    U W^{-1} U^T` and `J_j (I + C_i J_j)^{-1} = J_j - J_j U W^{-1} U^T J_j`, so
    the combined `C` and `J` are symmetric by construction.
    """
    A_i, b_i, C_i, eta_i, J_i = earlier
    A_j, b_j, C_j, eta_j, J_j = later
    n = b_i.shape[-1]
    eye = jnp.eye(n, dtype=b_i.dtype)
    U = _chol(C_i)
    UtJ = U.T @ J_j
    L_W = jnp.linalg.cholesky(_sym(eye + UtJ @ U))
    Z = jsl.solve_triangular(L_W, UtJ, lower=True)  # L_W^{-1} U^T J_j
    V = jsl.solve_triangular(L_W, U.T, lower=True)  # L_W^{-1} U^T
    M = eye - V.T @ Z  # (I + C_i J_j)^{-1}
    A_j_M = A_j @ M
    A = A_j_M @ A_i
    b = A_j_M @ (b_i + C_i @ eta_j) + b_j
    AV = A_j @ V.T
    C = _sym(AV @ AV.T + C_j)
    eta = A_i.T @ (M.T @ (eta_j - J_j @ b_i)) + eta_i
    J = _sym(A_i.T @ (J_j - Z.T @ Z) @ A_i + J_i)
    return A, b, C, eta, J


def _predictions(model: _Model, c, ms, Ps):
    """One-step predictions of every step from the filtered moments of the previous."""
    m_prev = jnp.concatenate([model.m0[None], ms[:-1]])
    P_prev = jnp.concatenate([_gram(model.L_P0)[None], Ps[:-1]])
    F_ax = 0 if _per_step(model.F, 2) else None
    Q_ax = 0 if _per_step(model.L_Q, 2) else None
    c_ax = None if c is None else 0
    return jax.vmap(_predict, in_axes=(0, 0, F_ax, Q_ax, c_ax))(
        m_prev, P_prev, model.F, model.L_Q, c
    )


def _filter_parallel(model: _Model, c, yw, obs, W, logdet) -> KalmanFilterResult:
    elements = _filter_elements(model, c, yw, obs, W)
    _, ms, Ps, _, _ = level_scan(jax.vmap(_combine_filter), elements)
    # the log-likelihood from the filtered states, after the scan (see module doc)
    mps, Pps = _predictions(model, c, ms, Ps)
    T = yw.shape[0]
    Hw = _bt(W, T) @ _bt(model.H, T)
    _, _, lls, _ = jax.vmap(_update)(mps, Pps, yw, Hw, obs)
    lls = lls - logdet
    return KalmanFilterResult(ms, Ps, mps, Pps, lls, jnp.sum(lls))


# --- smoothers ---


def _smoother_elements(model: _Model, filtered: KalmanFilterResult):
    """RTS elements `(E_t, g_t, L_t)`: `p(x_t | x_{t+1}, y_1..y_t) = N(E x + g, L)`."""
    ms, Ps = filtered.means, filtered.covs
    F_next = model.F[1:] if _per_step(model.F, 2) else model.F
    F_ax = 0 if _per_step(model.F, 2) else None

    def element(m, P, m_pred_next, P_pred_next, F):
        FP = F @ P
        Et = _cho_solve(_chol(P_pred_next), FP)  # E^T = P_pred^{-1} F P
        g = m - Et.T @ m_pred_next
        L = _sym(P - Et.T @ FP)
        return Et.T, g, L

    E, g, L = jax.vmap(element, in_axes=(0, 0, 0, 0, F_ax))(
        ms[:-1],
        Ps[:-1],
        filtered.predicted_means[1:],
        filtered.predicted_covs[1:],
        F_next,
    )
    E = jnp.concatenate([E, jnp.zeros((1, *E.shape[1:]), E.dtype)])  # T = 1: E empty
    g = jnp.concatenate([g, ms[-1:]])
    L = jnp.concatenate([L, Ps[-1:]])
    return E, g, L


def _combine_smoother(later, earlier):
    # a reverse associative scan passes the element later in time first
    E_l, g_l, L_l = later
    E_e, g_e, L_e = earlier
    return E_e @ E_l, E_e @ g_l + g_e, _sym(E_e @ L_l @ E_e.T + L_e)


def _smooth_associative(model: _Model, filtered: KalmanFilterResult):
    """RTS smoother as an associative scan over the elements `(E_t, g_t, L_t)`."""
    E, g, L = _smoother_elements(model, filtered)
    _, ms, Ps = level_scan(jax.vmap(_combine_smoother), (E, g, L), reverse=True)
    cross = E[:-1] @ Ps[1:]
    return KalmanSmootherResult(ms, Ps, cross, filtered)


def _step_information(F: Array, Hw: Array, ks: Array, es: Array, ss: Array):
    """Step `t`'s transition and scalar updates as one affine map of `(r, N)`.

    Going back through update `j = p..1` maps `r -> h e / s + L_j^T r` and
    `N -> h h^T / s + L_j^T N L_j` with `L_j = I - k_j h_j^T`, then through the
    transition `r -> F^T r`, `N -> F^T N F`: together `r -> b + G^T r` and
    `N -> J + G^T N G` with `G = L_p ... L_1 F`. Built with rank-one updates.
    """
    G = F
    J = jnp.zeros(F.shape, F.dtype)
    b = jnp.zeros(F.shape[:1], F.dtype)
    for j in range(ks.shape[0]):
        h, k, e, s = Hw[j], ks[j], es[j], ss[j]
        g = jnp.sum(G * h[:, None], axis=0)  # (L_{j-1} ... L_1 F)^T h
        J = J + g[:, None] * g[None, :] / s
        b = b + g * (e / s)
        G = G - k[:, None] * g[None, :]
    return G, J, b


def _smooth_sequential(model: _Model, filtered: KalmanFilterResult, recorded):
    """The RTS smoother in Bryson-Frazier form: backwards in information form.

    Bierman, "Factorization Methods for Discrete Sequential Estimation" (1977);
    Koopman & Durbin (J. Time Series Analysis 2000) for the scalar updates. The
    smoothed moments are `m^f_t + P^f_t r_t` and `P^f_t (I - N_t P^f_t)` from the
    *filtered* ones, where `(r_t, N_t)`, the information that `y_{t+1..T}` carry
    about `x_t`, run backwards as `r <- b + G^T r`, `N <- J + G^T N G` with step
    `t + 1`'s `(G, J, b)` from `_step_information`. Nothing is inverted or
    factored (the classic RTS gain needs `P_{t+1}^{-1}` every step); the loop
    body is two small matrix products and everything else is batched over `t`.
    With `P^f_{t+1} = L_p ... L_1 P_{t+1}` (predicted `P_{t+1}`),
    `Cov[x_t, x_{t+1}] = P^f_t G_{t+1}^T (I - N_{t+1} P^f_{t+1})`.
    """
    Hw, ks, es, ss = recorded
    T, n = filtered.means.shape
    dtype = filtered.means.dtype
    # varying, under `shard_map`, like the filtered means (which depend on everything)
    init = (
        zeros_like_inputs((n,), dtype, filtered.means),
        zeros_like_inputs((n, n), dtype, filtered.means),
    )
    if T == 1:
        r, N = init[0][None], init[1][None]
        G = jnp.zeros((0, n, n), dtype)
    else:
        in_axes = (
            0 if _per_step(model.F, 2) else None,
            0 if Hw.ndim == 3 else None,
            0,
            0,
            0,
        )
        G, J, b = jax.vmap(_step_information, in_axes=in_axes)(
            model.F[1:] if _per_step(model.F, 2) else model.F,
            Hw[1:] if Hw.ndim == 3 else Hw,
            ks[1:],
            es[1:],
            ss[1:],
        )

        def step(carry, x):
            r, N = carry
            G, J, b = x
            return (b + _mv(G.T, r), _sym(J + _sandwich(G.T, N))), (r, N)

        # steps T..2; the carry out of step 2 is step 1's (r, N)
        (r1, N1), (r, N) = lax.scan(step, init, (G, J, b), reverse=True)
        r = jnp.concatenate([r1[None], r])
        N = jnp.concatenate([N1[None], N])
    Pf = filtered.covs
    ms = filtered.means + jnp.sum(Pf * r[:, None, :], axis=-1)
    X = _bmm(N, Pf)
    Ps = _sym(Pf - _bmm(Pf, X))
    PfGt = _bmm(Pf[:-1], _mT(G))
    cross = PfGt - _bmm(PfGt, X[1:])
    return KalmanSmootherResult(ms, Ps, cross, filtered)


# --- driver ---


def _uses_associative(scan: AbstractScan) -> bool:
    """Whether `scan` (after `AutoScan`'s choice) is the parallel backend."""
    chosen = scan.select() if isinstance(scan, AutoScan) else scan
    return isinstance(chosen, AssociativeScan)


def _complete_whitening(L_R: Array, T: int) -> tuple[Array, Array]:
    """`W = L_R^{-1}` (constant unless `R` varies) and `log det L_R` per step."""
    W = jsl.solve_triangular(L_R, _eye_like(L_R), lower=True)
    logdet = jnp.sum(jnp.log(jnp.diagonal(L_R, axis1=-2, axis2=-1)), axis=-1)
    return W, jnp.broadcast_to(logdet, (T,))


def _prepare(kf: "KalmanFilter", ys: Array, us: Array | None):
    """`(model, c, y, obs)`: `y` the observations minus `D u` with NaNs zeroed,
    `c = B u`, `obs` the observed entries.

    Under `jax.shard_map` the model's matrices are made to vary like the data, so
    that every carry and `lax.cond` branch downstream has one type (a covariance
    computed from the model alone would otherwise be shared by the devices while
    one updated with per-device missing data is not)."""
    data = (ys,) if us is None else (ys, us)
    model = jax.tree.map(lambda p: vary_like(p, *data), kf._model())
    obs = ~jnp.isnan(ys)
    y = jnp.where(obs, ys, 0)  # zero NaNs before any arithmetic (double where)
    c = None if kf.B is None else us @ kf.B.T
    if kf.D is not None:
        y = jnp.where(obs, y - us @ kf.D.T, 0)
    return model, c, y, obs


@jax.custom_batching.custom_vmap
def _all_observed(obs: Array) -> Array:
    """Whether every entry of `obs` is true; under `jax.vmap`, over the whole batch.

    The filter branches on this (`lax.cond`). A batched predicate would turn the
    `cond` into a `select` that runs both branches for every sequence: under `vmap`
    over 16 complete sequences (state 4, T=2000) the filter took 84 ms, against
    4.5 ms for 16 separate calls. One unbatched answer for the batch keeps the
    branch: a batch with any missing entry runs the exact filter for all its
    sequences, which gives complete ones the same numbers to round-off.
    """
    return jnp.all(obs)


@_all_observed.def_vmap
def _all_observed_vmap(axis_size, in_batched, obs):
    del axis_size, in_batched
    return _all_observed(obs), False


def _run(kf: "KalmanFilter", ys: Array, us: Array | None, body):
    """Prepare the data and call `body(model, c, y, obs, W, logdet, whiten)`.

    `y` are the observations minus `D u` with NaNs zeroed, `c = B u`, `W, logdet`
    the whitening (see `_whiten`) and `whiten(L_R)` a function computing it for
    other `R` (for Fisher's identity). With complete data `W` is one constant
    matrix: for the sequential backend `body` runs in one branch of a `lax.cond`
    per case (so that the loop keeps `W` outside); for the associative backend only
    the whitening is cond'ed, so that the (slow to compile) parallel program
    appears once.
    """
    model, c, y, obs = _prepare(kf, ys, us)
    T = ys.shape[0]
    R_varies = _per_step(model.L_R, 2)
    complete = _all_observed(obs)

    def missing_whitening(L_R):
        return _whiten(L_R, obs, R_varies)

    def call(whiten):
        W, logdet = whiten(model.L_R)
        return body(model, c, y, obs, W, logdet, whiten)

    if _uses_associative(kf.scan):

        def either(L_R):
            def full():
                W, logdet = _complete_whitening(L_R, T)
                return jnp.broadcast_to(W, (T, *W.shape[-2:])), logdet

            return lax.cond(complete, full, lambda: missing_whitening(L_R))

        return call(either)
    return lax.cond(
        complete,
        lambda: call(lambda L_R: _complete_whitening(L_R, T)),
        lambda: call(missing_whitening),
    )


def _whitened(W: Array, y: Array) -> Array:
    return jnp.einsum("ij,tj->ti" if W.ndim == 2 else "tij,tj->ti", W, y)


@full_precision
def _filter(kf: "KalmanFilter", ys: Array, us: Array | None) -> KalmanFilterResult:
    run = _filter_parallel if _uses_associative(kf.scan) else _filter_sequential

    def body(model, c, y, obs, W, logdet, whiten):
        return run(model, c, _whitened(W, y), obs, W, logdet)

    return _run(kf, ys, us, body)


def _smoothed(model: _Model, c, y, obs, W, logdet, assoc: bool):
    if assoc:
        filtered = _filter_parallel(model, c, _whitened(W, y), obs, W, logdet)
        return _smooth_associative(model, filtered)
    filtered, recorded = _filter_sequential(
        model, c, _whitened(W, y), obs, W, logdet, record=True
    )
    return _smooth_sequential(model, filtered, recorded)


@full_precision
def _smooth(kf: "KalmanFilter", ys: Array, us: Array | None) -> KalmanSmootherResult:
    assoc = _uses_associative(kf.scan)

    def body(model, c, y, obs, W, logdet, whiten):
        return _smoothed(model, c, y, obs, W, logdet, assoc)

    return _run(kf, ys, us, body)


# --- the log-likelihood's gradient by Fisher's identity ---


def _sum_tr(A: Array, X: Array, B: Array) -> Array:
    """`sum_t tr(A_t X_t B_t^T)`; `A`, `B` constant or per step, `X` per step."""
    if A.ndim == 2 and B.ndim == 2:
        return jnp.sum((A @ jnp.sum(X, axis=0)) * B)
    T = X.shape[0]
    return jnp.sum(_bmm(_bt(A, T), X) * _bt(B, T))


def _expected_log_joint(params, ys, us, static, obs, stats, whiten) -> Array:
    """`E[log p(x_1..x_T, y_1..y_T | params)]` over a fixed Gaussian posterior.

    `stats = (means, covs, cross_covs)` are the smoother's moments of `x_1..x_T`
    (`x_0` is integrated out: `x_1 ~ N(F_1 m0 + B u_1, F_1 P0 F_1^T + Q_1)`); only
    observed entries of `y` count. Linear in the statistics and scan-free; its
    gradient at the parameters the statistics came from is the log-likelihood's
    (Fisher's identity). Quadratic forms in `Q^{-1}`, `Sigma_1^{-1}` go through
    triangular solves with the Cholesky factors.
    """
    kf = eqx.combine(params, static)
    model = kf._model()
    ms, Ps, cross = stats
    T, n = ms.shape
    F_v, Q_v = _per_step(model.F, 2), _per_step(model.L_Q, 2)
    dtype = ms.dtype
    y = jnp.where(obs, ys, 0)
    c = None if kf.B is None else us @ kf.B.T
    if kf.D is not None:
        y = jnp.where(obs, y - us @ kf.D.T, 0)
    # x_1
    F1 = model.F[0] if F_v else model.F
    LQ1 = model.L_Q[0] if Q_v else model.L_Q
    mu1, S1 = _predict(
        model.m0, _gram(model.L_P0), F1, LQ1, None if c is None else c[0]
    )
    L1 = jnp.linalg.cholesky(S1)
    d1 = ms[0] - mu1
    q1 = jnp.trace(_cho_solve(L1, Ps[0] + d1[:, None] * d1[None, :]))
    ll = -0.5 * (n * _LOG_2PI + q1) - jnp.sum(jnp.log(jnp.diagonal(L1)))
    # transitions x_{t-1} -> x_t, t = 2..T
    if T > 1:
        F = model.F[1:] if F_v else model.F
        L_Q = model.L_Q[1:] if Q_v else model.L_Q
        K = jsl.solve_triangular(L_Q, _eye_like(L_Q), lower=True)  # L_Q^{-1}
        d = ms[1:] - (
            ms[:-1] @ _mT(F) if not F_v else jnp.einsum("tij,tj->ti", F, ms[:-1])
        )
        if c is not None:
            d = d - c[1:]
        Kd = d @ K.T if not Q_v else jnp.einsum("tij,tj->ti", K, d)
        KF = K @ F
        quad = (
            jnp.sum(Kd * Kd)
            + _sum_tr(K, Ps[1:], K)
            - 2 * _sum_tr(KF, cross, K)
            + _sum_tr(KF, Ps[:-1], KF)
        )
        logdet_Q = jnp.sum(jnp.log(jnp.diagonal(L_Q, axis1=-2, axis2=-1)))
        logdet_Q = logdet_Q * (1 if Q_v else T - 1)
        ll = ll - 0.5 * ((T - 1) * n * _LOG_2PI + quad) - logdet_Q
    # emissions
    W, logdet = whiten(model.L_R)
    Hw = W @ model.H
    r = _whitened(W, y) - (
        ms @ _mT(Hw) if Hw.ndim == 2 else jnp.einsum("tij,tj->ti", Hw, ms)
    )
    quad = jnp.sum(r * r) + _sum_tr(Hw, Ps, Hw)
    num_obs = jnp.sum(obs).astype(dtype)
    return ll - 0.5 * (num_obs * _LOG_2PI + quad) - jnp.sum(logdet)


@full_precision
def _fisher_log_likelihood(kf: "KalmanFilter", ys: Array, us: Array | None) -> Array:
    """The log-likelihood, differentiated by Fisher's identity (a custom JVP).

    Its tangent is `<g, dot>` with `g` the gradient of `_expected_log_joint` at the
    smoother's statistics (computed from primal values: no autodiff through the
    filter), so reverse mode transposes a linear map. Differentiating `g` again
    (Hessians) goes through the smoother by plain autodiff.
    """
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    assoc = _uses_associative(kf.scan)

    @jax.custom_jvp
    def log_likelihood(params, ys, us):
        return _filter(eqx.combine(params, static), ys, us).log_likelihood

    @log_likelihood.defjvp
    @full_precision
    def log_likelihood_jvp(primals, tangents):
        params, ys, us = primals
        obs = ~jnp.isnan(ys)
        # under `shard_map`, parameters that vary like the data, as in `_prepare`,
        # so that the gradients the branches below return have one type (without
        # this the shard_map Kalman tests crash; checked 2026-11-22)
        data = (ys,) if us is None else (ys, us)
        params = jax.tree.map(lambda p: vary_like(p, *data), params)

        def body(model, c, y, obs_, W, logdet, whiten):
            def fisher():
                sm = _smoothed(model, c, y, obs_, W, logdet, assoc)
                stats = (sm.means, sm.covs, sm.cross_covs)
                grads = jax.grad(_expected_log_joint, argnums=(0, 1, 2))(
                    params, ys, us, static, obs, stats, whiten
                )
                return sm.filtered.log_likelihood, grads

            if assoc or not _may_settle(model, W, ys.shape[0]):
                return fisher()
            # complete data (`W` one matrix), time-invariant model: plain autodiff
            # through the steady-state filter, cheaper than the smoother, when its
            # covariance settled (which depends on the model only, so the `cond`
            # stays a branch under `vmap` over sequences); else Fisher's identity
            (value, settled), grads = jax.value_and_grad(
                _steady_log_likelihood, argnums=(0, 1, 2), has_aux=True
            )(params, ys, us, static)
            return lax.cond(settled, lambda: (value, grads), fisher)

        value, grads = _run(eqx.combine(params, static), ys, us, body)
        dot = sum(
            (
                jnp.vdot(g, t)
                for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(tangents))
            ),
            start=jnp.zeros((), value.dtype),
        )
        return value, dot

    return log_likelihood(params, ys, us)


def _steady_log_likelihood(params, ys, us, static) -> tuple[Array, Array]:
    """The log-likelihood through the steady-state filter (`_filter_sequential`;
    time-invariant model, complete data), and whether its covariance settled
    (if not, the value is not the log-likelihood)."""
    kf = eqx.combine(params, static)
    model, c, y, obs = _prepare(kf, ys, us)
    W, logdet = _complete_whitening(model.L_R, ys.shape[0])
    steps, xs, Hw = _sequential_step(model, c, _whitened(W, y), obs, W, complete=True)
    init = (model.m0, _gram(model.L_P0))
    head, (m, P), tail_xs = _head(steps["head"], init, xs, W.dtype)
    settled = _settle(model, m, P, Hw)
    tail = _steady_tail(model, settled, m, tail_xs)
    return jnp.sum(head[-1]) + jnp.sum(tail[-1]) - jnp.sum(logdet), settled.ok


def _check_matrix(name: str, x: Array, shape: tuple[int, ...]) -> None:
    """`x` has per-step shape `shape`, optionally with a leading time axis."""
    ok = x.shape == shape or (x.ndim == len(shape) + 1 and x.shape[1:] == shape)
    if not ok:
        raise ValueError(
            f"eqx_seq.KalmanFilter: `{name}` must have shape {shape} (or (T, *{shape}) "
            f"for a time-varying model), got {x.shape}."
        )


class KalmanFilter(eqx.Module):
    r"""A linear-Gaussian state-space model: Kalman filter, RTS smoother, sampler.

    The model, for steps `t = 1, ..., T` (row `t - 1` of every array), starting
    from `x_0 ~ N(m0, P0)` (before the first observation):

    $$x_t = F_t x_{t-1} + B u_t + q_t, \quad q_t \sim N(0, Q_t)$$
    $$y_t = H_t x_t + D u_t + r_t, \quad r_t \sim N(0, R_t)$$

    `F`, `H`, `Q` and `R` may each carry a leading time axis of length `T`
    (time-varying); `u_t` are optional controls. As a layer, `kf(ys)` returns the
    filtered means: denoised features of the sequence `ys`.

    **Parameterisation.** The learnable arrays are `F`, `H`, `B`, `D`, `m0` and the
    unconstrained `Q_factor`, `R_factor`, `P0_factor`. Each factor maps to a
    lower-triangular Cholesky factor `L` (strict lower triangle as is, diagonal
    `exp` of the raw diagonal; the raw upper triangle is ignored), and the
    covariance is `L L^T`. So every value of the parameters, whatever an optimiser
    does, is a valid model with positive-definite `Q`, `R` and `P0`. The matrices
    are available as `kf.Q`, `kf.R`, `kf.P0`.

    **Missing data.** NaN entries of `ys` (whole rows or single entries) are
    skipped exactly: the filter conditions on the observed entries only and the
    log-likelihood counts only them; gradients stay finite (NaNs are replaced
    before any arithmetic). With missing data `R` restricted to the observed
    entries is factored at every step, which costs a little more.

    **Backends.** `scan` picks the algorithm, according to `eqx_seq.AutoScan`'s rule
    (`SequentialScan` on CPU): with [`eqx_seq.SequentialScan`][] the standard
    filter and RTS smoother in a `jax.lax.scan`; with [`eqx_seq.AssociativeScan`][]
    the parallel filter and smoother of Särkkä & García-Fernández, "Temporal
    Parallelization of Bayesian Smoothers", IEEE TAC 2021, in an associative scan
    whose levels are a loop (`O(log T)` depth, about 3-5x the work: for
    accelerators; unlike `jax.lax.associative_scan`, the combine is traced
    once, so compiling takes seconds, not tens of seconds, at
    `T = 10^4`). The backend object only *selects* the algorithm: the Kalman
    recursions are not diagonal recurrences, so this layer runs its own scans.
    Other `AbstractScan` subclasses select the sequential filter. Both give the
    same numbers to float tolerance; the parallel log-likelihood is computed from
    the filtered states after the scan, which stays accurate when the state
    drifts far from zero.

    **Numerics.** Observations are whitened by the Cholesky factor of `R` and
    conditioned on one entry at a time (no matrix solve in the sequential loop);
    covariances are symmetrised every step; all solves and log-determinants use
    Cholesky factors. The sequential smoother runs backwards in information form
    (Bryson-Frazier), so it factors no matrix either. Every matrix product runs at
    `jax.lax.Precision.HIGHEST`, whatever `jax.default_matmul_precision` says: on
    GPUs JAX's default for float32 products is TF32, which took the float32
    log-likelihood 20% off on an H100.

    **Steady state.** For a time-invariant model with complete data the covariance
    recursion does not depend on the data and converges. The sequential filter
    runs 32 exact steps (128 in float64), then estimates how far the covariance
    still is from its fixed point (propagating its last change through the
    closed-loop dynamics); when that is within a few units of round-off, the
    remaining steps use the fixed covariances and gain, so that the loop is one
    matrix-vector product per step (the same arithmetic as the exact update, made
    an affine map). Otherwise every step stays exact. The result is the exact
    filter's to round-off (tested against a float64 textbook filter); it made the
    filter 3.6-15x faster (state 4 and 16, `T` = 1k-100k, float32). Missing data,
    time-varying matrices, short sequences and the smoother always run every step
    exactly. In float32 most models tried settled within 32 steps; some took up to
    46, and a barely observed one 119: those run every step exactly. Under
    `jax.vmap` over sequences the choice between complete and missing data is made
    once for the batch: a batch with any missing entry runs every step exactly for
    all its sequences (the same numbers, to round-off). Decided per sequence, it
    would run both paths for all of them (21x slower for 16 complete sequences).

    **Gradients.** [`eqx_seq.KalmanFilter.log_likelihood`][] is differentiated by
    Fisher's identity, `d/dθ log p(y | θ) = E[d/dθ log p(x, y | θ) | y]`: its
    custom JVP is the gradient of the expected complete-data log-likelihood at the
    smoother's means, covariances and lag-one cross-covariances (Shumway & Stoffer,
    J. Time Series Analysis 1982; Segal & Weinstein, Proc. IEEE 1989). A gradient
    costs a filter, a smoother and one batched, scan-free gradient (measured
    1.2-2.6x the exact filter); forward mode, `jax.jacfwd` and Hessians work
    (second derivatives go through the smoother, or the steady-state filter below,
    by plain autodiff). It covers
    everything the log-likelihood does (time-varying matrices, controls, missing
    entries, both backends) and gives the gradient with respect to `ys` and `us`
    too. Where the steady state applies (above), plain autodiff through the
    steady-state filter is cheaper and is used instead (measured 0.3-2.3x the
    filter, which also writes every covariance; the reverse pass through the exact
    steps is a fixed cost, 2-3 ms at state 16 / obs 8; `benchmarks/README.md`). The
    filtered means (`kf(ys)`, `kf.filter(ys)`) are not an expectation of a
    complete-data quantity, so Fisher's identity does not apply to them: their
    gradients, and that of `kf.filter(ys).log_likelihood`, are plain JAX autodiff
    through the (small, fused, rematerialised) step: about 3x the filter at
    `state_size = 4`, 8-10x at 16 (`benchmarks/README.md`).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import jax.random as jr
        import eqx_seq

        kf = eqx_seq.KalmanFilter(state_size=4, obs_size=2, key=jr.key(0))
        states, ys = kf.sample(jr.key(1), 100)
        ys = ys.at[10:20].set(jnp.nan)            # missing observations
        means = kf(ys)                             # (100, 4) filtered means
        smoothed = kf.smooth(ys)                   # .means, .covs, .filtered
        grads = jax.grad(lambda kf: -kf.log_likelihood(ys))(kf)
        ```
    """

    F: Float[Array, "*T n n"]
    H: Float[Array, "*T p n"]
    B: Float[Array, "n c"] | None
    D: Float[Array, "p c"] | None
    m0: Float[Array, " n"]
    Q_factor: Float[Array, "*T n n"]
    R_factor: Float[Array, "*T p p"]
    P0_factor: Float[Array, "n n"]
    scan: AbstractScan
    state_size: int = eqx.field(static=True)
    obs_size: int = eqx.field(static=True)
    control_size: int = eqx.field(static=True)
    num_steps: int | None = eqx.field(static=True)

    def __init__(
        self,
        state_size: int,
        obs_size: int,
        *,
        control_size: int = 0,
        scan: AbstractScan = AutoScan(),
        dtype: Any = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `state_size`: the size `n` of the hidden state `x_t`.
        - `obs_size`: the size `p` of the observations `y_t`.
        - `control_size`: the size `c` of the controls `u_t`; `0` for none.
        - `scan`: the backend, see the class docstring.
        - `dtype`: the parameters' floating dtype (default: JAX's default float).
        - `key`: a `jax.random.key` for the initialisation.

        The initial model is stable and stationary: `F = 0.9 U` with `U` a random
        orthogonal matrix, `Q = 0.19 I`, `m0 = 0` and `P0 = I` (the stationary
        covariance); `H` has `N(0, 1/n)` entries and `R = I`; `B` has `N(0, 1/c)`
        entries and `D = 0`.
        """
        check_positive_int("state_size", state_size)
        check_positive_int("obs_size", obs_size)
        if not (isinstance(control_size, int) and control_size >= 0) or isinstance(
            control_size, bool
        ):
            raise ValueError(
                f"`control_size` must be a non-negative int, got {control_size!r}."
            )
        _check_scan(scan)
        dtype = check_parameter_dtype("KalmanFilter", dtype)
        n, p, c = state_size, obs_size, control_size
        kF, kH, kB = jr.split(key, 3)
        U, _ = jnp.linalg.qr(jr.normal(kF, (n, n), dtype))
        self.F = 0.9 * U
        self.H = jr.normal(kH, (p, n), dtype) / math.sqrt(n)
        self.B = jr.normal(kB, (n, c), dtype) / math.sqrt(c) if c else None
        self.D = jnp.zeros((p, c), dtype) if c else None
        self.m0 = jnp.zeros((n,), dtype)
        self.Q_factor = jnp.diag(jnp.full((n,), 0.5 * math.log(0.19), dtype))
        self.R_factor = jnp.zeros((p, p), dtype)
        self.P0_factor = jnp.zeros((n, n), dtype)
        self.scan = scan
        self.state_size, self.obs_size, self.control_size = n, p, c
        self.num_steps = None

    @classmethod
    def from_matrices(
        cls,
        F: Float[ArrayLike, "*T n n"],
        H: Float[ArrayLike, "*T p n"],
        Q: Float[ArrayLike, "*T n n"],
        R: Float[ArrayLike, "*T p p"],
        m0: Float[ArrayLike, " n"],
        P0: Float[ArrayLike, "n n"],
        *,
        B: Float[ArrayLike, "n c"] | None = None,
        D: Float[ArrayLike, "p c"] | None = None,
        scan: AbstractScan = AutoScan(),
        dtype: Any = None,
    ) -> "KalmanFilter":
        """A Kalman filter for a given model.

        **Arguments:**

        - `F`: the transition matrix, `(n, n)` or `(T, n, n)`.
        - `H`: the emission matrix, `(p, n)` or `(T, p, n)`.
        - `Q`, `R`: the transition and observation noise covariances, `(n, n)` /
            `(p, p)` or with a leading `T`; symmetric positive definite.
        - `m0`, `P0`: mean and covariance of `x_0`, the state before the first
            observation.
        - `B`, `D`: optional control matrices `(n, c)` and `(p, c)`; give one or
            both to use controls (the missing one is zero).
        - `scan`: the backend, see the class docstring.
        - `dtype`: the parameters' dtype; default: the common dtype of the inputs
            (floating).

        All time-varying matrices must share the same length `T`, which the
        observations must then have.

        **Returns:**

        A [`eqx_seq.KalmanFilter`][] whose parameters encode these matrices.

        **Raises:**

        `ValueError` for inconsistent shapes; at run time (`eqx.error_if`) if `Q`,
        `R` or `P0` is not symmetric positive definite.
        """
        _check_scan(scan)
        arrays = {"F": F, "H": H, "Q": Q, "R": R, "m0": m0, "P0": P0, "B": B, "D": D}
        arrays = {k: v if v is None else jnp.asarray(v) for k, v in arrays.items()}
        given = [v for v in arrays.values() if v is not None]
        if dtype is None:
            dtype = jnp.result_type(*[v.dtype for v in given])
            if not jnp.issubdtype(dtype, jnp.floating):
                dtype = jnp.zeros(()).dtype
        dtype = check_parameter_dtype("KalmanFilter", dtype)
        for k, v in arrays.items():
            if v is not None and not (
                jnp.issubdtype(v.dtype, jnp.floating)
                or jnp.issubdtype(v.dtype, jnp.integer)
            ):
                raise ValueError(f"`{k}` must be a real array, got dtype {v.dtype}.")
        a = {k: v if v is None else v.astype(dtype) for k, v in arrays.items()}
        F, H = a["F"], a["H"]
        if F.ndim not in (2, 3) or F.shape[-1] != F.shape[-2]:
            raise ValueError(
                "eqx_seq.KalmanFilter.from_matrices: `F` must be square, shape (n, n) "
                f"or (T, n, n), got {F.shape}."
            )
        n = F.shape[-1]
        if H.ndim not in (2, 3) or H.shape[-1] != n:
            raise ValueError(
                "eqx_seq.KalmanFilter.from_matrices: `H` must have shape (p, n) or "
                f"(T, p, n) with n = {n} (from `F`), got {H.shape}."
            )
        p = H.shape[-2]
        if a["m0"].shape != (n,):
            raise ValueError(f"`m0` must have shape ({n},), got {a['m0'].shape}.")
        _check_matrix("Q", a["Q"], (n, n))
        _check_matrix("R", a["R"], (p, p))
        if a["P0"].shape != (n, n):
            raise ValueError(f"`P0` must have shape ({n}, {n}), got {a['P0'].shape}.")
        c = 0
        for name, rows in (("B", n), ("D", p)):
            m = a[name]
            if m is not None:
                if m.ndim != 2 or m.shape[0] != rows or m.shape[1] < 1:
                    raise ValueError(
                        f"`{name}` must have shape ({rows}, c) with c >= 1, got "
                        f"{m.shape}."
                    )
                c = m.shape[1] if c == 0 else c
                if m.shape[1] != c:
                    raise ValueError(
                        f"`B` and `D` must have the same number of columns (the "
                        f"control size), got {a['B'].shape} and {a['D'].shape}."
                    )
        if c:
            a["B"] = jnp.zeros((n, c), dtype) if a["B"] is None else a["B"]
            a["D"] = jnp.zeros((p, c), dtype) if a["D"] is None else a["D"]
        lengths = {
            k: a[k].shape[0]
            for k, r in (("F", 2), ("H", 2), ("Q", 2), ("R", 2))
            if a[k].ndim > r
        }
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"Time-varying matrices must share one length T, got {lengths}."
            )
        raw = {k: _checked_raw_factor(k, a[k]) for k in ("Q", "R", "P0")}
        self = object.__new__(cls)
        fields = dict(
            F=F,
            H=H,
            B=a["B"],
            D=a["D"],
            m0=a["m0"],
            Q_factor=raw["Q"],
            R_factor=raw["R"],
            P0_factor=raw["P0"],
            scan=scan,
            state_size=n,
            obs_size=p,
            control_size=c,
            num_steps=next(iter(lengths.values()), None),
        )
        for k, v in fields.items():
            object.__setattr__(self, k, v)
        return self

    # --- the matrices ---

    @property
    def Q(self) -> Float[Array, "*T n n"]:
        """The transition noise covariance `Q = L L^T` (from `Q_factor`)."""
        return _gram(_factor(self.Q_factor))

    @property
    def R(self) -> Float[Array, "*T p p"]:
        """The observation noise covariance `R = L L^T` (from `R_factor`)."""
        return _gram(_factor(self.R_factor))

    @property
    def P0(self) -> Float[Array, "n n"]:
        """The covariance of `x_0` (from `P0_factor`)."""
        return _gram(_factor(self.P0_factor))

    def _model(self) -> _Model:
        return _Model(
            F=self.F,
            L_Q=_factor(self.Q_factor),
            H=self.H,
            L_R=_factor(self.R_factor),
            m0=self.m0,
            L_P0=_factor(self.P0_factor),
        )

    def _inputs(self, ys: Any, us: Any, caller: str) -> tuple[Array, Array | None]:
        """Validate observations and controls; cast them to the parameters' dtype."""
        dtype = self.m0.dtype
        ys = jnp.asarray(ys)
        if not jnp.issubdtype(ys.dtype, jnp.floating):
            raise ValueError(
                f"eqx_seq.KalmanFilter.{caller}: `ys` must be floating (NaN marks a "
                f"missing entry), got dtype {ys.dtype}."
            )
        if ys.ndim != 2 or ys.shape[1] != self.obs_size or ys.shape[0] < 1:
            raise ValueError(
                f"eqx_seq.KalmanFilter.{caller}: `ys` must have shape (T, obs_size) "
                f"= (T, {self.obs_size}) with T >= 1, got {ys.shape}. Use `jax.vmap` "
                "for a batch of sequences."
            )
        T = ys.shape[0]
        self._check_length(T, caller)
        return ys.astype(dtype), self._controls(us, T, caller)

    def _check_length(self, T: int, caller: str) -> None:
        if self.num_steps is not None and T != self.num_steps:
            raise ValueError(
                f"eqx_seq.KalmanFilter.{caller}: this model is time-varying with "
                f"{self.num_steps} steps, but the sequence has {T}."
            )

    def _controls(self, us: Any, T: int, caller: str) -> Array | None:
        c = self.control_size
        if c == 0:
            if us is not None:
                raise ValueError(
                    f"eqx_seq.KalmanFilter.{caller}: got controls `us` but this model "
                    "has control_size=0."
                )
            return None
        if us is None:
            raise ValueError(
                f"eqx_seq.KalmanFilter.{caller}: this model has control_size={c}; "
                f"pass `us` of shape (T, {c})."
            )
        us = jnp.asarray(us)
        if us.shape != (T, c) or not jnp.issubdtype(us.dtype, jnp.floating):
            raise ValueError(
                f"eqx_seq.KalmanFilter.{caller}: `us` must be a floating array of "
                f"shape (T, control_size) = ({T}, {c}), got {us.shape} {us.dtype}."
            )
        return us.astype(self.m0.dtype)

    # --- inference ---

    def __call__(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T n"]:
        """The filtered means: the layer's output.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.
        - `key`: ignored; for compatibility with the Equinox layer API.

        **Returns:**

        `E[x_t | y_1..y_t]` for every step, shape `(T, state_size)`.
        """
        del key
        return self.filter(ys, us=us).means

    def filter(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> KalmanFilterResult:
        """Filtered moments and the log-likelihood.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        A [`eqx_seq.KalmanFilterResult`][]: filtered and predicted means and
        covariances, per-step log-likelihoods and their sum.
        """
        ys, us = self._inputs(ys, us, "filter")
        return _filter_jit(self, ys, us)

    def log_likelihood(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> Float[Array, ""]:
        """The log-likelihood `log p(y_1..y_T)` of the observed entries.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        A scalar. Per-step terms are `filter(ys).log_likelihoods`.

        Its derivatives come from Fisher's identity with the smoother's statistics
        (see the class docstring): a gradient costs about one filter and one
        smoother. `filter(ys).log_likelihood` is the same number with plain
        autodiff through the filter.
        """
        ys, us = self._inputs(ys, us, "log_likelihood")
        return _log_likelihood_jit(self, ys, us)

    def smooth(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> KalmanSmootherResult:
        """Smoothed moments (Rauch-Tung-Striebel).

        Rauch, Tung & Striebel, "Maximum likelihood estimates of linear dynamic
        systems", AIAA Journal 1965; with `SequentialScan` in Bryson-Frazier
        (information) form, Bierman 1977; in parallel, Särkkä & García-Fernández
        2021.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        A [`eqx_seq.KalmanSmootherResult`][]: smoothed means and covariances,
        lag-one cross-covariances, and the filter's result.
        """
        ys, us = self._inputs(ys, us, "smooth")
        return _smooth_jit(self, ys, us)

    def sample(
        self,
        key: PRNGKeyArray,
        num_steps: int,
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> tuple[Float[Array, "T n"], Float[Array, "T p"]]:
        """Draw states and observations from the model.

        **Arguments:**

        - `key`: a `jax.random.key`.
        - `num_steps`: the number `T` of steps.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        `(states, observations)`: `x_1..x_T`, shape `(T, state_size)`, and
        `y_1..y_T`, shape `(T, obs_size)`.
        """
        check_positive_int("num_steps", num_steps)
        self._check_length(num_steps, "sample")
        us = self._controls(us, num_steps, "sample")
        return _sample_jit(self, key, num_steps, us)


def _check_scan(scan: Any) -> None:
    if not isinstance(scan, AbstractScan):
        raise ValueError(
            "eqx_seq.KalmanFilter: `scan` must be an `eqx_seq.AbstractScan` such as "
            f"`eqx_seq.SequentialScan()` or `eqx_seq.AssociativeScan()`, got {scan!r}."
        )


def _spd_factor(name: str, A: Array) -> Array:
    """Cholesky factor of a given covariance; a run-time error unless it is SPD."""
    scale = jnp.max(jnp.abs(A), axis=(-2, -1), keepdims=True)
    tol = math.sqrt(jnp.finfo(A.dtype).eps) * scale
    asymmetric = jnp.any(jnp.abs(A - _mT(A)) > tol)
    L = jnp.linalg.cholesky(_sym(A))
    bad = asymmetric | ~jnp.all(jnp.isfinite(L))
    return error_if_any(
        L,
        bad,
        f"eqx_seq.KalmanFilter.from_matrices: `{name}` must be symmetric positive "
        "definite.",
    )


# One compiled program per shape (`eqx.filter_jit`, so that a failed check raises
# Equinox's readable error): run op by op, the dozen small operations of the check
# and the factorisation were compiled one at a time, seconds per new shape.
@eqx.filter_jit
def _checked_raw_factor(name: str, A: Array) -> Array:
    """The unconstrained parameter (`_unfactor`) of a checked covariance `A`."""
    return _unfactor(_spd_factor(name, A))


@eqx.filter_jit
def _filter_jit(kf: KalmanFilter, ys: Array, us: Array | None) -> KalmanFilterResult:
    return _filter(kf, ys, us)


@eqx.filter_jit
def _smooth_jit(kf: KalmanFilter, ys: Array, us: Array | None) -> KalmanSmootherResult:
    return _smooth(kf, ys, us)


@eqx.filter_jit
def _log_likelihood_jit(kf: KalmanFilter, ys: Array, us: Array | None) -> Array:
    return _fisher_log_likelihood(kf, ys, us)


@eqx.filter_jit
@full_precision
def _sample_jit(kf: KalmanFilter, key, num_steps: int, us: Array | None):
    model = kf._model()
    n, p = kf.state_size, kf.obs_size
    dtype = model.m0.dtype
    k0, kq, kr = jr.split(key, 3)
    x0 = model.m0 + model.L_P0 @ jr.normal(k0, (n,), dtype)
    q = jr.normal(kq, (num_steps, n), dtype)
    r = jr.normal(kr, (num_steps, p), dtype)
    xs = {"q": q, "r": r}
    for name, x in (
        ("F", model.F),
        ("L_Q", model.L_Q),
        ("H", model.H),
        ("L_R", model.L_R),
    ):
        if _per_step(x, 2):
            xs[name] = x
    if us is not None:
        xs["Bu"] = us @ kf.B.T
        xs["Du"] = us @ kf.D.T

    def step(x_prev, s):
        get = lambda name: s[name] if name in s else getattr(model, name)
        x = get("F") @ x_prev + get("L_Q") @ s["q"]
        if "Bu" in s:
            x = x + s["Bu"]
        y = get("H") @ x + get("L_R") @ s["r"]
        if "Du" in s:
            y = y + s["Du"]
        return x, (x, y)

    _, (states, observations) = lax.scan(step, x0, xs)
    return states, observations
