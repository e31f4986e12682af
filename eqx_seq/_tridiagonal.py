"""Batched tridiagonal solves along any axis, differentiated implicitly.

Three methods, picked by the `scan` backend and the `pivoting` flag:

- Thomas (LU without pivoting) for [`eqx_seq.SequentialScan`][]: one sweep down and
  one back along the solve axis, every other axis vectorised. The systems are
  processed in blocks of `_BLOCK_BYTES` per row (1024 float32 / 512 float64
  systems) so that the sweep's scratch stays in cache (on CPU; on accelerators
  one sweep runs over all the systems); the sweeps read their rows
  straight from the inputs and write straight into the output. When the solve axis
  is not the leading one, each block (never the whole array) is laid out time-major
  while it is in cache. `_over_blocks` is the one place where sweeps are blocked.
- Parallel cyclic reduction (Hockney 1965; Hockney & Jesshope 1981) for
  [`eqx_seq.AssociativeScan`][]: `ceil(log2 n)` rounds of elementwise updates with
  shifts along the axis, so no transposes either.
- LAPACK `gtsv` / cuSPARSE through `jax.lax.linalg.tridiagonal_solve` for
  `pivoting=True`.

Derivatives are implicit, never autodiff through the sweeps. Thomas has a
`jax.custom_jvp` (`_thomas_solve`): its rule runs the primal sweeps once, keeping
the reciprocals of the pivots (`A = L U`), and gets the tangent
`x' = A^{-1}(r' - A' x)` from `jax.lax.custom_linear_solve` whose `solve` and
`transpose_solve` are sweeps with those factors (`A^T = U^T L^T`; multiplications
only). Reverse mode is then the primal pass, two division-free sweeps and
elementwise products; forward mode one more pair of sweeps; the plain forward is
untouched. PCR and `pivoting=True` use `jax.lax.custom_linear_solve` around their
own solves (the transposed solve being the method run on `A^T`).
"""

import functools as ft
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Inexact

from ._misc import error_if_any, vary_like, zeros_like_inputs
from ._scan import AbstractScan, AutoScan, check_scan


# Systems per block on the Thomas path, as bytes of one row of a block: 1024
# float32 / 512 float64 systems. Measured on a 2-core CPU at 100k x 100: once the
# sweeps read their rows straight from the inputs and write straight into the
# output (that, not the block size, took float64 from 1.8x to about 1.3x Numba's
# single-threaded time), rows of 2-32 KiB were within 10% of each other, 4 KiB
# slightly ahead time-major. Small problems are blocked too: at 10k x 100 blocks
# were 1.2x (time-major) to 2.2x (last axis, float64) faster than one sweep over
# everything.
_BLOCK_BYTES = 4096


# ------------------------------------------------------------ sweeps over blocks
class _Block(NamedTuple):
    """A block of systems of 3-D arrays: the solve axis is `axis` (0 or 1), the other
    two axes index systems; the block spans `sizes` from `starts` along them."""

    axis: int
    starts: tuple
    sizes: tuple[int, int]

    def dims(self) -> tuple[int, int]:
        return (1, 2) if self.axis == 0 else (0, 2)

    def row_shape(self, a: Array) -> tuple[int, int]:
        """The shape of a row of `a` in this block (1 where `a` is broadcast)."""
        return tuple(
            1 if a.shape[k] == 1 else b for k, b in zip(self.dims(), self.sizes)
        )

    def _window(self, a: Array, i):
        start, size = [0, 0, 0], [1, 1, 1]
        start[self.axis] = i
        for k, s, b in zip(self.dims(), self.starts, self.sizes):
            if a.shape[k] != 1:
                start[k], size[k] = s, b
        return start, size

    def row(self, a: Array, i) -> Array:
        """Row `i` along the solve axis, shape `row_shape(a)`."""
        start, size = self._window(a, i)
        return lax.dynamic_slice(a, start, size).reshape(self.row_shape(a))

    def put(self, out: Array, i, v: Array) -> Array:
        """`out` with row `i` of this block set to `v`."""
        start, size = self._window(out, i)
        v = jnp.broadcast_to(v, self.row_shape(out)).reshape(size)
        return lax.dynamic_update_slice(out, v.astype(out.dtype), start)


