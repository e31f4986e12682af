"""The backends of one device: one step after another, in parallel, and the
automatic choice between them."""

import functools as ft
from collections.abc import Callable
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Inexact, Num, PyTree

from .._misc import check_positive_int, vary_like, zeros_like_inputs
from ._base import AbstractLocalScan, AbstractScan, compose, decayed
from ._level import level_scan


class SequentialScan(AbstractLocalScan):
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


def fold_initial_state(a: Array, b: Array, h0: Array, *, reverse: bool) -> Array:
    """`b` with `a * h0` added to its first step: the same states, started from zero."""
    first = -1 if reverse else 0
    a_first = a if a.ndim < b.ndim else a[first]
    return b.at[first].add(decayed(a_first, h0))


class AssociativeScan(AbstractLocalScan):
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
    unroll: ClassVar[int] = 1
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
        _, h = lax.associative_scan(compose, (jnp.broadcast_to(a, b.shape), b))
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
    Everything else it is asked, it forwards to that backend.
    """

    splits_time: ClassVar[bool] = False

    def select(self) -> AbstractScan:
        """The backend these rules pick on the current platform."""
        if jax.default_backend() == "cpu":
            return SequentialScan()
        return AssociativeScan()

    @property
    def parallel(self) -> bool:
        return self.select().parallel

    @property
    def unroll(self) -> int:
        return self.select().unroll

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

    def shift(
        self,
        x: Inexact[Array, " T *S"],
        fill: Inexact[Array, "*#S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " T *S"]:
        return self.select().shift(x, fill, reverse=reverse)

    def sum_over_blocks(self, x: Num[Array, "*shape"]) -> Num[Array, "*shape"]:
        return self.select().sum_over_blocks(x)

    def halo(
        self,
        x: Inexact[Array, " T *C"],
        width: int,
        fill: Inexact[Array, " W *C"] | None = None,
        *,
        reverse: bool = False,
    ) -> Inexact[Array, " W *C"]:
        return self.select().halo(x, width, fill, reverse=reverse)

    def carry_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*S"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*S"]:
        return self.select().carry_into_block(block_map, h0, reverse=reverse)

    def carry_matrix_into_block(
        self,
        block_map: Callable[[Array], tuple[Array, Array]],
        h0: Inexact[Array, "*B d e"],
        *,
        reverse: bool = False,
    ) -> Inexact[Array, "*B d e"]:
        return self.select().carry_matrix_into_block(block_map, h0, reverse=reverse)

    def block_scan(self) -> AbstractScan:
        return self.select().block_scan()
