"""The selective (S6) recurrence with its read-out fused in, checkpointed by chunks.

    h_t = exp(delta_t A) * h_{t-1} + (delta_t u_t) B_t,    y_t = h_t C_t

with `h_t` of shape `(D, N)`, `delta_t`, `u_t` of shape `(D,)`, `B_t`, `C_t` of
shape `(N,)`. Only `y` `(T, D)` and the last state leave a chunk: the `(T, D, N)`
states are never stored, forward or backward. The forward pass keeps the state
entering each chunk; the backward pass recomputes a chunk's states from it and runs
the adjoint recurrence `l_t = exp(delta_{t+1} A) * l_{t+1} + gy_t C_t` through the
chunk in reverse, reading the parameter cotangents out of `(h, l)` with reductions
over `D` or `N`. Both recurrences are the backend's (`scan.recurrence`). The
derivation is in `docs/devdocs/selective.md`.
"""

import functools as ft

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


def selective_decay(delta: Array, A: Array, keep: Array) -> Array:
    """`exp(delta A)`, zero where `keep` is zero (a segment start), selected rather
    than multiplied: an overflowing `exp` times zero would be NaN."""
    return jnp.where(keep == 0, jnp.zeros((), A.dtype), jnp.exp(delta * A))


def _chunk_states(scan, delta, A, u, B, keep, h_in):
    """The decays `a` and every state `h` of one chunk, both `(L, D, N)`."""
    a = selective_decay(delta[:, :, None], A[None], keep[:, None, None])
    b = (delta * u)[:, :, None] * B[:, None, :]
    return a, scan.recurrence(a, b, h_in)


def _forward(scan: AbstractScan, chunk: int, delta, A, u, B, C, keep, h0):
    """`(y, h_last, h_in)`, `h_in[k]` the state entering chunk `k`."""

    def body(h, xs):
        delta_c, u_c, B_c, C_c, keep_c = xs
        _, h_c = _chunk_states(scan, delta_c, A, u_c, B_c, keep_c, h)
        y_c = jnp.einsum("ldn,ln->ld", h_c, C_c)
        return h_c[-1], (y_c, h)

    xs = tuple(chunked(x, chunk) for x in (delta, u, B, C, keep))
    h_last, (y, h_in) = lax.scan(body, h0, xs)
    return unchunked(y), h_last, h_in


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def fused_selective_scan(
    scan: AbstractScan, chunk: int, delta, A, u, B, C, keep, h0
) -> tuple[Array, Array]:
    """`(y, h_last)` for inputs whose length is a multiple of `chunk`; `keep` is
    `(T,)`, zero where a segment starts (not differentiated)."""
    y, h_last, _ = _forward(scan, chunk, delta, A, u, B, C, keep, h0)
    return y, h_last


def _fwd(scan, chunk, delta, A, u, B, C, keep, h0):
    y, h_last, h_in = _forward(scan, chunk, delta, A, u, B, C, keep, h0)
    return (y, h_last), (delta, A, u, B, C, keep, h_in)


def _bwd(scan, chunk, residuals, cotangents):
    delta, A, u, B, C, keep, h_in = residuals
    gy, g_last = cotangents
    L = chunk

    def body(carry, xs):
        # `carry`: the cotangent that reaches the chunk's last state from later
        # steps, `a_{t+1} l_{t+1}` for its last step `t` (`g_last` after the end);
        # `gA`: the cotangent of `A`, summed over the chunks seen so far.
        nu, gA = carry
        delta_c, u_c, B_c, C_c, keep_c, gy_c, h_start = xs
        a, h = _chunk_states(scan, delta_c, A, u_c, B_c, keep_c, h_start)
        # l_t = a_{t+1} l_{t+1} + gy_t C_t, run backwards from `nu`
        a_next = jnp.concatenate([a[1:], jnp.ones_like(a[:1])])
        rhs = gy_c[:, :, None] * C_c[:, None, :]
        lam = scan.recurrence(a_next, rhs, nu, reverse=True)
        h_prev = jnp.concatenate([h_start[None], h[:-1]])
        # h_t = a_t h_{t-1} + (delta_t u_t) B_t with a_t = exp(delta_t A):
        g_log_a = lam * decayed(a, h_prev)  # cotangent of delta_t A
        g_drive = jnp.einsum("ldn,ln->ld", lam, B_c)  # of delta_t u_t
        g_delta = jnp.einsum("ldn,dn->ld", g_log_a, A) + g_drive * u_c
        g_u = g_drive * delta_c
        g_B = jnp.einsum("ldn,ld->ln", lam, delta_c * u_c)
        g_C = jnp.einsum("ldn,ld->ln", h, gy_c)
        gA = gA + jnp.einsum("ldn,ld->dn", g_log_a, delta_c)
        return (decayed(a[0], lam[0]), gA), (g_delta, g_u, g_B, g_C)

    xs = tuple(chunked(x, L) for x in (delta, u, B, C, keep, gy)) + (h_in,)
    gA0 = zeros_like_inputs(A.shape, A.dtype, delta, u, B, C, gy, A)
    (g_h0, gA), grads = lax.scan(body, (g_last, gA0), xs, reverse=True)
    g_delta, g_u, g_B, g_C = (unchunked(g) for g in grads)
    return g_delta, gA, g_u, g_B, g_C, jnp.zeros_like(keep), g_h0


fused_selective_scan.defvjp(_fwd, _bwd)
