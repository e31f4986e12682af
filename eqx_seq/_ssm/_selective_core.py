"""The selective (S6) recurrence with its read-out fused in, checkpointed by chunks.

    h_t = a_t * h_{t-1} + (delta_t u_t) B_t,    y_t = h_t C_t

with the decay `a_t = exp(delta_t A)`, or `2 exp(delta_t A) - 1` in `(-1, 1)` with
`negative` (Grazzi et al., "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues", 2025), and `h_t` of shape `(D, N)`, `delta_t`, `u_t` of
shape `(D,)`, `B_t`, `C_t` of shape `(N,)`. Only `y` `(T, D)` and the last state
leave a chunk: the `(T, D, N)` states are never stored, forward or backward.

One skeleton (`selective_chunks`) does the checkpointing: a forward scan over the
chunks that keeps the state entering each, and a reversed scan that carries the
adjoint `nu` (the cotangent reaching a chunk's last state from later steps) and the
cotangent of `A`. Two kernels run a chunk inside it:

- `RecurrenceKernel`: the chunk's `(L, D, N)` decays and inputs through a backend's
  `recurrence`, forward and (the adjoint `l_t = a_{t+1} l_{t+1} + gy_t C_t`)
  backward, the cotangents read out of `(h, l)` by reductions;
- `LoopKernel`: one step at a time, the decay, input, update and read-out computed
  in one loop body (no `(L, D, N)` array of decays or inputs is formed); backward,
  the chunk's states are recomputed into one buffer and the adjoint stepped in
  reverse.

The derivation is in `docs/devdocs/selective.md`.
"""

import abc
import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import zeros_like_inputs
from .._scan import AbstractScan, decayed


def chunked(x: Array, chunk: int) -> Array:
    """`(T, ...)` with `T = n * chunk` as `(n, chunk, ...)`."""
    return x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])


