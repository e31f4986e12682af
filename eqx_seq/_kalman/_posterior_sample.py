"""Draws of the whole state path from `p(x_1..x_T | y_1..y_T)`: forward filtering,
backward sampling (Frühwirth-Schnatter 1994; Carter & Kohn 1994).

Backwards, `x_t | x_{t+1}, y_1..y_t ~ N(E_t x_{t+1} + g_t, L_t)` (the RTS elements
of `_smoother.smoother_elements`; `x_T ~ N(m_T, P_T)`). With the noise drawn
first, `x_t = E_t x_{t+1} + g_t + chol(L_t) eps_t` is an affine recursion: a
backward `lax.scan` on a sequential backend, and on a parallel one the composition
of the affine maps by the backend's `associative_scan` (the smoother's combine,
whose covariance part then carries the smoothed covariances along unused).
"""

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._misc import full_precision
from ._dispatch import backend, filter_
from ._linalg import _jittered, cholesky
from ._problem import _model
from ._smoother import combine, smoother_elements


if TYPE_CHECKING:
    from ._layer import KalmanFilter


@eqx.filter_jit
@full_precision
def posterior_sample(
    kf: "KalmanFilter",
    key: PRNGKeyArray,
    ys: Array,
    us: Array | None,
    num_samples: int,
) -> Array:
    """`num_samples` paths `x_1..x_T` given `ys` and `us` (checked), shape
    `(num_samples, T, n)`; the filter and the elements are computed once."""
    scan = backend(kf.scan, caller="posterior_sample")
    filtered = filter_(kf, ys, us, scan)
    E, g, L = smoother_elements(_model(kf), filtered)
    # every L_t is positive definite (Q and P_t are); factored without LAPACK,
    # whose call batched over the steps can deadlock (`_linalg`)
    C = cholesky(_jittered(L))
    T, n = g.shape
    eps = jr.normal(key, (num_samples, T, n), g.dtype)

    def one(eps):
        w = g + jnp.einsum("tij,tj->ti", C, eps)
        if scan.parallel:
            # a reverse scan composes step t's map after those of t+1..T
            _, xs, _ = scan.associative_scan(jax.vmap(combine), (E, w, L), reverse=True)
            return xs

        def step(x_next, e):
            E_t, w_t = e
            x = E_t @ x_next + w_t
            return x, x

        # E_T = 0: the first step back draws x_T from the last filtered moments
        _, xs = lax.scan(step, jnp.zeros_like(w[0]), (E, w), reverse=True)
        return xs

    return jax.vmap(one)(eps)
