"""The parallel filter of Särkkä & García-Fernández, "Temporal Parallelization of
Bayesian Smoothers", IEEE TAC 2021: per-step elements combined by the backend's
`associative_scan`, in the square-root form of Yaghoobi, Corenflos, Hassan & Särkkä
(SIAM J. Sci. Comput. 2025, arXiv:2207.00426), or in covariance form behind the
layer's private `_square_root` (for comparisons). The log-likelihood comes from the
filtered states after the scan, never from inside the scan element, which cancels
catastrophically when the state drifts far from zero (`docs/devdocs/kalman.md`,
"Parallel filter").
"""

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array

from .._scan import AbstractScan
from ._filter import (
    first_factor,
    first_prediction,
    predict,
    predicted_covs,
    update,
)
from ._interface import (
    filter_result,
    KalmanFilterResult,
)
from ._linalg import (
    cho_solve,
    chol,
    gram,
    mT,
    sqrt_update,
    sym,
    tria,
    tria_gram,
    tril_inverse_by_rows,
    whitened_log_density,
)
from ._model import (
    per_step,
    Problem,
)


def _filter_elements(problem: Problem):
    """Särkkä & García-Fernández filtering elements `(A, b, C, eta, J)`, all steps
    (covariance form).

    Element `t` is `p(x_t | x_{t-1}, y_t) = N(A x_{t-1} + b, C)` together with the
    information `(eta, J)` that `y_t` carries about `x_{t-1}`; element 1 has the
    prior folded in (`A = 0`, `eta = 0`, `J = 0`).
    """
    model, c, yw = problem.model, problem.c, problem.yw
    T, p = yw.shape
    n = model.m0.shape[0]
    dtype = yw.dtype
    F = jnp.broadcast_to(model.F, (T, n, n))
    Q = jnp.broadcast_to(gram(model.L_Q), (T, n, n))
    mu = jnp.zeros((T, n), dtype) if c is None else c
    Hw = problem.Hw
    # step 1: the prediction of x_1 from the prior, and no dependence on x_0
    m_pred0, P_pred0 = first_prediction(model, c)
    mu = mu.at[0].set(m_pred0)
    Sigma = Q.at[0].set(P_pred0)
    F = F.at[0].set(0)

    def element(F, mu, Sigma, Hw, y):
        HS = Hw @ Sigma
        S = sym(HS @ Hw.T) + jnp.eye(p, dtype=dtype)  # eigenvalues >= 1
        L_S = jnp.linalg.cholesky(S)
        Kt = cho_solve(L_S, HS)  # K^T = S^{-1} H Sigma
        HF = Hw @ F
        v = y - Hw @ mu
        A = F - Kt.T @ HF
        b = mu + Kt.T @ v
        C = sym(Sigma - Kt.T @ HS)
        Sinv_HF = cho_solve(L_S, HF)
        eta = HF.T @ cho_solve(L_S, v[:, None])[:, 0]
        J = sym(HF.T @ Sinv_HF)
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
    U = chol(C_i)
    UtJ = U.T @ J_j
    L_W = jnp.linalg.cholesky(sym(eye + UtJ @ U))
    Z = jsl.solve_triangular(L_W, UtJ, lower=True)  # L_W^{-1} U^T J_j
    V = jsl.solve_triangular(L_W, U.T, lower=True)  # L_W^{-1} U^T
    M = eye - V.T @ Z  # (I + C_i J_j)^{-1}
    A_j_M = A_j @ M
    A = A_j_M @ A_i
    b = A_j_M @ (b_i + C_i @ eta_j) + b_j
    AV = A_j @ V.T
    C = sym(AV @ AV.T + C_j)
    eta = A_i.T @ (M.T @ (eta_j - J_j @ b_i)) + eta_i
    J = sym(A_i.T @ (J_j - Z.T @ Z) @ A_i + J_i)
    return A, b, C, eta, J


