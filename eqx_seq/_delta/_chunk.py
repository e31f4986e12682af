"""The delta rule's chunk form: per head a matrix state `S` `(dk, dv)`,

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t,

computed chunk by chunk. Inside a chunk of `C` steps, with `b` the cumulative sum
of the log-gates `g = log alpha` from the chunk's start and `Gamma[r, s] =
exp(b_r - b_s)` for `s <= r` in one segment (else zero), the updates
`u_t = beta_t (v_t - (alpha_t S_{t-1})^T k_t)` solve a unit lower-triangular
system (the UT transform of the WY representation):

    (I + A) u = beta V - beta e^b K S_in,   A = strict_lower(beta (K K^T * Gamma)),

so `u = U - W S_in` with `[W | U] = (I + A)^{-1} [beta e^b K | beta V]`, and

    O = e^b Q S_in + (Q K^T * Gamma) u,   S_out = e^{b_C} S_in + K~^T u,

`K~ = e^{b_C - b} K`. A chunk is an affine map of its entering state with a dense
`dk x dk` part: the pass between chunks carries `S` and applies it in factored
form (`_carry`), never forming the map. On a time axis split over devices each
device forms its block's map once, by running its chunks on the augmented state
`[S | I]` (`_block_map`), for the exchange that gives it its entering state.

A reset (a segment start) is a zero gate: its masks, never `g = -inf` (whose
differences are NaN), keep segments apart: `Gamma` is zero across them, `e^b`
after the chunk's first reset, `K~` outside its last segment and `e^{b_C}` in a
chunk that holds one (so its map's matrix part is zero). The derivation is in
`docs/devdocs/delta-rule.md`.

Arrays are head-major inside this module, query and key heads split by group,
`H = G * R`: `q`, `k` `(K, G, C, dk)`, `v` `(K, G, R, C, dv)`, `beta`, `g`
`(K, G, R, C)`, `segment` `(K, C)`: the resets counted from each chunk's start.
"""

import functools as ft

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array


def _masked_exp(keep: Array, x: Array) -> Array:
    """`exp(x)` where `keep`, else zero: the rest is selected away before `exp` (a
    positive gap there may overflow), so neither the value nor its derivative
    sees it."""
    return jnp.exp(jnp.where(keep, x, -jnp.inf))


def _diagonal_blocks(A: Array, m: int) -> Array:
    """The `m x m` blocks on the diagonal of `A` `(..., n m, n m)`, `(..., n, m, m)`:
    a strided slice of the blocks laid out in a row, not a gather."""
    n = A.shape[-1] // m
    lead = A.shape[:-2]
    blocks = jnp.swapaxes(A.reshape(*lead, n, m, n, m), -3, -2)
    return blocks.reshape(*lead, n * n, m, m)[..., :: n + 1, :, :]


