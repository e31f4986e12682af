"""Sequence parallelism: the diagonal recurrence with its time axis split over the
devices of a mesh axis, inside `jax.shard_map`.

Each device reduces its block to the affine map `h -> A h + H` of the whole block
(`A` the product of its decays, `H` its last state from zero, or from `h0` on the
first device). The devices exchange those `2 |S|` numbers, either all of them by one
`all_gather` or by a prefix scan of `ppermute`s, each composes the maps of the blocks
before it into its initial state, and runs the inner backend on its block from
there. The adjoint is the same recurrence backwards in time, so
`eqx_seq.linear_recurrence`'s derivatives run this backend too; the one step that
crosses a block boundary (`shift`) is passed between neighbours, as are the steps a
causal convolution reads before a block (`halo`). The selective scan exchanges its
blocks' maps with the same `carry_into_block`. The delta rule's state is carried by
maps with a dense matrix part, `S -> M @ S + N` (`carry_matrix_into_block`): the
same exchanges, given the algebra of those maps (`_Maps`: identity, composition,
application), so that one exchange code serves both. See
`docs/devdocs/sequence-parallel.md`.
"""

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Inexact, Num, PyTree

from .._misc import zeros_like_inputs
from ._base import (
    AbstractScan,
    check_halo_width,
    check_scan,
    compose,
    decayed,
    fill_halo,
    shift_local,
)
from ._local import AutoScan


def mesh_axis(axis_name: str) -> tuple[int, Array]:
    """The size of the mesh axis and this device's index along it, or a clear error
    outside a `jax.shard_map` over it."""
    try:
        return lax.axis_size(axis_name), lax.axis_index(axis_name)
    except NameError as e:
        raise ValueError(
            f"eqx_seq.ShardedScan({axis_name!r}) runs inside `jax.shard_map` over a "
            f"mesh with an axis named {axis_name!r}, the time axis split over it "
            f"(in_specs such as `P({axis_name!r})` for `(T, ...)` inputs); no such "
            "axis is bound here."
        ) from e


def _block_map(
    inner: AbstractScan, a: Array, b: Array, h0: Array, *, reverse: bool
) -> tuple[Array, Array]:
    """The block's affine map `(A, H)`: the product of its decays and its last
    state from `h0` (in run order). A sequential `inner` gets a loop that carries
    them and writes no state (it reads the block once, where a recurrence also
    writes it: the loop is memory-bound); a parallel one its own recurrence and a
    reduction, which keep its depth logarithmic."""
    num_steps = b.shape[0]
    varying = a.ndim == b.ndim
    if inner.parallel:
        states = inner.recurrence(a, b, h0, reverse=reverse)
        if varying:
            # a zero decay (a reset) zeroes the product, selected: the decays
            # around it may overflow
            prod = jnp.where(jnp.any(a == 0, axis=0), 0, jnp.prod(a, axis=0))
        else:
            prod = a**num_steps
        return prod, states[0] if reverse else states[-1]

    def step(i, carry):
        prod, h = carry
        t = num_steps - 1 - i if reverse else i
        b_t = lax.dynamic_index_in_dim(b, t, keepdims=False)
        if not varying:
            return prod, decayed(a, h) + b_t
        a_t = lax.dynamic_index_in_dim(a, t, keepdims=False)
        return decayed(a_t, prod), decayed(a_t, h) + b_t

    prod = a**num_steps if not varying else jnp.ones_like(h0)
    return lax.fori_loop(0, num_steps, step, (prod, h0))


class _Maps(NamedTuple):
    """A family of affine maps as the exchanges use them: a map is a pair of
    arrays, composed, applied to a state, and packed into one array (one message
    per round of the `ppermute` scan)."""

    identity: Callable[[tuple[Array, Array]], tuple[Array, Array]]
    compose: Callable  # (earlier, later) -> the map of first earlier, then later
    apply: Callable[[tuple[Array, Array], Array], Array]
    pack: Callable[[tuple[Array, Array]], Array]
    unpack: Callable[[Array], tuple[Array, Array]]


# `h -> A * h + H`, a decay per state entry: `carry_into_block`
_DIAGONAL = _Maps(
    identity=lambda block: (jnp.ones_like(block[0]), jnp.zeros_like(block[1])),
    compose=compose,
    apply=lambda map_, h: decayed(map_[0], h) + map_[1],
    # `A` and `H` travel as one array
    pack=lambda block: jnp.stack(jnp.broadcast_arrays(*block)),
    unpack=tuple,
)


def _matrix_compose(earlier, later):
    """The maps `S -> M @ S + N` composed: first `earlier`, then `later`."""
    (M_e, N_e), (M_l, N_l) = earlier, later
    return M_l @ M_e, M_l @ N_e + N_l


