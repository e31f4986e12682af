"""Small-matrix linear algebra for the Kalman filter, and its square-root step.

Cholesky factors and triangular inverses of stacks of small matrices are written as
`jax.numpy` arithmetic vectorised over the stack, not batched LAPACK calls: on CPU,
two batched LAPACK calls that XLA schedules at once can deadlock on its thread pool,
and at these sizes the fused arithmetic is faster anyway (see
`docs/devdocs/kalman.md`, "Whitening").
"""

import math

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array, Inexact

from .._misc import full_precision


LOG_2PI = math.log(2 * math.pi)


def sym(P: Array) -> Array:
    return 0.5 * (P + jnp.swapaxes(P, -1, -2))


def mT(A: Array) -> Array:
    return jnp.swapaxes(A, -1, -2)


def eye_like(A: Array) -> Array:
    return jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)


def chol(A: Array) -> Array:
    """Cholesky factor of a symmetric PSD matrix, with jitter scaled to its dtype.

    The jitter is `eps(dtype) * mean(diag(A))` on the diagonal: invisible in float64,
    enough in float32 to keep a matrix that is PD up to rounding factorable.
    """
    return jnp.linalg.cholesky(jittered(A))


def jittered(A: Array) -> Array:
    """`A` symmetrised, with `chol`'s jitter on the diagonal."""
    A = sym(A)
    scale = jnp.mean(jnp.diagonal(A, axis1=-2, axis2=-1), axis=-1)
    jitter = jnp.finfo(A.dtype).eps * jnp.abs(scale)
    return A + jitter[..., None, None] * eye_like(A)


def cho_solve(L: Array, B: Array) -> Array:
    """`(L L^T)^{-1} B` from a lower Cholesky factor `L`."""
    Z = jsl.solve_triangular(L, B, lower=True)
    return jsl.solve_triangular(L, Z, lower=True, trans=1)


def factor(raw: Array) -> Array:
    """Unconstrained `raw` -> lower-triangular factor with diagonal `exp(diag(raw))`.

    The upper triangle of `raw` is ignored (and receives zero gradient).
    """
    eye = jnp.broadcast_to(jnp.eye(raw.shape[-1], dtype=bool), raw.shape)
    # double where: exp of an off-diagonal entry may overflow, its gradient must not
    return jnp.where(eye, jnp.exp(jnp.where(eye, raw, 0)), jnp.tril(raw))


def unfactor(L: Array) -> Array:
    """The inverse of `factor` on lower-triangular `L` with a positive diagonal."""
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=bool), L.shape)
    return jnp.where(eye, jnp.log(jnp.where(eye, L, 1)), jnp.tril(L))


@full_precision
def gram(L: Array) -> Array:
    return L @ mT(L)


# --- products of small matrices ---

# Up to this size the sequential step multiplies matrices as broadcast products and
# sums, which XLA fuses into a few loop kernels; `@` becomes a library call per
# product whose overhead dominates at these sizes.
_ELEMENTWISE_MAX = 16


def mm(A: Array, B: Array) -> Array:
    if max(A.shape[-1], A.shape[-2], B.shape[-1]) > _ELEMENTWISE_MAX:
        return A @ B
    return jnp.sum(A[:, :, None] * B[None, :, :], axis=1)


# Up to this state size `A X A^T` in the sequential loops is one broadcast product
# summed over two axes (n^4 terms in one fused kernel); beyond it the n^4 terms cost
# more than two matrix products.
_SANDWICH_4D_MAX = 4


def sandwich(A: Array, X: Array) -> Array:
    """`A X A^T` for small matrices."""
    if A.shape[-1] <= _SANDWICH_4D_MAX and A.shape[-2] <= _SANDWICH_4D_MAX:
        out = jnp.sum(
            A[:, :, None, None] * X[None, :, :, None] * A.T[None, None], axis=(1, 2)
        )
        return out
    return mm(mm(A, X), A.T)


