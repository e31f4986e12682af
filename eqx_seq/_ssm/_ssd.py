"""`ssd_scan` and `ssd_step`: Mamba-2's state-space duality (SSD), a chunked
diagonal recurrence with one scalar decay per head, unbatched and time-first.

Inside a chunk of `Q` steps the outputs and the chunk's state are masked,
decay-weighted matrix products; between chunks the state follows the diagonal
recurrence `h_c = alpha_c h_{c-1} + S_c` over `T / Q` steps, which
`linear_recurrence` solves with the given backend (its adjoint written by hand,
a time axis split over devices included). The derivation, the resets and the
memory of the gradient are in `docs/devdocs/ssd.md`.

Inside this module the heads are split by group, `H = G * R`: arrays per head
carry the axes `(G, R)` where the reference has `H`, so that a group's `B` and
`C` meet its heads by broadcasting, never by copies.
"""

import functools as ft
import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .._misc import check_bool, check_positive_int, check_reset, vary_like
from .._recurrence import linear_recurrence
from .._scan import AbstractScan, AutoScan, check_scan
from ._packing import (
    count_last,
    finite,
    finite_cotangent,
    into_chunks,
    keeps,
    link,
    met_within,
    reads,
)
from ._selective_core import log_decays
from ._ssd_checks import check_dt_limit, check_shapes, checked_arrays, compute_dtype


def _step_sizes(dt, dt_bias, dt_softplus: bool, dt_limit: tuple[float, float]):
    """`dt` after its bias, the softplus and the clamp, in the reference's order."""
    if dt_bias is not None:
        dt = dt + jnp.broadcast_to(dt_bias, dt.shape)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    lo, hi = dt_limit
    if lo > 0 or math.isfinite(hi):
        dt = jnp.clip(dt, lo, hi)
    return dt


def _masked_exp(keep: Array, x: Array, flips: Array | None = None) -> Array:
    """`exp(x)` where `keep`, else zero, negated where `flips` is odd (a product
    of decays with that many negative ones). The rest is selected away before
    `exp` (there the argument may be a positive gap that overflows), so that
    neither the value nor its derivative sees it."""
    out = jnp.exp(jnp.where(keep, x, -jnp.inf))
    return out if flips is None else jnp.where(flips % 2 == 1, -out, out)


# --- one chunk: `Q` steps, vmapped over the chunks ---
#
# Head-major, so that the products batch over the leading axes: `log_a` (G, R, Q):
# the log-decays `log|a|`; `xdt` (G, R, Q, P): the inputs times `dt`; `B`, `C`
# (G, Q, N); `segment` (G, R, Q), or (1, 1, Q) for all heads: the resets counted
# from the chunk's start (0 before its first reset); `flips` (G, R, Q) or `None`:
# the negative decays counted likewise; `h_in` (G, R, P, N): the state entering
# it. Both functions are rematerialised: the backward pass recomputes a chunk's
# `Q x Q` weights rather than keeping them.


@jax.checkpoint
def _chunk_state(log_a, xdt, B, segment, flips):
    """The chunk's own contribution to its last state, `sum_t exp(L_Q - L_t) xdt_t
    B_t^T` over the steps of its last segment, `(G, R, P, N)`, and the decay
    `alpha = exp(L_Q)` that carries the entering state through it, `(G, R)`,
    zero if a segment starts in the chunk (`L_s = sum_{t <= s} log_a_t`; with
    negative decays, `flips` counts them as `L` sums their logs, and the products
    take their signs)."""
    L = jnp.cumsum(log_a, axis=-1)
    last = segment == segment[..., -1:]
    gap = None if flips is None else flips[..., -1:] - flips
    weight = _masked_exp(last, L[..., -1:] - L, gap)
    S = jnp.einsum("grtp,gtn->grpn", weight[..., None] * xdt, B)
    total = None if flips is None else flips[..., -1]
    return S, _masked_exp(segment[..., -1] == 0, L[..., -1], total)