def unchunked(x: Array) -> Array:
    """The inverse of `chunked`."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def log_decays(x: Array, negative: bool) -> tuple[Array, Array | None, Array | None]:
    """`(log|a|, a < 0, a == 0)` of the decays `a = exp(x)` (then `(x, None,
    None)`), or with `negative` `a = 2 exp(x) - 1`. A zero decay forgets the state,
    as a reset does: its `log|a|` is set to 0, and the callers count the step as a
    segment start."""
    if not negative:
        return x, None, None
    m = 2 * jnp.expm1(x)  # a - 1
    a = 1 + m
    zero, positive = a == 0, a > 0
    # log1p where a > 0: exact near a = 1, where log(a) cancels
    log_abs = jnp.where(
        positive,
        jnp.log1p(jnp.where(positive, m, 0)),
        jnp.log(jnp.where(positive | zero, 1, -a)),
    )
    return log_abs, a < 0, zero


def selective_decay(
    delta: Array, A: Array, keep: Array, negative: bool
) -> tuple[Array, Array]:
    """`(a, da/d(delta A))`: the decays `exp(delta A)` (or `2 exp(delta A) - 1`
    with `negative`) and their derivatives, both zero where `keep` is zero (a
    segment start), selected rather than multiplied: an overflowing `exp` times
    zero would be NaN."""
    e = jnp.where(keep == 0, jnp.zeros((), A.dtype), jnp.exp(delta * A))
    if not negative:
        return e, e
    return jnp.where(keep == 0, jnp.zeros((), A.dtype), 2 * e - 1), 2 * e


def decay_product(delta: Array, A: Array, keep: Array, negative: bool) -> Array:
    """The product over time of the decays of `delta` `(T, D)`, `(D, N)`: zero if
    a segment starts (`keep` `(T,)` zero) or a decay is zero. Summed as logs, so
    that no `(T, D, N)` array is kept."""
    if not negative:
        return selective_decay(
            jnp.sum(delta, axis=0)[:, None], A, jnp.min(keep), False
        )[0]
    log_abs, below, zero = log_decays(delta[:, :, None] * A[None], True)
    sign = jnp.where(jnp.sum(below, axis=0) % 2 == 1, -1, 1).astype(A.dtype)
    stop = jnp.any(zero, axis=0) | (jnp.min(keep) == 0)
    return jnp.where(stop, jnp.zeros((), A.dtype), sign * jnp.exp(jnp.sum(log_abs, 0)))


def _coefficients(A, delta_t, u_t, B_t, keep_t, negative):
    """`(a_t, b_t, da_t)` of one step, all `(D, N)`; `keep_t = 0` at a segment
    start; `da_t` the derivative of `a_t` with respect to `delta_t A`."""
    a, slope = selective_decay(delta_t[:, None], A, keep_t, negative)
    return a, (delta_t * u_t)[:, None] * B_t[None, :], slope


def selective_step(
    h: Array,
    A: Array,
    delta_t: Array,
    u_t: Array,
    B_t: Array,
    C_t: Array,
    keep_t,
    negative: bool,
) -> tuple[Array, Array]:
    """One step of the recurrence and its read-out: `(h_t, h_t C_t)` from
    `h_{t-1}` `(D, N)`; `keep_t = 0` starts a segment (the state is replaced,
    whatever it held). `LoopKernel` and `Mamba.step` both step with it."""
    a, b, _ = _coefficients(A, delta_t, u_t, B_t, keep_t, negative)
    h = decayed(a, h) + b
    return h, jnp.sum(h * C_t[None, :], axis=1)


class AbstractKernel(eqx.Module):
    """How one chunk of `L` steps runs inside `selective_chunks`; `negative`: the
    decays `2 exp(delta A) - 1`."""

    negative: eqx.AbstractVar[bool]

    @abc.abstractmethod
    def forward(self, A, h, delta, u, B, C, keep) -> tuple[Array, Array]:
        """`(h_last, y)` of the chunk from the state `h` entering it."""

    @abc.abstractmethod
    def backward(self, A, nu, gA, h, delta, u, B, C, keep, gy) -> tuple:
        """`(nu, gA, (g_delta, g_u, g_B, g_C))`: the cotangent reaching the state
        entering the chunk and that of `A` so far, from those after it (`nu`,
        `gA`), the chunk's entering state `h` and the cotangent `gy` of its
        outputs."""


class RecurrenceKernel(AbstractKernel):
    """A chunk through the backend's recurrence, forward and backward."""

    scan: AbstractScan
    negative: bool = eqx.field(static=True)

    def _states(self, A, h, delta, u, B, keep):
        """The decays `a`, their derivatives and every state of the chunk, all
        `(L, D, N)`."""
        a, slope = selective_decay(
            delta[:, :, None], A[None], keep[:, None, None], self.negative
        )
        b = (delta * u)[:, :, None] * B[:, None, :]
        return a, slope, self.scan.recurrence(a, b, h)

    def forward(self, A, h, delta, u, B, C, keep):
        _, _, states = self._states(A, h, delta, u, B, keep)
        return states[-1], jnp.einsum("ldn,ln->ld", states, C)

    def backward(self, A, nu, gA, h, delta, u, B, C, keep, gy):
        a, slope, states = self._states(A, h, delta, u, B, keep)
        # l_t = a_{t+1} l_{t+1} + gy_t C_t, run backwards from `nu`
        a_next = jnp.concatenate([a[1:], jnp.ones_like(a[:1])])
        rhs = gy[:, :, None] * C[:, None, :]
        lam = self.scan.recurrence(a_next, rhs, nu, reverse=True)
        h_prev = jnp.concatenate([h[None], states[:-1]])
        # h_t = a_t h_{t-1} + (delta_t u_t) B_t with a_t a function of delta_t A
        g_log_a = lam * decayed(slope, h_prev)  # cotangent of delta_t A
        g_drive = jnp.einsum("ldn,ln->ld", lam, B)  # of delta_t u_t
        g_delta = jnp.einsum("ldn,dn->ld", g_log_a, A) + g_drive * u
        g_B = jnp.einsum("ldn,ld->ln", lam, delta * u)
        g_C = jnp.einsum("ldn,ld->ln", states, gy)
        gA = gA + jnp.einsum("ldn,ld->dn", g_log_a, delta)
        return decayed(a[0], lam[0]), gA, (g_delta, g_drive * delta, g_B, g_C)


def _row(x: Array, t) -> Array:
    return lax.dynamic_index_in_dim(x, t, keepdims=False)


def _put(buffer: Array, t, value: Array) -> Array:
    return lax.dynamic_update_index_in_dim(buffer, value, t, 0)