def bmm(A: Array, B: Array) -> Array:
    """`A @ B` over leading batch axes; small matrices as a broadcast product and
    sum (XLA:CPU's batched dot is slow for them)."""
    if max(A.shape[-1], A.shape[-2], B.shape[-1]) > _ELEMENTWISE_MAX:
        return A @ B
    return jnp.sum(A[..., :, :, None] * B[..., None, :, :], axis=-2)


def mv(A: Array, x: Array) -> Array:
    if max(A.shape) > _ELEMENTWISE_MAX:
        return A @ x
    return jnp.sum(A * x[None, :], axis=1)


# --- Cholesky factors and triangular inverses without LAPACK ---

# Up to this size every entry is its own vector over the batch, so both functions
# are elementwise arithmetic that XLA fuses into a few loops; beyond it, whole
# columns (rows) per step keep the program small.
_ENTRYWISE_MAX = 16


def _entries(A: Array) -> list[list[Array]]:
    n = A.shape[-1]
    return [[A[..., i, j] for j in range(n)] for i in range(n)]


def _assemble(rows: list[list[Array]], like: Array) -> Array:
    zero = jnp.zeros(like.shape[:-2], like.dtype)
    n = like.shape[-1]
    full = [[rows[i][j] if j <= i else zero for j in range(n)] for i in range(n)]
    return jnp.stack([jnp.stack(r, axis=-1) for r in full], axis=-2)


def cholesky(A: Inexact[Array, "*batch n n"]) -> Inexact[Array, "*batch n n"]:
    """Lower Cholesky factors `L` (`A = L L^T`) of a stack of symmetric positive
    definite matrices. Only the lower triangle of `A` is read; a matrix that is not
    positive definite gives NaNs (as `jnp.linalg.cholesky`)."""
    n = A.shape[-1]
    if n > _ENTRYWISE_MAX:
        return _cholesky_by_columns(A)
    a = _entries(A)
    L = [[None] * n for _ in range(n)]
    zero = jnp.zeros((), A.dtype)
    for j in range(n):
        L[j][j] = jnp.sqrt(a[j][j] - sum((L[j][k] ** 2 for k in range(j)), zero))
        for i in range(j + 1, n):
            v = a[i][j] - sum((L[i][k] * L[j][k] for k in range(j)), zero)
            L[i][j] = v / L[j][j]
    return _assemble(L, A)


def tril_inverse(L: Inexact[Array, "*batch n n"]) -> Inexact[Array, "*batch n n"]:
    """`L^{-1}` for a stack of lower-triangular matrices with non-zero diagonals,
    by forward substitution."""
    n = L.shape[-1]
    if n > _ENTRYWISE_MAX:
        return tril_inverse_by_rows(L)
    l = _entries(L)
    W = [[None] * n for _ in range(n)]
    for i in range(n):
        W[i][i] = 1 / l[i][i]
        for j in range(i):
            v = sum((l[i][k] * W[k][j] for k in range(j, i)), jnp.zeros((), L.dtype))
            W[i][j] = -v * W[i][i]
    return _assemble(W, L)


def _cholesky_by_columns(A: Array) -> Array:
    n = A.shape[-1]
    below = jnp.broadcast_to(jnp.arange(n), A.shape[:-1])
    cols = []
    for j in range(n):
        v = A[..., :, j]
        if j:
            done = jnp.stack(cols, axis=-1)  # (..., n, j)
            v = v - jnp.sum(done * done[..., j : j + 1, :], axis=-1)
        d = jnp.sqrt(v[..., j : j + 1])
        cols.append(jnp.where(below >= j, v / d, 0))
    return jnp.stack(cols, axis=-1)


def tril_inverse_by_rows(L: Array) -> Array:
    """`tril_inverse` by forward substitution one row at a time: fewer, wider
    operations (for large matrices, or one small matrix with no batch)."""
    n = L.shape[-1]
    eye = jnp.eye(n, dtype=L.dtype)
    rows = []
    for i in range(n):
        r = jnp.broadcast_to(eye[i], L.shape[:-1])
        if i:
            done = jnp.stack(rows, axis=-2)  # (..., i, n)
            r = r - jnp.sum(L[..., i, :i, None] * done, axis=-2)
        rows.append(r / L[..., i, i, None])
    return jnp.stack(rows, axis=-2)


