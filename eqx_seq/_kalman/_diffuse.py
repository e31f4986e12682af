"""The exact diffuse start of the filter: an infinite-variance prior resolved by the
first observations, on the scalar updates of `_filter`'s step; the rest of the
sequence runs on the ordinary filter."""

import math

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import error_if_any
from ._filter import predict
from ._interface import (
    filter_result,
    KalmanFilterResult,
)
from ._linalg import (
    chol,
    LOG_2PI,
    mv,
    sandwich,
    sym,
)
from ._model import (
    Model,
    per_step,
    Problem,
)


# --- the exact diffuse filter: an infinite-variance prior, resolved by the first
# observations (Koopman & Durbin, J. Time Series Analysis 2000, on the whitened
# scalar observations of the step above; Durbin & Koopman 2012, section 5.2) ---
#
# The prior covariance is `P + kappa P_inf` with `kappa -> infinity`. A scalar update
# whose observation sees the diffuse part (`F_inf = h^T P_inf h > 0`) takes the limit
# of the ordinary one: the mean moves by `P_inf h e / F_inf`, `P_inf` loses the
# direction it saw, and the log-likelihood gains `-(log 2 pi + log F_inf) / 2`
# (statsmodels' exact diffuse likelihood). Once `P_inf = 0` the steps are the
# ordinary filter's. The first `diffuse_steps` steps run here, in a loop; the rest
# start from their proper moments and run on any backend.


def diffuse_steps(n: int, T: int) -> int:
    """Steps run by the diffuse filter: enough for any observable model with an
    observed entry per step to resolve the prior (`n` steps), with room for a few
    missing ones."""
    return min(T, 2 * n + 8)


def _tolerance(dtype) -> float:
    # `F_inf` below this (relative to |h|^2) is round-off left from a resolved
    # direction: the diffuse part has unit scale
    return math.sqrt(float(jnp.finfo(dtype).eps))


def _diffuse_update(m, P, P_inf, y, Hw, obs):
    """Condition on the whitened scalars `y_j = h_j^T x + e` one at a time; the
    ordinary update where the observation does not see the diffuse part."""
    ll = jnp.zeros((), m.dtype)
    tol = _tolerance(m.dtype)
    for j in range(y.shape[0]):
        h = Hw[j]
        M_inf, M = mv(P_inf, h), mv(P, h)
        F_inf, F = jnp.sum(h * M_inf), jnp.sum(h * M) + 1
        e = y[j] - jnp.sum(h * m)
        sees = F_inf > tol * jnp.sum(h * h)
        F_inf = jnp.where(sees, F_inf, 1)  # double where: no division by ~0
        k_inf = M_inf / F_inf
        k = M / F
        m = m + jnp.where(sees, k_inf, k) * e
        P_seen = (
            P
            + (F / F_inf) * k_inf[:, None] * M_inf[None, :]
            - (M[:, None] * k_inf[None, :] + k_inf[:, None] * M[None, :])
        )
        P = jnp.where(sees, P_seen, P - k[:, None] * M[None, :])
        P_inf = jnp.where(sees, P_inf - k_inf[:, None] * M_inf[None, :], P_inf)
        ll_j = jnp.where(
            sees,
            -0.5 * (LOG_2PI + jnp.log(F_inf)),
            -0.5 * (LOG_2PI + jnp.log(F) + e * e / F),
        )
        ll = ll + jnp.where(obs[j], ll_j, 0)
    return m, sym(P), sym(P_inf), ll


def _reported(P: Array, P_inf: Array) -> Array:
    """The covariance as returned: infinite in the rows and columns of states the
    data have not determined yet."""
    tol = _tolerance(P.dtype)
    open_ = jnp.diagonal(P_inf) > tol
    return jnp.where(open_[:, None] | open_[None, :], jnp.inf, P)


