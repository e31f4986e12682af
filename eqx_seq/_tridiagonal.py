"""Batched tridiagonal solves along any axis, differentiated implicitly.

Three methods, picked by the `scan` backend and the `pivoting` flag:

- Thomas (LU without pivoting) for [`eqx_seq.SequentialScan`][]: one sweep down and
  one back along the solve axis, every other axis vectorised. The systems are
  processed in blocks of about `_BLOCK` systems so that the sweep's scratch stays
  in cache; when the solve axis is not the leading one, each block (not the whole
  array) is laid out time-major while it is in cache.
- Parallel cyclic reduction (Hockney 1965; Hockney & Jesshope 1981) for
  [`eqx_seq.AssociativeScan`][]: `ceil(log2 n)` rounds of elementwise updates with
  shifts along the axis, so no transposes either.
- LAPACK `gtsv` / cuSPARSE through `jax.lax.linalg.tridiagonal_solve` for
  `pivoting=True`.

Derivatives come from `jax.lax.custom_linear_solve` around the tridiagonal product:
the tangent is one more solve, `x' = A^{-1}(r' - A' x)`, and the reverse-mode
adjoint is one solve with `A^T` (the off-diagonals swapped and shifted by one) and
elementwise products, never autodiff through the sweeps.
"""

import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Inexact

from ._scan import AbstractScan, AssociativeScan, AutoScan, SequentialScan


# Systems per block on the Thomas path. Measured on a 2-core CPU at 100k x 100
# float32: blocks of 2k-4k were alike and 1.5x faster than one sweep over all
# systems at once (the sweep's scratch then stays in cache), 16k slower, and
# unrolling slower still. Problems whose arrays fit in cache (below
# _UNBLOCKED_BYTES each) are swept in one go: there, blocks only add loop overhead
# (2.3x slower at 10k x 100).
_BLOCK = 4096
_UNBLOCKED_BYTES = 8 * 2**20


# ------------------------------------------------------------------- Thomas sweeps
def _thomas_leading(l, d, u, r, *, transpose: bool, unroll: int) -> Array:
    """Thomas along axis 0 of arrays that broadcast against each other elsewhere.

    Solves `A x = r`, or `A^T x = r` if `transpose`. `l[0]` and `u[-1]` are ignored.
    The transposed system has sub-diagonal `u[i-1]` and super-diagonal `l[i+1]`; the
    shifts are carried from one step to the next instead of materialised.
    """
    shape = jnp.broadcast_shapes(l.shape[1:], d.shape[1:], u.shape[1:], r.shape[1:])
    zero = jnp.zeros(shape, r.dtype)
    if not transpose:

        def down(carry, xs):
            e_prev, y_prev = carry
            l_i, d_i, u_i, r_i = xs
            inv = 1 / (d_i + l_i * e_prev)
            e = -u_i * inv
            y = (r_i - l_i * y_prev) * inv
            return (e, y), (e, y)

        _, (e, y) = lax.scan(down, (zero, zero), (l, d, u, r), unroll=unroll)

        def up(x_next, xs):
            e_i, y_i = xs
            x = y_i + e_i * x_next
            return x, x

        _, x = lax.scan(up, zero, (e, y), reverse=True, unroll=unroll)
        return x

    def down_t(carry, xs):
        # `e` of the step before, -l[i] / pivot[i-1], is only known at step i
        inv_prev, y_prev, u_prev = carry
        l_i, d_i, u_i, r_i = xs
        e_prev = -l_i * inv_prev
        inv = 1 / (d_i + u_prev * e_prev)
        y = (r_i - u_prev * y_prev) * inv
        return (inv, y, jnp.broadcast_to(u_i, shape)), (e_prev, y)

    one = jnp.ones(shape, r.dtype)
    _, (e_shifted, y) = lax.scan(down_t, (one, zero, zero), (l, d, u, r), unroll=unroll)

    def up_t(carry, xs):
        x_next, e_next = carry
        e_prev, y_i = xs
        x = y_i + e_next * x_next
        return (x, e_prev), x

    _, x = lax.scan(up_t, (zero, zero), (e_shifted, y), reverse=True, unroll=unroll)
    return x


def _as_pnq(x: Array, axis: int, full: tuple[int, ...]) -> Array:
    """`x` reshaped to `(P', n, Q')` with `P'` in `{1, P}` and `Q'` in `{1, Q}`.

    No copy when the axes before (after) `axis` are all full or all broadcast (size
    1); other broadcasting patterns are materialised on that side.
    """
    shape = list(x.shape)
    for side in (slice(0, axis), slice(axis + 1, len(full))):
        if any(s != 1 for s in shape[side]):
            shape[side] = full[side]
    x = jnp.broadcast_to(x, tuple(shape))
    return x.reshape(_prod(shape[:axis]), full[axis], _prod(shape[axis + 1 :]))


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _slice(x: Array, start, size: int, dim: int) -> Array:
    """A block of `size` along `dim`, unless `x` is broadcast (size 1) there."""
    if x.shape[dim] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, dim)


