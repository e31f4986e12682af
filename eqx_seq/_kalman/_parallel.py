"""The parallel filter and smoother of Särkkä & García-Fernández, "Temporal
Parallelization of Bayesian Smoothers", IEEE TAC 2021: per-step elements combined by
the backend's `associative_scan`. The log-likelihood comes from the filtered states
after the scan, never from inside the scan element, which cancels catastrophically
when the state drifts far from zero (`docs/devdocs/kalman.md`, "Parallel filter").
"""

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl

from .._scan import AbstractScan
from ._linalg import _cho_solve, _chol, _gram, _jittered, _sym, inverse_cholesky
from ._problem import _Model, _per_step, _Problem
from ._results import _filter_result, KalmanFilterResult, KalmanSmootherResult
from ._step import _predict, _update, first_prediction


def _filter_elements(problem: _Problem):
    """Särkkä & García-Fernández filtering elements `(A, b, C, eta, J)`, all steps.

    Element `t` is `p(x_t | x_{t-1}, y_t) = N(A x_{t-1} + b, C)` together with the
    information `(eta, J)` that `y_t` carries about `x_{t-1}`; element 1 has the
    prior folded in (`A = 0`, `eta = 0`, `J = 0`).
    """
    model, c, yw = problem.model, problem.c, problem.yw
    T, p = yw.shape
    n = model.m0.shape[0]
    dtype = yw.dtype
    F = jnp.broadcast_to(model.F, (T, n, n))
    Q = jnp.broadcast_to(_gram(model.L_Q), (T, n, n))
    mu = jnp.zeros((T, n), dtype) if c is None else c
    Hw = problem.Hw
    # step 1: the prediction of x_1 from the prior, and no dependence on x_0
    m_pred0, P_pred0 = first_prediction(model, c)
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
    m1, P1 = first_prediction(model, c)
    if ms.shape[0] == 1:
        return m1[None], P1[None]
    F_ax = 0 if _per_step(model.F, 2) else None
    Q_ax = 0 if _per_step(model.L_Q, 2) else None
    c_ax = None if c is None else 0
    mps, Pps = jax.vmap(_predict, in_axes=(0, 0, F_ax, Q_ax, c_ax))(
        ms[:-1],
        Ps[:-1],
        model.F[1:] if F_ax == 0 else model.F,
        model.L_Q[1:] if Q_ax == 0 else model.L_Q,
        None if c is None else c[1:],
    )
    return jnp.concatenate([m1[None], mps]), jnp.concatenate([P1[None], Pps])


def filter_parallel(problem: _Problem, scan: AbstractScan) -> KalmanFilterResult:
    """The filter as `scan.associative_scan` over the elements."""
    elements = _filter_elements(problem)
    _, ms, Ps, _, _ = scan.associative_scan(jax.vmap(_combine_filter), elements)
    # the log-likelihood from the filtered states, after the scan (module docstring)
    mps, Pps = _predictions(problem.model, problem.c, ms, Ps)
    _, _, lls, _ = jax.vmap(_update)(mps, Pps, problem.yw, problem.Hw, problem.obs)
    return _filter_result(ms, Ps, mps, Pps, lls, problem.logdet)


def _smoother_elements(model: _Model, filtered: KalmanFilterResult):
    """RTS elements `(E_t, g_t, L_t)`: `p(x_t | x_{t+1}, y_1..y_t) = N(E x + g, L)`."""
    ms, Ps = filtered.means, filtered.covs
    F_next = model.F[1:] if _per_step(model.F, 2) else model.F
    F_ax = 0 if _per_step(model.F, 2) else None

    def element(m, P, m_pred_next, P_pred_next, F):
        FP = F @ P
        # E^T = P_pred^{-1} F P, without LAPACK: one factorisation per step,
        # batched over the steps, is the batched call that can deadlock (`_linalg`)
        W = inverse_cholesky(_jittered(P_pred_next))
        Et = W.T @ (W @ FP)
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


def smooth_parallel(
    model: _Model, filtered: KalmanFilterResult, scan: AbstractScan
) -> KalmanSmootherResult:
    """The RTS smoother as `scan.associative_scan` over the elements `(E, g, L)`."""
    E, g, L = _smoother_elements(model, filtered)
    _, ms, Ps = scan.associative_scan(
        jax.vmap(_combine_smoother), (E, g, L), reverse=True
    )
    cross = E[:-1] @ Ps[1:]
    return KalmanSmootherResult(ms, Ps, cross, filtered)
