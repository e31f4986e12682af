"""The Mamba-2 layer: one input projection, a causal convolution, the chunked scan
(SSD) and a gated RMS norm."""

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real
from typing_extensions import TypeAliasType

from .._misc import (
    check_bool,
    check_parameter_dtype,
    check_positive_int,
    check_real,
    check_reals,
    check_reset,
    check_sequence,
    real_input,
)
from .._scan import AbstractScan, AutoScan, check_scan
from ._conv import CausalConv
from ._mamba import linear_weight
from ._recurrent import AbstractRecurrentLayer
from ._ssd import ssd_scan, ssd_step
from ._ssd_checks import check_dt_limit


DECAY_INITS = ("independent", "stratified")


def check_decay_init(
    A_init_range: object,
    dt_min: object,
    dt_max: object,
    dt_init_floor: object,
    decay_init: object,
) -> tuple[float, float, float, float, float, bool]:
    """The initialisation of Mamba-2's decays (and Gated DeltaNet's gates),
    checked: `(low, high, dt_min, dt_max, dt_init_floor, stratified)`."""
    lo, hi = check_reals("A_init_range", A_init_range, ("low", "high"), positive=True)
    if not lo <= hi:
        raise ValueError(
            f"`A_init_range` must be (low, high) with low <= high, got "
            f"{A_init_range!r}."
        )
    dt_min = check_real("dt_min", dt_min, positive=True)
    dt_max = check_real("dt_max", dt_max, positive=True)
    if not dt_min < dt_max:
        raise ValueError(f"Need dt_min < dt_max, got dt_min={dt_min}, dt_max={dt_max}.")
    if not (isinstance(decay_init, str) and decay_init in DECAY_INITS):
        raise ValueError(
            f"`decay_init` must be one of {DECAY_INITS}, got {decay_init!r}."
        )
    return (
        lo,
        hi,
        dt_min,
        dt_max,
        check_real("dt_init_floor", dt_init_floor, nonnegative=True),
        decay_init == "stratified",
    )


def init_decays(
    dt_key: PRNGKeyArray, A_key: PRNGKeyArray, heads: int, ranges: tuple, dtype
) -> tuple[Float[Array, " heads"], Float[Array, " heads"]]:
    """`(A_log, dt_bias)` from the checked `ranges`: `exp(A_log)` uniform in
    `[low, high]`; the step size `Δ = softplus(dt_bias)` at least `dt_init_floor`
    (`dt_bias` is its inverse softplus), and either log-uniform in
    `[dt_min, dt_max]` independently per head, or (stratified) such that the heads'
    decay rates `exp(A_log) Δ` fall one in each of `heads` equal slices of
    `[low dt_min, high dt_max]` on a log scale, in a random order, each uniform
    (in log) within its slice.

    Stratified, every layer starts with heads of long and of short memory; drawn
    independently, all of a layer's heads may start with short memory."""
    lo, hi, dt_min, dt_max, floor, stratified = ranges
    A = jr.uniform(A_key, (heads,), dtype, minval=lo, maxval=hi)
    if stratified:
        low, high = math.log(lo * dt_min), math.log(hi * dt_max)
        order_key, within_key = jr.split(dt_key)
        slot = jr.permutation(order_key, heads).astype(dtype)
        where = (slot + jr.uniform(within_key, (heads,), dtype)) / heads
        dt = jnp.exp(low + where * (high - low)) / A
    else:
        low, high = math.log(dt_min), math.log(dt_max)
        dt = jnp.exp(jr.uniform(dt_key, (heads,), dtype, minval=low, maxval=high))
    dt = jnp.maximum(dt, floor)
    return jnp.log(A), dt + jnp.log(-jnp.expm1(-dt))


# The state of `Mamba2` and `Mamba2Block`: the convolution's last `conv_size - 1`
# inputs (of `x`, `B` and `C` together) and the scan's state per head.
Mamba2State = TypeAliasType(
    "Mamba2State", tuple[Float[Array, "K1 C"], Float[Array, "Hd P N"]]
)


