"""The Thomas algorithm over blocks of systems: the primal sweeps and the sweeps with
its factors, for [`eqx_seq.tridiagonal_solve`][]."""

import functools as ft
import math
from typing import NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import zeros_like_inputs


# Systems per block on the Thomas path, as bytes of one row of a block (1024 float32
# / 512 float64 systems): a block's scratch stays in cache, and the timing is flat
# around this size (docs/devdocs/tridiagonal.md, "Blocking").
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
    (`moveaxis`) while it is in cache: never the whole array (faster than reading
    such blocks in place with strides).
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
        # `lower[0]` and `upper[-1]` lie outside the matrix: never read them, so
        # that whatever they hold (NaN included) cannot reach the solution
        l_i = _inside(l_i, i != 0)
        inv = 1 / (d_i + l_i * e_prev)
        e = -_inside(u_i, i != n - 1) * inv
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
    # as in `_k_thomas`, the entries outside the matrix are never read
    e = lambda i: -_inside(row(u, i), i != n - 1) * row(inv, i)

    def down(y_prev, i):
        if transpose:
            y = row(b, i) + e(jnp.maximum(i - 1, 0)) * y_prev
        else:
            y = (row(b, i) - _inside(row(l, i), i != 0) * y_prev) * row(inv, i)
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


def _inside(x: Array, inside) -> Array:
    """`x` where the scalar predicate `inside` holds, else zero."""
    return jnp.where(inside, x, jnp.zeros((), x.dtype))


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


def thomas(
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
    `_Factors` of the matrix for `lu_solve`.
    """
    full = jnp.broadcast_shapes(l.shape, d.shape, u.shape, r.shape)
    if block_bytes is None:
        block_bytes = _BLOCK_BYTES if jax.default_backend() == "cpu" else None
    # no blocks on accelerators: each block is a loop of `n` steps, each step a
    # kernel launch or more, so one sweep over all the systems is much faster
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


def lu_solve(f: _Factors, b: Array, *, transpose: bool) -> Array:
    """Solve `A x = b` (or `A^T x = b`) with the factors of `A`, in blocks."""
    ins = (f.lower, f.upper, f.inv, _as_pnq(b, f.axis, f.full))
    kernel = ft.partial(_k_lu, transpose=transpose, unroll=f.unroll)
    (x,) = _over_blocks(kernel, ins, [ins[3].shape], b.dtype, block=f.block)
    return x.reshape(f.full)
