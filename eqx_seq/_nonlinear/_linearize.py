"""Linearisations of a nonlinear function `g` about a Gaussian `N(m, L L^T)`: the
affine model `g(x) ~ A x + b + e`, `e ~ N(0, Lam)`, that every filter and smoother
of the nonlinear layer conditions with.

- `"extended"`: first-order Taylor at the mean, `A = dg/dx(m)`, `b = g(m) - A m`,
  `Lam = 0` (Jacobian by `jax.jacfwd`).
- `"cubature"` and `"unscented"`: statistical linear regression on sigma points
  `X_i = m + L xi_i` with weights (`w_m` for the mean, `w_c` for covariances),
  `A = Cov[g, x] Cov[x]^{-1}`, `b = E[g] - A m` and `Lam` the covariance of the
  regression's residuals (Arasaratnam & Haykin 2009; Julier & Uhlmann 2004; as a
  regression: Garcia-Fernandez, Svensson, Morelande & Sarkka 2015).

With `sum_i w_c,i xi_i xi_i^T = I` (both rules), `A = M L^{-1}` with
`M = sum_i w_c,i (g_i - gbar) xi_i^T`, and the residuals `r_i = g_i - gbar - M xi_i`
are orthogonal to the points, so `Lam = sum_i w_c,i r_i r_i^T` exactly: a factor of
`Lam` is the triangularisation of the weighted residuals, never a difference of
covariances (see `docs/devdocs/nonlinear.md`).
"""

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._kalman._linalg import mm, mv, tril_inverse_by_rows
from .._misc import vary_like


Method = Literal["extended", "cubature", "unscented"]
METHODS = ("extended", "cubature", "unscented")


class SigmaPoints(NamedTuple):
    """Unit sigma points `xi` (one per row) and their weights, as NumPy constants."""

    xi: np.ndarray
    w_mean: np.ndarray
    w_cov: np.ndarray


class Unscented(NamedTuple):
    """The unscented transform's parameters (Wan & van der Merwe's `alpha`, `beta`,
    `kappa`); the defaults are dynamax's, whose weights are all positive."""

    alpha: float = math.sqrt(3)
    beta: float = 2.0
    kappa: float = 1.0


def sigma_points(method: Method, n: int, unscented: Unscented) -> SigmaPoints:
    """The rule's unit points and weights for a state of size `n`."""
    eye = np.eye(n)
    if method == "cubature":
        xi = math.sqrt(n) * np.concatenate([eye, -eye])
        w = np.full(2 * n, 1 / (2 * n))
        return SigmaPoints(xi, w, w)
    alpha, beta, kappa = unscented
    lam = alpha**2 * (n + kappa) - n
    spread = n + lam
    if not spread > 0:
        raise ValueError(
            "eqx_seq.NonlinearKalmanFilter: the unscented transform needs "
            f"alpha**2 * (n + kappa) > 0, got alpha={alpha}, kappa={kappa}, n={n}."
        )
    xi = np.concatenate(
        [np.zeros((1, n)), math.sqrt(spread) * np.concatenate([eye, -eye])]
    )
    rest = np.full(2 * n, 1 / (2 * spread))
    w_mean = np.concatenate([[lam / spread], rest])
    w_cov = np.concatenate([[lam / spread + 1 - alpha**2 + beta], rest])
    if w_cov[0] < 0:
        # a negative weight has no square-root form (the residual covariance would
        # be a difference of factors, a Cholesky downdate that may fail)
        raise ValueError(
            "eqx_seq.NonlinearKalmanFilter: these unscented parameters give the "
            f"central point a negative covariance weight ({w_cov[0]:.3g}), which the "
            "square-root filter cannot use; choose alpha, beta, kappa with "
            "lambda / (n + lambda) + 1 - alpha**2 + beta >= 0, lambda = "
            "alpha**2 * (n + kappa) - n (the defaults do)."
        )
    return SigmaPoints(xi, w_mean, w_cov)


def linearize(
    g: Callable[[Array], Array],
    m: Array,
    L: Array | None,
    points: SigmaPoints | None,
) -> tuple[Array, Array, Array | None]:
    """`(A, b, S)`: `g(x) ~ A x + b + e` about `N(m, L L^T)`, `e ~ N(0, S S^T)`
    with `S` the weighted residuals, a factor with a column per sigma point (`tria`
    makes it square); `points` is `None` for the Taylor linearisation (`L` unused,
    `S` is `None`), else the sigma-point rule."""
    if points is None:
        gm, A = _value_and_jacobian(g, m)
        return A, gm - mv(A, m), None
    xi = jnp.asarray(points.xi, m.dtype)
    w_mean = jnp.asarray(points.w_mean, m.dtype)
    w_cov = jnp.asarray(points.w_cov, m.dtype)
    # products as broadcasts and sums (`mm`), which fuse in the filter's loop body
    X = m[None, :] + mm(xi, L.T)
    G = jax.vmap(g)(X)
    g_bar = jnp.sum(w_mean[:, None] * G, axis=0)
    Gc = G - g_bar[None, :]
    M = mm((Gc * w_cov[:, None]).T, xi)
    # A = M L^{-1}, by substitution in the step's own arithmetic (a LAPACK call per
    # step of a loop costs more than the few products it replaces)
    A = mm(M, tril_inverse_by_rows(L))
    residuals = Gc - mm(xi, M.T)
    return A, g_bar - mv(A, m), (residuals * jnp.sqrt(w_cov)[:, None]).T


def _value_and_jacobian(g: Callable[[Array], Array], x: Array) -> tuple[Array, Array]:
    """`g(x)` and its Jacobian in one forward-mode pass."""
    # the tangents vary over a mesh as `x` does (under `jax.shard_map`)
    eye = vary_like(jnp.eye(x.shape[0], dtype=x.dtype), x)
    gx, jvp = jax.linearize(g, x)
    return gx, jax.vmap(jvp, out_axes=1)(eye)