def _transitions(problem: Problem):
    """Every step's `F`, `mu` (the control's `B u`) and the factor of the noise
    covariance `Sigma` given `x_{t-1}`; step 1 with the prior folded in (no
    dependence on `x_0`: `F = 0`, and the prediction of `x_1`, `first_factor`)."""
    model, c = problem.model, problem.c
    T = problem.num_steps
    n = model.m0.shape[0]
    F = jnp.broadcast_to(model.F, (T, n, n))
    L_Q = jnp.broadcast_to(model.L_Q, (T, n, n))
    mu = jnp.zeros((T, n), F.dtype) if c is None else c
    m1, L1 = first_factor(model, c)
    return F.at[0].set(0), mu.at[0].set(m1), L_Q.at[0].set(L1)


def _sqrt_element(F: Array, mu: Array, L: Array, Hw: Array, y: Array):
    """The filtering element `(A, b, U, eta, Z)` of one step, `C = U U^T`,
    `J = Z Z^T`; `Z` is `n x n` (zero columns added, or compressed by `tria_gram`).

    With the factor `L` of `Sigma`, the triangularisation of `[[Hw L, I], [L, 0]]`
    is `[[S^{1/2}, 0], [Sigma Hw^T S^{-T/2}, U]]`: the gain `K = Sigma Hw^T S^{-1}`
    and `C = Sigma - K S K^T` without cancellation; `Z = F^T Hw^T S^{-T/2}`.
    """
    p, n = Hw.shape
    X = tria(
        jnp.concatenate(
            [
                jnp.concatenate([Hw @ L, jnp.eye(p, dtype=L.dtype)], axis=1),
                jnp.concatenate([L, jnp.zeros((n, p), L.dtype)], axis=1),
            ]
        )
    )
    S_inv_half = tril_inverse_by_rows(X[:p, :p])  # S^{-1/2}
    K = X[p:, :p] @ S_inv_half
    HF = Hw @ F
    v = y - Hw @ mu
    Z = HF.T @ S_inv_half.T
    eta = Z @ (S_inv_half @ v)
    if p < n:
        Z = jnp.concatenate([Z, jnp.zeros((n, n - p), Z.dtype)], axis=1)
    elif p > n:
        Z = tria_gram(Z)
    return F - K @ HF, mu + K @ v, X[p:, p:], eta, Z


def _sqrt_elements(problem: Problem):
    """The filtering elements (`_sqrt_element`) of every step."""
    F, mu, L_Sigma = _transitions(problem)
    return jax.vmap(_sqrt_element)(F, mu, L_Sigma, problem.Hw, problem.yw)


def sqrt_combine(earlier, later):
    """`p(x_k | x_i, y_{i+1..k})` from the elements over `(i, j]` and `(j, k]`.

    With `B = U_i^T Z_j`, `Xi = tria([B, I])` (`Xi Xi^T = I + U_i^T J_j U_i`) and
    `V = U_i Xi^{-T}`: `(I + C_i J_j)^{-1} = I - V V^T J_j` and
    `(I + C_i J_j)^{-1} C_i = V V^T`, so `C = A_j V V^T A_j^T + C_j` is
    `tria([A_j V, U_j])`; with `G = tria([I, B^T])` (`G G^T = I + Z_j^T C_i Z_j`),
    `J_j (I + C_i J_j)^{-1} = Z_j G^{-T} G^{-1} Z_j^T`, so `J` is
    `tria_gram([A_i^T Z_j G^{-T}, Z_i])` (rank deficient while `y_{i+1..k}` do not
    determine `x_i`). The mean is updated in innovation form,
    `b_i + V V^T (eta_j - J_j b_i)`, which stays accurate where `(I + C_i J_j)^{-1}`
    is small (a precise observation after a vague state).
    """
    A_i, b_i, U_i, eta_i, Z_i = earlier
    A_j, b_j, U_j, eta_j, Z_j = later
    n = b_i.shape[-1]
    eye = jnp.eye(n, dtype=b_i.dtype)
    B = U_i.T @ Z_j
    V = U_i @ mT(tril_inverse_by_rows(tria(jnp.concatenate([B, eye], axis=1))))
    G_inv = tril_inverse_by_rows(tria(jnp.concatenate([eye, B.T], axis=1)))
    r = eta_j - Z_j @ (Z_j.T @ b_i)  # eta_j - J_j b_i
    Vr = V @ (V.T @ r)
    b = A_j @ (b_i + Vr) + b_j
    A = A_j @ (A_i - V @ ((V.T @ Z_j) @ (Z_j.T @ A_i)))
    U = tria(jnp.concatenate([A_j @ V, U_j], axis=1))
    eta = A_i.T @ (r - Z_j @ (Z_j.T @ Vr)) + eta_i
    Z = tria_gram(jnp.concatenate([A_i.T @ Z_j @ G_inv.T, Z_i], axis=1))
    return A, b, U, eta, Z


