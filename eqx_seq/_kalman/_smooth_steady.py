"""The smoother's statistics that EM needs, from the steady-state filter:
time-invariant model, complete data.

Once the filtered covariance has settled (`_steady`), the RTS gain
`J = P_f F^T P_p^{-1}` is constant, and so is the backward recursion of the
smoothed covariances, `P_t = C + J P_{t+1} J^T` with `C = P_f - J P_p J^T`: from
the last step it approaches its fixed point `P_ss` as `P_t = P_ss + J^j D J^jT`
(`j` steps back, `D = P_f - P_ss`). So the sums of the smoothed covariances and
cross-covariances over the steady steps are Lyapunov sums, `O(log T)` products;
the smoothed means are a backward loop of one matrix-vector product; the exact
head runs the RTS recursion step by step. The gains and `C` are the square-root
smoother's elements (`_smoother._element`, from the filtered factors), never the
covariance form's `P_f - J P_p J^T`: on a stiff model (a vague prior meeting
precise observations) the head's predicted covariances are many orders above the
filtered ones, and that difference cancelled in float32. Only sums leave this
module (no per-step covariances): see `docs/devdocs/kalman.md`,
"Expectation-maximisation".
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from ._linalg import _sym
from ._problem import _Problem
from ._smoother import _element
from ._steady import _affine_scan, _head_steps, filter_steady


# The fixed point is the sum of `J^j C J^jT` for `j < 2^_LOG2_TERMS`; it counts as
# converged when `|J^(2^_LOG2_TERMS)|^2` is below round-off.
_LOG2_TERMS = 12


class _SmoothedSums(eqx.Module):
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
        P = _sym(E @ P1 @ E.T + C)
        return (m, P), (m, P, E @ P1)

    return lax.scan(step, (m_next, P_next), (E, g, C), reverse=True)[1]


def smoothed_sums_steady(problem: _Problem) -> tuple[_SmoothedSums, Array]:
    """The statistics of a problem that `_may_settle`, and whether they are exact:
    the filter's covariance settled and the smoother's converges (`J` contracts)."""
    result, settled, (head_factors, tail_factor) = filter_steady(
        problem, exact_fallback=False, factors=True
    )
    model = problem.model
    F, L_Q = model.F, model.L_Q
    mf, mp = result.means, result.predicted_means
    T = mf.shape[0]
    K = _head_steps(mf.dtype)
    N = T - K  # the steady steps
    Pf = result.covs[-1]
    # the steady steps' element: the gain J and C = Pf - J Pp J^T, by one
    # triangularisation of the settled factor (its `g` is per step, below)
    J, _, C = _element(mf[K], tail_factor, mp[K + 1], F, L_Q)
    # means: the steady steps backwards from the last, then the head
    z = mf[K:-1] - mp[K + 1 :] @ J.T
    tail = _affine_scan(J, z[::-1], mf[-1])[::-1]
    m_K = tail[0] if N > 1 else mf[-1]
    # covariances of the steady steps: P_ss + J^j D J^jT, j = 0..N-1 from the last
    P_ss, J_far = lyapunov_sum(J, C, 2**_LOG2_TERMS)
    D = Pf - P_ss
    tail_sum = N * P_ss + lyapunov_sum(J, D, N)[0]
    J_K = jnp.linalg.matrix_power(J, N - 1)
    P_K = _sym(P_ss + J_K @ D @ J_K.T)
    # the head, rows 0..K-1: elements from their own filtered factors
    E_h, g_h, C_h = jax.vmap(_element, in_axes=(0, 0, 0, None, None))(
        mf[:K], head_factors, mp[1 : K + 1], F, L_Q
    )
    ms_h, Ps_h, cross_h = _head(E_h, g_h, C_h, m_K, P_K)
    sums = _SmoothedSums(
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
