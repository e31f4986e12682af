"""The square-root filter step: the filter carries a Cholesky factor `L` of the
filtered covariance (`P = L L^T`), and one triangularisation per step predicts and
conditions on all the whitened observations at once (the "array" form; Bierman,
"Factorization Methods for Discrete Sequential Estimation", 1977). Covariances are
then positive semi-definite by construction, and a factor spans the square root of
the covariance's dynamic range, so that a vague prior meeting a precise observation
does not cancel catastrophically in float32 (`docs/devdocs/kalman.md`,
"Square-root filter").
"""

import jax.numpy as jnp
from jaxtyping import Array

from ._linalg import _LOG_2PI, _mm, _mv, tria, tril_inverse_by_rows


def _block(rows: list[list[Array]]) -> Array:
    return jnp.concatenate([jnp.concatenate(r, axis=-1) for r in rows], axis=-2)


def sqrt_update(
    m_pred: Array, FL: Array, L_Q: Array, Hw: Array, y: Array, HwLQ: Array | None = None
):
    """Predict the covariance and condition on `y = Hw x + e`, `e ~ N(0, I)`.

    With `F L` (`L` the factor of the previous filtered covariance) the
    triangularisation of

        [[I,   Hw F L, Hw L_Q, 0],        [[S^{1/2}, 0,   0],
         [0,   F L,    L_Q,    0],   ->    [K_bar,   L_f, 0],
         [e^T, 0,      0,      1]]         [nu^T,    *,   *]]

    gives the factor `S^{1/2}` of the innovation covariance `S = Hw P_pred Hw^T + I`,
    `K_bar = P_pred Hw^T S^{-T/2}`, the filtered factor `L_f`, and the whitened
    innovations `nu = S^{-1/2} e`, `e = y - Hw m_pred` (the last row: the first
    block row is `S^{1/2} Q_1^T`, so `Q_1^T [e; 0] = S^{-1/2} e`; its unit column
    keeps the matrix of full rank). `S^{1/2}` is the factor the scalar updates
    compute one entry at a time: its squared diagonal is their innovation
    variances, `nu` their innovations over their standard deviations. A missing
    entry is a zero row of `Hw` and a zero `y`: its row is `[e_j, 0, 0, 0]`, a unit
    diagonal and no innovation.

    Returns the filtered mean, `L_f`, `nu`, and the log-variances
    `log diag(S^{1/2})^2`.
    """
    n, p = FL.shape[-1], Hw.shape[-2]
    dtype = FL.dtype
    e = y - _mv(Hw, m_pred)
    HwLQ = _mm(Hw, L_Q) if HwLQ is None else HwLQ
    zeros = lambda r, c: jnp.zeros((r, c), dtype)
    one = jnp.ones((1, 1), dtype)
    A = _block(
        [
            [jnp.eye(p, dtype=dtype), _mm(Hw, FL), HwLQ, zeros(p, 1)],
            [zeros(n, p), FL, L_Q, zeros(n, 1)],
            [e[None, :], zeros(1, n), zeros(1, n), one],
        ]
    )
    Lo = tria(A)
    nu = Lo[p + n, :p]
    m_f = m_pred + _mv(Lo[p : p + n, :p], nu)
    log_s = 2 * jnp.log(jnp.diagonal(Lo)[:p])
    return m_f, Lo[p : p + n, p : p + n], nu, log_s


def sqrt_affine_update(FL: Array, L_Q: Array, Hw: Array):
    """`sqrt_update` for a fixed `F L` as an affine map of the predicted mean and
    the observation: `m_f = M m_pred + G y`, `nu = E_m m_pred + E_y y`, from the
    same triangularisation without the innovation row (`E_y = S^{-1/2}`,
    `G = K_bar S^{-1/2}`); and the filtered factor and log-variances. For the
    steady state: cheaper to differentiate than the Jacobian of `sqrt_update`."""
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
