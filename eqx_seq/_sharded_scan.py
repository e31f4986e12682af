"""Sequence parallelism: the diagonal recurrence with its time axis split over the
devices of a mesh axis, inside `jax.shard_map`.

Each device reduces its block to the affine map `h -> A h + H` of the whole block
(`A` the product of its decays, `H` its last state from zero). The devices gather
those `2 |S|` numbers, each folds the maps of the blocks before it into its initial
state, and runs the inner backend on its block from there. The adjoint is the same
recurrence backwards in time, so `eqx_seq.linear_recurrence`'s derivatives run this
backend too; the one step that crosses a block boundary (`shift`) is passed between
neighbours, as are the steps a causal convolution reads before a block (`halo`).
The selective scan folds its blocks' maps with the same `carry_into_block`. See
`docs/devdocs/sequence-parallel.md`.
"""

from typing import ClassVar

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Inexact

from ._scan import (
    AbstractScan,
    AutoScan,
    check_halo_width,
    check_scan,
    fill_halo,
    shift_local,
)


def _mesh_axis(axis_name: str) -> tuple[int, Array]:
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
    inner: AbstractScan, a: Array, b: Array, *, reverse: bool
) -> tuple[Array, Array]:
    """The block's affine map `(A, H)`: the product of its decays and its last
    state from zero (in run order). A sequential `inner` gets a loop that carries
    them and writes no state (it reads the block once, where a recurrence also
    writes it: the loop is memory-bound); a parallel one its own recurrence and a
    reduction, which keep its depth logarithmic."""
    num_steps = b.shape[0]
    varying = a.ndim == b.ndim
    if getattr(type(inner), "parallel", False):
        states = inner.recurrence(a, b, reverse=reverse)
        prod = jnp.prod(a, axis=0) if varying else a**num_steps
        return prod, states[0] if reverse else states[-1]

    def step(i, carry):
        prod, h = carry
        t = num_steps - 1 - i if reverse else i
        b_t = lax.dynamic_index_in_dim(b, t, keepdims=False)
        if not varying:
            return prod, a * h + b_t
        a_t = lax.dynamic_index_in_dim(a, t, keepdims=False)
        return prod * a_t, a_t * h + b_t

    h = jnp.zeros_like(b[0])
    prod = a**num_steps if not varying else jnp.ones_like(h)
    return lax.fori_loop(0, num_steps, step, (prod, h))


def carry_into_block(
    axis_name: str,
    block_map: tuple[Inexact[Array, "*S"], Inexact[Array, "*S"]],
    h0: Inexact[Array, "*S"] | None,
    *,
    reverse: bool = False,
) -> Inexact[Array, "*S"]:
    """The state entering this device's block, from every block's affine map.

    Gathers the maps `(A, H)` of all the blocks over `axis_name` (`A` the product
    of the block's decays, `H` its last state from zero, in run order) and folds
    those of the blocks before this one into `h0`, the first block's (in run
    order) initial state (zeros if `None`). The recurrences with a time axis split
    over devices share it: the diagonal one of `ShardedScan.recurrence` and the
    selective scan's.
    """
    num_devices, index = _mesh_axis(axis_name)
    maps = lax.all_gather(block_map, axis_name)
    order = range(num_devices - 1, -1, -1) if reverse else range(num_devices)
    carry = jnp.zeros_like(block_map[1])
    if h0 is not None:
        carry = carry + lax.all_gather(h0, axis_name)[order[0]]
    for j in order:
        before = (j > index) if reverse else (j < index)
        carry = jnp.where(before, maps[0][j] * carry + maps[1][j], carry)
    return carry


class ShardedScan(AbstractScan):
    """One long sequence split over devices: the time axis of every input is split
    over the mesh axis `axis_name` of an enclosing `jax.shard_map`, each device runs
    `inner` on its block, and the devices exchange two numbers per state entry
    (`parallel = False`: the sequential algorithms of the layers that choose).

    Only the first device's `h0` is used (the last's with `reverse`), and the final
    state is the last device's last step. The blocks have equal lengths, as
    `jax.shard_map` splits them; pad a sequence to a multiple of the device count.
    The selective layers' causal convolutions of `K` taps read the `K - 1` steps
    before each block from the device before (`halo`), so their blocks must be at
    least that long. See [Several devices](../usage/several-devices.md).

    **Arguments:**

    - `axis_name`: the mesh axis the time axis is split over.
    - `inner`: the backend of each device's block; [`eqx_seq.AutoScan`][] by
        default.
    """

    parallel: ClassVar[bool] = False
    splits_time: ClassVar[bool] = True
    axis_name: str = eqx.field(static=True)
    inner: AbstractScan = AutoScan()

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

    def recurrence(
        self,
        a: Inexact[Array, "..."],
        b: Inexact[Array, " T *S"],
        h0: Inexact[Array, "*S"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        _mesh_axis(self.axis_name)  # its clear error before any work
        inner = self.inner.select()
        block_map = _block_map(inner, a, b, reverse=reverse)
        carry = carry_into_block(self.axis_name, block_map, h0, reverse=reverse)
        return inner.recurrence(a, b, carry, reverse=reverse)

    def shift(
        self,
        x: Inexact[Array, " T *S"],
        fill: Inexact[Array, "*S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        num_devices, index = _mesh_axis(self.axis_name)
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

    def halo(
        self,
        x: Inexact[Array, " T *C"],
        width: int,
        fill: Inexact[Array, " W *C"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " W *C"]:
        check_halo_width(width)
        num_devices, index = _mesh_axis(self.axis_name)
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
