"""The square-root filter step: the filter carries a Cholesky factor `L` of the
filtered covariance (`P = L L^T`) and updates it in the "array" form (Bierman,
"Factorization Methods for Discrete Sequential Estimation", 1977), one whitened
entry at a time, then triangularises once per step. Covariances are then positive
semi-definite by construction, and a factor spans the square root of the
covariance's dynamic range, so that a vague prior meeting a precise observation
does not cancel catastrophically in float32 (`docs/devdocs/kalman.md`,
"Square-root filter").
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._linalg import _LOG_2PI, tria, tril_inverse_by_rows


def _block(rows: list[list[Array]]) -> Array:
    return jnp.concatenate([jnp.concatenate(r, axis=-1) for r in rows], axis=-2)


def sqrt_update(
    m_pred: Array, FL: Array, L_Q: Array, Hw: Array, y: Array, *, loop: bool = False
):
    """Predict the covariance and condition on `y = Hw x + e`, `e ~ N(0, I)`, one
    entry at a time, in square-root form.

    The factor starts as `[F L, L_Q, 0]` (`L` the previous filtered factor, one
    zero column per entry): a factor of the predicted covariance. Entry `j`, with
    `phi = L^T h_j` and `s = |phi|^2 + 1`, is the triangularisation of
    `[[1, phi^T], [0, L]]` done in one step: the rows `[0, L]` lose their
    projection on `[1, phi^T] / sqrt(s)`, i.e. `L <- L - k phi^T` with the gain
    `k = L phi / s`, and the column of the `1` (the entry's noise), zero until
    then, becomes `-k`. That column keeps, exactly, the variance `k k^T` which the
    rank-one update alone would have to leave behind by cancellation (Potter's
    update loses it when `s` is large). The mean is updated with the innovation
    `e_j = y_j - h_j . m`, as the covariance form's scalar updates do. A final
    `tria` (with `loop`, in the sequential filter) makes the factor square and
    triangular again.

    A missing entry is a zero row of `Hw` and a zero `y`: `phi = 0`, `s = 1`, no
    update. Returns the filtered mean and factor, the whitened innovations
    `nu_j = e_j / sqrt(s_j)` and the log innovation variances `log s_j`.
    """
    n, p = FL.shape[-1], Hw.shape[-2]
    dtype = FL.dtype
    L = jnp.concatenate([FL, L_Q, jnp.zeros((n, p), dtype)], axis=1)
    noise = jnp.eye(2 * n + p, dtype=dtype)[2 * n :]
    m = m_pred
    nus, log_ss = [], []
    for j in range(p):
        h = Hw[j]
        phi = jnp.sum(L * h[:, None], axis=0)
        s = jnp.sum(phi * phi) + 1  # >= 1: the whitened noise has unit variance
        k = jnp.sum(L * phi[None, :], axis=1) / s
        e = y[j] - jnp.sum(h * m)
        m = m + k * e
        # the noise column j, zero until now (and so is phi there), becomes -k
        L = L - k[:, None] * (phi + noise[j])[None, :]
        nus.append(e * jax.lax.rsqrt(s))
        log_ss.append(jnp.log(s))
    return m, tria(L, loop=loop), jnp.stack(nus), jnp.stack(log_ss)


def sqrt_affine_update(FL: Array, L_Q: Array, Hw: Array):
    """`sqrt_update` for a fixed `F L` as an affine map of the predicted mean and
    the observation, `m_f = M m_pred + G y`, `nu = E_m m_pred + E_y y`; and the
    filtered factor and log-variances. For the steady state, once.

    All entries at once: the triangularisation of `[[I, Hw F L, Hw L_Q],
    [0, F L, L_Q]]` is `[[S^{1/2}, 0], [K_bar, L_f]]` with `S^{1/2}` the Cholesky
    factor of `S = Hw P_pred Hw^T + I` (the diagonal: the scalar updates' `sqrt(s)`),
    `K_bar = P_pred Hw^T S^{-T/2}`, so that `E_y = S^{-1/2}`, `E_m = -E_y Hw`,
    `G = K_bar S^{-1/2}` and `M = I - G Hw`. Built so, the map keeps
    `M + G Hw = I` and `E_m = -E_y Hw` exactly, which Jacobians taken one by one
    do not (to round-off, which a long tail accumulates).
    """
    n, p = FL.shape[-1], Hw.shape[-2]
    dtype = FL.dtype
    A = _block(
        [
            [jnp.eye(p, dtype=dtype), Hw @ FL, Hw @ L_Q],
            [jnp.zeros((n, p), dtype), FL, L_Q],
        ]
    )
    Lo = tria(A)
    E_y = tril_inverse_by_rows(Lo[:p, :p])
    G = Lo[p:, :p] @ E_y
    M = jnp.eye(n, dtype=dtype) - G @ Hw
    log_s = 2 * jnp.log(jnp.diagonal(Lo)[:p])
    return M, G, -E_y @ Hw, E_y, Lo[p:, p:], log_s


def whitened_log_density(nu: Array, log_s: Array, obs: Array) -> Array:
    """The log-density of the observed entries from the whitened innovations `nu`
    and the log innovation variances `log_s` (without the whitening's
    log-determinant)."""
    return jnp.sum(jnp.where(obs, -0.5 * (_LOG_2PI + log_s + nu * nu), 0))
