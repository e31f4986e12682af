"""`delta_rule_scan` and `delta_rule_step`: the gated delta rule on one sequence,
time first, chunked (`_chunk.py`) or one step at a time."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .._misc import (
    check_bool,
    check_positive_int,
    check_real,
    check_reset,
    vary_like,
)
from .._recurrence import linear_recurrence
from .._scan import AbstractScan, AutoScan, check_scan
from .._ssm._packing import (
    count_last,
    finite,
    finite_cotangent,
    into_chunks,
    keeps,
    link,
    met_within,
    reads,
)
from .._ssm._ssd_checks import checked_arrays, compute_dtype
from ._chunk import chunked


def _unit(x: Array) -> Array:
    """`x` over its L2 norm along the last axis, `x / sqrt(|x|^2 + 1e-6)` as the
    field's kernels normalise queries and keys."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _check_shapes(name: str, arrays: dict, time: tuple) -> None:
    """Shapes against those `q` and `v` give (`time`: `(T,)`, or `()` for a step)."""
    q, v = arrays["q"], arrays["v"]
    n = len(time)
    if q.ndim != n + 2 or (time and q.shape[0] == 0):
        what = "(T, G, dk) with T >= 1" if time else "(G, dk)"
        raise ValueError(
            f"`{name}`: `q` must have shape {what}, got shape {q.shape}"
            + ("; use `jax.vmap` for a batch." if time else ".")
        )
    if v.ndim != n + 2:
        what = "(T, H, dv)" if time else "(H, dv)"
        raise ValueError(f"`{name}`: `v` must have shape {what}, got {v.shape}.")
    *_, G, dk = q.shape
    *_, H, dv = v.shape
    if not min(G, dk, H, dv):
        raise ValueError(
            f"`{name}`: every axis of the heads must have a size: got G = {G} query "
            f"and key heads of dk = {dk} (`q` {q.shape}), H = {H} value heads of "
            f"dv = {dv} (`v` {v.shape})."
        )
    if H % G:
        raise ValueError(
            f"`{name}`: the {G} heads of `q` and `k` must divide the {H} heads of "
            f"`v` (each serves H / G of them), got G = {G}, H = {H}."
        )
    T = q.shape[:1] if time else ()
    expected = {
        "k": (*T, G, dk), "v": (*T, H, dv), "beta": (*T, H), "g": (*T, H),
        "h0": (H, dk, dv), "state": (H, dk, dv),
    }  # fmt: skip
    sizes = (
        f"G = {G} query and key heads of dk = {dk}, H = {H} value heads of dv = {dv}"
    )
    if T:
        sizes = f"T = {T[0]} steps, " + sizes
    for key, a in arrays.items():
        if key != "q" and a.shape != expected[key]:
            raise ValueError(
                f"`{name}`: `{key}` must have shape {expected[key]} (with {sizes}, "
                f"read from `q` {q.shape} and `v` {v.shape}), got {a.shape}."
            )


def _prepare(name: str, given: dict, required: tuple, time: tuple, scale, normalize):
    arrays = checked_arrays(name, given, required=required)
    _check_shapes(name, arrays, time)
    if scale is not None:
        scale = check_real("scale", scale, positive=True)
    normalize = check_bool("normalize_qk", normalize)
    dtype, compute = compute_dtype(arrays)
    arrays = {key: a.astype(compute) for key, a in arrays.items()}
    dk = arrays["q"].shape[-1]
    return arrays, dtype, dk**-0.5 if scale is None else scale, normalize