def _blocked(fn, arrays: tuple[Array, ...], out_shape, dtype, dim: int, block: int):
    """`fn` on blocks of `block` along `dim`, written into one output buffer."""
    total = out_shape[dim]
    count, rest = divmod(total, block)
    out = jnp.empty(out_shape, dtype)
    if count:

        def body(k, out):
            start = k * block
            blocks = tuple(_slice(a, start, block, dim) for a in arrays)
            return lax.dynamic_update_slice_in_dim(out, fn(*blocks), start, dim)

        out = lax.fori_loop(0, count, body, out)
    if rest:
        start = count * block
        blocks = tuple(_slice(a, start, rest, dim) for a in arrays)
        out = lax.dynamic_update_slice_in_dim(out, fn(*blocks), start, dim)
    return out


def _thomas(
    l,
    d,
    u,
    r,
    *,
    axis: int,
    transpose: bool,
    unroll: int,
    block: int = _BLOCK,
    unblocked_bytes: int = _UNBLOCKED_BYTES,
) -> Array:
    """Thomas along `axis` of rank-aligned arrays, about `block` systems at a time
    (all at once if the full array takes at most `unblocked_bytes`).

    The result has the broadcast shape of the inputs.
    """
    full = jnp.broadcast_shapes(l.shape, d.shape, u.shape, r.shape)
    n = full[axis]
    P, Q = _prod(full[:axis]), _prod(full[axis + 1 :])
    if n * P * Q * r.dtype.itemsize <= unblocked_bytes:
        block = max(block, P * Q)
    l, d, u, r = (_as_pnq(x, axis, full) for x in (l, d, u, r))
    sweep = ft.partial(_thomas_leading, transpose=transpose, unroll=unroll)
    if P == 1:
        # time-major: blocks of systems are contiguous runs of each row
        squeeze = lambda x: x[0]
        l, d, u, r = map(squeeze, (l, d, u, r))
        if Q <= 2 * block:
            x = sweep(l, d, u, r)
        else:
            x = _blocked(sweep, (l, d, u, r), (n, Q), r.dtype, 1, block)
        return x.reshape(full)

    # systems along the leading axes: each block of `rows` leading indices is made
    # time-major while it is in cache
    rows = max(1, block // Q)

    def tile(l, d, u, r):
        lead = lambda x: jnp.moveaxis(x, 1, 0)
        return jnp.moveaxis(sweep(lead(l), lead(d), lead(u), lead(r)), 0, 1)

    if P <= rows:
        x = tile(l, d, u, r)
    else:
        x = _blocked(tile, (l, d, u, r), (P, n, Q), r.dtype, 0, rows)
    return x.reshape(full)


# ------------------------------------------------------ parallel cyclic reduction
def _shift(x: Array, s: int, axis: int, fill: float, *, down: bool) -> Array:
    """`x[i - s]` (`down`) or `x[i + s]` along `axis`, `fill` outside the range."""
    n = x.shape[axis]
    s = min(s, n)
    pad = [(0, 0, 0)] * x.ndim
    if down:
        kept = lax.slice_in_dim(x, 0, n - s, axis=axis)
        pad[axis] = (s, 0, 0)
    else:
        kept = lax.slice_in_dim(x, s, n, axis=axis)
        pad[axis] = (0, s, 0)
    return lax.pad(kept, jnp.asarray(fill, x.dtype), pad)


def _zero_corners(l: Array, u: Array, axis: int) -> tuple[Array, Array]:
    """`l[0]` and `u[-1]` along `axis` (the ignored entries) set to zero."""
    n = l.shape[axis]
    index = lax.broadcasted_iota(jnp.int32, (1,) * axis + (n,), axis)
    index = index.reshape(index.shape + (1,) * (l.ndim - axis - 1))
    l = jnp.where(index == 0, jnp.zeros((), l.dtype), l)
    u = jnp.where(index == n - 1, jnp.zeros((), u.dtype), u)
    return l, u


def _pcr(l, d, u, r, *, axis: int, transpose: bool) -> Array:
    """Parallel cyclic reduction along `axis`.

    Round `k` (`s = 2^k`) eliminates each row's couplings to rows `i - s` and
    `i + s` with those rows, leaving couplings at distance `2s`; after
    `ceil(log2 n)` rounds every row is decoupled. Rows are kept scaled to a unit
    diagonal, so a round costs one reciprocal per row; rows outside the system act
    as identity rows. The rounds are a `fori_loop` (a dynamic shift): unrolled,
    XLA fused them and recomputed earlier rounds, and compiled 2.5x slower.
    """
    if transpose:
        l, u = _shift(u, 1, axis, 0, down=True), _shift(l, 1, axis, 0, down=False)
    n = r.shape[axis]
    index = lax.broadcasted_iota(jnp.int32, (1,) * axis + (n,), axis)
    index = index.reshape(index.shape + (1,) * (r.ndim - axis - 1))
    zero = jnp.zeros((), r.dtype)
    inv = 1 / d
    l, u = _zero_corners(l * inv, u * inv, axis)
    full = jnp.broadcast_shapes(l.shape, u.shape, r.shape)
    l, u, r = (jnp.broadcast_to(x, full) for x in (l, u, r * inv))

    def round_(k, state):
        l, u, r = state
        s = jnp.left_shift(1, k)
        # x[i - s] and x[i + s], zero outside the system
        down = lambda x: jnp.where(index >= s, jnp.roll(x, s, axis=axis), zero)
        up = lambda x: jnp.where(index < n - s, jnp.roll(x, -s, axis=axis), zero)
        inv = 1 / (1 - l * down(u) - u * up(l))
        return (
            -l * down(l) * inv,
            -u * up(u) * inv,
            (r - l * down(r) - u * up(r)) * inv,
        )

    _, _, r = lax.fori_loop(0, (n - 1).bit_length(), round_, (l, u, r))
    return r


# ------------------------------------------------------------- the public solve
def _backend(scan: AbstractScan) -> AbstractScan:
    if isinstance(scan, AutoScan):
        scan = scan.select()
    if not isinstance(scan, (SequentialScan, AssociativeScan)):
        raise ValueError(
            "`tridiagonal_solve(..., scan=...)` supports `eqx_seq.SequentialScan()` "
            "(Thomas), `eqx_seq.AssociativeScan()` (parallel cyclic reduction) and "
            f"`eqx_seq.AutoScan()`, got {scan!r}."
        )
    return scan


def _primal(l, d, u, r, *, axis: int, scan: AbstractScan, transpose: bool) -> Array:
    if isinstance(scan, SequentialScan):
        return _thomas(l, d, u, r, axis=axis, transpose=transpose, unroll=scan.unroll)
    return _pcr(l, d, u, r, axis=axis, transpose=transpose)


def _matvec(l, d, u, x, *, axis: int) -> Array:
    """`A x` for the tridiagonal `A`: `l[i] x[i-1] + d[i] x[i] + u[i] x[i+1]`."""
    below = _shift(x, 1, axis, 0, down=True)
    above = _shift(x, 1, axis, 0, down=False)
    return l * below + d * x + u * above


def _pivoting_solve(l, d, u, r, *, axis: int) -> Array:
    full = r.shape
    move = lambda x: jnp.moveaxis(jnp.broadcast_to(x, full), axis, -1)
    x = lax.linalg.tridiagonal_solve(move(l), move(d), move(u), move(r)[..., None])
    return jnp.moveaxis(x[..., 0], -1, axis)


def _checked(l, d, u, r, x, *, axis: int, dominance: bool) -> Array:
    """`x`, raising through `eqx.error_if` for non-dominant or singular systems."""
    if dominance:
        l, u = _zero_corners(l, u, axis)
        a_l, a_d, a_u = jnp.abs(l), jnp.abs(d), jnp.abs(u)
        by_rows = jnp.all(a_d >= a_l + a_u, axis=axis)
        below = _shift(a_u, 1, axis, 0, down=True)  # |A[i-1, i]|
        above = _shift(a_l, 1, axis, 0, down=False)  # |A[i+1, i]|
        by_columns = jnp.all(a_d >= below + above, axis=axis)
        x = eqx.error_if(
            x,
            ~(by_rows | by_columns),
            "eqx_seq.tridiagonal_solve: a system is not diagonally dominant (by rows "
            "or by columns), so the solve without pivoting may be inaccurate. Use "
            "`pivoting=True`, or build a dominant matrix (see "
            "eqx_seq.TridiagonalImplicit).",
        )
    return eqx.error_if(
        x,
        ~jnp.all(jnp.isfinite(x)),
        "eqx_seq.tridiagonal_solve: the solution is not finite: a system is singular "
        "(a zero pivot) or its inputs are not finite.",
    )


@eqx.filter_jit
def _solve(l, d, u, r, axis, scan, pivoting, check):
    full = r.shape
    if pivoting:
        solve = lambda _, b: _pivoting_solve(l, d, u, b, axis=axis)
        transpose_solve = lambda _, b: _pivoting_solve(
            _shift(u, 1, axis, 0, down=True),
            d,
            _shift(l, 1, axis, 0, down=False),
            b,
            axis=axis,
        )
    else:
        solve = lambda _, b: _primal(l, d, u, b, axis=axis, scan=scan, transpose=False)
        transpose_solve = lambda _, b: _primal(
            l, d, u, b, axis=axis, scan=scan, transpose=True
        )
    matvec = lambda x: jnp.broadcast_to(_matvec(l, d, u, x, axis=axis), full)
    x = lax.custom_linear_solve(matvec, r, solve, transpose_solve)
    if check:
        x = _checked(l, d, u, r, x, axis=axis, dominance=not pivoting)
    return x


def tridiagonal_solve(
    lower: Inexact[ArrayLike, "..."],
    diag: Inexact[ArrayLike, "..."],
    upper: Inexact[ArrayLike, "..."],
    rhs: Inexact[ArrayLike, "..."],
    *,
    axis: int = 0,
    scan: AbstractScan = AutoScan(),
    pivoting: bool = False,
    check: bool = False,
) -> Inexact[Array, "..."]:
    r"""Solve tridiagonal systems $A x = r$ along `axis`, many at once.

    Row $i$ of each system reads
    $\text{lower}_i x_{i-1} + \text{diag}_i x_i + \text{upper}_i x_{i+1} = r_i$;
    `lower[0]` and `upper[-1]` (along `axis`) are ignored, as in
    `jax.lax.linalg.tridiagonal_solve`. Every other axis indexes independent
    systems, and the four inputs broadcast against each other NumPy-style, so one
    set of diagonals can serve many right-hand sides (give it size 1 on those axes)
    without being copied.

    **Methods.** The backend picks the algorithm:

    - [`eqx_seq.SequentialScan`][] (the `AutoScan` choice on CPU): the Thomas
        algorithm (Gaussian elimination without pivoting; Thomas 1949), `O(n)` per
        system, vectorised across systems. It never transposes the whole array:
        systems are swept in blocks of a few thousand so that the sweep's scratch
        stays in cache, and when `axis` is not the leading axis each block is laid
        out along `axis` while it is in cache. At 100k systems of size 100 on CPU
        it was 2.5-4.8x faster than `jax.lax.linalg.tridiagonal_solve` on
        time-major data (`axis=0`) and 1.9-2.3x on systems along the last axis
        (`benchmarks/README.md`).
    - [`eqx_seq.AssociativeScan`][] (the `AutoScan` choice on GPU/TPU): parallel
        cyclic reduction (PCR; Hockney 1965), `ceil(log2 n)` rounds of elementwise
        updates with shifts along `axis`: `O(n log n)` work, `O(log n)` depth, for
        a few long systems on parallel hardware. On CPU it is 10-15x slower than
        Thomas. Chosen over the associative-scan form of Thomas (2x2 products for
        the pivots), which inherits Thomas's pivots and so its failure on a tiny
        leading pivot, where PCR stays accurate (measured in
        `benchmarks/README.md`).
    - `pivoting=True` (then `scan` is not used):
        `jax.lax.linalg.tridiagonal_solve`, i.e. LAPACK `gtsv` with partial
        pivoting on CPU, for matrices that are not diagonally dominant. It moves
        `axis` last and materialises broadcast inputs (copies). Note that JAX's
        batched GPU path (cuSPARSE `gtsv2StridedBatch`) does *not* pivot.

    **Stability.** Without pivoting, Thomas and PCR are backward stable for
    matrices that are diagonally dominant by rows or by columns, symmetric positive
    definite, or M-matrices (Higham 1990). Otherwise a pivot can be tiny or zero and
    the result inaccurate, `inf` or `NaN`; nothing is raised unless `check=True`.
    [`eqx_seq.TridiagonalImplicit`][] builds dominant matrices by construction.

    **Derivatives** by implicit differentiation, for every method, w.r.t. all four
    inputs: forward mode costs one more solve, $x' = A^{-1}(r' - A' x)$; reverse
    mode one solve with $A^\top$ and elementwise products
    ($\bar r = A^{-\top} \bar x$, $\bar{\text{diag}}_i = -\bar r_i x_i$,
    $\bar{\text{lower}}_i = -\bar r_i x_{i-1}$,
    $\bar{\text{upper}}_i = -\bar r_i x_{i+1}$). `jax.grad`, `jax.jacfwd`,
    `jax.jacrev`, `jax.vmap`, `jax.jit` and higher orders all work. Complex dtypes
    follow JAX's convention (plain transposes, no conjugation).

    **Arguments:**

    - `lower`, `diag`, `upper`: the sub-, main and super-diagonal. After NumPy's
        rank alignment each must have the size `n` of `rhs` along `axis`, and
        broadcast with `rhs` elsewhere.
    - `rhs`: the right-hand sides.
    - `axis`: the axis along which the systems run (negative counts from the end),
        of the broadcast shape. Default 0: time-major, the package's convention.
    - `scan`: the backend, see above. Defaults to [`eqx_seq.AutoScan`][].
    - `pivoting`: if `True`, solve with partial pivoting (LAPACK on CPU).
    - `check`: if `True`, raise at run time (through `eqx.error_if`, so also under
        `jax.jit`) when a system is diagonally dominant neither by rows nor by
        columns (unless `pivoting`), or when the solution is not finite (a singular
        system, a zero pivot, or non-finite inputs). Costs a few extra passes over
        the inputs.

    **Returns:**

    The solution `x`, with the broadcast shape of the inputs and their common dtype
    (JAX's standard promotion).

    **Raises:**

    `ValueError` at trace time for an `axis` out of range, inputs whose sizes along
    `axis` differ or that do not broadcast, non-floating dtypes, an empty system, or
    an unsupported `scan`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_seq

        n, batch = 100, 8
        lower = jnp.full((n, 1), -1.0)  # shared by all 8 right-hand sides
        diag = jnp.full((n, 1), 4.0)
        upper = jnp.full((n, 1), -1.0)
        rhs = jnp.ones((n, batch))       # time-major: systems along axis 0
        x = eqx_seq.tridiagonal_solve(lower, diag, upper, rhs)
        x_pcr = eqx_seq.tridiagonal_solve(
            lower, diag, upper, rhs, scan=eqx_seq.AssociativeScan()
        )
        ```

    ??? cite "References"

        Thomas, "Elliptic problems in linear difference equations over a network",
        Watson Sci. Comput. Lab. report, 1949. Hockney, "A fast direct solution of
        Poisson's equation using Fourier analysis", J. ACM 12(1), 1965. Higham,
        "Bounding the error in Gaussian elimination for tridiagonal systems", SIAM
        J. Matrix Anal. Appl. 11(4), 1990.
    """
    if not isinstance(scan, AbstractScan):
        raise ValueError(
            "`tridiagonal_solve(..., scan=...)` must be an `eqx_seq.AbstractScan`, "
            f"got {scan!r}."
        )
    scan = _backend(scan)
    try:
        arrays = [jnp.asarray(x) for x in (lower, diag, upper, rhs)]
    except TypeError as e:
        raise ValueError(f"`tridiagonal_solve` needs arrays: {e}") from e
    names = ("lower", "diag", "upper", "rhs")
    for name, x in zip(names, arrays):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"`tridiagonal_solve` needs floating or complex arrays, got {x.dtype} "
                f"for `{name}`; cast it, e.g. `{name}.astype(jnp.float32)`."
            )
    ndim = max(x.ndim for x in arrays)
    if ndim == 0:
        raise ValueError("`tridiagonal_solve` needs arrays with at least one axis.")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(
            f"`axis` must be an int in [-{ndim}, {ndim}) for inputs of up to {ndim} "
            f"dimensions, got {axis!r}."
        )
    axis %= ndim
    arrays = [x.reshape((1,) * (ndim - x.ndim) + x.shape) for x in arrays]
    sizes = {name: x.shape[axis] for name, x in zip(names, arrays)}
    n = sizes["rhs"]
    if n == 0 or any(s != n for s in sizes.values()):
        raise ValueError(
            f"`tridiagonal_solve` needs every input to have the same non-zero size "
            f"along axis={axis} (after aligning ranks as NumPy does), got {sizes}. "
            "For diagonals shared across systems, give them size 1 on the other "
            "axes, e.g. `diag[:, None]` for time-major `rhs` of shape (n, batch)."
        )
    try:
        full = jnp.broadcast_shapes(*(x.shape for x in arrays))
    except ValueError as e:
        raise ValueError(
            "The inputs of `tridiagonal_solve` must broadcast against each other, "
            f"got shapes {[x.shape for x in arrays]}."
        ) from e
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*arrays)
    l, d, u, r = (x.astype(dtype) for x in arrays)
    r = jnp.broadcast_to(r, full)
    return _solve(l, d, u, r, axis, scan, bool(pivoting), bool(check))