class Mamba2(AbstractRecurrentLayer):
    """The Mamba-2 layer: a selective state space model with one scalar decay per
    head, computed by the chunked scan [`eqx_seq.ssd_scan`][].

    Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
    Through Structured State Space Duality", 2024. On `x` of shape `(T, H)`, with
    `E = expand * H` channels in `E / head_dim` heads and `G = ngroups`:

    1. one in-projection to `(z, x, B, C, dt)`: `E`, `E`, `G N`, `G N` and one
        step size per head;
    2. `(x, B, C) -> silu(conv(x, B, C))` (a causal depthwise convolution of
        `conv_size` taps);
    3. [`eqx_seq.ssd_scan`][] with `A = -exp(A_log)` per head, the skip `D`,
        `dt_bias` and the softplus;
    4. the gated RMS norm `rmsnorm(y * silu(z))`, normalised over each group's
        `E / G` channels;
    5. out-projection back to `H`.

    The state of step mode and streaming, [`eqx_seq.Mamba2State`][], is
    `(conv_state, ssm_state)`: the last `conv_size - 1` inputs of the convolution,
    `(conv_size - 1, E + 2 G N)`, and the scan's state, `(E / head_dim, head_dim,
    state_size)`.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.Mamba2(32, state_size=16, head_dim=16, key=jr.key(0))
        y = layer(jnp.ones((100, 32)))                 # (100, 32)
        ```
    """

    recurrence_fields: ClassVar[tuple[str, ...]] = ("A_log", "D", "dt_bias")
    in_proj: Float[Array, "I H"]
    conv: CausalConv
    dt_bias: Float[Array, " Hd"]
    A_log: Float[Array, " Hd"]
    D: Float[Array, " Hd"]
    norm_weight: Float[Array, " E"]
    out_proj: Float[Array, "H E"]
    input_size: int = eqx.field(static=True)
    state_size: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    ngroups: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    dt_limit: tuple[float, float] = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    negative_decays: bool = eqx.field(static=True)
    scan: AbstractScan

    def __init__(
        self,
        input_size: int,
        *,
        state_size: int = 128,
        head_dim: int = 64,
        expand: int = 2,
        ngroups: int = 1,
        conv_size: int = 4,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        decay_init: Literal["independent", "stratified"] = "independent",
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        norm_eps: float = 1e-5,
        negative_decays: bool = False,
        chunk_size: int = 64,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: `H`, the number of input (and output) features.
        - `state_size`: `N`, the states per channel.
        - `head_dim`: `P`, the channels per head; must divide `E = expand * H`.
        - `expand`: `E = expand * H` channels inside the layer.
        - `ngroups`: `G`, the groups of heads that share `B` and `C`; must divide
            the number of heads `E / head_dim`.
        - `conv_size`: the taps of the causal convolution.
        - `A_init_range`: `-A` starts uniform in this range, one per head.
        - `dt_min`, `dt_max`, `dt_init_floor`: the step sizes start log-uniform in
            `[dt_min, dt_max]` (with `decay_init="independent"`), at least
            `dt_init_floor` (through `dt_bias`).
        - `decay_init`: `"independent"` (the reference's) draws each head's `-A` and
            step size independently; `"stratified"` keeps `-A`'s draw and sets the
            step sizes so that each layer's decay rates `-A * dt` fall one in each
            equal slice of `[low * dt_min, high * dt_max]` on a log scale (in a
            random order), so that every layer starts with heads of long and of
            short memory (see the MQAR example).
        - `dt_limit`: `(low, high)`, the step sizes clamped to it (the default
            clamps nothing).
        - `norm_eps`: the gated RMS norm's epsilon.
        - `negative_decays`: decays `2 exp(dt A) - 1` in `(-1, 1)` instead of
            `exp(dt A)`, for state tracking (see [`eqx_seq.ssd_scan`][]).
        - `chunk_size`: [`eqx_seq.ssd_scan`][]'s steps per chunk (the reference's
            256 suits GPUs; on CPU shorter chunks are faster, see the benchmarks
            page).
        - `scan`: the backend of the recurrence between chunks, an
            [`eqx_seq.AbstractScan`][]; with [`eqx_seq.ShardedScan`][] the
            convolution also reads the `conv_size - 1` inputs before each device's
            block from the device before.
        - `dtype`: the parameter dtype, float32 or float64 (default: JAX's default
            float). Half-precision inputs are computed in this dtype.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        for name, value in (
            ("input_size", input_size),
            ("state_size", state_size),
            ("head_dim", head_dim),
            ("expand", expand),
            ("ngroups", ngroups),
            ("conv_size", conv_size),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, value)
        E = expand * input_size
        if E % head_dim:
            raise ValueError(
                f"`head_dim` must divide the {E} channels (expand * input_size = "
                f"{expand} * {input_size}), got head_dim={head_dim}."
            )
        heads = E // head_dim
        if heads % ngroups:
            raise ValueError(
                f"`ngroups` must divide the {heads} heads (E / head_dim = {E} / "
                f"{head_dim}), got ngroups={ngroups}."
            )
        ranges = check_decay_init(
            A_init_range, dt_min, dt_max, dt_init_floor, decay_init
        )
        norm_eps = check_real("norm_eps", norm_eps, positive=True)
        dt_limit = check_dt_limit("eqx_seq.Mamba2", dt_limit)
        check_scan(scan, name="eqx_seq.Mamba2", splits_time=True)
        dtype = check_parameter_dtype("Mamba2", dtype)
        GN = ngroups * state_size
        ikey, ckey, dkey, akey, okey = jr.split(key, 5)
        self.in_proj = linear_weight(ikey, input_size, 2 * E + 2 * GN + heads, dtype)
        self.conv = CausalConv(E + 2 * GN, conv_size, dtype=dtype, key=ckey)
        self.A_log, self.dt_bias = init_decays(dkey, akey, heads, ranges, dtype)
        self.D = jnp.ones(heads, dtype)
        self.norm_weight = jnp.ones(E, dtype)
        self.out_proj = linear_weight(okey, E, input_size, dtype)
        self.input_size = input_size
        self.state_size = state_size
        self.head_dim = head_dim
        self.ngroups = ngroups
        self.chunk_size = chunk_size
        self.dt_limit = dt_limit
        self.norm_eps = norm_eps
        self.negative_decays = check_bool("negative_decays", negative_decays)
        self.scan = scan

    @property
    def channels(self) -> int:
        """`E`, the channels inside the layer."""
        return self.norm_weight.shape[0]

    @property
    def heads(self) -> int:
        """The number of heads, `E / head_dim`."""
        return self.D.shape[0]

    # ---------------------------------------------------------------- validation

    def _state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        conv = (self.conv.kernel_size - 1, self.channels + 2 * self._gn)
        return conv, (self.heads, self.head_dim, self.state_size)

    @property
    def _gn(self) -> int:
        return self.ngroups * self.state_size

    def _check_state(self, state, name: str = "Mamba2") -> Mamba2State:
        shapes = self._state_shapes()
        expected = (
            "a pair `(conv_state, ssm_state)` of real floating arrays of shapes "
            f"{shapes[0]} and {shapes[1]}, as `init_state()` returns"
        )
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise ValueError(f"`{name}`: the state must be {expected}, got {state!r}.")
        parts = []
        for part, shape in zip(state, shapes):
            try:
                part = jnp.asarray(part)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`{name}`: the state must be {expected}, got {state!r}."
                ) from None
            if part.shape != shape or not jnp.issubdtype(part.dtype, jnp.floating):
                raise ValueError(
                    f"`{name}`: the state must be {expected}, got {part.dtype} of "
                    f"shape {part.shape} for a part of shape {shape}."
                )
            parts.append(part)
        return tuple(parts)

    def _check(self, x, h0, reset) -> tuple[Array, Mamba2State | None, Array | None]:
        x = check_sequence(x, self.input_size, "Mamba2", dtype=self.D.dtype)
        if h0 is not None:
            h0 = self._check_state(h0)
        reset = check_reset(reset, x.shape[0], "Mamba2")
        return x.astype(self._dtype(x)), h0, reset

    def _dtype(self, x: Array) -> jnp.dtype:
        with jax.numpy_dtype_promotion("standard"):
            return jnp.result_type(self.D.dtype, x.dtype)

    # -------------------------------------------------------------------- pieces

    def _project(self, x: Array) -> tuple[Array, Array, Array]:
        """`(z, xBC, dt)`: the in-projection (last axis of `x`), as one product per
        part rather than one product sliced, whose slices and their gradient's
        padding would each be a pass over the projection."""
        E, GN = self.channels, self._gn
        w = self.in_proj.astype(x.dtype)
        return (
            x @ w[:E].T,
            x @ w[E : 2 * E + 2 * GN].T,
            x @ w[2 * E + 2 * GN :].T,
        )

    def _heads(self, xBC: Array) -> tuple[Array, Array, Array]:
        """`(x, B, C)` with heads and groups, `(..., heads, P)` and `(..., G, N)`."""
        E, GN, G, N = self.channels, self._gn, self.ngroups, self.state_size
        lead = xBC.shape[:-1]
        x = xBC[..., :E].reshape(*lead, self.heads, self.head_dim)
        B = xBC[..., E : E + GN].reshape(*lead, G, N)
        C = xBC[..., E + GN :].reshape(*lead, G, N)
        return x, B, C

    def _gated_norm(self, y: Array, z: Array) -> Array:
        """`rmsnorm(y * silu(z)) * weight`, the mean square over each group's
        channels."""
        g = y * jax.nn.silu(z)
        lead = g.shape[:-1]
        g = g.reshape(*lead, self.ngroups, -1)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.norm_eps)
        weight = self.norm_weight.astype(g.dtype)
        return g.reshape(*lead, -1) * weight.reshape((1,) * len(lead) + (-1,))

    def _run(
        self, x: Array, h0: Mamba2State | None, reset: Array | None
    ) -> tuple[Array, Mamba2State]:
        dtype = x.dtype
        z, xBC, dt = self._project(x)
        conv_state, ssm_state = (None, None) if h0 is None else h0
        # on a time axis split over devices, the inputs before this block
        conv_state = self.conv.block_state(xBC, conv_state, reset, self.scan)
        xs, B, C = self._heads(jax.nn.silu(self.conv(xBC, conv_state, reset)))
        y, h = ssd_scan(
            xs,
            dt,
            -jnp.exp(self.A_log.astype(dtype)),
            B,
            C,
            self.D.astype(dtype),
            dt_bias=self.dt_bias.astype(dtype),
            dt_softplus=True,
            dt_limit=self.dt_limit,
            negative_decays=self.negative_decays,
            h0=None if ssm_state is None else ssm_state.astype(dtype),
            reset=reset,
            return_final_state=True,
            chunk_size=self.chunk_size,
            scan=self.scan,
        )
        y = self._gated_norm(y.reshape(y.shape[0], -1), z)
        state = (self.conv.final_state(xBC, conv_state, reset), h)
        return y @ self.out_proj.astype(dtype).T, state

    # -------------------------------------------------------------------- public

    def __call__(
        self,
        x: Real[ArrayLike, "T H"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: Mamba2State | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T H"]:
        """Run the layer over a whole sequence.

        **Arguments:**

        - `x`: the input sequence, shape `(T, input_size)`. One example:
            `jax.vmap` over a batch.
        - `reset`: optional bools, shape `(T,)`, `True` where a segment starts
            (packed sequences): the convolution and the scan restart there, so
            each segment gives the outputs of a separate call.
        - `h0`: optional state `(conv_state, ssm_state)` to continue from (a
            previous chunk's [`eqx_seq.Mamba2.final_state`][]); zeros if `None`.
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:**

        The output sequence, shape `(T, input_size)`.
        """
        del key
        with jax.named_scope("eqx_seq.Mamba2"):
            x, h0, reset = self._check(x, h0, reset)
            return self._run(x, h0, reset)[0]

    def final_state(
        self,
        x: Real[ArrayLike, "T H"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: Mamba2State | None = None,
    ) -> Mamba2State:
        """The state `(conv_state, ssm_state)` after the last step of `x`: calling
        the layer chunk after chunk, each with `h0=` the `final_state` of the
        chunks so far, gives the outputs of one call on the whole sequence."""
        x, h0, reset = self._check(x, h0, reset)
        return self._run(x, h0, reset)[1]

    def init_state(self) -> Mamba2State:
        """The zero state to start step mode from."""
        conv, ssm = self._state_shapes()
        dtype = self.D.dtype
        return jnp.zeros(conv, dtype), jnp.zeros(ssm, dtype)

    def step(
        self,
        state: Mamba2State,
        x_t: Real[ArrayLike, " H"],
        *,
        reset: bool | Bool[ArrayLike, ""] = False,
    ) -> tuple[Mamba2State, Float[Array, " H"]]:
        """One step (RNN mode): stepping from `init_state()` gives the outputs of
        the parallel call, to float tolerance. `reset=True` starts a segment.

        **Returns:**

        `(state, y_t)`, `y_t` of shape `(input_size,)`.
        """
        x_t = jnp.asarray(x_t)
        if x_t.shape != (self.input_size,):
            raise ValueError(
                f"`Mamba2.step` takes one real input of shape ({self.input_size},), "
                f"got {x_t.dtype} of shape {x_t.shape}."
            )
        x_t = real_input(x_t, "Mamba2.step", self.D.dtype)
        reset = jnp.asarray(reset)
        if reset.shape != () or reset.dtype != jnp.bool_:
            raise ValueError(f"`reset` in `step` must be a bool scalar, got {reset!r}.")
        conv_state, h = self._check_state(state, "Mamba2.step")
        dtype = self._dtype(x_t)
        z, xBC, dt = self._project(x_t.astype(dtype))
        conv_state, xBC = self.conv.step(conv_state.astype(dtype), xBC, reset)
        xs, B, C = self._heads(jax.nn.silu(xBC))
        h = jnp.where(reset, jnp.zeros((), dtype), h.astype(dtype))
        y, h = ssd_step(
            h,
            xs,
            dt,
            -jnp.exp(self.A_log.astype(dtype)),
            B,
            C,
            self.D.astype(dtype),
            dt_bias=self.dt_bias.astype(dtype),
            dt_softplus=True,
            dt_limit=self.dt_limit,
            negative_decays=self.negative_decays,
        )
        y = self._gated_norm(y.reshape(-1), z)
        return (conv_state, h), y @ self.out_proj.astype(dtype).T