@jax.custom_jvp
def inverse_cholesky(A: Inexact[Array, "*batch n n"]) -> Inexact[Array, "*batch n n"]:
    """`L^{-1}` for the lower Cholesky factors `L` of a stack of symmetric positive
    definite matrices (`A^{-1} = W^T W` with `W = L^{-1}`).

    Differentiated by its own rule, `dW = -Phi(W dA W^T) W` with `Phi` the lower
    triangle and half the diagonal (from `dL = L Phi(L^{-1} dA L^{-T})`): a few
    batched products instead of autodiff through the unrolled factorisation, which
    is slower than LAPACK's gradient, or LAPACK itself.
    """
    return tril_inverse(cholesky(A))


@inverse_cholesky.defjvp
@full_precision
def _inverse_cholesky_jvp(primals, tangents):
    (A,), (dA,) = primals, tangents
    W = inverse_cholesky(A)
    X = W @ _sym_part(dA) @ jnp.swapaxes(W, -1, -2)
    n = A.shape[-1]
    phi = jnp.tril(jnp.ones((n, n), A.dtype)) - 0.5 * jnp.eye(n, dtype=A.dtype)
    return W, -(X * jnp.broadcast_to(phi, X.shape)) @ W


def _sym_part(A: Array) -> Array:
    # the factorisation reads the lower triangle only: a tangent in the upper one
    # does not move it, so the effective tangent is the symmetric matrix with that
    # lower triangle
    lower = jnp.tril(A)
    return lower + jnp.swapaxes(jnp.tril(A, -1), -1, -2)


# --- triangularisation (square-root factors) ---


def _inv_norm(norm2: Array) -> Array:
    """`1 / sqrt(norm2)`, and 0 for a zero row (double where: zero derivatives,
    not NaN ones)."""
    pos = norm2 > 0
    return jnp.where(pos, jax.lax.rsqrt(jnp.where(pos, norm2, 1)), 0)


def _gram_schmidt(A: Array, loop: bool = False) -> tuple[Array, Array]:
    """`(L, Q)` with `A = L Q^T`: `L` lower triangular with a non-negative diagonal,
    the columns of `Q` the orthonormalised rows of `A`, by modified Gram-Schmidt.

    Row `i` is normalised and projected out of the rows below it: one reduction
    and one update, every row a vector over the batch and the columns; no LAPACK
    call (`docs/devdocs/kalman.md`, "Small factorisations without LAPACK").
    Unrolled, the rows still to do shrink at every step; with `loop`, a `lax.scan`
    over the rows keeps every array whole (masked): more arithmetic, but a program,
    and a derivative, quicker to compile inside the sequential filter's loop. A row
    that is zero after the projections (rank deficiency) gives a zero column of `L`
    and of `Q`.
    """
    m = A.shape[-2]
    if not loop:
        rest, cols, qs = A, [], []
        for i in range(m):
            a = rest[..., 0, :]
            g = jnp.sum(rest * a[..., None, :], axis=-1)  # row i against rows i..
            inv = _inv_norm(g[..., 0])
            c, q = g * inv[..., None], a * inv[..., None]
            rest = rest[..., 1:, :] - c[..., 1:, None] * q[..., None, :]
            zeros = jnp.zeros((*c.shape[:-1], i), A.dtype)
            cols.append(jnp.concatenate([zeros, c], axis=-1))
            qs.append(q)
        return jnp.stack(cols, axis=-1), jnp.stack(qs, axis=-1)

    rows = jnp.arange(m)

    def body(rest, i):
        a = jnp.take(rest, i, axis=-2)
        g = jnp.sum(rest * a[..., None, :], axis=-1)  # row i against every row
        inv = _inv_norm(jnp.take(g, i, axis=-1))
        c = jnp.where(rows >= i, g * inv[..., None], 0)  # column i of L
        q = a * inv[..., None]
        below = (rows > i)[:, None]
        rest = jnp.where(below, rest - c[..., :, None] * q[..., None, :], 0)
        return rest, (c, q)

    _, (cols, qs) = jax.lax.scan(body, A, rows)
    return jnp.moveaxis(cols, 0, -1), jnp.moveaxis(qs, 0, -1)