class LoopKernel(AbstractKernel):
    """A chunk one step at a time, everything of a step in one loop body."""

    unroll: int = eqx.field(static=True)
    negative: bool = eqx.field(static=True)

    def forward(self, A, h, delta, u, B, C, keep):
        def step(t, carry):
            h, y = carry
            rows = (_row(x, t) for x in (delta, u, B, C, keep))
            h, y_t = selective_step(h, A, *rows, self.negative)
            return h, _put(y, t, y_t)

        y = zeros_like_inputs(u.shape, u.dtype, h, delta, u, B, C)
        return lax.fori_loop(0, u.shape[0], step, (h, y), unroll=self.unroll)

    def backward(self, A, nu, gA, h, delta, u, B, C, keep, gy):
        L = u.shape[0]

        def coefficients(t):
            rows = (_row(x, t) for x in (delta, u, B, keep))
            return _coefficients(A, *rows, self.negative)

        def recompute(t, carry):
            h, previous = carry
            a, b, _ = coefficients(t)
            return decayed(a, h) + b, _put(previous, t, h)

        # the buffer varies over the mesh like the inputs (under `jax.shard_map`)
        empty = zeros_like_inputs((L, *h.shape), h.dtype, h, delta, u, B)
        _, previous = lax.fori_loop(0, L, recompute, (h, empty), unroll=self.unroll)

        def adjoint(i, carry):
            t = L - 1 - i
            nu, gA, g_delta, g_u, g_B, g_C = carry
            delta_t, u_t, B_t, gy_t = (_row(x, t) for x in (delta, u, B, gy))
            a, b, slope = coefficients(t)
            h_prev = _row(previous, t)
            forgotten = decayed(a, h_prev)  # a_t h_{t-1}
            lam = nu + gy_t[:, None] * _row(C, t)[None, :]
            g_log_a = lam * decayed(slope, h_prev)  # cotangent of delta_t A
            g_drive = jnp.sum(lam * B_t[None, :], axis=1)  # of delta_t u_t
            g_delta = _put(g_delta, t, jnp.sum(g_log_a * A, axis=1) + g_drive * u_t)
            g_u = _put(g_u, t, g_drive * delta_t)
            g_B = _put(g_B, t, jnp.sum((delta_t * u_t)[:, None] * lam, axis=0))
            g_C = _put(g_C, t, jnp.sum(gy_t[:, None] * (forgotten + b), axis=0))
            gA = gA + g_log_a * delta_t[:, None]
            return decayed(a, lam), gA, g_delta, g_u, g_B, g_C

        outputs = tuple(
            zeros_like_inputs(x.shape, x.dtype, nu, gy, h, x) for x in (delta, u, B, C)
        )
        nu, gA, *grads = lax.fori_loop(
            0, L, adjoint, (nu, gA, *outputs), unroll=self.unroll
        )
        return nu, gA, tuple(grads)


def _forward(kernel: AbstractKernel, chunk: int, delta, A, u, B, C, keep, h0):
    """`(y, h_last, h_in)`, `h_in[k]` the state entering chunk `k`."""

    def body(h, xs):
        h_last, y = kernel.forward(A, h, *xs)
        return h_last, (y, h)

    xs = tuple(chunked(x, chunk) for x in (delta, u, B, C, keep))
    h_last, (y, h_in) = lax.scan(body, h0, xs)
    return unchunked(y), h_last, h_in


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def selective_chunks(
    kernel: AbstractKernel, chunk: int, delta, A, u, B, C, keep, h0
) -> tuple[Array, Array]:
    """`(y, h_last)` for inputs whose length is a multiple of `chunk`, each chunk
    run by `kernel`; `keep` is `(T,)`, zero where a segment starts (not
    differentiated)."""
    y, h_last, _ = _forward(kernel, chunk, delta, A, u, B, C, keep, h0)
    return y, h_last


def _fwd(kernel, chunk, delta, A, u, B, C, keep, h0):
    y, h_last, h_in = _forward(kernel, chunk, delta, A, u, B, C, keep, h0)
    return (y, h_last), (delta, A, u, B, C, keep, h_in)


def _bwd(kernel, chunk, residuals, cotangents):
    delta, A, u, B, C, keep, h_in = residuals
    gy, g_last = cotangents

    def body(carry, xs):
        nu, gA, grads = kernel.backward(A, *carry, xs[-1], *xs[:-1])
        return (nu, gA), grads

    xs = tuple(chunked(x, chunk) for x in (delta, u, B, C, keep, gy)) + (h_in,)
    gA0 = zeros_like_inputs(A.shape, A.dtype, delta, u, B, C, gy, A)
    (g_h0, gA), grads = lax.scan(body, (g_last, gA0), xs, reverse=True)
    g_delta, g_u, g_B, g_C = (unchunked(g) for g in grads)
    return g_delta, gA, g_u, g_B, g_C, jnp.zeros_like(keep), g_h0


selective_chunks.defvjp(_fwd, _bwd)