def _log_likelihoods(problem: Problem, ms, Ls):
    """Every step's predicted mean and log-density from the previous step's
    filtered mean and factor (step 1's from the prior), batched (the module
    docstring)."""
    model, c = problem.model, problem.c
    T, n = ms.shape
    F = jnp.broadcast_to(model.F, (T, n, n))
    L_Q = jnp.broadcast_to(model.L_Q, (T, n, n))
    m_prev = jnp.concatenate([model.m0[None], ms[:-1]])
    L_prev = jnp.concatenate([model.L_P0[None], Ls[:-1]])
    m_pred = jnp.einsum("tij,tj->ti", F, m_prev)
    if c is not None:
        m_pred = m_pred + c
    FL = F @ L_prev
    if model.prior_at == "x1":  # no transition into step 1
        m_pred, FL = m_pred.at[0].set(model.m0), FL.at[0].set(model.L_P0)
        L_Q = L_Q.at[0].set(0)

    def log_density(m_pred, FL, L_Q, Hw, y, obs):
        _, _, nu, log_s = sqrt_update(m_pred, FL, L_Q, Hw, y)
        return whitened_log_density(nu, log_s, obs)

    lls = jax.vmap(log_density)(m_pred, FL, L_Q, problem.Hw, problem.yw, problem.obs)
    return m_pred, lls


def filter_parallel(
    problem: Problem, scan: AbstractScan, *, square_root: bool = True
) -> tuple[KalmanFilterResult, Array]:
    """The filter as `scan.associative_scan` over the elements, and the filtered
    covariances' factors (for the smoother)."""
    model = problem.model
    if square_root:
        elements = _sqrt_elements(problem)
        _, ms, Ls, _, _ = scan.associative_scan(jax.vmap(sqrt_combine), elements)
        # the log-likelihood from the filtered states, after the scan (module doc)
        mps, lls = _log_likelihoods(problem, ms, Ls)
        Ps = sym(Ls @ mT(Ls))
        Pps = predicted_covs(model, Ps)
    else:
        elements = _filter_elements(problem)
        _, ms, Ps, _, _ = scan.associative_scan(jax.vmap(_combine_filter), elements)
        mps, Pps = _predictions(problem, ms, Ps)
        _, _, lls, _ = jax.vmap(update)(mps, Pps, problem.yw, problem.Hw, problem.obs)
        Ls = chol(Ps)
    return filter_result(ms, Ps, mps, Pps, lls, problem.logdet), Ls


def _predictions(problem: Problem, ms, Ps):
    """One-step predictions of every step from the filtered moments of the previous
    (covariance form)."""
    model, c = problem.model, problem.c
    m1, P1 = first_prediction(model, c)
    if ms.shape[0] == 1:
        return m1[None], P1[None]
    F_ax = 0 if per_step(model.F, 2) else None
    Q_ax = 0 if per_step(model.L_Q, 2) else None
    c_ax = None if c is None else 0
    mps, Pps = jax.vmap(predict, in_axes=(0, 0, F_ax, Q_ax, c_ax))(
        ms[:-1],
        Ps[:-1],
        model.F[1:] if F_ax == 0 else model.F,
        model.L_Q[1:] if Q_ax == 0 else model.L_Q,
        None if c is None else c[1:],
    )
    return jnp.concatenate([m1[None], mps]), jnp.concatenate([P1[None], Pps])
