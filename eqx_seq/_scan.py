"""Backends for the diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t`.

A backend is an immutable `eqx.Module` passed to a layer or function as its `scan`
argument (the lineax/diffrax pattern). Backends only compute the primal recurrence;
derivatives are defined once, for every backend, in `eqx_seq.linear_recurrence`.
"""

import abc
import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Inexact

from ._misc import check_positive_int, vary_like, zeros_like_inputs


class AbstractScan(eqx.Module):
    """Abstract base class for recurrence backends.

    Subclass it and implement [`eqx_seq.AbstractScan.recurrence`][] to add a backend;
    it can then be passed as `scan=` anywhere in `eqx_seq`.
    """

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


class SequentialScan(AbstractScan):
    """One step after another: `O(T)` depth and work.

    With `unroll=1` (the default), a loop that writes each state in place over a
    copy of `b`, so that under `jax.vmap` the batch axis stays in front (no
    transposes); with `unroll > 1`, `jax.lax.scan(..., unroll=unroll)`.

    `AutoScan`'s choice on CPU: forward passes 1.8-3.4x and gradients 1.6-4.9x
    faster than `AssociativeScan` there (T=64-4096), and much faster to compile
    (`benchmarks/README.md`). On a GPU every step costs
    kernel launches (about 15 us per step on an H100, where `unroll=16` was 10x
    faster than `unroll=1`); `AssociativeScan` is the choice there.
    """

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
            # unrolled, the in-place loop made XLA copy the whole buffer at every
            # step (140x slower at T=1024 on CPU)
            return _stacked(a, b, init, reverse, self.unroll)
        return _in_place(a, b, init, reverse)


def _stacked(a: Array, b: Array, init: Array, reverse: bool, unroll: int) -> Array:
    """The states as `lax.scan` outputs: what differentiating `_in_place` traces."""
    if a.ndim < b.ndim:

        def step(h, b_t):
            h = a * h + b_t
            return h, h

        xs = b
    else:

        def step(h, a_b_t):
            a_t, b_t = a_b_t
            h = a_t * h + b_t
            return h, h

        xs = (a, b)
    return lax.scan(step, init, xs, reverse=reverse, unroll=unroll)[1]


# The states overwrite a copy of `b` in a loop carry, one step at a time, instead of
# being stacked as `lax.scan` outputs. Under `jax.vmap` (a batch of sequences) the
# carry keeps the batch axis in front and each step reads and writes one strided
# slice; stacked outputs made XLA transpose `b` and the states between batch-major
# and time-major, and start from a zeroed buffer. Measured on CPU, `vmap` over 8
# sequences of (4096, 32) complex64: forward 5.2 -> 2.8 ms, forward + adjoint
# (`linear_recurrence`) 27.7 -> 6.7 ms, the same numbers. Autodiff traced through
# this loop, though, copies the whole buffer at every step of the transposed loop
# (75x slower at 4096 x 64), so its derivative is `_stacked`'s.
@ft.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _in_place(a: Array, b: Array, init: Array, reverse: bool) -> Array:
    T = b.shape[0]
    time_varying = a.ndim == b.ndim

    def step(i, carry):
        h, out = carry
        t = T - 1 - i if reverse else i
        a_t = lax.dynamic_index_in_dim(a, t, keepdims=False) if time_varying else a
        h = a_t * h + lax.dynamic_index_in_dim(out, t, keepdims=False)
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
    return b.at[first].add(a_first * h0)


def _compose(earlier, later):
    # Composition of the affine maps h -> a*h + b: first `earlier`, then `later`.
    a_e, b_e = earlier
    a_l, b_l = later
    return a_l * a_e, a_l * b_e + b_l


class AssociativeScan(AbstractScan):
    """In parallel with `jax.lax.associative_scan`: `O(log T)` depth, `O(T)` work.

    Composes the affine maps `h -> a_t * h + b_t` pairwise (Blelloch, "Prefix sums
    and their applications", 1990; Martin & Cundy, ICLR 2018). It materialises the
    decay over time, so a time-invariant `a` costs a `(T, *S)` buffer.
    """

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
            # unflipped: measured 15-20% faster on CPU (benchmarks/README.md).
            time_varying = a.ndim == b.ndim
            a = jnp.flip(a, 0) if time_varying else a
            return jnp.flip(self.recurrence(a, jnp.flip(b, 0)), 0)
        _, h = lax.associative_scan(_compose, (jnp.broadcast_to(a, b.shape), b))
        return h


class AutoScan(AbstractScan):
    """Picks a backend at trace time from the platform.

    The rule:

    - on CPU, [`eqx_seq.SequentialScan`][] (`unroll=1`) at every length. Measured in
        `benchmarks/bench_recurrence.py` for T from 64 to 4096: forward passes
        1.8-3.4x and gradients 1.6-4.9x faster than the associative scan's,
        compilation 2-4x faster, and larger `unroll` slower;
    - on GPU and TPU, [`eqx_seq.AssociativeScan`][], whose `O(log T)` depth is what
        parallel hardware rewards. Measured on one H100 (jax 0.11.2): a sequential
        loop costs about 15 us per step there (kernel launches), so at T=1024 the
        associative S5 forward took 0.17 ms and the sequential one 15 ms.

    The platform is `jax.default_backend()`, read at trace time.
    """

    def select(self) -> AbstractScan:
        """The backend this rule picks on the current platform."""
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
