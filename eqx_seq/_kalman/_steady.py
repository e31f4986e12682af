"""The steady-state filter: time-invariant model, complete data.

The covariance recursion then does not depend on the data and converges. After `K`
exact steps `_settle` estimates the distance of the covariance from its fixed point;
when it is within a few units of round-off, the remaining steps are the
steady-state filter (`_steady_tail`): the means are a loop of one matrix-vector
product, innovations and log-likelihoods are batched, the covariances are the fixed
ones. See `docs/devdocs/kalman.md`, "Steady state".
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from ._linalg import _gram, _LOG_2PI, _mv, _sym
from ._problem import _Model, _per_step, _Problem
from ._results import _filter_result
from ._step import (
    _affine_update,
    _covariances,
    _initial,
    _predict_cov,
    _predicted_covs,
    _sequential_step,
)


def _head_steps(dtype) -> int:
    """Exact steps before the steady state is tried: enough for most models to
    settle in this precision (one that has not runs every step exactly), few
    enough that a gradient does not pay for many exact steps."""
    return 32 if jnp.finfo(dtype).bits <= 32 else 128


# The covariance counts as settled when the estimated distance to the fixed point of
# its recursion is at most this many units of round-off (relative, Frobenius).
_SETTLED_ULPS = 8


def _may_settle(problem: _Problem) -> bool:
    """Static part of the test: a time-invariant model, complete data (one
    whitening matrix), and steps to spare after the exact head."""
    model, W = problem.model, problem.W
    varies = any(_per_step(a, 2) for a in (model.F, model.L_Q, model.H, W))
    return not varies and problem.num_steps > _head_steps(W.dtype) + 1


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


def _settle(model: _Model, m: Array, S: Array, Hw: Array, square_root: bool):
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
    P = _gram(S) if square_root else S
    P_filt = _sym(_gram(S_filt)) if square_root else S_filt
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
    nus = mps @ st.E_m.T + y @ st.E_y.T
    log_s = st.log_s[None, :]
    lls = jnp.sum(-0.5 * (_LOG_2PI + log_s + nus * nus), axis=-1)
    T = y.shape[0]
    Ps = jnp.broadcast_to(st.P_filt, (T, *st.P_filt.shape))
    Pps = jnp.broadcast_to(st.P_pred, (T, *st.P_pred.shape))
    return ms, Ps, mps, Pps, lls


def filter_steady(
    problem: _Problem,
    *,
    square_root: bool = True,
    exact_fallback: bool = True,
    factors: bool = False,
) -> tuple:
    """The filter of a problem that `_may_settle`, and whether its covariance settled.

    The `K` exact steps, then the steady-state tail if the covariance settled, else
    (a `lax.cond`) the exact tail. The gradient's and the smoother's paths
    (`exact_fallback=False`) run the steady-state tail in any case, and use the
    result only if settled. With `factors`, also the head's filtered factors
    (covariances in covariance form) and the tail's fixed one.
    """
    model = problem.model
    steps, xs, Hw = _sequential_step(problem, square_root=square_root, complete=True)
    init = (model.m0, _initial(model, square_root))
    head, (m, S), tail_xs = _head(steps[False], init, xs, problem.yw.dtype)
    head_factors = head[1]
    head_covs = _covariances(head_factors, square_root)
    head = (head[0], head_covs, head[2], _predicted_covs(model, head_covs), head[3])
    settled = _settle(model, m, S, Hw, square_root)
    steady = lambda: _steady_tail(model, settled, m, tail_xs)
    if exact_fallback:

        def exact():
            ms, Ss, mps, lls = lax.scan(steps[True], (m, S), tail_xs)[1]
            covs = _covariances(Ss, square_root)
            prev = jnp.concatenate([head_covs[-1:], covs[:-1]])
            return ms, covs, mps, _predicted_covs(model, covs, prev), lls

        tail = lax.cond(settled.ok, steady, exact)
    else:
        tail = steady()
    outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), head, tail)
    result = _filter_result(*outs, problem.logdet)
    if factors:
        return result, settled.ok, (head_factors, settled.S_filt)
    return result, settled.ok
