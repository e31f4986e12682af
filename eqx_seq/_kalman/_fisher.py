"""The log-likelihood's gradient by Fisher's identity,
`d/dθ log p(y | θ) = E[d/dθ log p(x, y | θ) | y]`: the gradient of the expected
complete-data log-likelihood at the smoother's moments, so that reverse mode costs
one filter, one smoother and a batched gradient, with no autodiff through the loop
(Shumway & Stoffer, J. Time Series Analysis 1982; Segal & Weinstein, Proc. IEEE
1989). Where the steady state applies, the smoother is the steady-state one (its
tail shares one element). See `docs/devdocs/kalman.md`, "Fisher's identity".
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array

from .._misc import full_precision, vary_like
from .._scan import AbstractScan
from ._dispatch import (
    by_whitening,
    filter_,
    smooth_problem,
    steady_applies,
    steady_or_exact,
)
from ._e_step import smoothed_sums_steady, SmoothedSums
from ._filter import first_prediction
from ._linalg import bmm, cho_solve, eye_like, LOG_2PI, mT
from ._model import bt, Model, per_step, prepare, Problem


def _sum_tr(A: Array, X: Array, B: Array) -> Array:
    """`sum_t tr(A_t X_t B_t^T)`; `A`, `B` constant or per step, `X` per step, or
    already summed over the steps (`A`, `B` constant)."""
    if A.ndim == 2 and B.ndim == 2:
        return jnp.sum((A @ (X if X.ndim == 2 else jnp.sum(X, axis=0))) * B)
    T = X.shape[0]
    return jnp.sum(bmm(bt(A, T), X) * bt(B, T))


def _expected_log_joint(problem: Problem, stats) -> Array:
    """`E[log p(x_1..x_T, y_1..y_T)]` over a fixed Gaussian posterior.

    `stats` are the smoother's moments of `x_1..x_T` (`x_1 ~ N(mu_1, S_1)`, its
    predicted moments, `x_0` integrated out): the means, and the covariances and
    lag-one cross-covariances per step or, for a time-invariant model with
    complete data, summed over the steps (`SmoothedSums`); only observed entries
    of `y` count. Linear in the statistics and scan-free; its
    gradient at the problem the statistics came from is the log-likelihood's
    (Fisher's identity). Quadratic forms in `Q^{-1}`, `Sigma_1^{-1}` go through
    triangular solves with the Cholesky factors.
    """
    model, c = problem.model, problem.c
    ms, cross = stats.means, stats.cross
    T, n = ms.shape
    # sum_t P_t over all steps, all but the first, all but the last
    if stats.covs.ndim == 2:
        P_all = stats.covs
        P_later, P_earlier = P_all - stats.first, P_all - stats.last
    else:
        P_all, P_later, P_earlier = stats.covs, stats.covs[1:], stats.covs[:-1]
    F_v, Q_v = per_step(model.F, 2), per_step(model.L_Q, 2)
    dtype = ms.dtype
    # x_1
    mu1, S1 = first_prediction(model, c)
    L1 = jnp.linalg.cholesky(S1)
    d1 = ms[0] - mu1
    q1 = jnp.trace(cho_solve(L1, stats.first + d1[:, None] * d1[None, :]))
    ll = -0.5 * (n * LOG_2PI + q1) - jnp.sum(jnp.log(jnp.diagonal(L1)))
    # transitions x_{t-1} -> x_t, t = 2..T
    if T > 1:
        F = model.F[1:] if F_v else model.F
        L_Q = model.L_Q[1:] if Q_v else model.L_Q
        K = jsl.solve_triangular(L_Q, eye_like(L_Q), lower=True)  # L_Q^{-1}
        d = ms[1:] - (
            ms[:-1] @ mT(F) if not F_v else jnp.einsum("tij,tj->ti", F, ms[:-1])
        )
        if c is not None:
            d = d - c[1:]
        Kd = d @ K.T if not Q_v else jnp.einsum("tij,tj->ti", K, d)
        KF = K @ F
        quad = (
            jnp.sum(Kd * Kd)
            + _sum_tr(K, P_later, K)
            - 2 * _sum_tr(KF, cross, K)
            + _sum_tr(KF, P_earlier, KF)
        )
        logdet_Q = jnp.sum(jnp.log(jnp.diagonal(L_Q, axis1=-2, axis2=-1)))
        logdet_Q = logdet_Q * (1 if Q_v else T - 1)
        ll = ll - 0.5 * ((T - 1) * n * LOG_2PI + quad) - logdet_Q
    # emissions
    Hw = problem.W @ model.H
    r = problem.yw - (ms @ mT(Hw) if Hw.ndim == 2 else jnp.einsum("tij,tj->ti", Hw, ms))
    quad = jnp.sum(r * r) + _sum_tr(Hw, P_all, Hw)
    num_obs = jnp.sum(problem.obs).astype(dtype)
    return ll - 0.5 * (num_obs * LOG_2PI + quad) - jnp.sum(problem.logdet)


@full_precision
def fisher_log_likelihood(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> Array:
    """The log-likelihood, differentiated by Fisher's identity (a custom JVP).

    Its tangent is `<g, dot>` with `g` the gradient of `_expected_log_joint` at the
    smoother's statistics (computed from primal values: no autodiff through the
    filter), pulled back through `prepare` to the parameters, observations and
    controls; so reverse mode transposes a linear map. Differentiating `g` again
    (Hessians) goes through the smoother by plain autodiff.
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)

    @jax.custom_jvp
    def log_likelihood(params, ys, us):
        return filter_(eqx.combine(params, static), ys, us, scan).log_likelihood

    @log_likelihood.defjvp
    @full_precision
    def log_likelihood_jvp(primals, tangents):
        params, ys, us = primals
        # under `shard_map`, parameters that vary like the data (as `prepare` makes
        # the model), so that the gradients the branches below return have one type
        data = (ys,) if us is None else (ys, us)
        params = jax.tree.map(lambda p: vary_like(p, *data), params)

        def value_and_grads(whitening, steady=False):
            problem, pullback = eqx.filter_vjp(
                lambda p, y, u: prepare(eqx.combine(p, static), y, u, whitening),
                params,
                ys,
                us,
            )
            if steady:
                # the steady state's sums over the steps, not its per-step arrays
                stats, settled = smoothed_sums_steady(problem)
            else:
                sm = smooth_problem(problem, scan, model.square_root)
                covs = sm.covs
                stats = SmoothedSums(
                    sm.means, covs[0], covs[-1], covs, sm.cross_covs,
                    sm.filtered.log_likelihood,
                )  # fmt: skip
            cotangent = eqx.filter_grad(_expected_log_joint)(problem, stats)
            out = stats.log_likelihood, pullback(cotangent)
            return (out, settled) if steady else out

        if model.square_root and steady_applies(model, ys, scan):
            steady = lambda: value_and_grads("complete", steady=True)
            value, grads = steady_or_exact(ys, steady, value_and_grads)
        else:
            value, grads = by_whitening(ys, scan, value_and_grads)
        dot = sum(
            (
                jnp.vdot(g, t)
                for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(tangents))
            ),
            start=jnp.zeros((), value.dtype),
        )
        return value, dot

    return log_likelihood(params, ys, us)
