"""The backend contract: what a layer may ask of the `scan` it is given.

A backend is an immutable `eqx.Module` passed to a layer or function as its `scan`
argument (the lineax/diffrax pattern). `AbstractScan` declares everything a layer
reads from one, and nothing else is read: the primal recurrence, which family of
algorithms a layer runs with it (`parallel`), the loop unroll of those algorithms,
the pytree scan of the parallel ones, and the layout of the time axis (`splits_time`
and the collectives that make a layer the same on one device or several: among
them the state entering a block of a recurrence that a layer runs itself, carried
by affine maps that are diagonal, `carry_into_block`, or have a dense matrix part,
`carry_matrix_into_block`). The one-device layout is implemented once
(`AbstractLocalScan`), the split one in `ShardedScan`. Derivatives are defined once,
for every backend, in `eqx_seq.linear_recurrence`.
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Inexact, Num, PyTree

from .._misc import zeros_like_inputs


# NumPy arrays too, here and in `forgotten_as_zero`: under an eager `jax.jvp` of
# NumPy inputs, JAX hands `_decayed_jvp` its primals as the NumPy arrays they are.
@jax.custom_jvp
def decayed(a: ArrayLike, h: ArrayLike) -> Array:
    """`a * h`, with a zero decay forgetting the state: zero wherever `a` is zero,
    whatever `h` holds there (NaN and inf included).

    A segment start (a reset) is a zero decay, and must replace the state: with a
    plain product, `0 * nan = nan` carried one bad segment's values into every
    later one. Every algorithm of the recurrence, its adjoints and the step modes
    multiply a state by a decay through this. Its derivative with respect to `a`
    is `h` (see `forgotten_as_zero`), also at a zero decay.
    """
    return jnp.where(a == 0, jnp.zeros((), jnp.result_type(a, h)), a * h)


@decayed.defjvp
def _decayed_jvp(primals, tangents):
    a, h = primals
    da, dh = tangents
    return decayed(a, h), da * forgotten_as_zero(a, h) + decayed(a, dh)


def forgotten_as_zero(a: ArrayLike, h: Array | np.ndarray) -> Array:
    """`h` as the derivative of `a * h` with respect to `a` reads it: zero where a
    zero decay forgets a state that is not finite, so that the derivatives forget
    it too; everywhere else `h`, the exact derivative (at a zero decay too)."""
    forgotten = (a == 0) & ~jnp.isfinite(h)
    return jnp.where(forgotten, jnp.zeros((), h.dtype), h)


def compose(earlier: tuple[Array, Array], later: tuple[Array, Array]):
    """The affine maps `h -> a h + b` composed: first `earlier`, then `later`."""
    a_e, b_e = earlier
    a_l, b_l = later
    return decayed(a_l, a_e), decayed(a_l, b_e) + b_l


class AbstractScan(eqx.Module):
    """Abstract base class for recurrence backends: the contract between a backend
    and the layers that take one as `scan=`.

    A layer reads a backend only through what is declared here. `parallel` picks the
    family of algorithms of a layer that runs its own ([`eqx_seq.KalmanFilter`][],
    [`eqx_seq.tridiagonal_solve`][], [`eqx_seq.selective_scan`][]); `splits_time`
    and the methods `shift`, `halo`, `sum_over_blocks`, `carry_into_block` and
    `carry_matrix_into_block` are the layout of the time axis, one block on one
    device or one block per device.

    What each backend declares:

    - `parallel` (a class variable): the family of algorithms a layer that runs its
        own picks. `False`: the sequential one (the standard Kalman filter, Thomas,
        the selective scan's fused loop); `True`: the parallel one (the filter of
        Särkkä & García-Fernández run by `associative_scan`, parallel cyclic
        reduction, the selective scan's chunked recurrences).
    - `splits_time` (a class variable): whether the time axis is split over
        devices, each calling the layer on its block ([`eqx_seq.ShardedScan`][]).
        A layer that cannot run on a split axis refuses such a backend.
    - `unroll`: how many steps the sequential loops of the layers' own algorithms
        (Thomas, the selective scan's fused loop) unroll; 1 for none.

    To write a backend for one device, subclass [`eqx_seq.AbstractLocalScan`][],
    which implements the layout, and implement `recurrence` and declare
    `parallel` and `unroll`. A class that leaves any of them out cannot be
    instantiated, with an error naming what is missing.
    """

    parallel: eqx.AbstractClassVar[bool]
    splits_time: eqx.AbstractClassVar[bool]
    unroll: eqx.AbstractVar[int]

    @abc.abstractmethod
    def select(self) -> "AbstractScan":
        """The backend that runs: `self` for a concrete backend;
        [`eqx_seq.AutoScan`][] returns the one its rule picks."""

    @abc.abstractmethod
    def recurrence(
        self,
        a: Inexact[Array, "..."],
        b: Inexact[Array, " T *S"],
        h0: Inexact[Array, "*S"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        """Solve `h_t = a_t * h_{t-1} + b_t` along axis 0, from `h_{-1} = h0`.

        A zero decay forgets the state: where `a_t` is zero, `h_t = b_t` whatever
        `h_{t-1}` holds, NaN and inf included (a segment start of packed
        sequences, which one bad segment must not reach across). A backend
        multiplies a state by a decay as `where(a == 0, 0, a * h)`.

        This is the low-level primal: it is differentiated by tracing. Call
        [`eqx_seq.linear_recurrence`][] instead for validated inputs, initial states
        and adjoint derivatives.

        **Arguments:**

        - `a`: the decay, either `(T, *S)` (time-varying) or exactly `S`
            (time-invariant), with the dtype of `b`.
        - `b`: the inputs, shape `(T, *S)`, `T >= 1`.
        - `h0`: the initial state, shape `S` with the dtype of `b`; zeros if `None`.
        - `reverse`: if `True`, solve `h_t = a_t * h_{t+1} + b_t` from `h_T = h0`
            instead, i.e. run from the last step to the first.

        **Returns:**

        All states `h`, shape `(T, *S)`.
        """

    @abc.abstractmethod
    def associative_scan(
        self, fn: Callable, elems: PyTree[Array], *, reverse: bool = False
    ) -> PyTree[Array]:
        """The inclusive scan of `elems` under an associative `fn`, with the
        semantics of `jax.lax.associative_scan(fn, elems, reverse=reverse)`: the
        pytree scan of the parallel Kalman filter. A sequential backend may run it
        one element after another.

        **Arguments:**

        - `fn`: an associative operator on batches of elements: `fn(a, b)` takes two
            pytrees whose leaves share a leading (batch) length and returns one like
            them, `a` being the earlier element (the later one when `reverse`).
        - `elems`: a pytree of arrays sharing the leading (time) length `T >= 1`.
        - `reverse`: scan from the end.

        **Returns:**

        The inclusive scan, a pytree like `elems`.
        """

    @abc.abstractmethod
    def shift(
        self,
        x: Inexact[Array, " T *S"],
        fill: Inexact[Array, "*#S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        """`x` moved one step along time (axis 0), `fill` entering at the start of
        the run: step `t` of the result is `x[t - 1]` (`x[t + 1]` when `reverse`),
        and `fill` at the first step (the last when `reverse`).

        The derivatives of [`eqx_seq.linear_recurrence`][] read the previous state
        through it. On a time axis split over devices, the step that crosses a
        block boundary comes from the neighbouring device.

        **Arguments:**

        - `x`: shape `(T, *S)`.
        - `fill`: broadcasting to `S`.
        - `reverse`: shift towards the start instead.

        **Returns:**

        The shifted array, shape `(T, *S)`.
        """

    @abc.abstractmethod
    def sum_over_blocks(self, x: Num[Array, "*shape"]) -> Num[Array, "*shape"]:
        """A sum over this block's steps made the sum over the whole sequence, the
        same on every device: what pooling over time and sums of per-step terms
        read. On one device, `x` itself.

        **Arguments:**

        - `x`: a sum over this block's steps, any shape, floating or integer (a
            count of steps).

        **Returns:**

        The sum over every block, shaped like `x`.
        """

    @abc.abstractmethod
    def halo(
        self,
        x: Inexact[Array, " T *C"],
        width: int,
        fill: Inexact[Array, " W *C"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " W *C"]:
        """The `width` steps of the sequence just before this block of it: what a
        causal convolution of `width + 1` taps reads before the block's first step.

        On one device nothing precedes the sequence, so this is `fill`. On a time
        axis split over devices ([`eqx_seq.ShardedScan`][]), the last `width`
        steps of `x` on the device before (and `fill` on the first device), so a
        layer stays the same whichever backend it runs.

        **Arguments:**

        - `x`: this block, shape `(T, *C)`; on a split time axis, the neighbour
            reads its last `width` steps, so they must be what continues into the
            next block (zeroed where that should not cross).
        - `width`: the number of steps, `>= 0`.
        - `fill`: what precedes the sequence's start, shape `(width, *C)` (cast to
            the dtype of `x`); zeros if `None`.
        - `reverse`: the `width` steps just after the block instead (the first ones
            of the next device, `fill` on the last), for an anticausal
            convolution.

        **Returns:**

        Shape `(width, *C)`, in time order.
        """

    @abc.abstractmethod
    def carry_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*S"]:
        """The state entering this block of a diagonal recurrence that the caller
        runs itself (as the selective scan runs its fused one).

        On one device the block is the whole sequence, so this is `h0`, and
        `block_map` is not called. On a time axis split over devices, each block
        reduces to its affine map `h -> A h + H`; the devices exchange those maps
        and compose the ones before them into their initial state.

        **Arguments:**

        - `block_map`: `start -> (A, H)`, this block's map: the product of its
            decays (zero where a segment starts in it), and its last state (in run
            order) from the state `start`, both shaped like `h0`.
        - `h0`: the state before the whole sequence (before its last step with
            `reverse`).
        - `reverse`: the recurrence runs from the last step to the first.

        **Returns:**

        The state before this block's first step in run order, shaped like `h0`.
        """

    @abc.abstractmethod
    def carry_matrix_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*B d e"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*B d e"]:
        """The state entering this block of a recurrence on matrix states that the
        caller runs itself, each block of which is an affine map `S -> M @ S + N`
        with a dense `d x d` part `M` (as the delta rule's chunks are): the same
        layout as `carry_into_block`, for maps that are not diagonal.

        On one device the block is the whole sequence, so this is `h0`, and
        `block_map` is not called. On a time axis split over devices, each device
        computes its block's map (only the first device in run order from `h0`,
        the others from zero, so that the first map carries `h0` to every later
        block); the devices exchange those maps and compose the ones before them
        into their initial state. The maps compose by matrix products, so the
        states and maps must be finite (a product does not forget a NaN as a zero
        decay does in `carry_into_block`).

        **Arguments:**

        - `block_map`: `start -> (M, S)`, this block's map: its matrix part `M`,
            shape `(*B, d, d)`, and its last state (in run order) from the state
            `start`, shaped like `h0`. A caller computes both in one pass by running
            its block on the augmented state `[start | I]`, whose identity columns
            the block's inputs do not reach.
        - `h0`: the state before the whole sequence (before its last step with
            `reverse`), shape `(*B, d, e)`: `*B` batch axes of `d x e` states.
        - `reverse`: the recurrence runs from the last step to the first.

        **Returns:**

        The state before this block's first step in run order, shaped like `h0`.
        """

    @abc.abstractmethod
    def block_scan(self) -> "AbstractScan":
        """The backend that runs one block of the time axis: `self` where the whole
        sequence is one block; on a split axis, the backend of each device's block
        (which splits nothing). A layer that runs its own algorithm on its block
        picks it by this backend's `parallel` and reads its `unroll`."""