def tria(
    A: Inexact[Array, "*batch m k"], *, loop: bool = False
) -> Inexact[Array, "*batch m m"]:
    """The lower-triangular `L` with a non-negative diagonal and `L L^T = A A^T`:
    the triangular factor of a QR decomposition of `A^T`, i.e. the Cholesky factor
    of `A A^T` computed without forming it.

    The square-root filter's building block: `tria([F L, L_Q])` is a factor of
    `F L L^T F^T + Q`. Differentiated by autodiff through the Gram-Schmidt steps,
    which is as accurate as they are: the rule from the Gramian,
    `dL = L Phi(L^{-1} dA Q + ...)`, divides by the factor's small diagonal, which
    lost accuracy on stiff models (`docs/devdocs/kalman.md`, "Square-root filter").
    `loop`: see `_gram_schmidt`.
    """
    return _gram_schmidt(A, loop)[0]


@jax.custom_jvp
def tria_gram(A: Inexact[Array, "*batch m k"]) -> Inexact[Array, "*batch m m"]:
    """`tria(A)` for an `A` that may be rank deficient, for factors that are only
    ever used through their Gramian `L L^T`.

    Its derivative is `dA Q` (`A = L Q^T`, `Q` held fixed): not lower triangular,
    but a tangent of the Gramian (`dL L^T + L dL^T = dA A^T + A dA^T`) that stays
    finite where `L` is singular, where autodiff through the Gram-Schmidt steps
    divides by (almost) zero.
    """
    return _gram_schmidt(A)[0]


@tria_gram.defjvp
@full_precision
def _tria_gram_jvp(primals, tangents):
    (A,), (dA,) = primals, tangents
    L, Q = _gram_schmidt(A)
    return L, dA @ Q


# --- the square-root filter step ---

# The filter carries a Cholesky factor `L` of the filtered covariance (`P = L L^T`)
# and updates it in the "array" form (Bierman, "Factorization Methods for Discrete
# Sequential Estimation", 1977), one whitened entry at a time, then triangularises
# once per step. Covariances are then positive semi-definite by construction, and a
# factor spans the square root of the covariance's dynamic range, so that a vague
# prior meeting a precise observation does not cancel catastrophically in float32
# (`docs/devdocs/kalman.md`, "Square-root filter").


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
    n, p = FL.shape[0], Hw.shape[-2]
    k = FL.shape[1] + L_Q.shape[1]  # any number of columns: any factors
    dtype = FL.dtype
    L = jnp.concatenate([FL, L_Q, jnp.zeros((n, p), dtype)], axis=1)
    noise = jnp.eye(k + p, dtype=dtype)[k:]
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
    Lo = tria(A, loop=True)  # once per sequence: the loop compiles quicker
    E_y = tril_inverse_by_rows(Lo[:p, :p])
    G = Lo[p:, :p] @ E_y
    M = jnp.eye(n, dtype=dtype) - G @ Hw
    log_s = 2 * jnp.log(jnp.diagonal(Lo)[:p])
    return M, G, -E_y @ Hw, E_y, Lo[p:, p:], log_s


def whitened_log_density(nu: Array, log_s: Array, obs: Array) -> Array:
    """The log-density of the observed entries from the whitened innovations `nu`
    and the log innovation variances `log_s` (without the whitening's
    log-determinant)."""
    return jnp.sum(jnp.where(obs, -0.5 * (LOG_2PI + log_s + nu * nu), 0))
