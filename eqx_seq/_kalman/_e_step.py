"""The E-step of `KalmanFilter.fit_em`: the smoothed moments of every sequence as
the expected sufficient statistics of the M-step's regressions (`Moments`), from
the smoother, or for complete data and a time-invariant model from the
steady-state filter's sums (`smoothed_sums_steady`). See `docs/devdocs/kalman.md`,
"Expectation-maximisation".
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._scan import AbstractScan
from ._dispatch import (
    by_whitening,
    smooth_problem,
    steady_applies,
    steady_or_exact,
)
from ._filter import affine_scan, filter_steady, head_steps
from ._linalg import (
    bmm,
    gram,
    mT,
    sym,
    tria,
    tril_inverse_by_rows,
)
from ._model import (
    bt,
    Model,
    prepare,
    Problem,
)
from ._smoother import element


# --- the E-step's sums from the steady-state filter ---
#
# The smoother's statistics that EM needs, from the steady-state filter:
# time-invariant model, complete data.
#
# Once the filtered covariance has settled (`_filter.filter_steady`), the RTS gain
# `J = P_f F^T P_p^{-1}` is constant, and so is the backward recursion of the
# smoothed covariances, `P_t = C + J P_{t+1} J^T` with `C = P_f - J P_p J^T`: from
# the last step it approaches its fixed point `P_ss` as `P_t = P_ss + J^j D J^jT`
# (`j` steps back, `D = P_f - P_ss`). So the sums of the smoothed covariances and
# cross-covariances over the steady steps are Lyapunov sums, `O(log T)` products;
# the smoothed means are a backward loop of one matrix-vector product; the exact
# head runs the RTS recursion step by step. The gains and `C` are the square-root
# smoother's elements (`_smoother.element`, from the filtered factors), never the
# covariance form's `P_f - J P_p J^T`: on a stiff model (a vague prior meeting
# precise observations) the head's predicted covariances are many orders above the
# filtered ones, and that difference cancelled in float32. Only sums leave these
# functions (no per-step covariances): see `docs/devdocs/kalman.md`,
# "Expectation-maximisation".


# The fixed point is the sum of `J^j C J^jT` for `j < 2^_LOG2_TERMS`; it counts as
# converged when `|J^(2^_LOG2_TERMS)|^2` is below round-off.
_LOG2_TERMS = 12


class SmoothedSums(eqx.Module):
    """What EM reads of the smoother: the means `(T, n)`, the first and last
    covariances, the sum of all covariances and of the lag-one cross-covariances
    `Cov[x_t, x_{t+1}]` (or, where noted by the caller, the per-step arrays), and
    the log-likelihood."""

    means: Array
    first: Array
    last: Array
    covs: Array
    cross: Array
    log_likelihood: Array


def lyapunov_sum(J: Array, X: Array, N: int) -> tuple[Array, Array]:
    """`sum_{j < N} J^j X J^jT` and `J^N`, by doubling over the binary digits of
    `N` (static)."""
    total = jnp.zeros_like(X)
    power = jnp.eye(J.shape[0], dtype=J.dtype)
    A, S = J, X  # S: the sum of the first 2^i terms, A = J^(2^i)
    while N:
        if N & 1:
            total = total + power @ S @ power.T
            power = power @ A
        N >>= 1
        if N:
            S = S + A @ S @ A.T
            A = A @ A
    return total, power


def _head(E, g, C, m_next, P_next):
    """The exact steps' RTS recursion, backwards from the smoothed moments of the
    first steady step, on their square-root elements `(E, g, C)`: the means,
    covariances (sums of positive semi-definite terms) and cross-covariances."""

    def step(carry, x):
        m1, P1 = carry
        E, g, C = x
        m = E @ m1 + g
        P = sym(E @ P1 @ E.T + C)
        return (m, P), (m, P, E @ P1)

    return lax.scan(step, (m_next, P_next), (E, g, C), reverse=True)[1]


def smoothed_sums_steady(problem: Problem) -> tuple[SmoothedSums, Array]:
    """The statistics of a problem that `may_settle`, and whether they are exact:
    the filter's covariance settled and the smoother's converges (`J` contracts)."""
    result, settled, (head_factors, tail_factor) = filter_steady(
        problem, exact_fallback=False, factors=True
    )
    model = problem.model
    F, L_Q = model.F, model.L_Q
    mf, mp = result.means, result.predicted_means
    T = mf.shape[0]
    K = head_steps(mf.dtype)
    N = T - K  # the steady steps
    Pf = result.covs[-1]
    # the steady steps' element: the gain J and C = Pf - J Pp J^T, by one
    # triangularisation of the settled factor (its `g` is per step, below)
    J, _, C = element(mf[K], tail_factor, mp[K + 1], F, L_Q)
    # means: the steady steps backwards from the last, then the head
    z = mf[K:-1] - mp[K + 1 :] @ J.T
    tail = affine_scan(J, z[::-1], mf[-1])[::-1]
    m_K = tail[0] if N > 1 else mf[-1]
    # covariances of the steady steps: P_ss + J^j D J^jT, j = 0..N-1 from the last
    P_ss, J_far = lyapunov_sum(J, C, 2**_LOG2_TERMS)
    D = Pf - P_ss
    tail_sum = N * P_ss + lyapunov_sum(J, D, N)[0]
    J_K = jnp.linalg.matrix_power(J, N - 1)
    P_K = sym(P_ss + J_K @ D @ J_K.T)
    # the head, rows 0..K-1: elements from their own filtered factors
    E_h, g_h, C_h = jax.vmap(element, in_axes=(0, 0, 0, None, None))(
        mf[:K], head_factors, mp[1 : K + 1], F, L_Q
    )
    ms_h, Ps_h, cross_h = _head(E_h, g_h, C_h, m_K, P_K)
    sums = SmoothedSums(
        means=jnp.concatenate([ms_h, tail, mf[-1:]]),
        first=Ps_h[0],
        last=Pf,
        covs=jnp.sum(Ps_h, axis=0) + tail_sum,
        cross=jnp.sum(cross_h, axis=0) + J @ (tail_sum - P_K),
        log_likelihood=result.log_likelihood,
    )
    eps = jnp.finfo(mf.dtype).eps
    converged = jnp.sum(J_far * J_far) <= eps
    return sums, settled & converged


# --- the E-step and the M-step ---


class Moments(eqx.Module):
    """The expected sufficient statistics of a regression of targets `y` on
    regressors `z`, per sequence: the posterior means `my` `(T, d)` and `mz`
    `(T, k)` of every step, and the posterior covariances `Vyy`, `Vyz`, `Vzz`,
    summed over the steps, or per step (a leading `T`) where a coefficient held
    fixed varies with time. `E[y z^T]` at a step is `Vyz + my mz^T`."""

    my: Array
    mz: Array
    Vyy: Array
    Vyz: Array
    Vzz: Array


def _pad(V: Array, rows: int, cols: int) -> Array:
    """`V` with zero rows and columns appended up to `(rows, cols)` (the controls',
    which are known)."""
    pad = [(0, 0)] * (V.ndim - 2) + [(0, rows - V.shape[-2]), (0, cols - V.shape[-1])]
    return jnp.pad(V, pad)


def _with_controls(x: Array, us: Array | None) -> Array:
    return x if us is None else jnp.concatenate([x, us], axis=-1)


def _smoothed_x0(model: Model, m1: Array, P1: Array, c1: Array | None):
    """The smoothed moments of `x_0`, the state before the first observation, and
    `Cov[x_0, x_1 | y]`: one RTS step back from the smoothed `x_1`, whose
    prediction from the prior has no data in between, `x_0 | x_1 ~ N(J x_1 + g,
    C)`. `C` in information form, `C^{-1} = P0^{-1} + F^T Q^{-1} F` (a sum; from
    the triangularisation of the factors' inverses), `J = C F^T Q^{-1}` and `g = C
    P0^{-1} m0 - J B u_1`: the covariance form, `J = P0 F^T S_1^{-1}` and `C = (I -
    J F) P0 (I - J F)^T + J Q J^T`, cancels in `I - J F` where the prior is vague
    (with `P0 = 1e6 I`, float32's smoothed `P0` came out 0.3% of its variances
    off, and its square-root element no better). `c1 = B u_1` as `(1, n)`."""
    F = model.F[0] if model.F.ndim == 3 else model.F
    L_Q = model.L_Q[0] if model.L_Q.ndim == 3 else model.L_Q
    W0 = tril_inverse_by_rows(model.L_P0)
    WQF = tril_inverse_by_rows(L_Q)  # then W_Q F, W_Q^T W_Q = Q^{-1}
    WQ, WQF = WQF, WQF @ F
    U = tria(jnp.concatenate([W0.T, WQF.T], axis=1))  # U U^T = C^{-1}
    Y = mT(tril_inverse_by_rows(U))  # Y Y^T = C
    C = Y @ Y.T
    J = C @ (WQF.T @ WQ)
    g = C @ (W0.T @ (W0 @ model.m0))
    if c1 is not None:
        g = g - J @ c1[0]
    return J @ m1 + g, sym(J @ P1 @ J.T + C), J @ P1


def _completed_observations(
    problem: Problem, ms, Ps, ys, us, L_R, D, per_step, complete
):
    """The moments of the completed observations `y_t` (missing entries latent)
    from the smoothed means `ms` and covariances `Ps`: their means `(T, p)`, and
    the covariances `Cov[y_t]` and `Cov[y_t, x_t]` (summed over the steps unless
    `per_step`).

    Given `x_t` and the observed entries, `y_t = H x_t + D u_t + K_t (w_t - W_t H
    x_t) + eta_t` with `K_t = R W_t^T`, `w_t` the whitened observed entries and
    `eta_t ~ N(0, R - K_t W_t R)`, the conditional law of the missing entries
    (`K_t W_t = R Pi_t`, `Pi_t` the inverse of `R` on the observed entries,
    padded with zeros). With complete data `y_t` is known.
    """
    T, p = ys.shape
    n = problem.model.m0.shape[0]
    if complete:
        shape = (T,) if per_step else ()
        zeros = lambda *s: jnp.zeros((*shape, *s), ys.dtype)
        return ys, zeros(p, p), zeros(p, n)
    W = bt(problem.W, T)
    R = bt(gram(L_R), T)
    H = bt(problem.model.H, T)
    K = bmm(R, mT(W))
    Hw = bmm(W, H)
    w = problem.yw - jnp.einsum("tpn,tn->tp", Hw, ms)
    my = jnp.einsum("tpn,tn->tp", H, ms) + jnp.einsum("tpq,tq->tp", K, w)
    if D is not None:
        my = my + us @ D.T
    A = H - bmm(K, Hw)  # the missing entries' dependence on x_t
    Vyx = bmm(A, Ps)
    Vyy = bmm(Vyx, mT(A)) + R - bmm(bmm(K, W), R)
    if not per_step:
        Vyx, Vyy = jnp.sum(Vyx, axis=0), jnp.sum(Vyy, axis=0)
    return my, sym(Vyy), Vyx


def _smoothed(model: Model, ys, us, scan: AbstractScan, per_step: bool):
    """The smoother's statistics (summed over the steps unless `per_step`) and the
    completed observations' moments. For a time-invariant model with complete data
    the sums come from the steady-state filter (`smoothed_sums_steady`) where it settles
    and the smoother converges, else from the smoother."""
    L_R = model.L_R

    def exact(whitening):
        problem = prepare(model, ys, us, whitening)
        sm = smooth_problem(problem, scan)
        ms, Ps, cross = sm.means, sm.covs, sm.cross_covs
        complete = whitening == "complete"
        obs = _completed_observations(
            problem, ms, Ps, ys, us, L_R, model.D, per_step, complete
        )
        if not per_step:
            Ps, cross = jnp.sum(Ps, axis=0), jnp.sum(cross, axis=0)
        ll = sm.filtered.log_likelihood
        return SmoothedSums(ms, sm.covs[0], sm.covs[-1], Ps, cross, ll), obs

    def steady():
        problem = prepare(model, ys, us, "complete")
        sums, ok = smoothed_sums_steady(problem)
        obs = _completed_observations(
            problem, None, None, ys, us, L_R, model.D, per_step, True
        )
        return (sums, obs), ok

    if per_step or not steady_applies(model, ys, scan):
        return by_whitening(ys, scan, exact)
    return steady_or_exact(ys, steady, exact)


def sequence_moments(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> tuple[tuple[Moments, Moments, Moments], Array]:
    """The E-step on one sequence: the moments of the prior, transition and
    emission regressions, and the log-likelihood."""
    per_step_x, per_step_y = model.F.ndim == 3, model.H.ndim == 3
    per_step = per_step_x or per_step_y
    sm, (my, Vyy, Vyx) = _smoothed(model, ys, us, scan, per_step)
    if per_step and not per_step_y:  # one emission regression: summed moments
        Vyy, Vyx = jnp.sum(Vyy, axis=0), jnp.sum(Vyx, axis=0)
    T, n = sm.means.shape
    c = 0 if us is None else us.shape[1]
    k = n + c
    ms = sm.means
    x1 = model.prior_at == "x1"
    if x1:
        # the prior is x_1's; transitions into x_2..x_T
        m0, P0 = ms[0], sm.first
        mprev, xs, u_x = ms[:-1], ms[1:], None if us is None else us[1:]
    else:
        # x_0 smoothed too; transitions into x_1..x_T
        c1 = None if us is None else us[:1] @ model.B.T
        m0, P0, C01 = _smoothed_x0(model, ms[0], sm.first, c1)
        mprev, xs, u_x = jnp.concatenate([m0[None], ms[:-1]]), ms, us
    # the covariances of the targets x_t, of the regressors x_{t-1}, and
    # Cov[x_t, x_{t-1}]
    if per_step:
        Ps, cross = sm.covs, sm.cross
        if x1:
            Vyy_x, Vzz_x, Vyz_x = Ps[1:], Ps[:-1], mT(cross)
        else:
            Vyy_x, Vzz_x = Ps, jnp.concatenate([P0[None], Ps[:-1]])
            Vyz_x = mT(jnp.concatenate([C01[None], cross]))
        if not per_step_x:
            Vyy_x, Vyz_x, Vzz_x = (jnp.sum(V, 0) for V in (Vyy_x, Vyz_x, Vzz_x))
        Vzz_y = Ps if per_step_y else jnp.sum(Ps, axis=0)
    else:
        S = sm.covs
        if x1:
            Vyy_x, Vzz_x, Vyz_x = S - sm.first, S - sm.last, mT(sm.cross)
        else:
            Vyy_x, Vzz_x, Vyz_x = S, P0 + S - sm.last, mT(C01 + sm.cross)
        Vzz_y = S
    zero = lambda *shape: jnp.zeros(shape, ms.dtype)
    prior = Moments(m0[None], zero(1, 1) + 1, P0, zero(n, 1), zero(1, 1))
    transition = Moments(
        xs, _with_controls(mprev, u_x), Vyy_x, _pad(Vyz_x, n, k), _pad(Vzz_x, k, k)
    )
    emission = Moments(
        my, _with_controls(ms, us), Vyy, _pad(Vyx, Vyx.shape[-2], k), _pad(Vzz_y, k, k)
    )
    return (prior, transition, emission), sm.log_likelihood
