"""The sequential filter (a `lax.scan` of `_step`) and the sequential smoother, in
Bryson-Frazier (information) form over the filter's scalar updates."""

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import zeros_like_inputs
from ._linalg import _bmm, _gram, _mT, _mv, _sandwich, _sym
from ._problem import _Model, _per_step, _Problem
from ._results import _filter_result, KalmanFilterResult, KalmanSmootherResult
from ._steady import _may_settle, filter_steady
from ._step import _sequential_step


def filter_sequential(
    problem: _Problem, *, steady_state: bool = True
) -> KalmanFilterResult:
    """The filter in a `lax.scan`. With `steady_state`, for a time-invariant model
    with complete data (`W` one matrix), the steps after the covariance has settled
    are the steady-state filter (`_steady`); until then, and otherwise, every step
    is exact."""
    if steady_state and _may_settle(problem):
        return filter_steady(problem)[0]
    steps, xs, _ = _sequential_step(problem)
    init = (problem.model.m0, _gram(problem.model.L_P0))
    _, outs = lax.scan(steps[False], init, xs)
    return _filter_result(*outs, problem.logdet)


def filter_recorded(problem: _Problem) -> tuple[KalmanFilterResult, tuple]:
    """The filter with every step exact, and what the smoother needs: the whitened
    emissions `Hw` and the scalar updates' gains, innovations and variances."""
    steps, xs, Hw_const = _sequential_step(problem)
    init = (problem.model.m0, _gram(problem.model.L_P0))
    _, (outs, rec) = lax.scan(steps[True], init, xs)
    Hw = Hw_const if Hw_const is not None else problem.Hw
    return _filter_result(*outs, problem.logdet), (Hw, *rec)


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


def smooth_sequential(
    model: _Model, filtered: KalmanFilterResult, recorded
) -> KalmanSmootherResult:
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