@jax.checkpoint
def _chunk_output(log_a, xdt, B, C, segment, flips, h_in):
    """The chunk's outputs, `(G, R, Q, P)`: its own inputs through the masked
    products `y_s = sum_{t <= s} (C_s . B_t) exp(L_s - L_t) xdt_t` (`t` in `s`'s
    segment), plus the entering state read out as `exp(L_s) C_s h_in` before the
    chunk's first reset."""
    L = jnp.cumsum(log_a, axis=-1)
    Q = L.shape[-1]
    causal = jnp.arange(Q)[:, None] >= jnp.arange(Q)[None, :]
    same = (segment[..., :, None] == segment[..., None, :]) & causal[None, None]
    gap = None if flips is None else flips[..., :, None] - flips[..., None, :]
    decay = _masked_exp(same, L[..., :, None] - L[..., None, :], gap)
    CB = jnp.einsum("gsn,gtn->gst", C, B)
    # a product with batch axes, not a broadcast: the gradient with respect to `CB`
    # is then a batched dot rather than a sum over the heads, which XLA:CPU makes slow
    own = jnp.einsum("grst,grtp->grsp", jnp.einsum("grst,gst->grst", decay, CB), xdt)
    entry = _masked_exp(segment == 0, L, flips)
    read = jnp.einsum("gsn,grpn->grsp", C, h_in)
    return own + entry[..., None] * read


# --- the whole sequence ---
#
# Packed documents stay independent whatever they hold: the chunks only meet
# finite values, and what depends on a non-finite one is NaN by selection, its
# derivatives included (`_packing.py`).