# `S -> M @ S + N`, `M` `(*B, d, d)` and states `(*B, d, e)`: `carry_matrix_into_block`
_MATRIX = _Maps(
    # typed like the block's map under `jax.shard_map` (varying over the mesh), as
    # `ones_like` makes the diagonal one: the `where`s that select it transpose only
    # between equal types
    identity=lambda block: (
        jnp.zeros_like(block[0])
        + jnp.broadcast_to(
            jnp.eye(block[0].shape[-1], dtype=block[0].dtype), block[0].shape
        ),
        jnp.zeros_like(block[1]),
    ),
    compose=_matrix_compose,
    apply=lambda map_, S: map_[0] @ S + map_[1],
    # `M` and `N` travel as one array, `[M | N]` `(*B, d, d + e)`
    pack=lambda block: jnp.concatenate(block, axis=-1),
    unpack=lambda x: (x[..., : x.shape[-2]], x[..., x.shape[-2] :]),
)


def _tree_where(cond: Array, x, y):
    return jax.tree.map(lambda x_i, y_i: jnp.where(cond, x_i, y_i), x, y)


def _before_by_gather(
    maps: _Maps,
    block: tuple[Array, Array],
    axis_name: str,
    num_devices: int,
    index: Array,
    *,
    reverse: bool,
) -> tuple[Array, Array]:
    """The composed map of the blocks before this one in run order, from one
    `all_gather` of every block's map (`D` small steps, replicated)."""
    gathered = lax.all_gather(block, axis_name)
    prefix = maps.identity(block)
    for j in range(num_devices - 1, -1, -1) if reverse else range(num_devices):
        before = (j > index) if reverse else (j < index)
        composed = maps.compose(prefix, (gathered[0][j], gathered[1][j]))
        prefix = _tree_where(before, composed, prefix)
    return prefix


def _before_by_ppermute(
    maps: _Maps,
    block: tuple[Array, Array],
    axis_name: str,
    num_devices: int,
    index: Array,
    *,
    reverse: bool,
) -> tuple[Array, Array]:
    """The composed map of the blocks before this one in run order, by a
    Hillis-Steele scan over the devices: in round `k` each device receives the map
    that covers the `2^k` blocks ending `2^k` before it and composes it before its
    own (and before the exclusive prefix that it keeps beside it)."""
    # a map travels packed: one message per round, the rounds being a chain of
    # dependent messages
    covered, prefix = maps.pack(block), maps.identity(block)
    distance = 1
    while distance < num_devices:
        senders = range(num_devices - distance)
        if reverse:
            pairs = [(i + distance, i) for i in senders]
            receives = index < num_devices - distance
        else:
            pairs = [(i, i + distance) for i in senders]
            receives = index >= distance
        # devices that no one sends to receive zeros: they keep what they have
        received = maps.unpack(lax.ppermute(covered, axis_name, pairs))
        prefix = _tree_where(receives, maps.compose(received, prefix), prefix)
        composed = maps.pack(maps.compose(received, maps.unpack(covered)))
        covered = jnp.where(receives, composed, covered)
        distance *= 2
    return prefix


_EXCHANGES = {"all_gather": _before_by_gather, "ppermute": _before_by_ppermute}