class AbstractLocalScan(AbstractScan):
    """Abstract base class for the backends of one device, on which the whole
    sequence is one block (`splits_time = False`). It implements the layout:
    `select` and `block_scan` return `self`, `shift` shifts the array, `halo` is
    its `fill`, `sum_over_blocks`, `carry_into_block` and `carry_matrix_into_block`
    are the identity, and
    `associative_scan` combines one element after another (a parallel backend
    implements its own).

    Subclass it, implement `recurrence` (the primal recurrence) and declare
    `parallel` and `unroll`: that is a backend for every layer of one device.
    [`eqx_seq.linear_recurrence`][] differentiates through its own adjoint, which
    calls `recurrence` again, so you write no derivative.
    """

    splits_time: ClassVar[bool] = False

    def select(self) -> AbstractScan:
        return self

    def block_scan(self) -> AbstractScan:
        return self

    def associative_scan(
        self, fn: Callable, elems: PyTree[Array], *, reverse: bool = False
    ) -> PyTree[Array]:
        return sequential_pytree_scan(fn, elems, reverse=reverse)

    def shift(
        self,
        x: Inexact[Array, " T *S"],
        fill: Inexact[Array, "*#S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        return shift_local(x, fill, reverse=reverse)

    def sum_over_blocks(self, x: Num[Array, "*shape"]) -> Num[Array, "*shape"]:
        return x

    def halo(
        self,
        x: Inexact[Array, " T *C"],
        width: int,
        fill: Inexact[Array, " W *C"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " W *C"]:
        return fill_halo(x, width, fill)

    def carry_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*S"]:
        return h0

    def carry_matrix_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*B d e"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*B d e"]:
        return h0


def sequential_pytree_scan(fn: Callable, elems: PyTree[Array], *, reverse: bool):
    """`lax.associative_scan`'s result, combining one element after another."""
    first_step = -1 if reverse else 0
    first = jax.tree.map(lambda x: x[first_step][None], elems)
    rest = jax.tree.map(lambda x: x[:-1] if reverse else x[1:], elems)

    def step(carry, x):
        carry = fn(carry, jax.tree.map(lambda leaf: leaf[None], x))
        return carry, jax.tree.map(lambda leaf: leaf[0], carry)

    _, out = lax.scan(step, first, rest, reverse=reverse)
    if reverse:
        return jax.tree.map(lambda f, o: jnp.concatenate([o, f]), first, out)
    return jax.tree.map(lambda f, o: jnp.concatenate([f, o]), first, out)


def fill_halo(x: Array, width: int, fill: Array | None) -> Array:
    """`fill` (zeros if `None`) as the `width` steps around a block `x`."""
    check_halo_width(width)
    shape = (width, *x.shape[1:])
    if fill is None:
        return zeros_like_inputs(shape, x.dtype, x)
    return jnp.broadcast_to(jnp.asarray(fill).astype(x.dtype), shape)


def check_halo_width(width: object) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"`halo`: `width` must be an int >= 0, got {width!r}.")


def shift_local(x: Array, fill: Array, *, reverse: bool) -> Array:
    """`x` moved one step along time, `fill` entering at the start of the run."""
    fill = jnp.broadcast_to(fill, x.shape[1:])[None]
    if reverse:
        return jnp.concatenate([x[1:], fill])
    return jnp.concatenate([fill, x[:-1]])


def check_scan(
    scan: Any,
    *,
    name: str,
    pytree_scan: bool = False,
    splits_time: bool = False,
) -> AbstractScan:
    """`scan.select()`: the backend that runs, after checking what the caller needs.

    **Arguments:**

    - `scan`: the `scan=` argument a user passed.
    - `name`: the caller, for the error messages, e.g. `"eqx_seq.KalmanFilter"`.
    - `pytree_scan`: a parallel backend's `associative_scan` must be a parallel
        pytree scan (not the one-element-after-another scan of
        [`eqx_seq.AbstractLocalScan`][]).
    - `splits_time`: the caller runs with a backend that splits time over devices
        (`splits_time = True`, [`eqx_seq.ShardedScan`][]); other callers refuse one.

    **Raises:**

    `ValueError` if `scan` is not an [`eqx_seq.AbstractScan`][], or lacks what the
    caller needs.
    """
    if not isinstance(scan, AbstractScan):
        raise ValueError(
            f"{name}: `scan` must be an `eqx_seq.AbstractScan` such as "
            f"`eqx_seq.SequentialScan()` or `eqx_seq.AssociativeScan()`, got {scan!r}."
        )
    chosen = scan.select()
    if not isinstance(chosen, AbstractScan):
        raise ValueError(
            f"{name}: `{type(scan).__name__}.select()` must return an "
            f"`eqx_seq.AbstractScan`, got {chosen!r}."
        )
    if chosen.splits_time and not splits_time:
        raise ValueError(
            f"{name} does not run on a time axis split over devices "
            f"(`{type(chosen).__name__}`): across a block boundary it needs more than "
            "the recurrence's state. The layers that do are listed on the Several "
            "devices page of the docs."
        )
    if (
        pytree_scan
        and chosen.parallel
        and type(chosen).associative_scan is AbstractLocalScan.associative_scan
    ):
        raise ValueError(
            f"{name} supports parallel backends that implement `associative_scan` "
            "(the pytree scan of its parallel algorithm); "
            f"`{type(chosen).__name__}` declares `parallel = True` but keeps the "
            "one-element-after-another `associative_scan` of "
            "`eqx_seq.AbstractLocalScan`."
        )
    return chosen