@eqx.filter_jit
def _run(
    scan, chunk, x, dt, A, B, C, D, z, h0, reset, dt_bias, softplus, limit, negative
):
    T, H, P = x.shape
    _, G, N = B.shape
    R = H // G
    heads = lambda v: jnp.repeat(v, R, axis=1)  # (T, G, ...) -> (T, H, ...)
    # finite inputs, and a sum of them per step (head) and per output (the link)
    x, bad_x = finite(x)
    dt, bad_dt = finite(dt)
    B, bad_B = finite(B)
    C, bad_C = finite(C)
    A, bad_head = finite(A)
    if dt_bias is not None:
        dt_bias, bad_bias = finite(dt_bias)
        bad_head = bad_head | bad_bias
    dt = _step_sizes(dt, dt_bias, softplus, limit)
    dt, overflow = finite(dt)  # a finite `dt` whose softplus or bias overflows
    bad_dt = bad_dt | overflow | bad_head[None]
    per_step = A[None] + dt + jnp.sum(x, axis=-1) + heads(jnp.sum(B, axis=-1))
    per_output = heads(jnp.sum(C, axis=-1))
    bad_y = heads(jnp.any(bad_C, axis=-1))[..., None]
    if D is not None:
        D, bad_D = finite(D[:, None] if D.ndim == 1 else D)
        per_output = per_output + jnp.sum(D, axis=-1)[None]
        bad_y = bad_y | bad_D[None]
    if z is not None:
        z, bad_z = finite(z)
        per_output = per_output + jnp.sum(z, axis=-1)
        bad_y = bad_y | bad_z
    # padded steps have `dt = 0`: a decay of one and no input, so the last state is
    # that of the last real step (also at the end of a device's block, mid-sequence)
    K = -(-T // chunk)

    chunks = ft.partial(into_chunks, chunk)
    resets = None if reset is None else chunks(reset.astype(jnp.int32))
    # the non-finite inputs met since the segment's start: by each output (its
    # `x`, `dt` and `B`), and by the last segment of each chunk (apart, for the
    # final state)
    met = bad_x | bad_dt[..., None] | heads(jnp.any(bad_B, axis=-1))[..., None]
    bad = [bad_x.reshape(T, H * P), bad_dt, bad_B.reshape(T, G * N)]
    bad = chunks(jnp.concatenate(bad, axis=1).astype(x.dtype))
    met = met_within(chunks(met.reshape(T, H * P).astype(x.dtype)), resets)
    last_met = count_last(bad, resets)

    log_a, below, zero = log_decays(dt * A[None], negative)
    log_a = chunks(log_a.reshape(T, G, R), G, R)
    xdt = chunks((x * dt[..., None]).reshape(T, G, R, P), G, R)
    B, C = chunks(B, G), chunks(C, G)
    starts = jnp.zeros((K, chunk), jnp.int32) if resets is None else resets
    flips = None
    if negative:
        # a zero decay starts a segment of its head; signs flip at negative ones
        zero = chunks(zero.astype(jnp.int32).reshape(T, G, R), G, R)
        starts = jnp.maximum(starts[:, None, None], zero)
        flips = jnp.cumsum(chunks(below.astype(jnp.int32).reshape(T, G, R), G, R), -1)
        segment = jnp.cumsum(starts, axis=-1)
    else:  # one segment count for every head
        segment = jnp.cumsum(starts, axis=1)[:, None, None]
    S, alpha = jax.vmap(_chunk_state)(log_a, xdt, B, segment, flips)

    # between chunks, one recurrence: the states (one decay per head; one that is
    # not finite can only come from `h0`, which a reset forgets by selection) and
    # the counts (carried on unless the chunk resets)
    if h0 is None:
        h0 = jnp.zeros((H, P, N), x.dtype)
    h0 = vary_like(h0, x)
    M = last_met.shape[-1]
    decays = jnp.broadcast_to(alpha.reshape(K, H, 1), (K, H, P * N)).reshape(K, -1)
    keep = jnp.broadcast_to(keeps(resets, K, x.dtype)[:, None], (K, M))
    a = jnp.concatenate([decays, keep], axis=1)
    b = jnp.concatenate([S.reshape(K, -1), last_met], axis=1)
    start = jnp.concatenate([h0.reshape(-1), jnp.zeros_like(last_met[0])])
    carried = linear_recurrence(a, b, start, scan=scan)
    entering = scan.shift(carried, start)
    h_in, bad_in = finite(entering[:, :-M].reshape(K, G, R, P, N))

    def met_by_state(counts):
        """`(..., H, P, N)`: whether the counts `(..., M)` of the `x`, `dt` and `B`
        entries a state has met are not all zero."""
        c_x, c_dt, c_B = jnp.split(counts > 0, [H * P, H * P + H], axis=-1)
        c_x = c_x.reshape(*c_x.shape[:-1], H, P, 1)
        c_B = jnp.repeat(c_B.reshape(*c_B.shape[:-1], G, 1, N), R, axis=-3)
        return c_x | c_dt[..., None, None] | c_B

    # the steps of a chunk before its first reset read what enters it
    bad_in = bad_in.reshape(K, H, P, N) | met_by_state(entering[:, -M:])
    bad_in = jnp.any(bad_in, axis=-1).reshape(K, 1, H * P)
    met = met | (bad_in & reads(resets, K, chunk)[..., None])

    y = jax.vmap(_chunk_output)(log_a, xdt, B, C, segment, flips, h_in)
    y = jnp.moveaxis(y, 3, 1).reshape(K * chunk, H, P)[:T]
    if D is not None:
        y = y + D[None] * x
    if z is not None:
        y = y * jax.nn.silu(z)
    h0_link = jnp.sum(finite(h0)[0], axis=(1, 2))
    to_y, to_final = link(scan, chunks(per_step), chunks(per_output), resets, h0_link)
    y = finite_cotangent(y) + to_y.reshape(K * chunk, H, 1)[:T]
    y = jnp.where(bad_y | met.reshape(K * chunk, H, P)[:T], jnp.nan, y)

    last = carried[-1]
    final = finite_cotangent(last[:-M].reshape(H, P, N)) + to_final[:, None, None]
    return y, jnp.where(met_by_state(last[-M:]), jnp.nan, final)


def _step(state, x, dt, A, B, C, D, z, dt_bias, softplus, limit, negative):
    H, P = x.shape
    G = B.shape[0]
    dt = _step_sizes(dt, dt_bias, softplus, limit)
    B, C = jnp.repeat(B, H // G, axis=0), jnp.repeat(C, H // G, axis=0)  # (H, N)
    decay = 1 + 2 * jnp.expm1(dt * A) if negative else jnp.exp(dt * A)
    decay = decay[:, None, None]
    state = decay * state + (dt[:, None] * x)[:, :, None] * B[:, None, :]
    y = jnp.einsum("hpn,hn->hp", state, C)
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        y = y * jax.nn.silu(z)
    return y, state


def ssd_scan(
    x: Float[ArrayLike, "T H P"],
    dt: Float[ArrayLike, "T H"],
    A: Float[ArrayLike, " H"],
    B: Float[ArrayLike, "T G N"],
    C: Float[ArrayLike, "T G N"],
    D: Float[ArrayLike, " H"] | Float[ArrayLike, "H P"] | None = None,
    *,
    z: Float[ArrayLike, "T H P"] | None = None,
    dt_bias: Float[ArrayLike, " H"] | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    negative_decays: bool = False,
    h0: Float[ArrayLike, "H P N"] | None = None,
    reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
    return_final_state: bool = False,
    chunk_size: int = 64,
    scan: AbstractScan = AutoScan(),
) -> Float[Array, "T H P"] | tuple[Float[Array, "T H P"], Float[Array, "H P N"]]:
    r"""The chunked scan of Mamba-2 (state-space duality, SSD): a recurrence with
    one scalar decay per head, computed as matrix products inside chunks.

    With $\Delta_t$ = `dt[t]` (after `dt_bias`, the softplus and `dt_limit`, if
    asked), head $h$'s state $S^h_t \in \mathbb{R}^{P \times N}$ from `h0`:

    $S^h_t = \exp(\Delta^h_t A^h)\, S^h_{t-1} + \Delta^h_t\, x^h_t B_t^{g\top}$,
    $\quad y^h_t = S^h_t C^g_t + D^h x^h_t$,

    with $g$ the group of head $h$ (`H / G` consecutive heads share one), times
    $\mathrm{silu}(z_t)$ when `z` is given: the arguments and results of
    `mamba_chunk_scan_combined` of `state-spaces/mamba` for one sequence, time
    first (`jax.vmap` for a batch; `reset` is its `seq_idx`).

    Inside a chunk of `chunk_size` steps the outputs are masked, decay-weighted
    products of `C`, `B` and `x`; between chunks the state follows
    [`eqx_seq.linear_recurrence`][] over `T / chunk_size` steps with the given
    backend, so every backend runs it, [`eqx_seq.ShardedScan`][] included (one
    chunk state per head crosses a device boundary). The `(T, H, P, N)` states are
    never formed: the gradient keeps the chunks' states and recomputes a chunk's
    products, so its memory is `O(T H P + T G N + (T / chunk_size) H P N)`.
    Differentiable in reverse and forward mode with respect to every array
    argument.

    A value that is not finite (NaN or inf, in any array) reaches exactly the
    outputs that depend on it, as in the recurrent form: the later steps of its
    segment, never an earlier step nor another segment, and they are NaN (the
    final state too). So packed documents stay independent whatever one of them
    holds, in the derivatives as well: the gradient of a loss on one document is
    that of a separate call on it, and a NaN cotangent of an output reaches only
    the derivatives of what that output depends on.

    **Arguments:**

    - `x`: the input, shape `(T, H, P)`: `H` heads of `P` channels.
    - `dt`: the step sizes $\Delta$ before `dt_bias` and the softplus, `(T, H)`.
    - `A`: the decay rates, one per head, shape `(H,)` (negative for a decaying
        state).
    - `B`, `C`: the input and output vectors, shape `(T, G, N)`, `G` dividing `H`.
    - `D`: the skip connection, shape `(H,)` or `(H, P)`, or `None` for none.
    - `z`: the gate, shape `(T, H, P)`, or `None` for none.
    - `dt_bias`: added to `dt`, shape `(H,)`.
    - `dt_softplus`: apply `jax.nn.softplus` to `dt + dt_bias`.
    - `dt_limit`: `(low, high)`, the step sizes clamped to it after the softplus
        (the default clamps nothing).
    - `negative_decays`: decays `2 exp(dt A) - 1` in `(-1, 1)` instead of
        `exp(dt A)` in `(0, 1)`, which lets a layer track state such as parity
        (Grazzi et al., "Unlocking State-Tracking in Linear RNNs Through Negative
        Eigenvalues", 2025). A decay that is exactly zero (`dt A = -log 2`)
        forgets the state as a reset does, in the derivatives too: the state it
        forgets does not reach the derivatives with respect to that step's `dt`
        and `A`.
    - `h0`: the state before the first step, shape `(H, P, N)`; zeros if `None`.
    - `reset`: optional bools, shape `(T,)`, `True` where a segment starts (packed
        sequences): there the state restarts from zero, so each segment gives the
        outputs of a separate call (`h0` is ignored at a reset on step 0).
    - `return_final_state`: also return the state after the last step.
    - `chunk_size`: the steps per chunk (`T` need not be a multiple of it). The
        work inside chunks grows with it and the recurrence between them shrinks:
        on CPU short chunks are faster, on GPUs longer ones (the reference uses
        256); the benchmarks page has the sweep.
    - `scan`: the backend of the recurrence between chunks, an
        [`eqx_seq.AbstractScan`][].

    **Returns:**

    `y`, shape `(T, H, P)`; `(y, final_state)` with `final_state` of shape
    `(H, P, N)` if `return_final_state` (under [`eqx_seq.ShardedScan`][], the last
    device's is the whole sequence's). In the inputs' floating dtype (half
    precision is computed in float32 and cast back).

    **Raises:**

    `ValueError` for a required array given as `None`, shapes that do not fit
    together, an axis of size zero, groups that do not divide the heads,
    non-floating arrays, a `reset` that is not `(T,)` bools, a bad `dt_limit` or
    `chunk_size`, flags that are not bools, or a `scan` that is not an
    [`eqx_seq.AbstractScan`][].

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        T, H, P, G, N = 200, 4, 8, 1, 16
        k = jr.split(jr.key(0), 4)
        x = jr.normal(k[0], (T, H, P))
        dt = jr.normal(k[1], (T, H))
        A = -jnp.arange(1.0, H + 1)
        B, C = jr.normal(k[2], (T, G, N)), jr.normal(k[3], (T, G, N))
        y, state = eqx_seq.ssd_scan(
            x, dt, A, B, C, dt_softplus=True, return_final_state=True
        )
        ```
    """
    name = "eqx_seq.ssd_scan"
    check_positive_int("chunk_size", chunk_size)
    chosen = check_scan(scan, name=name, splits_time=True)
    limit = check_dt_limit(name, dt_limit)
    softplus = check_bool("dt_softplus", dt_softplus)
    negative = check_bool("negative_decays", negative_decays)
    check_bool("return_final_state", return_final_state)
    given = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, h0=h0)
    arrays = checked_arrays(name, given, required=("x", "dt", "A", "B", "C"))
    check_shapes(name, arrays, time=(None,))
    T = arrays["x"].shape[0]
    dtype, compute = compute_dtype(arrays)
    arrays = {k: v.astype(compute) for k, v in arrays.items()}
    y, final = _run(
        chosen,
        min(chunk_size, T),
        arrays["x"],
        arrays["dt"],
        arrays["A"],
        arrays["B"],
        arrays["C"],
        arrays.get("D"),
        arrays.get("z"),
        arrays.get("h0"),
        check_reset(reset, T, name),
        arrays.get("dt_bias"),
        softplus,
        limit,
        negative,
    )
    y = y.astype(dtype)
    if return_final_state:
        return y, final.astype(dtype)
    return y


def ssd_step(
    state: Float[ArrayLike, "H P N"],
    x: Float[ArrayLike, "H P"],
    dt: Float[ArrayLike, " H"],
    A: Float[ArrayLike, " H"],
    B: Float[ArrayLike, "G N"],
    C: Float[ArrayLike, "G N"],
    D: Float[ArrayLike, " H"] | Float[ArrayLike, "H P"] | None = None,
    *,
    z: Float[ArrayLike, "H P"] | None = None,
    dt_bias: Float[ArrayLike, " H"] | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    negative_decays: bool = False,
) -> tuple[Float[Array, "H P"], Float[Array, "H P N"]]:
    r"""One step of [`eqx_seq.ssd_scan`][] in its recurrent form, for generation:
    the arguments of one time step of `ssd_scan` (its arrays without the time
    axis) and the state before it.

    Called on each step in turn from `h0`, it gives `ssd_scan`'s outputs and
    final state (to rounding).

    **Arguments:**

    - `state`: the state before the step, shape `(H, P, N)`.
    - `x`, `dt`, `B`, `C`, `z`: the step's rows, shapes `(H, P)`, `(H,)`,
        `(G, N)`, `(G, N)`, `(H, P)`.
    - `A`, `D`, `dt_bias`, `dt_softplus`, `dt_limit`, `negative_decays`: as for
        [`eqx_seq.ssd_scan`][].

    **Returns:**

    `(y, state)`: the step's output `(H, P)` and the state after it `(H, P, N)`, in
    the inputs' floating dtype.

    **Raises:**

    `ValueError` for a required array given as `None`, shapes that do not fit
    together, an axis of size zero, groups that do not divide the heads,
    non-floating arrays, a bad `dt_limit` or flags that are not bools.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        H, P, G, N = 4, 8, 1, 16
        k = jr.split(jr.key(0), 3)
        state = jnp.zeros((H, P, N))
        x, dt = jr.normal(k[0], (H, P)), jnp.full((H,), 0.1)
        B, C = jr.normal(k[1], (G, N)), jr.normal(k[2], (G, N))
        y, state = eqx_seq.ssd_step(state, x, dt, -jnp.ones(H), B, C)
        ```
    """
    name = "eqx_seq.ssd_step"
    limit = check_dt_limit(name, dt_limit)
    softplus = check_bool("dt_softplus", dt_softplus)
    negative = check_bool("negative_decays", negative_decays)
    given = dict(x=x, state=state, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    arrays = checked_arrays(name, given, required=("state", "x", "dt", "A", "B", "C"))
    check_shapes(name, arrays, time=())
    dtype, compute = compute_dtype(arrays)
    arrays = {k: v.astype(compute) for k, v in arrays.items()}
    y, state = _step(
        arrays["state"],
        arrays["x"],
        arrays["dt"],
        arrays["A"],
        arrays["B"],
        arrays["C"],
        arrays.get("D"),
        arrays.get("z"),
        arrays.get("dt_bias"),
        softplus,
        limit,
        negative,
    )
    return y.astype(dtype), state.astype(dtype)