def _unit_lower_inverse(A: Array) -> Array:
    """`(I + A)^{-1}` for `A` `(..., C, C)` strictly lower triangular, by doubling
    the inverted diagonal blocks: two blocks' inverses `T1`, `T2` give the
    inverse of the block they make, `[[T1, 0], [-T2 A21 T1, T2]]`. The arithmetic
    of a blocked triangular inversion, in a few batched products and no custom
    call (XLA:CPU's triangular solve parallelises its batch on the thread pool
    that the program's own parallel kernels wait on, and the two can deadlock on
    a small machine)."""
    C = A.shape[-1]
    size = 1 << (C - 1).bit_length()  # padded by identity rows to a power of two
    lead = A.shape[:-2]
    A = jnp.pad(A, [(0, 0)] * len(lead) + [(0, size - C)] * 2)
    T = jnp.ones((*lead, size, 1, 1), A.dtype)  # the inverses of the 1 x 1 blocks
    b = 1
    while b < size:
        lower = _diagonal_blocks(A, 2 * b)[..., b:, :b]  # (..., n, b, b)
        pairs = T.reshape(*lead, size // (2 * b), 2, b, b)
        T1, T2 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        T21 = -(T2 @ lower @ T1)
        top = jnp.concatenate([T1, jnp.zeros_like(T1)], axis=-1)
        T = jnp.concatenate([top, jnp.concatenate([T21, T2], axis=-1)], axis=-2)
        b *= 2
    return T.reshape(*lead, size, size)[..., :C, :C]


def _unit_lower_solve(A: Array, rhs: Array) -> Array:
    """`(I + A)^{-1} rhs` for `A` `(..., C, C)` strictly lower triangular and `rhs`
    `(..., C, D)`, differentiated implicitly (`lax.custom_linear_solve`: the
    derivative with respect to `A` from the solution, the transposed system solved
    by the same inverse)."""
    inverse = lax.stop_gradient(_unit_lower_inverse(A))
    matvec = lambda x: x + A @ x
    solve = lambda _, b: inverse @ b
    transpose_solve = lambda _, b: jnp.swapaxes(inverse, -1, -2) @ b
    return lax.custom_linear_solve(matvec, rhs, solve, transpose_solve)


def chunk_pieces(q, k, v, beta, g, segment):
    """What a chunk's affine map needs, all independent of the entering state:
    `W` `(G, R, C, dk)`, `U` `(G, R, C, dv)`, `K~` `(G, R, C, dk)`, the decay
    `e^{b_C}` `(G, R)` (zero if the chunk holds a reset), the read-out weights
    `P = Q K^T * Gamma` `(G, R, C, C)` and the entering state's weights `e^b`
    `(G, R, C)` (zero from the first reset on). One chunk; vmapped over them."""
    C = q.shape[-2]
    b = jnp.cumsum(g, axis=-1)
    causal = jnp.arange(C)[:, None] >= jnp.arange(C)[None, :]
    same = ((segment[:, None] == segment[None, :]) & causal)[None, None]
    gamma = _masked_exp(same, b[..., :, None] - b[..., None, :])  # (G, R, C, C)
    strict = same & ~jnp.eye(C, dtype=bool)[None, None]
    kk = jnp.einsum("gsd,gtd->gst", k, k)[:, None]
    A = jnp.where(strict, beta[..., :, None] * kk * gamma, 0)
    entry = _masked_exp((segment == 0)[None, None], b)  # (G, R, C)
    rhs = jnp.concatenate(
        [
            (beta * entry)[..., None] * k[:, None],
            beta[..., None] * v,
        ],
        axis=-1,
    )
    WU = _unit_lower_solve(A, rhs)
    dk = k.shape[-1]
    W, U = WU[..., :dk], WU[..., dk:]
    last = (segment == segment[-1])[None, None]
    tail = _masked_exp(last, b[..., -1:] - b)  # (G, R, C)
    K_tilde = tail[..., None] * k[:, None]
    decay = _masked_exp(jnp.broadcast_to(segment[-1] == 0, b.shape[:-1]), b[..., -1])
    P = jnp.einsum("gsd,gtd->gst", q, k)[:, None] * gamma
    return W, U, K_tilde, decay, P, entry


def _carry(S, piece):
    """One chunk's map applied to its entering state `S` `(G, R, dk, dv)`, in
    factored form: the updates `u = U - W S` and the leaving state."""
    W, U, K_tilde, decay = piece
    u = U - jnp.einsum("grcd,grde->grce", W, S)
    S_out = decay[..., None, None] * S + jnp.einsum("grcd,grce->grde", K_tilde, u)
    return S_out, (S, u)


def _block_map(pieces, start):
    """The block's map `S -> M S + N` (`M` `(G, R, dk, dk)`) and its last state from
    `start`, by one pass over its chunks on the augmented state `[start | I]`: the
    identity columns, which get no updates (`U` padded with zeros), come out as
    `M`, the product of the chunks' matrix parts, in the same factored form."""
    W, U, K_tilde, decay = pieces
    dk, dv = W.shape[-1], U.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=start.dtype), (*start.shape[:-1], dk))
    U = jnp.concatenate([U, jnp.zeros((*U.shape[:-1], dk), U.dtype)], axis=-1)
    step = jax.checkpoint(lambda S, piece: (_carry(S, piece)[0], None))
    last, _ = lax.scan(step, jnp.concatenate([start, eye], -1), (W, U, K_tilde, decay))
    return last[..., dv:], last[..., :dv]


def chunked(q, k, v, beta, g, segment, S0, scan):
    """The outputs `(K, G, R, C, dv)` and the final state `(G, R, dk, dv)` from the
    state `S0` before the sequence. The pass between chunks keeps one state per
    chunk for the backward pass (`jax.checkpoint` recomputes a chunk's updates),
    never one per step. On a time axis split over devices (`scan`), it starts from
    the state entering this device's block, from the blocks' maps
    (`carry_matrix_into_block`); on one device from `S0`."""
    W, U, K_tilde, decay, P, entry = jax.vmap(chunk_pieces)(q, k, v, beta, g, segment)
    pieces = (W, U, K_tilde, decay)
    S0 = scan.carry_matrix_into_block(ft.partial(_block_map, pieces), S0)
    final, (S_in, u) = lax.scan(jax.checkpoint(_carry), S0, pieces)
    read = jnp.einsum("kgcd,kgrde->kgrce", q, S_in)
    O = entry[..., None] * read + jnp.einsum("kgrst,kgrte->kgrse", P, u)
    return O, final