class ShardedScan(AbstractScan):
    """One long sequence split over devices: the time axis of every input is split
    over the mesh axis `axis_name` of an enclosing `jax.shard_map`, each device runs
    `inner` on its block, and the devices exchange the affine maps of their blocks,
    two numbers per state entry each (`parallel = False`: the sequential algorithms
    of the layers that choose).

    Only the first device's `h0` is used (the last's with `reverse`), and the final
    state is the last device's last step. The blocks have equal lengths, as
    `jax.shard_map` splits them; pad a sequence to a multiple of the device count.
    The selective layers' causal convolutions of `K` taps read the `K - 1` steps
    before each block from the device before (`halo`), so their blocks must be at
    least that long. Its pytree scan (`associative_scan`) is each block's, with
    the total of the blocks before it (gathered) combined into every element. See
    [Several devices](../usage/several-devices.md).

    **Arguments:**

    - `axis_name`: the mesh axis the time axis is split over.
    - `inner`: the backend of each device's block; [`eqx_seq.AutoScan`][] by
        default.
    - `exchange`: how the maps cross devices. `"all_gather"` (the default): one
        `all_gather`, after which each device holds all `D` maps and composes those
        before it. `"ppermute"`: `ceil(log2 D)` rounds of `ppermute`, each passing
        one composed map to the device `2^k` further on (a Hillis-Steele scan), so
        that a device receives `ceil(log2 D)` maps instead of `D`.
    """

    parallel: ClassVar[bool] = False
    splits_time: ClassVar[bool] = True
    axis_name: str = eqx.field(static=True)
    inner: AbstractScan = AutoScan()
    exchange: str = eqx.field(default="all_gather", static=True)

    def __check_init__(self):
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise ValueError(
                "eqx_seq.ShardedScan: `axis_name` must be the name of a mesh axis (a "
                f"non-empty string), got {self.axis_name!r}."
            )
        if isinstance(self.inner, ShardedScan):
            raise ValueError(
                "eqx_seq.ShardedScan: `inner` runs one device's block, so it cannot "
                "be another ShardedScan."
            )
        check_scan(self.inner, name="eqx_seq.ShardedScan (inner)")
        if self.exchange not in _EXCHANGES:
            raise ValueError(
                'eqx_seq.ShardedScan: `exchange` must be "all_gather" or "ppermute", '
                f"got {self.exchange!r}."
            )

    def select(self) -> AbstractScan:
        return self

    def block_scan(self) -> AbstractScan:
        return self.inner.select()

    @property
    def unroll(self) -> int:
        return self.block_scan().unroll

    def recurrence(
        self,
        a: Inexact[Array, "..."],
        b: Inexact[Array, " T *S"],
        h0: Inexact[Array, "*S"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        mesh_axis(self.axis_name)  # its clear error before any work
        inner = self.block_scan()
        h0 = zeros_like_inputs(b.shape[1:], b.dtype, a, b) if h0 is None else h0

        def block_map(start):
            return _block_map(inner, a, b, start, reverse=reverse)

        carry = self.carry_into_block(block_map, h0, reverse=reverse)
        return inner.recurrence(a, b, carry, reverse=reverse)

    def carry_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*S"]:
        return self._carry(_DIAGONAL, block_map, h0, reverse)

    def carry_matrix_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*B d e"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*B d e"]:
        return self._carry(_MATRIX, block_map, h0, reverse)

    def _carry(self, maps: _Maps, block_map: Callable, h0: Array, reverse: bool):
        # Only the first block in run order starts from `h0`, the others from zero:
        # the first block's map then carries `h0` to every later block.
        num_devices, index = mesh_axis(self.axis_name)
        first = num_devices - 1 if reverse else 0
        start = jnp.where(index == first, h0, jnp.zeros_like(h0))
        block = block_map(start)
        exchange = _EXCHANGES[self.exchange]
        before = exchange(
            maps, block, self.axis_name, num_devices, index, reverse=reverse
        )
        return maps.apply(before, start)

    def associative_scan(
        self, fn: Callable, elems: PyTree[Array], *, reverse: bool = False
    ) -> PyTree[Array]:
        # each block's inclusive scan, then the total of the blocks before it in run
        # order (gathered, combined in device order) combined into every element
        num_devices, index = mesh_axis(self.axis_name)
        scanned = self.block_scan().associative_scan(fn, elems, reverse=reverse)
        last = 0 if reverse else -1
        totals = lax.all_gather(
            jax.tree.map(lambda x: x[last][None], scanned), self.axis_name
        )
        order = range(num_devices - 1, -1, -1) if reverse else range(num_devices)
        before, covered = None, None
        for j in order:
            total_j = jax.tree.map(lambda x: x[j], totals)
            covered = total_j if covered is None else fn(covered, total_j)
            # the devices after `j` in run order see the blocks up to `j`
            after = index < j if reverse else index > j
            before = covered if before is None else _tree_where(after, covered, before)
        first = num_devices - 1 if reverse else 0
        length = jax.tree.leaves(scanned)[0].shape[0]
        prefix = jax.tree.map(
            lambda x: jnp.broadcast_to(x, (length, *x.shape[1:])), before
        )
        return _tree_where(index == first, scanned, fn(prefix, scanned))

    def shift(
        self,
        x: Inexact[Array, " T *S"],
        fill: Inexact[Array, "*#S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        num_devices, index = mesh_axis(self.axis_name)
        # each block's boundary step comes from the block before it in run order
        steps = range(num_devices - 1)
        if reverse:
            edge, pairs, first = x[0], [(i + 1, i) for i in steps], num_devices - 1
        else:
            edge, pairs, first = x[-1], [(i, i + 1) for i in steps], 0
        received = lax.ppermute(edge, self.axis_name, pairs)
        fill = jnp.broadcast_to(fill, edge.shape)
        boundary = jnp.where(index == first, fill, received)
        return shift_local(x, boundary, reverse=reverse)

    def sum_over_blocks(self, x: Num[Array, "*shape"]) -> Num[Array, "*shape"]:
        mesh_axis(self.axis_name)  # the clear error outside `jax.shard_map`
        return lax.psum(x, self.axis_name)

    def halo(
        self,
        x: Inexact[Array, " T *C"],
        width: int,
        fill: Inexact[Array, " W *C"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " W *C"]:
        check_halo_width(width)
        num_devices, index = mesh_axis(self.axis_name)
        num_steps = x.shape[0]
        if num_steps < width:
            raise ValueError(
                f"eqx_seq.ShardedScan({self.axis_name!r}): a block of {num_steps} "
                f"steps is shorter than the {width} steps that a convolution reads "
                "before it (a causal convolution of K taps reads the K - 1 steps "
                "before each block, and only the device before holds them); use "
                "fewer devices, a longer sequence or a shorter convolution."
            )
        fill = fill_halo(x, width, fill)
        if width == 0:
            return fill
        # the steps next to each boundary come from the block before it in run order
        steps = range(num_devices - 1)
        if reverse:
            edge, pairs, first = x[:width], [(i + 1, i) for i in steps], num_devices - 1
        else:
            edge, pairs, first = x[-width:], [(i, i + 1) for i in steps], 0
        received = lax.ppermute(edge, self.axis_name, pairs)
        return jnp.where(index == first, fill, received)