def _over_blocks(kernel, ins, out_shapes, dtype, *, block: int):
    """`kernel(ins, outs, blk) -> outs` over blocks of about `block` systems of the
    `(P, n, Q)` arrays `ins` (size 1 on a system axis: broadcast), writing into
    fresh buffers of `out_shapes` (also `(P | 1, n, Q | 1)`); returns them.

    The one place where the Thomas-type sweeps are blocked. Time-major data
    (`P == 1`): blocks of columns, read and written in place. Otherwise blocks of
    `block // Q` (at least one) leading indices, each laid out time-major
    (`moveaxis`) while it is in cache: never the whole array. (Reading such blocks
    in place with strides measured 1.35x slower at 100k x 100.)
    """
    P = max(a.shape[0] for a in ins)
    Q = max(a.shape[2] for a in ins)
    n = ins[0].shape[1]
    outs = tuple(zeros_like_inputs(s, dtype, *ins) for s in out_shapes)
    if P == 1:
        total, step = Q, block

        def run(start, size, outs):
            return kernel(ins, outs, _Block(1, (0, start), (1, size)))

    else:
        total, step = P, max(1, block // Q)

        def run(start, size, outs):
            at = lambda a: start if a.shape[0] != 1 else 0
            grab = lambda a: (
                a if a.shape[0] == 1 else lax.dynamic_slice_in_dim(a, start, size, 0)
            )
            tile_in = tuple(jnp.moveaxis(grab(a), 1, 0) for a in ins)
            tile_out = tuple(
                zeros_like_inputs(
                    (n, size if o.shape[0] != 1 else 1, o.shape[2]), dtype, *ins
                )
                for o in outs
            )
            tile_out = kernel(tile_in, tile_out, _Block(0, (0, 0), (size, Q)))
            return tuple(
                lax.dynamic_update_slice_in_dim(o, jnp.moveaxis(t, 0, 1), at(o), 0)
                for o, t in zip(outs, tile_out)
            )

    if total <= step:
        return run(0, total, outs)
    count, rest = divmod(total, step)
    outs = lax.fori_loop(0, count, lambda k, outs: run(k * step, step, outs), outs)
    if rest:
        outs = run(count * step, rest, outs)
    return outs


# ------------------------------------------------------------------- Thomas sweeps
# Thomas factorises A = L U: L lower bidiagonal with sub-diagonal `lower` and pivots
# p_i = diag_i + lower_i e_{i-1}, U unit upper bidiagonal with super-diagonal -e_i,
# e_i = -upper_i / p_i. Only `inv` = 1 / p is kept: `e` is recomputed from `upper`
# where needed, which reads an input instead of writing and reading one more array.
def _k_thomas(ins, outs, blk: _Block, *, unroll: int):
    """Kernel: `x` into `outs[0]`, and `inv` into `outs[1]` if there is one (at the
    broadcast shape of the diagonals)."""
    l, d, u, r = ins
    n = r.shape[blk.axis]
    dshape = jnp.broadcast_shapes(*(blk.row_shape(a) for a in (l, d, u)))
    shape = jnp.broadcast_shapes(dshape, blk.row_shape(r))

    def down(carry, i):
        e_prev, y_prev, outs = carry
        l_i, d_i, u_i, r_i = (blk.row(a, i) for a in ins)
        inv = 1 / (d_i + l_i * e_prev)
        e = -u_i * inv
        y = (r_i - l_i * y_prev) * inv
        if len(outs) == 2:
            outs = (outs[0], blk.put(outs[1], i, inv))
        return (e, y, outs), (e, y)

    init = (
        zeros_like_inputs(dshape, r.dtype, *ins),
        zeros_like_inputs(shape, r.dtype, *ins),
        outs,
    )
    (_, _, outs), (e, y) = lax.scan(down, init, jnp.arange(n), unroll=unroll)

    def up(j, carry):
        x_next, outs = carry
        i = n - 1 - j
        x = y[i] + e[i] * x_next
        return x, (blk.put(outs[0], i, x),) + outs[1:]

    zero = zeros_like_inputs(shape, r.dtype, *ins)
    _, outs = lax.fori_loop(0, n, up, (zero, outs), unroll=unroll)
    return outs


def _k_lu(ins, outs, blk: _Block, *, transpose: bool, unroll: int):
    """Kernel: solve `A x = b`, or `A^T x = b`, with `inv` from `_k_thomas`: only
    multiplications. `A x = b`: `y_i = (b_i - lower_i y_{i-1}) inv_i`, then
    `x_i = y_i + e_i x_{i+1}`. `A^T = U^T L^T`: `z_i = b_i + e_{i-1} z_{i-1}`, then
    `x_i = (z_i - lower_{i+1} x_{i+1}) inv_i`."""
    l, u, inv, b = ins
    n = b.shape[blk.axis]
    shape = jnp.broadcast_shapes(*(blk.row_shape(a) for a in ins))
    row = blk.row
    e = lambda i: -row(u, i) * row(inv, i)

    def down(y_prev, i):
        if transpose:
            y = row(b, i) + e(jnp.maximum(i - 1, 0)) * y_prev
        else:
            y = (row(b, i) - row(l, i) * y_prev) * row(inv, i)
        return y, y

    zero = zeros_like_inputs(shape, b.dtype, *ins)
    _, ys = lax.scan(down, zero, jnp.arange(n), unroll=unroll)

    def up(j, carry):
        x_next, out = carry
        i = n - 1 - j
        if transpose:
            x = (ys[i] - row(l, jnp.minimum(i + 1, n - 1)) * x_next) * row(inv, i)
        else:
            x = ys[i] + e(i) * x_next
        return x, blk.put(out, i, x)

    _, out = lax.fori_loop(0, n, up, (zero, outs[0]), unroll=unroll)
    return (out,)


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


class _Factors(NamedTuple):
    """Thomas's factors in `(P, n, Q)` form, and how to block sweeps over them."""

    lower: Array
    upper: Array
    inv: Array
    full: tuple[int, ...]
    axis: int
    block: int
    unroll: int


def _thomas(
    l,
    d,
    u,
    r,
    *,
    axis: int,
    unroll: int = 1,
    factors: bool = False,
    block_bytes: int | None = None,
):
    """Thomas along `axis` of rank-aligned arrays, in blocks of systems.

    Returns `x` with the broadcast shape of the inputs, and with `factors` also the
    `_Factors` of the matrix for `_lu_solve`.
    """
    full = jnp.broadcast_shapes(l.shape, d.shape, u.shape, r.shape)
    if block_bytes is None:
        block_bytes = _BLOCK_BYTES if jax.default_backend() == "cpu" else None
    # no blocks on accelerators: each block is a loop of `n` steps, each step a
    # kernel launch or more, so blocks of CPU size were 85x slower than one sweep
    # over all the systems on an H100 (100k x 100, float32: 254 vs 3.0 ms)
    block = math.prod(full) if block_bytes is None else block_bytes // r.dtype.itemsize
    block = max(1, block)
    ins = tuple(_as_pnq(x, axis, full) for x in (l, d, u, r))
    P, n, Q = ins[3].shape
    shapes = [(P, n, Q)]
    if factors:
        dshape = tuple(max(a.shape[k] for a in ins[:3]) for k in range(3))
        shapes.append(dshape)
    outs = _over_blocks(
        ft.partial(_k_thomas, unroll=unroll), ins, shapes, r.dtype, block=block
    )
    x = outs[0].reshape(full)
    if not factors:
        return x
    return x, _Factors(ins[0], ins[2], outs[1], full, axis, block, unroll)


def _lu_solve(f: _Factors, b: Array, *, transpose: bool) -> Array:
    """Solve `A x = b` (or `A^T x = b`) with the factors of `A`, in blocks."""
    ins = (f.lower, f.upper, f.inv, _as_pnq(b, f.axis, f.full))
    kernel = ft.partial(_k_lu, transpose=transpose, unroll=f.unroll)
    (x,) = _over_blocks(kernel, ins, [ins[3].shape], b.dtype, block=f.block)
    return x.reshape(f.full)


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
def _matvec(l, d, u, x, *, axis: int) -> Array:
    """`A x` for the tridiagonal `A`: `l[i] x[i-1] + d[i] x[i] + u[i] x[i+1]`."""
    below = _shift(x, 1, axis, 0, down=True)
    above = _shift(x, 1, axis, 0, down=False)
    return l * below + d * x + u * above


@ft.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _thomas_solve(l, d, u, r, axis: int, unroll: int) -> Array:
    """Thomas, differentiated by the rule below (never through the sweeps)."""
    return _thomas(l, d, u, r, axis=axis, unroll=unroll)


@_thomas_solve.defjvp
def _thomas_solve_jvp(axis, unroll, primals, tangents):
    # one primal sweep that also keeps the factors; the tangent is one solve with
    # them, x' = A^{-1}(r' - A' x), and its transpose (reverse mode) one solve with
    # A^T = U^T L^T: two sweeps of multiplications, then elementwise products
    l, d, u, r = primals
    dl, dd, du, dr = tangents
    x, factors = _thomas(l, d, u, r, axis=axis, unroll=unroll, factors=True)
    full = x.shape
    matvec = lambda v: jnp.broadcast_to(_matvec(l, d, u, v, axis=axis), full)
    rhs = jnp.broadcast_to(dr - _matvec(dl, dd, du, x, axis=axis), full)
    dx = lax.custom_linear_solve(
        matvec,
        rhs,
        lambda _, b: _lu_solve(factors, b, transpose=False),
        lambda _, b: _lu_solve(factors, b, transpose=True),
    )
    return x, dx


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
        x = error_if_any(
            x,
            ~(by_rows | by_columns),
            "eqx_seq.tridiagonal_solve: a system is not diagonally dominant (by rows "
            "or by columns), so the solve without pivoting may be inaccurate. Use "
            "`pivoting=True`, or build a dominant matrix (see "
            "eqx_seq.TridiagonalImplicit).",
        )
    return error_if_any(
        x,
        ~jnp.all(jnp.isfinite(x)),
        "eqx_seq.tridiagonal_solve: the solution is not finite: a system is singular "
        "(a zero pivot) or its inputs are not finite.",
    )


@eqx.filter_jit
def _solve(l, d, u, r, axis, scan, pivoting, check):
    full = r.shape
    if not scan.parallel and not pivoting:
        x = _thomas_solve(l, d, u, r, axis, getattr(scan, "unroll", 1))
        if check:
            x = _checked(l, d, u, r, x, axis=axis, dominance=True)
        return x
    l, d, u = (vary_like(x, r) for x in (l, d, u))  # for `shard_map`: see `vary_like`
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
        solve = lambda _, b: _pcr(l, d, u, b, axis=axis, transpose=False)
        transpose_solve = lambda _, b: _pcr(l, d, u, b, axis=axis, transpose=True)
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
        systems are swept in blocks of about a thousand so that the sweep's
        scratch stays in cache, rows are read from the inputs and written to the
        output in place, and when `axis` is not the leading axis each block is
        laid out along `axis` while it is in cache. At 100k systems of size 100 on
        CPU it was 3.4-4.7x faster than `jax.lax.linalg.tridiagonal_solve` on
        time-major data (`axis=0`) and 1.4-2.0x on systems along the last axis
        (`benchmarks/README.md`). XLA runs the sweeps on one thread; to use several
        cores, split the systems over CPU devices with `jax.shard_map` (README,
        "Several devices"). Sharded inputs without `shard_map` are slow: XLA's
        automatic partitioner gathers the blocks.
    - [`eqx_seq.AssociativeScan`][] (the `AutoScan` choice on GPU/TPU): parallel
        cyclic reduction (PCR; Hockney 1965), `ceil(log2 n)` rounds of elementwise
        updates with shifts along `axis`: `O(n log n)` work, `O(log n)` depth, for
        a few long systems on parallel hardware. On CPU it is 10-20x slower than
        Thomas. Chosen over the associative-scan form of Thomas (2x2 products for
        the pivots), which inherits Thomas's pivots and so its failure on a tiny
        leading pivot, where PCR stays accurate (measured in
        `benchmarks/README.md`).
    - `pivoting=True` (then `scan` is not used):
        `jax.lax.linalg.tridiagonal_solve`, i.e. LAPACK `gtsv` with partial
        pivoting on CPU, for matrices that are not diagonally dominant. It moves
        `axis` last and materialises broadcast inputs (copies). Note that JAX's
        batched GPU path (cuSPARSE `gtsv2StridedBatch`) does *not* pivot. On a
        GPU it is also the fastest method: on one H100 at 100k systems of size
        100 it took 0.8 ms (float32) against 2.1 ms for PCR and 3.0 ms for Thomas.

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
    $\bar{\text{upper}}_i = -\bar r_i x_{i+1}$). On the Thomas path these
    solves reuse the factorisation of the primal pass (the reciprocals of the
    pivots, $A = LU$, $A^\top = U^\top L^\top$): two sweeps of multiplications,
    no divisions; measured, the gradient of `sum(x**2)` w.r.t. all four inputs
    costs about 1.8-4.3x the forward on CPU (`benchmarks/README.md`). PCR and
    `pivoting=True` solve with $A^\top$ from scratch. `jax.grad`, `jax.jacfwd`,
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
    scan = check_scan(scan, name="eqx_seq.tridiagonal_solve", chooses=True)
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
