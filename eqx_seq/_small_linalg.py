"""Cholesky factors and triangular inverses of stacks of small matrices, written as
`jax.numpy` arithmetic vectorised over the stack instead of batched LAPACK calls.

Why: jaxlib's batched LAPACK kernels on CPU (`potrf`, `trsm`, ...) split a large
batch into tasks on XLA's intra-op thread pool and block until those finish. When
XLA's thunk executor runs two such calls at once, each on a pool thread, both wait
for tasks that no free thread can run: the program hangs at 0% CPU. Measured on a
2-core machine (jax 0.10.2): `jax.grad` of `KalmanFilter.log_likelihood` with
missing observations, state 16 / obs 8, T = 2000-10000, hung on most runs, with
`lapack_spotrf_ffi` and `lapack_strsm_ffi` each waiting in `ParallelBatchMap`
(gdb), and ran with `--xla_cpu_enable_concurrency_optimized_scheduler=false`.
The per-step matrices these are used on are a few entries wide, and the
vectorised arithmetic measured faster than the library calls (`_ENTRYWISE_MAX`).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Inexact

from ._misc import full_precision


# Up to this size every entry is its own vector over the batch, so both functions
# are elementwise arithmetic that XLA fuses into a few loops (measured at T = 10k,
# 8 x 8, float32: Cholesky and inverse 0.1x-0.7x the batched LAPACK calls' time);
# beyond it, whole columns (rows) per step keep the program small.
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
    batched products instead of autodiff through the unrolled factorisation (3x
    slower than LAPACK's gradient at 8 x 8, T = 10k) or LAPACK itself.
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