@eqx.filter_jit
def _run(scan, chunk, q, k, v, beta, g, h0, reset, scale, normalize):
    T, G, dk = q.shape
    _, H, dv = v.shape
    R = H // G
    heads = lambda a: jnp.repeat(a, R, axis=1)  # (T, G, ...) -> (T, H, ...)
    # finite inputs; which were not, per state column (head and value channel) and
    # per output; a sum of them per step and per output (the derivatives' link)
    q, bad_q = finite(q)
    k, bad_k = finite(k)
    v, bad_v = finite(v)
    beta, bad_beta = finite(beta)
    g = jnp.zeros_like(beta) if g is None else g
    g, bad_g = finite(g)
    h0 = jnp.zeros((H, dk, dv), q.dtype) if h0 is None else h0
    h0, bad_h0 = finite(h0)
    # under `jax.shard_map`, a shared `h0` meets per-device data in the carries and
    # in `link`'s rule, whose types must match
    h0 = vary_like(h0, q, k, v, beta, g)
    bad_step = heads(jnp.any(bad_k, axis=-1)) | bad_beta | bad_g  # (T, H)
    bad_state = (bad_v | bad_step[..., None]).reshape(T, H * dv)
    bad_y = heads(jnp.any(bad_q, axis=-1))[..., None]  # (T, H, 1)
    per_step = heads(jnp.sum(k, axis=-1)) + beta + g
    per_step = (v + per_step[..., None]).reshape(T, H * dv)
    per_output = heads(jnp.sum(q, axis=-1))[..., None]
    per_output = jnp.broadcast_to(per_output, (T, H, dv)).reshape(T, H * dv)
    h0_link = jnp.sum(h0, axis=1).reshape(H * dv)
    if normalize:
        q, k = _unit(q), _unit(k)
    q = q * scale
    # padded steps change nothing: no key, no write, a gate of one
    K = -(-T // chunk)

    chunks = ft.partial(into_chunks, chunk)
    resets = None if reset is None else chunks(reset.astype(jnp.int32))
    segment = jnp.zeros((K, chunk), jnp.int32) if resets is None else resets
    segment = jnp.cumsum(segment, axis=1)
    y, final = chunked(
        chunks(q, G),
        chunks(k, G),
        chunks(v.reshape(T, G, R, dv), G, R),
        chunks(beta.reshape(T, G, R), G, R),
        chunks(g.reshape(T, G, R), G, R),
        segment,
        h0.reshape(G, R, dk, dv),
        scan,
    )
    y = jnp.moveaxis(y, 3, 1).reshape(K * chunk, H, dv)[:T]
    final = final.reshape(H, dk, dv)

    # the non-finite inputs each output and the final state depend on: those of
    # its segment up to it, in its chunk and carried from the chunks before it
    bad = chunks(bad_state.astype(q.dtype))
    met = met_within(bad, resets)  # (K, C, H * dv)
    keep = jnp.broadcast_to(keeps(resets, K, q.dtype)[:, None], (K, H * dv))
    start = jnp.any(bad_h0, axis=1).reshape(H * dv).astype(q.dtype)
    carried = linear_recurrence(keep, count_last(bad, resets), start, scan=scan)
    entering = scan.shift(carried, start) > 0
    met = met | (entering[:, None] & reads(resets, K, chunk)[..., None])
    met = met.reshape(K * chunk, H, dv)[:T]
    to_y, to_final = link(scan, chunks(per_step), chunks(per_output), resets, h0_link)
    y = finite_cotangent(y) + to_y.reshape(K * chunk, H, dv)[:T]
    y = jnp.where(bad_y | met, jnp.nan, y)
    final = finite_cotangent(final) + to_final.reshape(H, 1, dv)
    return y, jnp.where((carried[-1] > 0).reshape(H, 1, dv), jnp.nan, final)


def delta_rule_scan(
    q: Float[ArrayLike, "T G dk"],
    k: Float[ArrayLike, "T G dk"],
    v: Float[ArrayLike, "T H dv"],
    beta: Float[ArrayLike, "T H"],
    *,
    g: Float[ArrayLike, "T H"] | None = None,
    h0: Float[ArrayLike, "H dk dv"] | None = None,
    reset: Bool[ArrayLike, " T"] | None = None,
    scale: float | None = None,
    normalize_qk: bool = False,
    chunk_size: int = 64,
    scan: AbstractScan = AutoScan(),
    return_final_state: bool = False,
) -> Float[Array, "T H dv"] | tuple[Float[Array, "T H dv"], Float[Array, "H dk dv"]]:
    r"""The gated delta rule (DeltaNet, Gated DeltaNet): a recurrence on one matrix
    state per head, computed in chunks.

    Head $h$'s state $S^h_t \in \mathbb{R}^{d_k \times d_v}$, from `h0`:

    $S^h_t = \alpha^h_t (I - \beta^h_t k_t k_t^\top) S^h_{t-1}
    + \beta^h_t k_t v^{h\top}_t$, $\quad o^h_t = s\, S^{h\top}_t q_t$,

    with $\alpha = \exp(g)$ (one without `g`: DeltaNet), $s$ = `scale`, and $q_t$,
    $k_t$ those of the head's group (`H / G` consecutive value heads share one
    query and key head). The state is stored `[key, value]`, as the field's
    checkpoints store it. For keys of unit norm (`normalize_qk`) and
    $\beta \in (0, 2)$ each step's map has eigenvalues $\alpha$ and
    $\alpha (1 - \beta) \in (-\alpha, \alpha)$: the negative ones let a layer
    track state such as parity (Grazzi et al., "Unlocking State-Tracking in Linear
    RNNs Through Negative Eigenvalues", 2025).

    Inside a chunk of `chunk_size` steps the outputs are products of masked,
    gate-weighted `C x C` matrices, through one unit lower-triangular solve per
    chunk and head (the WY representation's UT transform; a solve, not a series,
    so that $\beta$ up to 2 stays accurate); between chunks the state is carried
    by each chunk's map in factored form, sequentially (on a time axis split over
    devices, [`eqx_seq.ShardedScan`][], each device's block reduces to one affine
    map of its entering state, the devices exchange those, and each runs its
    chunks from its entering state). The `(T, H, dk, dv)` states are never
    formed: the gradient keeps one state per chunk (and each chunk's `C x C`
    weights), never one per step, so its memory is
    `O(T H (dk + dv + C) + (T / C) H dk dv)`. Differentiable in
    reverse and forward mode with respect to every array argument.

    A value that is not finite (NaN or inf, in any array) reaches exactly the
    outputs that depend on it, as in the recurrent form: the later steps of its
    segment (a `v` entry only its value channel, a `q` row only its step), never
    an earlier step nor another segment, and they are NaN (the final state too).
    So packed documents stay independent whatever one of them holds, in the
    derivatives as well.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(T, G, dk)`: `G` heads of `dk` channels.
    - `v`: values, shape `(T, H, dv)`, `G` dividing `H`.
    - `beta`: the write strengths, shape `(T, H)` (in `(0, 1)`, or `(0, 2)` for
        negative eigenvalues).
    - `g`: the log-gates $\log \alpha \le 0$, shape `(T, H)`, or `None` for none.
    - `h0`: the state before the first step, shape `(H, dk, dv)`; zeros if `None`.
    - `reset`: optional bools, shape `(T,)`, `True` where a segment starts (packed
        sequences): there the state restarts from zero, so each segment gives the
        outputs of a separate call (`h0` is ignored at a reset on step 0).
    - `scale`: the outputs' scale $s$; `dk ** -0.5` if `None`.
    - `normalize_qk`: divide `q` and `k` by their L2 norms first (with `1e-6`
        added to the squared norm, as the field's kernels do).
    - `chunk_size`: the steps per chunk (`T` need not be a multiple of it).
    - `scan`: the backend of the pass between chunks, an [`eqx_seq.AbstractScan`][].
        The state's pass is a loop on every backend (each chunk's map is dense:
        no diagonal recurrence carries it); with [`eqx_seq.ShardedScan`][] the
        time axis is split over devices (only the first device's `h0` is used).
    - `return_final_state`: also return the state after the last step.

    **Returns:**

    The outputs `o`, shape `(T, H, dv)`; `(o, final_state)` with `final_state` of
    shape `(H, dk, dv)` if `return_final_state` (under [`eqx_seq.ShardedScan`][],
    the last device's is the whole sequence's). In the inputs' floating dtype
    (half precision is computed in float32 and cast back).

    **Raises:**

    `ValueError` for a required array given as `None`, shapes that do not fit
    together, an axis of size zero, heads of `q` that do not divide those of `v`,
    non-floating arrays, a `reset` that is not `(T,)` bools, a bad `scale` or
    `chunk_size`, flags that are not bools, or a `scan` that is not an
    [`eqx_seq.AbstractScan`][].

    !!! Example

        ```python
        import jax, jax.numpy as jnp, jax.random as jr
        import eqx_seq

        T, G, H, dk, dv = 200, 2, 4, 16, 16
        kq, kk, kv, kb = jr.split(jr.key(0), 4)
        q, k = jr.normal(kq, (T, G, dk)), jr.normal(kk, (T, G, dk))
        v = jr.normal(kv, (T, H, dv))
        beta = jax.nn.sigmoid(jr.normal(kb, (T, H)))
        g = jnp.full((T, H), -0.05)
        o, state = eqx_seq.delta_rule_scan(
            q, k, v, beta, g=g, normalize_qk=True, return_final_state=True
        )
        ```
    """
    name = "eqx_seq.delta_rule_scan"
    check_positive_int("chunk_size", chunk_size)
    chosen = check_scan(scan, name=name, splits_time=True)
    check_bool("return_final_state", return_final_state)
    given = dict(q=q, k=k, v=v, beta=beta, g=g, h0=h0)
    arrays, dtype, scale, normalize = _prepare(
        name, given, ("q", "k", "v", "beta"), (None,), scale, normalize_qk
    )
    T = arrays["q"].shape[0]
    o, final = _run(
        chosen,
        min(chunk_size, T),
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays["beta"],
        arrays.get("g"),
        arrays.get("h0"),
        check_reset(reset, T, name),
        scale,
        normalize,
    )
    o = o.astype(dtype)
    if return_final_state:
        return o, final.astype(dtype)
    return o


def delta_rule_step(
    state: Float[ArrayLike, "H dk dv"],
    q: Float[ArrayLike, "G dk"],
    k: Float[ArrayLike, "G dk"],
    v: Float[ArrayLike, "H dv"],
    beta: Float[ArrayLike, " H"],
    *,
    g: Float[ArrayLike, " H"] | None = None,
    scale: float | None = None,
    normalize_qk: bool = False,
) -> tuple[Float[Array, "H dv"], Float[Array, "H dk dv"]]:
    r"""One step of [`eqx_seq.delta_rule_scan`][] in its recurrent form, for
    generation: the arguments of one time step of `delta_rule_scan` (its arrays
    without the time axis) and the state before it.

    Called on each step in turn from `h0`, it gives `delta_rule_scan`'s outputs
    and final state (to rounding).

    **Arguments:**

    - `state`: the state before the step, shape `(H, dk, dv)`.
    - `q`, `k`, `v`, `beta`, `g`: the step's rows, shapes `(G, dk)`, `(G, dk)`,
        `(H, dv)`, `(H,)`, `(H,)`.
    - `scale`, `normalize_qk`: as for [`eqx_seq.delta_rule_scan`][].

    **Returns:**

    `(o, state)`: the step's output `(H, dv)` and the state after it
    `(H, dk, dv)`, in the inputs' floating dtype.

    **Raises:**

    `ValueError` for a required array given as `None`, shapes that do not fit
    together, an axis of size zero, heads of `q` that do not divide those of `v`,
    non-floating arrays, a bad `scale` or a flag that is not a bool.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        G, H, dk, dv = 1, 2, 8, 8
        kq, kk, kv = jr.split(jr.key(0), 3)
        state = jnp.zeros((H, dk, dv))
        q, k = jr.normal(kq, (G, dk)), jr.normal(kk, (G, dk))
        o, state = eqx_seq.delta_rule_step(
            state, q, k, jr.normal(kv, (H, dv)), jnp.full((H,), 0.5),
            normalize_qk=True,
        )
        ```
    """
    name = "eqx_seq.delta_rule_step"
    given = dict(q=q, k=k, v=v, beta=beta, g=g, state=state)
    arrays, dtype, scale, normalize = _prepare(
        name, given, ("state", "q", "k", "v", "beta"), (), scale, normalize_qk
    )
    o, state = _step(
        arrays["state"],
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays["beta"],
        arrays.get("g"),
        scale,
        normalize,
    )
    return o.astype(dtype), state.astype(dtype)


def _step(S, q, k, v, beta, g, scale, normalize):
    H = v.shape[0]
    R = H // q.shape[0]
    if normalize:
        q, k = _unit(q), _unit(k)
    q, k = jnp.repeat(q, R, axis=0) * scale, jnp.repeat(k, R, axis=0)
    if g is not None:
        S = jnp.exp(g)[:, None, None] * S
    u = beta[:, None] * (v - jnp.einsum("hde,hd->he", S, k))
    S = S + k[:, :, None] * u[:, None, :]
    return jnp.einsum("hde,hd->he", S, q), S