def _diffuse_head(problem: Problem, D: int):
    """The diffuse filter over steps `1..D`: its outputs and the final carry."""
    model = problem.model
    n = model.m0.shape[0]
    dtype = problem.yw.dtype
    take = lambda a, nd: a[:D] if per_step(a, nd) else a
    F, L_Q = take(model.F, 2), take(model.L_Q, 2)
    Hw = problem.Hw[:D]
    xs = {"y": problem.yw[:D], "obs": problem.obs[:D], "Hw": Hw}
    xs["first"] = jnp.arange(D) == 0
    if per_step(F, 2):
        xs["F"] = F
    if per_step(L_Q, 2):
        xs["L_Q"] = L_Q
    if problem.c is not None:
        xs["c"] = problem.c[:D]
    zero = jnp.zeros((n, n), dtype) + jnp.zeros_like(problem.yw, shape=())
    eye = jnp.eye(n, dtype=dtype) + zero
    # x_0 (or x_1, with no transition into it) ~ N(0, kappa I)
    init = (zero[0], zero, eye)

    def step(carry, x):
        m, P, P_inf = carry
        F_t = x.get("F", F)
        m_p, P_p = predict(m, P, F_t, x.get("L_Q", L_Q), x.get("c"))
        P_inf_p = sym(sandwich(F_t, P_inf))
        if model.prior_at == "x1":
            m_p = jnp.where(x["first"], m, m_p)
            P_p = jnp.where(x["first"], P, P_p)
            P_inf_p = jnp.where(x["first"], P_inf, P_inf_p)
        m_f, P_f, P_inf_f, ll = _diffuse_update(
            m_p, P_p, P_inf_p, x["y"], x["Hw"], x["obs"]
        )
        out = (m_f, _reported(P_f, P_inf_f), m_p, _reported(P_p, P_inf_p), ll)
        return (m_f, P_f, P_inf_f), out

    return lax.scan(step, init, xs)


def _diffuse_tail(problem: Problem, D: int, m: Array, P: Array) -> Problem:
    """Steps `D+1..T` as a problem of their own, whose prior is the filtered law of
    `x_D` (a proper one: the diffuse part is resolved)."""
    model = problem.model
    cut = lambda a, nd: a[D:] if per_step(a, nd) else a
    tail_model = Model(
        F=cut(model.F, 2),
        L_Q=cut(model.L_Q, 2),
        H=cut(model.H, 2),
        m0=m,
        L_P0=chol(P),
        prior_at="x0",
    )
    return Problem(
        tail_model,
        None if problem.c is None else problem.c[D:],
        problem.obs[D:],
        cut(problem.W, 2),
        problem.logdet[D:],
        problem.yw[D:],
    )


def filter_diffuse(problem: Problem, run_tail) -> KalmanFilterResult:
    """The exact diffuse filter: `diffuse_steps` steps here, then `run_tail` (the
    backend's filter of a `Problem`) on the rest."""
    T, n = problem.num_steps, problem.model.m0.shape[0]
    D = diffuse_steps(n, T)
    (m, P, P_inf), head = _diffuse_head(problem, D)
    if D == T:
        return filter_result(*head, problem.logdet)
    tol = _tolerance(P.dtype)
    m = error_if_any(
        m,
        jnp.max(jnp.abs(P_inf)) > tol,
        "eqx_seq.KalmanFilter: the diffuse prior was not resolved by the first "
        f"{D} steps (2 * state_size + 8): the observations there do not determine "
        "the state (too many missing, or an unobservable model).",
    )
    tail = run_tail(_diffuse_tail(problem, D, m, P))
    lls = jnp.concatenate([head[4] - problem.logdet[:D], tail.log_likelihoods])
    cat = lambda a, b: jnp.concatenate([a, b])
    return KalmanFilterResult(
        cat(head[0], tail.means),
        cat(head[1], tail.covs),
        cat(head[2], tail.predicted_means),
        cat(head[3], tail.predicted_covs),
        lls,
        jnp.sum(lls),
    )
