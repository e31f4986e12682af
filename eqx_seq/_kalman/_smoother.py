"""The Rauch-Tung-Striebel smoother of both backends, from the filter's means and
covariance factors: per-step backward elements in square-root form, combined by a
loop (sequential backend) or an associative scan (parallel backend)."""

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._scan import AbstractScan
from ._interface import (
    KalmanFilterResult,
    KalmanSmootherResult,
)
from ._linalg import (
    bmm,
    cholesky,
    jittered,
    mT,
    mv,
    sandwich,
    sym,
    tria,
    tril_inverse_by_rows,
)
from ._model import (
    Model,
    per_step,
)


def element(m: Array, L: Array, m_pred_next: Array, F: Array, L_Q: Array):
    """`p(x_t | x_{t+1}, y_1..y_t) = N(E x_{t+1} + g, C)` from the filtered mean `m`
    and factor `L` of step `t`.

    The triangularisation of `[[F L, L_Q], [L, 0]]` is `[[L_pred, 0], [X, Lam]]`
    with `L_pred` the factor of the predicted covariance `P_pred`, `X = P F^T
    L_pred^{-T}` and `Lam Lam^T = P - P F^T P_pred^{-1} F P = C`: the gain
    `E = X L_pred^{-1}` and `C` come without the cancellation of `P - E P_pred E^T`
    (Park & Kailath's square-root smoother).
    """
    n = m.shape[0]
    A = jnp.concatenate(
        [
            jnp.concatenate([F @ L, L_Q], axis=1),
            jnp.concatenate([L, jnp.zeros_like(L)], axis=1),
        ]
    )
    X = tria(A)
    E = X[n:, :n] @ tril_inverse_by_rows(X[:n, :n])
    Lam = X[n:, n:]
    return E, m - E @ m_pred_next, sym(Lam @ Lam.T)


def smoother_elements(
    model: Model, filtered: KalmanFilterResult, factors: Array | None = None
):
    """The elements `(E_t, g_t, C_t)` of every step, batched over the steps; the
    last is `(0, m_T, P_T)`. `factors`: the filtered covariances' (default: their
    Cholesky factors, without LAPACK, whose calls batched over the steps can
    deadlock: `_linalg`)."""
    ms = filtered.means
    if factors is None:
        factors = cholesky(jittered(filtered.covs))
    F_v, Q_v = per_step(model.F, 2), per_step(model.L_Q, 2)
    in_axes = (0, 0, 0, 0 if F_v else None, 0 if Q_v else None)
    E, g, C = jax.vmap(element, in_axes=in_axes)(
        ms[:-1],
        factors[:-1],
        filtered.predicted_means[1:],
        model.F[1:] if F_v else model.F,
        model.L_Q[1:] if Q_v else model.L_Q,
    )
    E = jnp.concatenate([E, jnp.zeros((1, *E.shape[1:]), E.dtype)])  # T = 1: E empty
    g = jnp.concatenate([g, ms[-1:]])
    C = jnp.concatenate([C, filtered.covs[-1:]])
    return E, g, C


def settled_elements(
    model: Model, filtered: KalmanFilterResult, head: Array, tail: Array
):
    """`smoother_elements` of the steady-state filter: the filtered factors are
    `head` (steps `1..K`) and then one fixed factor `tail`, so the tail's elements
    share one `E` and `C` (one triangularisation, not one per step)."""
    ms, mps = filtered.means, filtered.predicted_means
    K, T = head.shape[0], ms.shape[0]
    # the tail's element with the head's, in one batch: one triangularisation in
    # the program, not two
    E, g_h, C = jax.vmap(element, in_axes=(0, 0, 0, None, None))(
        ms[: K + 1],
        jnp.concatenate([head, tail[None]]),
        mps[1 : K + 2],
        model.F,
        model.L_Q,
    )
    E_h, g_h, C_h, E_s, C_s = E[:K], g_h[:K], C[:K], E[K], C[K]
    g_s = ms[K:-1] - mps[K + 1 :] @ E_s.T
    tail_of = lambda X: jnp.broadcast_to(X, (T - 1 - K, *X.shape))
    zero = jnp.zeros((1, *E_s.shape), E_s.dtype)
    E = jnp.concatenate([E_h, tail_of(E_s), zero])
    g = jnp.concatenate([g_h, g_s, ms[-1:]])
    C = jnp.concatenate([C_h, tail_of(C_s), filtered.covs[-1:]])
    return E, g, C


def _smoothed(filtered, E, ms, Ps) -> KalmanSmootherResult:
    # Cov[x_t, x_{t+1} | y] = E_t Cov[x_{t+1} | y]
    return KalmanSmootherResult(ms, Ps, bmm(E[:-1], Ps[1:]), filtered)


def smooth_sequential(
    model: Model, filtered: KalmanFilterResult, factors: Array | tuple
) -> KalmanSmootherResult:
    """Backwards in a loop (`smooth_elements`). `factors`: every step's, or the
    steady-state filter's `(head, tail)`."""
    if isinstance(factors, tuple):
        elements = settled_elements(model, filtered, *factors)
    else:
        elements = smoother_elements(model, filtered, factors)
    return smooth_elements(filtered, elements, None)


def combine(later, earlier):
    # a reverse associative scan passes the element later in time first
    E_l, g_l, C_l = later
    E_e, g_e, C_e = earlier
    return E_e @ E_l, E_e @ g_l + g_e, sym(E_e @ C_l @ mT(E_e) + C_e)


def smooth_elements(
    filtered: KalmanFilterResult, elements, scan: AbstractScan | None
) -> KalmanSmootherResult:
    """The smoothed moments from every step's elements `(E, g, C)`, the last with
    `E = 0` (the smoothed moments of the last step): backwards in a loop,
    `m_t = E_t m_{t+1} + g_t`, `P_t = E_t P_{t+1} E_t^T + C_t` (a sum of positive
    semi-definite terms), or with a parallel `scan` as a reverse associative scan
    (Särkkä & García-Fernández, IEEE TAC 2021)."""
    E, g, C = elements
    if scan is not None and scan.parallel:
        _, ms, Ps = scan.associative_scan(jax.vmap(combine), (E, g, C), reverse=True)
        return _smoothed(filtered, E, ms, Ps)

    def step(carry, x):
        m, P = carry
        E, g, C = x
        m, P = mv(E, m) + g, sym(sandwich(E, P) + C)
        return (m, P), (m, P)

    init = (g[-1], C[-1])
    _, (ms, Ps) = lax.scan(step, init, (E[:-1], g[:-1], C[:-1]), reverse=True)
    ms = jnp.concatenate([ms, init[0][None]])
    Ps = jnp.concatenate([Ps, init[1][None]])
    return _smoothed(filtered, E, ms, Ps)


def smooth_parallel(
    model: Model, filtered: KalmanFilterResult, factors: Array, scan: AbstractScan
) -> KalmanSmootherResult:
    """The same elements as a reverse associative scan (`smooth_elements`)."""
    return smooth_elements(filtered, smoother_elements(model, filtered, factors), scan)
