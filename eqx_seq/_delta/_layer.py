"""The Gated DeltaNet layer and its residual block: projections, a short causal
convolution, the gated delta rule (`delta_rule_scan`), a gated RMS norm per value
head."""

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
    check_reset,
    check_sequence,
    check_state_parts,
    real_input,
)
from .._scan import AbstractScan, AutoScan, check_scan
from .._ssm._conv import CausalConv
from .._ssm._mamba import linear_weight
from .._ssm._mamba2 import check_decay_init, init_decays
from .._ssm._mamba_block import AbstractMixerBlock
from .._ssm._recurrent import AbstractRecurrentLayer
from ._scan import delta_rule_scan, delta_rule_step


# The state of `GatedDeltaNet` and `GatedDeltaNetBlock`: the convolution's last
# `conv_size - 1` inputs (of `q`, `k` and `v` together) and the matrix state per
# value head, `[key, value]`.
GatedDeltaNetState = TypeAliasType(
    "GatedDeltaNetState", tuple[Float[Array, "K1 C"], Float[Array, "Hv dk dv"]]
)


class GatedDeltaNet(AbstractRecurrentLayer):
    r"""The Gated DeltaNet layer: a linear recurrence on one matrix state per head,
    updated by the gated delta rule and computed by [`eqx_seq.delta_rule_scan`][].

    Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
    Rule", 2025 (the linear layers of Qwen3-Next). On `x` of shape `(T, H)`, with
    `num_heads` query and key heads of `head_dim` channels and `num_v_heads` value
    heads of `dv = expand_v * head_dim` channels:

    1. in-projections to `q`, `k`, `v`, the output gate `z`, and per value head
        `b` and `a`;
    2. `(q, k, v) -> silu(conv(q, k, v))`, a causal depthwise convolution of
        `conv_size` taps without bias;
    3. [`eqx_seq.delta_rule_scan`][] with `q` and `k` of unit L2 norm, the write
        strength $\beta = \sigma(b)$ ($2 \sigma(b)$ with `negative_eigenvalues`)
        and the log-gate $g = -\exp(A_{\log})\, \mathrm{softplus}(a + b_{dt})$ per
        value head, as Mamba-2's decay;
    4. per value head an RMS norm times `silu(z)`;
    5. out-projection back to `H`.

    The state of step mode and streaming, [`eqx_seq.GatedDeltaNetState`][], is
    `(conv_state, state)`: the convolution's last `conv_size - 1` inputs,
    `(conv_size - 1, 2 num_heads head_dim + num_v_heads dv)`, and the delta rule's
    state `(num_v_heads, head_dim, dv)` in the `[key, value]` layout.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.GatedDeltaNet(32, num_heads=2, head_dim=16, key=jr.key(0))
        y = layer(jnp.ones((100, 32)))                 # (100, 32)
        ```
    """

    recurrence_fields: ClassVar[tuple[str, ...]] = ("A_log", "dt_bias")
    in_proj: Float[Array, "I H"]
    conv: CausalConv
    A_log: Float[Array, " Hv"]
    dt_bias: Float[Array, " Hv"]
    norm_weight: Float[Array, " dv"]
    out_proj: Float[Array, "H E"]
    input_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_v_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    negative_eigenvalues: bool = eqx.field(static=True)
    scan: AbstractScan

    def __init__(
        self,
        input_size: int,
        *,
        num_heads: int = 4,
        head_dim: int = 64,
        num_v_heads: int | None = None,
        expand_v: int = 2,
        conv_size: int = 4,
        negative_eigenvalues: bool = False,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        decay_init: Literal["independent", "stratified"] = "independent",
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: `H`, the number of input (and output) features.
        - `num_heads`: the query and key heads.
        - `head_dim`: `dk`, the channels of each query and key head.
        - `num_v_heads`: the value heads (and states); `num_heads` if `None`. A
            multiple of `num_heads`: `num_v_heads / num_heads` consecutive value
            heads share one query and key head.
        - `expand_v`: each value head has `dv = expand_v * head_dim` channels.
        - `conv_size`: the taps of the causal convolution.
        - `negative_eigenvalues`: $\\beta = 2 \\sigma(b) \\in (0, 2)$, so that each
            step's map has eigenvalues in `(-1, 1)` and the layer can track state
            such as parity; $\\beta = \\sigma(b) \\in (0, 1)$ otherwise.
        - `A_init_range`: `exp(A_log)` starts uniform in this range, one per value
            head.
        - `dt_min`, `dt_max`, `dt_init_floor`: `softplus(dt_bias)` starts
            log-uniform in `[dt_min, dt_max]` (with `decay_init="independent"`), at
            least `dt_init_floor`.
        - `decay_init`: `"independent"` (Mamba-2's) draws each head's `exp(A_log)`
            and `softplus(dt_bias)` independently; `"stratified"` keeps
            `exp(A_log)`'s draw and sets `dt_bias` so that the heads' decay rates
            `exp(A_log) * softplus(dt_bias)` fall one in each equal slice of
            `[low * dt_min, high * dt_max]` on a log scale (in a random order), so
            that the layer starts with heads of long and of short memory (see the
            MQAR example).
        - `norm_eps`: the gated RMS norm's epsilon.
        - `chunk_size`: [`eqx_seq.delta_rule_scan`][]'s steps per chunk.
        - `scan`: the backend of the recurrence between chunks, an
            [`eqx_seq.AbstractScan`][]; with [`eqx_seq.ShardedScan`][] the
            convolution also reads the `conv_size - 1` inputs before each device's
            block from the device before.
        - `dtype`: the parameter dtype, float32 or float64 (default: JAX's default
            float). Half-precision inputs are computed in this dtype.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for name, value in (
            ("input_size", input_size),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("num_v_heads", num_v_heads),
            ("expand_v", expand_v),
            ("conv_size", conv_size),
            ("chunk_size", chunk_size),
        ):
            check_positive_int(name, value)
        if num_v_heads % num_heads:
            raise ValueError(
                f"`num_v_heads` must be a multiple of `num_heads` (each query and key "
                f"head serves num_v_heads / num_heads value heads), got "
                f"num_heads={num_heads}, num_v_heads={num_v_heads}."
            )
        ranges = check_decay_init(
            A_init_range, dt_min, dt_max, dt_init_floor, decay_init
        )
        norm_eps = check_real("norm_eps", norm_eps, positive=True)
        check_scan(scan, name="eqx_seq.GatedDeltaNet", splits_time=True)
        dtype = check_parameter_dtype("GatedDeltaNet", dtype)
        dv = expand_v * head_dim
        conv_channels = 2 * num_heads * head_dim + num_v_heads * dv
        out = conv_channels + num_v_heads * dv + 2 * num_v_heads
        ikey, ckey, dkey, akey, okey = jr.split(key, 5)
        self.in_proj = linear_weight(ikey, input_size, out, dtype)
        self.conv = CausalConv(
            conv_channels, conv_size, use_bias=False, dtype=dtype, key=ckey
        )
        self.A_log, self.dt_bias = init_decays(dkey, akey, num_v_heads, ranges, dtype)
        self.norm_weight = jnp.ones(dv, dtype)
        self.out_proj = linear_weight(okey, num_v_heads * dv, input_size, dtype)
        self.input_size = input_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_dim = head_dim
        self.chunk_size = chunk_size
        self.norm_eps = norm_eps
        self.negative_eigenvalues = check_bool(
            "negative_eigenvalues", negative_eigenvalues
        )
        self.scan = scan

    @property
    def value_dim(self) -> int:
        """`dv`, the channels of each value head."""
        return self.norm_weight.shape[0]

    # ---------------------------------------------------------------- validation

    def _state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        conv = (self.conv.kernel_size - 1, self.conv.weight.shape[1])
        return conv, (self.num_v_heads, self.head_dim, self.value_dim)

    def _check_state(self, state, name: str) -> GatedDeltaNetState:
        return check_state_parts(
            state, self._state_shapes(), name, ("conv_state", "state")
        )

    def _dtype(self, x: Array) -> jnp.dtype:
        with jax.numpy_dtype_promotion("standard"):
            return jnp.result_type(self.A_log.dtype, x.dtype)

    # -------------------------------------------------------------------- pieces

    def _project(self, x: Array) -> tuple[Array, Array, Array, Array]:
        """`(qkv, z, b, a)`: the in-projection (last axis of `x`), one product per
        part (the convolution's input, the output gate, `beta`'s and the gate's
        logits) rather than one product sliced."""
        w = self.in_proj.astype(x.dtype)
        conv = self.conv.weight.shape[1]
        ends = (conv, conv + self.num_v_heads * self.value_dim)
        ends = (*ends, ends[1] + self.num_v_heads)
        return (
            x @ w[: ends[0]].T,
            x @ w[ends[0] : ends[1]].T,
            x @ w[ends[1] : ends[2]].T,
            x @ w[ends[2] :].T,
        )

    def _heads(self, qkv: Array) -> tuple[Array, Array, Array]:
        """`(q, k, v)` with heads, `(..., num_heads, head_dim)` twice and
        `(..., num_v_heads, dv)`."""
        lead, width = qkv.shape[:-1], self.num_heads * self.head_dim
        q = qkv[..., :width].reshape(*lead, self.num_heads, self.head_dim)
        k = qkv[..., width : 2 * width].reshape(*lead, self.num_heads, self.head_dim)
        v = qkv[..., 2 * width :].reshape(*lead, self.num_v_heads, self.value_dim)
        return q, k, v

    def _beta_and_gate(self, b: Array, a: Array) -> tuple[Array, Array]:
        beta = jax.nn.sigmoid(b)
        if self.negative_eigenvalues:
            beta = 2 * beta
        A = jnp.broadcast_to(jnp.exp(self.A_log.astype(a.dtype)), a.shape)
        dt = jax.nn.softplus(
            a + jnp.broadcast_to(self.dt_bias.astype(a.dtype), a.shape)
        )
        return beta, -A * dt

    def _gated_norm(self, o: Array, z: Array) -> Array:
        """`rmsnorm(o) * weight * silu(z)` per value head, flattened over heads."""
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.norm_eps)
        weight = self.norm_weight.astype(o.dtype)
        o = o * weight.reshape((1,) * (o.ndim - 1) + (-1,))
        o = o * jax.nn.silu(z.reshape(o.shape))
        return o.reshape(*o.shape[:-2], -1)

    def _run(
        self, x: Array, h0: GatedDeltaNetState | None, reset: Array | None
    ) -> tuple[Array, GatedDeltaNetState]:
        dtype = x.dtype
        qkv, z, b, a = self._project(x)
        conv_state, state = (None, None) if h0 is None else h0
        # on a time axis split over devices, the inputs before this block
        conv_state = self.conv.block_state(qkv, conv_state, reset, self.scan)
        q, k, v = self._heads(jax.nn.silu(self.conv(qkv, conv_state, reset)))
        beta, g = self._beta_and_gate(b, a)
        o, state = delta_rule_scan(
            q,
            k,
            v,
            beta,
            g=g,
            h0=None if state is None else state.astype(dtype),
            reset=reset,
            normalize_qk=True,
            chunk_size=self.chunk_size,
            scan=self.scan,
            return_final_state=True,
        )
        y = self._gated_norm(o, z) @ self.out_proj.astype(dtype).T
        return y, (self.conv.final_state(qkv, conv_state, reset), state)

    def _check(self, x, h0, reset):
        x = check_sequence(x, self.input_size, "GatedDeltaNet", dtype=self.A_log.dtype)
        if h0 is not None:
            h0 = self._check_state(h0, "GatedDeltaNet")
        reset = check_reset(reset, x.shape[0], "GatedDeltaNet")
        return x.astype(self._dtype(x)), h0, reset

    # -------------------------------------------------------------------- public

    def __call__(
        self,
        x: Real[ArrayLike, "T H"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: GatedDeltaNetState | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T H"]:
        """Run the layer over a whole sequence.

        **Arguments:**

        - `x`: the input sequence, shape `(T, input_size)`. One example:
            `jax.vmap` over a batch.
        - `reset`: optional bools, shape `(T,)`, `True` where a segment starts
            (packed sequences): the convolution and the delta rule restart there,
            so each segment gives the outputs of a separate call.
        - `h0`: optional state `(conv_state, state)` to continue from (a previous
            chunk's [`eqx_seq.GatedDeltaNet.final_state`][]); zeros if `None`.
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:**

        The output sequence, shape `(T, input_size)`.
        """
        del key
        with jax.named_scope("eqx_seq.GatedDeltaNet"):
            x, h0, reset = self._check(x, h0, reset)
            return self._run(x, h0, reset)[0]

    def final_state(
        self,
        x: Real[ArrayLike, "T H"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: GatedDeltaNetState | None = None,
    ) -> GatedDeltaNetState:
        """The state `(conv_state, state)` after the last step of `x`: calling the
        layer chunk after chunk, each with `h0=` the `final_state` of the chunks so
        far, gives the outputs of one call on the whole sequence."""
        x, h0, reset = self._check(x, h0, reset)
        return self._run(x, h0, reset)[1]

    def init_state(self) -> GatedDeltaNetState:
        """The zero state to start step mode from."""
        conv, state = self._state_shapes()
        dtype = self.A_log.dtype
        return jnp.zeros(conv, dtype), jnp.zeros(state, dtype)

    def step(
        self,
        state: GatedDeltaNetState,
        x_t: Real[ArrayLike, " H"],
        *,
        reset: bool | Bool[ArrayLike, ""] = False,
    ) -> tuple[GatedDeltaNetState, Float[Array, " H"]]:
        """One step (RNN mode, for generation): stepping from `init_state()` gives
        the outputs of the call, to float tolerance. `reset=True` starts a
        segment at this step.

        **Returns:**

        `(state, y_t)`, `y_t` of shape `(input_size,)`.
        """
        x_t = jnp.asarray(x_t)
        if x_t.shape != (self.input_size,):
            raise ValueError(
                f"`GatedDeltaNet.step` takes one real input of shape "
                f"({self.input_size},), got {x_t.dtype} of shape {x_t.shape}."
            )
        x_t = real_input(x_t, "GatedDeltaNet.step", self.A_log.dtype)
        reset = jnp.asarray(reset)
        if reset.shape != () or reset.dtype != jnp.bool_:
            raise ValueError(f"`reset` in `step` must be a bool scalar, got {reset!r}.")
        conv_state, S = self._check_state(state, "GatedDeltaNet.step")
        dtype = self._dtype(x_t)
        qkv, z, b, a = self._project(x_t.astype(dtype))
        conv_state, qkv = self.conv.step(conv_state.astype(dtype), qkv, reset)
        q, k, v = self._heads(jax.nn.silu(qkv))
        beta, g = self._beta_and_gate(b, a)
        S = jnp.where(reset, jnp.zeros((), dtype), S.astype(dtype))
        o, S = delta_rule_step(S, q, k, v, beta, g=g, normalize_qk=True)
        y = self._gated_norm(o, z) @ self.out_proj.astype(dtype).T
        return (conv_state, S), y


class GatedDeltaNetBlock(AbstractMixerBlock):
    """A residual block around a [`eqx_seq.GatedDeltaNet`][] layer:
    `x -> x + dropout(layer(norm(x)))`, as [`eqx_seq.Mamba2Block`][] is around
    Mamba-2.

    The norm (`eqx.nn.RMSNorm` with a scale and no bias by default, or
    `eqx.nn.LayerNorm`) acts on each time step, so the block has a step mode.
    Dropout uses one mask for all time steps and is switched off by
    `eqx.nn.inference_mode`. Its state is the layer's,
    [`eqx_seq.GatedDeltaNetState`][].

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.GatedDeltaNet(32, num_heads=2, head_dim=16, key=jr.key(0))
        block = eqx_seq.GatedDeltaNetBlock(layer)
        y = block(jnp.ones((100, 32)))                     # (100, 32)
        ```
    """

    _parts: ClassVar[tuple[str, str]] = ("conv_state", "state")
    layer: GatedDeltaNet
    norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    dropout: eqx.nn.Dropout

    @property
    def _layer(self) -> GatedDeltaNet:
        return self.layer

    def __init__(
        self,
        layer: GatedDeltaNet,
        *,
        norm: Literal["layer", "rms"] = "rms",
        norm_eps: float = 1e-5,
        dropout: float = 0.0,
    ):
        """**Arguments:**

        - `layer`: the sequence mixer, an [`eqx_seq.GatedDeltaNet`][]; the block's
            feature size is its `input_size`.
        - `norm`: `"rms"` (`eqx.nn.RMSNorm`) or `"layer"` (`eqx.nn.LayerNorm`).
        - `norm_eps`: the norm's epsilon.
        - `dropout`: the dropout probability on the mixer's output.
        """
        self._setup("layer", layer, GatedDeltaNet, norm, norm_eps, dropout)
