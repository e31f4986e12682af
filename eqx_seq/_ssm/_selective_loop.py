"""The selective scan's sequential algorithm: one step at a time, everything fused.

The same recurrence, read-out and checkpoints as the chunked algorithm of
`_selective_core.py`, but the decay `exp(delta_t A)`, the input `(delta_t u_t) B_t`,
the update and the read-out are computed inside one loop body per step, so no array
of a chunk's `(L, D, N)` decays or inputs is ever formed: only the `(D, N)` state
crosses steps. The backward pass recomputes a chunk's states into one `(L, D, N)`
buffer and runs the adjoint step by step in reverse, reading every cotangent out in
the same body. The derivation is in `docs/devdocs/selective.md`.
"""

import functools as ft

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import zeros_like_inputs
from .._scan import decayed
from ._selective_core import chunked, selective_decay, unchunked


def _row(x: Array, t) -> Array:
    return lax.dynamic_index_in_dim(x, t, keepdims=False)


def _put(buffer: Array, t, value: Array) -> Array:
    return lax.dynamic_update_index_in_dim(buffer, value, t, 0)


def _coefficients(A, delta_t, u_t, B_t, keep_t):
    """`(a_t, b_t)` of one step, both `(D, N)`; `keep_t = 0` at a segment start."""
    a = selective_decay(delta_t[:, None], A, keep_t)
    return a, (delta_t * u_t)[:, None] * B_t[None, :]


def selective_step(
    h: Array, A: Array, delta_t: Array, u_t: Array, B_t: Array, C_t: Array, keep_t
) -> tuple[Array, Array]:
    """One step of the recurrence and its read-out: `(h_t, h_t C_t)` from
    `h_{t-1}` `(D, N)`; `keep_t = 0` starts a segment (the state is replaced,
    whatever it held). The loop below and `Mamba.step` both step with it."""
    a, b = _coefficients(A, delta_t, u_t, B_t, keep_t)
    h = decayed(a, h) + b
    return h, jnp.sum(h * C_t[None, :], axis=1)


def _forward(chunk: int, unroll: int, delta, A, u, B, C, keep, h0):
    """`(y, h_last, h_in)`, `h_in[k]` the state entering chunk `k`."""

    def chunk_body(h, xs):
        delta_c, u_c, B_c, C_c, keep_c = xs

        def step(t, carry):
            h, y = carry
            rows = (_row(x, t) for x in (delta_c, u_c, B_c, C_c, keep_c))
            h, y_t = selective_step(h, A, *rows)
            return h, _put(y, t, y_t)

        y = zeros_like_inputs(u_c.shape, u_c.dtype, h, delta_c, u_c, B_c, C_c)
        h_out, y = lax.fori_loop(0, chunk, step, (h, y), unroll=unroll)
        return h_out, (y, h)

    xs = tuple(chunked(x, chunk) for x in (delta, u, B, C, keep))
    h_last, (y, h_in) = lax.scan(chunk_body, h0, xs)
    return unchunked(y), h_last, h_in


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def looped_selective_scan(chunk: int, unroll: int, delta, A, u, B, C, keep, h0):
    """`(y, h_last)` for inputs whose length is a multiple of `chunk`; `keep` is
    `(T,)`, zero where a segment starts (not differentiated)."""
    y, h_last, _ = _forward(chunk, unroll, delta, A, u, B, C, keep, h0)
    return y, h_last


def _fwd(chunk, unroll, delta, A, u, B, C, keep, h0):
    y, h_last, h_in = _forward(chunk, unroll, delta, A, u, B, C, keep, h0)
    return (y, h_last), (delta, A, u, B, C, keep, h_in)


def _bwd(chunk, unroll, residuals, cotangents):
    delta, A, u, B, C, keep, h_in = residuals
    gy, g_last = cotangents

    def chunk_body(carry, xs):
        # `nu`: the cotangent reaching the chunk's last state from later steps,
        # `a_{t+1} l_{t+1}`; `gA`: the cotangent of `A` so far
        nu, gA = carry
        delta_c, u_c, B_c, C_c, keep_c, gy_c, h_start = xs

        def recompute(t, carry):
            h, previous = carry
            a, b = _coefficients(
                A, _row(delta_c, t), _row(u_c, t), _row(B_c, t), _row(keep_c, t)
            )
            return decayed(a, h) + b, _put(previous, t, h)

        # the buffer varies over the mesh like the inputs (under `jax.shard_map`)
        empty = zeros_like_inputs(
            (chunk, *h_start.shape), h_start.dtype, h_start, delta_c, u_c, B_c
        )
        _, previous = lax.fori_loop(
            0, chunk, recompute, (h_start, empty), unroll=unroll
        )

        def adjoint(i, carry):
            t = chunk - 1 - i
            nu, gA, g_delta, g_u, g_B, g_C = carry
            delta_t, u_t, B_t = _row(delta_c, t), _row(u_c, t), _row(B_c, t)
            gy_t = _row(gy_c, t)
            a, b = _coefficients(A, delta_t, u_t, B_t, _row(keep_c, t))
            h_prev = _row(previous, t)
            lam = nu + gy_t[:, None] * _row(C_c, t)[None, :]
            g_log_a = lam * decayed(a, h_prev)  # cotangent of delta_t A
            g_drive = jnp.sum(lam * B_t[None, :], axis=1)  # of delta_t u_t
            g_delta = _put(g_delta, t, jnp.sum(g_log_a * A, axis=1) + g_drive * u_t)
            g_u = _put(g_u, t, g_drive * delta_t)
            g_B = _put(g_B, t, jnp.sum((delta_t * u_t)[:, None] * lam, axis=0))
            h_t = decayed(a, h_prev) + b
            g_C = _put(g_C, t, jnp.sum(gy_t[:, None] * h_t, axis=0))
            gA = gA + g_log_a * delta_t[:, None]
            return decayed(a, lam), gA, g_delta, g_u, g_B, g_C

        outputs = tuple(
            zeros_like_inputs(x.shape, x.dtype, nu, gy_c, h_start, x)
            for x in (delta_c, u_c, B_c, C_c)
        )
        nu, gA, *grads = lax.fori_loop(
            0, chunk, adjoint, (nu, gA, *outputs), unroll=unroll
        )
        return (nu, gA), tuple(grads)

    xs = tuple(chunked(x, chunk) for x in (delta, u, B, C, keep, gy)) + (h_in,)
    gA0 = zeros_like_inputs(A.shape, A.dtype, delta, u, B, C, gy, A)
    (g_h0, gA), grads = lax.scan(chunk_body, (g_last, gA0), xs, reverse=True)
    g_delta, g_u, g_B, g_C = (unchunked(g) for g in grads)
    return g_delta, gA, g_u, g_B, g_C, jnp.zeros_like(keep), g_h0


looped_selective_scan.defvjp(_fwd, _bwd)
