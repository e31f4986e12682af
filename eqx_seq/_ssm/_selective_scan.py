"""`selective_scan`: Mamba's S6 recurrence as a function, with the reference's
argument meanings, unbatched and time-first."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .._misc import check_positive_int, check_reset, check_sequence, vary_like
from .._scan import AbstractScan, AutoScan, check_scan
from ._selective_core import (
    decay_product,
    LoopKernel,
    RecurrenceKernel,
    selective_chunks,
)


def _check_shapes(arrays: dict, T: int, D: int, N: int) -> None:
    expected = {
        "u": (T, D),
        "delta": (T, D),
        "A": (D, N),
        "B": (T, N),
        "C": (T, N),
        "D": (D,),
        "z": (T, D),
        "delta_bias": (D,),
        "h0": (D, N),
    }
    for name, x in arrays.items():
        if x.shape != expected[name]:
            raise ValueError(
                f"`selective_scan`: `{name}` must have shape {expected[name]} (with "
                f"T = {T} steps, D = {D} channels and N = {N} states, read from "
                f"`u` {(T, D)} and `A` {(D, N)}), got shape {x.shape}."
            )


def _block(
    scan: AbstractScan, chunk: int, args: tuple, h0: Array, negative: bool
) -> tuple:
    """`(y, h_last)` of the selective recurrence from `h0` on one block, by the
    algorithm the block's backend declares: the fused loop of a sequential one,
    else its chunked recurrences."""
    if scan.parallel:
        kernel = RecurrenceKernel(scan, negative)
    else:
        kernel = LoopKernel(scan.unroll, negative)
    return selective_chunks(kernel, chunk, *args, h0)


@eqx.filter_jit
def _run(scan, chunk, u, delta, A, B, C, D, z, bias, softplus, h0, reset, negative):
    T = u.shape[0]
    if bias is not None:
        delta = delta + bias[None]
    if softplus:
        delta = jax.nn.softplus(delta)
    # Under `jax.shard_map`, a parameter shared by the devices meets per-device
    # data inside the custom VJP, whose cotangents must have its inputs' types:
    # made to vary here, JAX sums their cotangents over the devices outside.
    A = vary_like(A, u, delta, B, C)
    # padded steps have `delta = 0`: a decay of one and no input, so the last state
    # is that of the last real step
    pad = -T % chunk

    def padded(x):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    # zero decay at a segment start: the state restarts there
    keep = jnp.ones(T, A.dtype) if reset is None else (~reset).astype(A.dtype)
    args = (padded(delta), A, padded(u), padded(B), padded(C))
    args = args + (jnp.pad(keep, (0, pad), constant_values=1),)
    h0 = jnp.zeros_like(A) if h0 is None else h0
    h0 = vary_like(h0, A)
    local = scan.block_scan()

    def block_map(start):
        # this block's affine map `h -> prod(a) h + H` (for a time axis split over
        # devices): `prod(a)` its decays' product (zero if a segment starts in it)
        # and `H` its last state from `start`
        _, last = _block(local, chunk, args, vary_like(start, A), negative)
        return decay_product(delta, A, keep, negative), last

    h0 = vary_like(scan.carry_into_block(block_map, h0), A)
    y, h_last = _block(local, chunk, args, h0, negative)
    y = y[:T]
    if D is not None:
        y = y + D[None] * u
    if z is not None:
        y = y * jax.nn.silu(z)
    return y, h_last


def selective_scan(
    u: Float[ArrayLike, "T D"],
    delta: Float[ArrayLike, "T D"],
    A: Float[ArrayLike, "D N"],
    B: Float[ArrayLike, "T N"],
    C: Float[ArrayLike, "T N"],
    D: Float[ArrayLike, " D"] | None = None,
    *,
    z: Float[ArrayLike, "T D"] | None = None,
    delta_bias: Float[ArrayLike, " D"] | None = None,
    delta_softplus: bool = False,
    h0: Float[ArrayLike, "D N"] | None = None,
    reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
    return_last_state: bool = False,
    negative_decays: bool = False,
    scan: AbstractScan = AutoScan(),
    chunk_size: int = 64,
) -> Float[Array, "T D"] | tuple[Float[Array, "T D"], Float[Array, "D N"]]:
    r"""The selective scan of Mamba (S6): a diagonal recurrence whose decay and input
    depend on the input, with the read-out fused in.

    With $\Delta_t$ = `delta[t]` (after `delta_bias` and the softplus, if asked),
    $h_t \in \mathbb{R}^{D \times N}$ from $h_{-1}$ = `h0`:

    $h_t = \exp(\Delta_t A) \odot h_{t-1} + (\Delta_t \odot u_t)\, B_t^\top$,
    $\quad y_t = h_t C_t + D \odot u_t$,

    times $\mathrm{silu}(z_t)$ when `z` is given: the arguments and results of the
    reference `selective_scan_fn` of `state-spaces/mamba`, for one sequence, time
    first (`jax.vmap` for a batch). With `negative_decays=True` the decay
    $\exp(\Delta_t A)$ becomes $2 \exp(\Delta_t A) - 1$, in $(-1, 1)$, for state
    tracking (Grazzi et al., 2025).

    The `(T, D, N)` states are never stored: only `y`, the final state and the
    state at the start of every chunk of `chunk_size` steps. The gradient
    recomputes a chunk's states and runs the adjoint recurrence through it
    (hand-written, see `docs/devdocs/selective.md`), so its memory is
    `O(T D + (T / chunk_size) D N + chunk_size D N)`. A sequential backend
    ([`eqx_seq.SequentialScan`][]) runs a loop whose body computes a step's decay,
    input, update and read-out together; any other backend runs each chunk through
    its `recurrence`. Differentiable in reverse mode (`jax.grad`, `jax.vjp`) with
    respect to every array argument; forward mode (`jax.jvp`) is not defined.

    With [`eqx_seq.ShardedScan`][] (inside `jax.shard_map`, the time axis split
    over devices), each device runs its inner backend's algorithm on its block
    twice: from zero, for the block's map (its last state, and the product of its
    decays), then from the state folded from the maps of the
    blocks before it. Only the first device's `h0` is used, and the last
    device's `h_last` is the whole sequence's.

    **Arguments:**

    - `u`: the input, shape `(T, D)`.
    - `delta`: the step sizes $\Delta$ before `delta_bias` and the softplus,
        shape `(T, D)`.
    - `A`: the continuous-time decay rates, shape `(D, N)` (negative for a decaying
        state).
    - `B`, `C`: the input-dependent input and output vectors, shape `(T, N)`.
    - `D`: the skip connection, shape `(D,)`, or `None` for none.
    - `z`: the gate, shape `(T, D)`, or `None` for none.
    - `delta_bias`: added to `delta`, shape `(D,)`.
    - `delta_softplus`: apply `jax.nn.softplus` to `delta + delta_bias`.
    - `h0`: the state before the first step, shape `(D, N)`; zeros if `None`.
    - `reset`: optional bools, shape `(T,)`, `True` where a segment starts (packed
        sequences): there the state restarts from zero (the decay is zero, and
        replaces the state whatever it held, NaN and inf included), so each segment
        gives the outputs of a separate call, and `h0` is ignored at a reset on
        step 0.
    - `return_last_state`: also return the state after the last step.
    - `negative_decays`: decays `2 exp(delta A) - 1` in `(-1, 1)` instead of
        `exp(delta A)`.
    - `scan`: the backend, an [`eqx_seq.AbstractScan`][].
    - `chunk_size`: the steps between stored states.

    **Returns:**

    `y`, shape `(T, D)`; `(y, h_last)` with `h_last` of shape `(D, N)` if
    `return_last_state`. In the inputs' floating dtype (half precision is computed
    in float32 and cast back).

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        T, D, N = 100, 8, 4
        k1, k2, k3 = jr.split(jr.key(0), 3)
        u = jr.normal(k1, (T, D))
        delta = jnp.full((T, D), 0.1)
        A = -jnp.broadcast_to(jnp.arange(1.0, N + 1), (D, N))  # S4D-real
        B, C = jr.normal(k2, (T, N)), jr.normal(k3, (T, N))
        y, h = eqx_seq.selective_scan(u, delta, A, B, C, return_last_state=True)
        ```
    """
    check_positive_int("chunk_size", chunk_size)
    chosen = check_scan(scan, name="eqx_seq.selective_scan", splits_time=True)
    given = {
        "u": u,
        "delta": delta,
        "A": A,
        "B": B,
        "C": C,
        "D": D,
        "z": z,
        "delta_bias": delta_bias,
        "h0": h0,
    }
    arrays = {}
    for name, x in given.items():
        if x is None:
            continue
        try:
            x = jnp.asarray(x)
        except TypeError as e:
            raise ValueError(f"`selective_scan`: `{name}` must be an array: {e}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"`selective_scan` needs real floating arrays, got {x.dtype} for "
                f"`{name}`; cast it, e.g. `{name}.astype(jnp.float32)`."
            )
        arrays[name] = x
    check_sequence(arrays["u"], None, "selective_scan", "D")
    if arrays["A"].ndim != 2:
        raise ValueError(
            f"`selective_scan`: `A` must have shape (D, N), got {arrays['A'].shape}."
        )
    (T, D_), N = arrays["u"].shape, arrays["A"].shape[1]
    _check_shapes(arrays, T, D_, N)
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*arrays.values())
        compute = jnp.promote_types(dtype, jnp.float32)
    arrays = {k: v.astype(compute) for k, v in arrays.items()}
    y, h_last = _run(
        chosen,
        min(chunk_size, T),
        arrays["u"],
        arrays["delta"],
        arrays["A"],
        arrays["B"],
        arrays["C"],
        arrays.get("D"),
        arrays.get("z"),
        arrays.get("delta_bias"),
        bool(delta_softplus),
        arrays.get("h0"),
        check_reset(reset, T, "selective_scan"),
        bool(negative_decays),
    )
    y = y.astype(dtype)
    if return_last_state:
        return y, h_last.astype(dtype)
    return y
