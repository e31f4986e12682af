"""Backends for the diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t`.

A backend is an immutable `eqx.Module` passed to a layer or function as its `scan`
argument (the lineax/diffrax pattern). It carries what each layer asks of it: the
primal recurrence, whether it is sequential or parallel (`parallel`), and for a
parallel one a pytree scan (`associative_scan`). Derivatives are defined once, for
every backend, in `eqx_seq.linear_recurrence`.
"""

import abc
import functools as ft
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Inexact, PyTree

from ._level_scan import level_scan
from ._misc import check_positive_int, vary_like, zeros_like_inputs


@jax.custom_jvp
def decayed(a: Array, h: Array) -> Array:
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


def forgotten_as_zero(a: Array, h: Array) -> Array:
    """`h` as the derivative of `a * h` with respect to `a` reads it: zero where a
    zero decay forgets a state that is not finite, so that the derivatives forget
    it too; everywhere else `h`, the exact derivative (at a zero decay too)."""
    forgotten = (a == 0) & ~jnp.isfinite(h)
    return jnp.where(forgotten, jnp.zeros((), h.dtype), h)


class AbstractScan(eqx.Module):
    """Abstract base class for recurrence backends.

    Subclass it and implement [`eqx_seq.AbstractScan.recurrence`][] to add a backend
    for [`eqx_seq.linear_recurrence`][] and the layers built on it
    ([`eqx_seq.S5`][], [`eqx_seq.LRU`][]).

    [`eqx_seq.KalmanFilter`][] and [`eqx_seq.tridiagonal_solve`][] run algorithms of
    their own and ask the backend which one: declare the class variable
    `parallel: ClassVar[bool]` (`False`: the sequential algorithm; `True`: the
    parallel one, for which the Kalman filter also needs
    [`eqx_seq.AbstractScan.associative_scan`][]). A backend that does not declare
    it is refused there with an error saying so, never replaced by another.
    """

    # declared by each concrete backend; not required of every subclass, so that
    # one implementing only `recurrence` still works where only that is asked
    parallel: ClassVar[bool]

    def select(self) -> "AbstractScan":
        """The backend that runs: `self` for a concrete backend;
        [`eqx_seq.AutoScan`][] returns the one its rule picks."""
        return self

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

    def shift(
        self,
        x: Inexact[Array, " T *S"],
        fill: Inexact[Array, "*S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        """`x` moved one step along time (axis 0), `fill` entering at the start of
        the run: step `t` of the result is `x[t - 1]` (`x[t + 1]` when `reverse`),
        and `fill` at the first step (the last when `reverse`).

        The derivatives of [`eqx_seq.linear_recurrence`][] read the previous state
        through it. A backend that splits time over devices
        ([`eqx_seq.ShardedScan`][]) overrides it to pass the step that crosses a
        block boundary; the base shifts the array.

        **Arguments:**

        - `x`: shape `(T, *S)`.
        - `fill`: broadcasting to `S`.
        - `reverse`: shift towards the start instead.

        **Returns:**

        The shifted array, shape `(T, *S)`.
        """
        return shift_local(x, fill, reverse=reverse)

    def sum_over_blocks(self, x: Inexact[Array, "..."]) -> Inexact[Array, "..."]:
        """A sum over this block's steps made the sum over the whole sequence, the
        same on every device: what pooling over time and sums of per-step terms
        read.

        The base returns `x` (the whole sequence is one block). A backend that
        splits time over devices ([`eqx_seq.ShardedScan`][]) overrides it to sum
        `x` over them.

        **Arguments:**

        - `x`: a sum over this block's steps, any shape.

        **Returns:**

        The sum over every block, shaped like `x`.
        """
        return x

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

        One device holds the whole sequence, so nothing precedes it and the base
        returns `fill`. A backend that splits time over devices
        ([`eqx_seq.ShardedScan`][]) returns the last `width` steps of `x` on the
        device before (and `fill` on the first device), so a layer stays the same
        whichever backend it runs.

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
        return fill_halo(x, width, fill)

    def associative_scan(
        self, fn: Callable, elems: PyTree[Array], *, reverse: bool = False
    ) -> PyTree[Array]:
        """The inclusive scan of `elems` under an associative `fn`, with the
        semantics of `jax.lax.associative_scan(fn, elems, reverse=reverse)`: the
        pytree scan of a parallel backend (the parallel Kalman filter's).

        Parallel backends implement it; the base raises `NotImplementedError`.

        **Arguments:**

        - `fn`: an associative operator on batches of elements: `fn(a, b)` takes two
            pytrees whose leaves share a leading (batch) length and returns one like
            them, `a` being the earlier element (the later one when `reverse`).
        - `elems`: a pytree of arrays sharing the leading (time) length `T >= 1`.
        - `reverse`: scan from the end.

        **Returns:**

        The inclusive scan, a pytree like `elems`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement `associative_scan`."
        )


class SequentialScan(AbstractScan):
    """One step after another: `O(T)` depth and work (`parallel = False`).

    With `unroll=1` (the default), a loop that writes each state in place over a
    copy of `b`, so that under `jax.vmap` the batch axis stays in front (no
    transposes); with `unroll > 1`, `jax.lax.scan(..., unroll=unroll)`.

    Fast on CPU and cheap to compile; on a GPU every step costs kernel launches,
    which [`eqx_seq.AssociativeScan`][] avoids. As a sequential backend it selects
    the standard Kalman filter and smoother in [`eqx_seq.KalmanFilter`][], and the
    Thomas algorithm (with this `unroll`) in [`eqx_seq.tridiagonal_solve`][].
    """

    parallel: ClassVar[bool] = False
    unroll: int = eqx.field(default=1, static=True)

    def __check_init__(self):
        check_positive_int("unroll", self.unroll)

    def recurrence(
        self,
        a: Inexact[Array, "..."],
        b: Inexact[Array, " T *S"],
        h0: Inexact[Array, "*S"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        # the carry varies (under `shard_map`) wherever `a`, `b` or `h0` does
        init = zeros_like_inputs(b.shape[1:], b.dtype, a, b)
        if h0 is not None:
            init = init + h0
        if self.unroll > 1:
            # unrolled, the in-place loop made XLA copy the whole buffer at every step
            return _stacked(a, b, init, reverse, self.unroll)
        return _in_place(a, b, init, reverse)


def _stacked(a: Array, b: Array, init: Array, reverse: bool, unroll: int) -> Array:
    """The states as `lax.scan` outputs: what differentiating `_in_place` traces."""
    if a.ndim < b.ndim:

        def step(h, b_t):
            h = decayed(a, h) + b_t
            return h, h

        xs = b
    else:

        def step(h, a_b_t):
            a_t, b_t = a_b_t
            h = decayed(a_t, h) + b_t
            return h, h

        xs = (a, b)
    return lax.scan(step, init, xs, reverse=reverse, unroll=unroll)[1]


# The states overwrite a copy of `b` in a loop carry, one step at a time, instead of
# being stacked as `lax.scan` outputs: under `jax.vmap` the carry keeps the batch
# axis in front, where stacked outputs made XLA transpose `b` and the states between
# batch-major and time-major. Autodiff traced through this loop copies the whole
# buffer at every step of the transposed loop, so its derivative is `_stacked`'s.
@ft.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _in_place(a: Array, b: Array, init: Array, reverse: bool) -> Array:
    T = b.shape[0]
    time_varying = a.ndim == b.ndim

    def step(i, carry):
        h, out = carry
        t = T - 1 - i if reverse else i
        a_t = lax.dynamic_index_in_dim(a, t, keepdims=False) if time_varying else a
        h = decayed(a_t, h) + lax.dynamic_index_in_dim(out, t, keepdims=False)
        return h, lax.dynamic_update_index_in_dim(out, h, t, 0)

    out = vary_like(b, a, init)  # for `shard_map`: see `vary_like`
    return lax.fori_loop(0, T, step, (init, out))[1]


@_in_place.defjvp
def _in_place_jvp(reverse, primals, tangents):
    return jax.jvp(lambda *p: _stacked(*p, reverse, 1), primals, tangents)


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


def fold_initial_state(a: Array, b: Array, h0: Array, *, reverse: bool) -> Array:
    """`b` with `a * h0` added to its first step: the same states, started from zero."""
    first = -1 if reverse else 0
    a_first = a if a.ndim < b.ndim else a[first]
    return b.at[first].add(decayed(a_first, h0))


def _compose(earlier, later):
    # Composition of the affine maps h -> a*h + b: first `earlier`, then `later`.
    a_e, b_e = earlier
    a_l, b_l = later
    return decayed(a_l, a_e), decayed(a_l, b_e) + b_l


class AssociativeScan(AbstractScan):
    """In parallel with `jax.lax.associative_scan`: `O(log T)` depth, `O(T)` work
    (`parallel = True`).

    Composes the affine maps `h -> a_t * h + b_t` pairwise (Blelloch, "Prefix sums
    and their applications", 1990; Martin & Cundy, ICLR 2018). It materialises the
    decay over time, so a time-invariant `a` costs a `(T, *S)` buffer.

    As a parallel backend it selects the parallel filter and smoother of Särkkä &
    García-Fernández in [`eqx_seq.KalmanFilter`][], run by
    [`eqx_seq.AbstractScan.associative_scan`][] (a scan whose levels are one loop, so
    that a heavy operator is traced once), and parallel cyclic reduction in
    [`eqx_seq.tridiagonal_solve`][].
    """

    parallel: ClassVar[bool] = True
    # The pytree scan behind `associative_scan`, for comparisons (diffrax's
    # `scan_kind` style): "levels" is `level_scan`, "lax" `jax.lax.associative_scan`.
    _pytree_scan: Literal["levels", "lax"] = eqx.field(
        default="levels", static=True, repr=False
    )

    def __check_init__(self):
        if self._pytree_scan not in ("levels", "lax"):
            raise ValueError(
                f'`_pytree_scan` must be "levels" or "lax", got {self._pytree_scan!r}.'
            )

    def recurrence(
        self,
        a: Inexact[Array, "..."],
        b: Inexact[Array, " T *S"],
        h0: Inexact[Array, "*S"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        if h0 is not None:
            b = fold_initial_state(a, b, h0, reverse=reverse)
        if reverse:
            # A backward run is a forward run in reversed time. Flipping here rather
            # than with `associative_scan(reverse=True)` leaves a time-invariant decay
            # unflipped, which is faster.
            time_varying = a.ndim == b.ndim
            a = jnp.flip(a, 0) if time_varying else a
            return jnp.flip(self.recurrence(a, jnp.flip(b, 0)), 0)
        _, h = lax.associative_scan(_compose, (jnp.broadcast_to(a, b.shape), b))
        return h

    def associative_scan(
        self, fn: Callable, elems: PyTree[Array], *, reverse: bool = False
    ) -> PyTree[Array]:
        if self._pytree_scan == "lax":
            return lax.associative_scan(fn, elems, reverse=reverse)
        return level_scan(fn, elems, reverse=reverse)


class AutoScan(AbstractScan):
    """Picks a backend at trace time from the platform, by these rules:

    - on CPU, [`eqx_seq.SequentialScan`][] (`unroll=1`), at every length: its loop is
        faster there than the associative scan's, forward and backward, and cheaper
        to compile;
    - on GPU and TPU, [`eqx_seq.AssociativeScan`][], whose `O(log T)` depth is what
        parallel hardware rewards (a sequential loop pays kernel launches at every
        step).

    The platform is `jax.default_backend()`, read at trace time.
    [`eqx_seq.AutoScan.select`][] applies the rules; every layer that takes `scan=`
    runs the backend it returns (in [`eqx_seq.KalmanFilter`][] and
    [`eqx_seq.tridiagonal_solve`][], its sequential or parallel algorithm).
    """

    def select(self) -> AbstractScan:
        """The backend these rules pick on the current platform."""
        if jax.default_backend() == "cpu":
            return SequentialScan()
        return AssociativeScan()

    def recurrence(
        self,
        a: Inexact[Array, "..."],
        b: Inexact[Array, " T *S"],
        h0: Inexact[Array, "*S"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        return self.select().recurrence(a, b, h0, reverse=reverse)

    def associative_scan(
        self, fn: Callable, elems: PyTree[Array], *, reverse: bool = False
    ) -> PyTree[Array]:
        return self.select().associative_scan(fn, elems, reverse=reverse)


# What runs with a backend that splits time over devices (`ShardedScan`), for the
# error that refuses it elsewhere.
_SPLITS_TIME_USERS = (
    "`eqx_seq.linear_recurrence`, `eqx_seq.recurrence_jacobians`, `eqx_seq.S5`, "
    "`eqx_seq.LRU` and `eqx_seq.RGLRU` (their calls and `final_state`, and S5's "
    "and LRU's `parameter_jacobians`), `eqx_seq.selective_scan`, `eqx_seq.Mamba`, "
    "`eqx_seq.MambaBlock`, `eqx_seq.HawkBlock`, and `eqx_seq.S5Block`, "
    "`eqx_seq.LanguageModel` and `eqx_seq.SequenceClassifier` around them; "
    "`eqx_seq.KalmanFilter` (`filter`, `log_likelihood`, `smooth`)"
)


def check_scan(
    scan: Any,
    *,
    name: str,
    chooses: bool = False,
    pytree_scan: bool = False,
    splits_time: bool = False,
) -> AbstractScan:
    """`scan.select()`: the backend that runs, after checking what the caller needs.

    **Arguments:**

    - `scan`: the `scan=` argument a user passed.
    - `name`: the caller, for the error messages, e.g. `"eqx_seq.KalmanFilter"`.
    - `chooses`: the caller runs an algorithm of its own, sequential or parallel as
        the backend declares (`parallel`).
    - `pytree_scan`: a parallel backend must also implement `associative_scan`.
    - `splits_time`: the caller runs with a backend that splits time over devices
        (one that declares `splits_time = True`, [`eqx_seq.ShardedScan`][]); other
        callers refuse one.

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
    if getattr(type(chosen), "splits_time", False) and not splits_time:
        raise ValueError(
            f"{name} does not run on a time axis split over devices "
            f"(`{type(chosen).__name__}`): across a block boundary it needs more than "
            f"the recurrence's state. Those that do: {_SPLITS_TIME_USERS}."
        )
    if not chooses:
        return chosen
    parallel = getattr(type(chosen), "parallel", None)
    if not isinstance(parallel, bool):
        raise ValueError(
            f"{name} supports backends that declare `parallel: ClassVar[bool]` "
            "(whether to run its sequential or its parallel algorithm), as "
            "`eqx_seq.SequentialScan` and `eqx_seq.AssociativeScan` do; "
            f"`{type(chosen).__name__}` does not declare it."
        )
    if (
        parallel
        and pytree_scan
        and type(chosen).associative_scan is AbstractScan.associative_scan
    ):
        raise ValueError(
            f"{name} supports parallel backends that implement `associative_scan` "
            "(the pytree scan of its parallel algorithm); "
            f"`{type(chosen).__name__}` declares `parallel = True` but does not."
        )
    return chosen
