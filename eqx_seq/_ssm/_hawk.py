"""Hawk's residual block (Griffin's recurrent block and gated MLP around an RG-LRU)."""

from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real

from .._misc import (
    check_parameter_dtype,
    check_positive_int,
    check_real,
    check_reset,
    check_sequence,
    check_state,
    real_input,
)
from .._scan import AbstractScan, AutoScan, check_scan
from ._conv import CausalConv
from ._recurrent import AbstractRecurrentLayer
from ._rglru import RGLRU


def _per_step(layer, x: Array) -> Array:
    """A layer of one time step (`eqx.nn.Linear`, `RMSNorm`) on `(T, F)` or `(F,)`."""
    return jax.vmap(layer)(x) if x.ndim == 2 else layer(x)


class HawkBlock(AbstractRecurrentLayer):
    """Hawk's residual block: Griffin's recurrent block and a gated MLP (De et al.,
    2024), the RG-LRU model's layer.

    `x -> RMSNorm -> recurrent block -> + x -> RMSNorm -> gated MLP -> + x`, where
    the recurrent block is `out(gelu(W_g z) ⊙ RGLRU(conv(W_x z)))` (`conv` a
    depthwise causal convolution of width `conv_size`), and the MLP is
    `W_3 (gelu(W_1 z) ⊙ W_2 z)` with hidden size `mlp_expansion · width`.

    The state of step mode and streaming is a tuple `(conv_state, rglru_state)`, of
    shapes `(conv_size - 1, lru_width)` and `(lru_width,)`. With `reset`, neither
    the convolution nor the recurrence sees across a segment start, so packed
    segments give the outputs of separate calls. No dropout: `key` is ignored.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        block = eqx_seq.HawkBlock(32, num_heads=4, key=jr.key(0))
        x = jr.normal(jr.key(1), (50, 32))
        y = block(x)                                       # (50, 32)
        state, y_0 = block.step(block.init_state(), x[0])
        assert jnp.allclose(y_0, y[0], atol=1e-4)
        ```
    """

    recurrence_fields: ClassVar[tuple[str, ...]] = ()
    norm: eqx.nn.RMSNorm
    gate_proj: eqx.nn.Linear
    in_proj: eqx.nn.Linear
    conv: CausalConv
    rglru: RGLRU
    out_proj: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    mlp_gate: eqx.nn.Linear
    mlp_up: eqx.nn.Linear
    mlp_down: eqx.nn.Linear
    width: int = eqx.field(static=True)
    lru_width: int = eqx.field(static=True)

    def __init__(
        self,
        width: int,
        *,
        lru_width: int | None = None,
        num_heads: int = 1,
        conv_size: int = 4,
        mlp_expansion: int = 3,
        norm_eps: float = 1e-6,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `width`: the number of features in and out.
        - `lru_width`: the width of the recurrence (default `width`).
        - `num_heads`: the number of blocks of the RG-LRU's gates; must divide
            `lru_width`.
        - `conv_size`: the number of taps of the causal convolution.
        - `mlp_expansion`: the MLP's hidden size is `mlp_expansion * width`.
        - `norm_eps`: the epsilon of both RMS norms (Griffin's 1e-6).
        - `scan`: the RG-LRU's recurrence backend, an [`eqx_seq.AbstractScan`][];
            with [`eqx_seq.ShardedScan`][] the convolution also reads the
            `conv_size - 1` inputs before each device's block from the device
            before.
        - `dtype`: the parameter dtype, float32 or float64 (default: JAX's default
            float). Half-precision inputs are computed in this dtype.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        check_positive_int("width", width)
        lru_width = width if lru_width is None else lru_width
        check_positive_int("lru_width", lru_width)
        check_positive_int("conv_size", conv_size)
        check_positive_int("mlp_expansion", mlp_expansion)
        norm_eps = check_real("norm_eps", norm_eps, positive=True)
        dtype = check_parameter_dtype("HawkBlock", dtype)
        check_scan(scan, name="eqx_seq.HawkBlock", splits_time=True)
        keys = jr.split(key, 8)
        hidden = mlp_expansion * width
        self.rglru = RGLRU(
            lru_width, num_heads=num_heads, scan=scan, dtype=dtype, key=keys[0]
        )
        self.norm = eqx.nn.RMSNorm(width, eps=norm_eps, use_bias=False, dtype=dtype)
        self.gate_proj = eqx.nn.Linear(width, lru_width, dtype=dtype, key=keys[1])
        self.in_proj = eqx.nn.Linear(width, lru_width, dtype=dtype, key=keys[2])
        self.conv = CausalConv(lru_width, conv_size, dtype=dtype, key=keys[3])
        self.out_proj = eqx.nn.Linear(lru_width, width, dtype=dtype, key=keys[4])
        self.mlp_norm = eqx.nn.RMSNorm(width, eps=norm_eps, use_bias=False, dtype=dtype)
        self.mlp_gate = eqx.nn.Linear(width, hidden, dtype=dtype, key=keys[5])
        self.mlp_up = eqx.nn.Linear(width, hidden, dtype=dtype, key=keys[6])
        self.mlp_down = eqx.nn.Linear(hidden, width, dtype=dtype, key=keys[7])
        self.width = width
        self.lru_width = lru_width

    # ---------------------------------------------------------------- pieces

    def _in_dtype(self, x: Array) -> tuple["HawkBlock", Array]:
        """The block and `x` in one compute dtype (the parameters', or `x`'s if
        wider), so the submodules' products never mix dtypes."""
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(self.rglru.a_param.dtype, x.dtype)
        block = jax.tree.map(
            lambda p: p.astype(dtype) if eqx.is_inexact_array(p) else p, self
        )
        return block, x.astype(dtype)

    def _check_state(self, state, what: str) -> tuple[Array, Array]:
        name = "HawkBlock"
        conv_shape = (self.conv.kernel_size - 1, self.lru_width)
        expected = (
            f"a tuple (conv_state, rglru_state) of real floating arrays of shapes "
            f"{conv_shape} and ({self.lru_width},), as `init_state()` returns"
        )
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            given = (
                f"a {type(state).__name__} of length {len(state)}"
                if isinstance(state, (tuple, list))
                else type(state).__name__
            )
            raise ValueError(f"`{name}`: `{what}` must be {expected}, got {given}.")
        for i, part in enumerate(state):
            # not an array (None, a string) or not floating: integers and bools
            # would be cast silently into a state no step could have produced
            try:
                dtype = jnp.asarray(part).dtype
            except (TypeError, ValueError):
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
                given = type(part).__name__ if dtype is None else str(dtype)
                raise ValueError(
                    f"`{name}`: `{what}[{i}]` ({('conv_state', 'rglru_state')[i]}) "
                    f"must be a real floating array, as in `init_state()`, got "
                    f"{given}."
                )
        return (
            check_state(state[0], conv_shape, name, f"{what}[0]"),
            check_state(state[1], (self.lru_width,), name, f"{what}[1]"),
        )

    def _branches(self, x: Array) -> tuple[Array, Array]:
        z = _per_step(self.norm, x)
        return jax.nn.gelu(_per_step(self.gate_proj, z)), _per_step(self.in_proj, z)

    def _finish(self, x: Array, gate: Array, h: Array) -> Array:
        x = x + _per_step(self.out_proj, gate * h)
        z = _per_step(self.mlp_norm, x)
        hidden = jax.nn.gelu(_per_step(self.mlp_gate, z)) * _per_step(self.mlp_up, z)
        return x + _per_step(self.mlp_down, hidden)

    def _run(self, x, reset, h0) -> tuple[Array, tuple[Array, Array]]:
        x = check_sequence(x, self.width, "HawkBlock", dtype=self.rglru.a_param.dtype)
        reset = check_reset(reset, x.shape[0], "HawkBlock")
        conv_state, lru_state = (
            (None, None) if h0 is None else self._check_state(h0, "h0")
        )
        block, x = self._in_dtype(x)
        gate, v = block._branches(x)
        # on a time axis split over devices, the inputs before this block
        conv_state = block.conv.block_state(v, conv_state, reset, block.rglru.scan)
        u = block.conv(v, conv_state, reset)
        conv_final = block.conv.final_state(v, conv_state, reset)
        h = block.rglru(u, reset=reset, h0=lru_state)
        return block._finish(x, gate, h), (conv_final, h[-1])

    # ---------------------------------------------------------------- public

    @jax.named_scope("eqx_seq.HawkBlock")
    def __call__(
        self,
        x: Real[ArrayLike, " T W"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: tuple[Float[ArrayLike, "conv L"], Float[ArrayLike, " L"]] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " T W"]:
        """**Arguments:**

        - `x`: one sequence, shape `(T, width)`.
        - `reset`: optional bool mask, shape `(T,)`, `True` where a segment starts
            (see [`eqx_seq.RGLRU`][]); the convolution restarts there too.
        - `h0`: optional state `(conv_state, rglru_state)` to continue from (see
            `final_state`).
        - `key`: ignored (no dropout); for compatibility with the Equinox API.

        **Returns:**

        Shape `(T, width)`.
        """
        del key
        return self._run(x, reset, h0)[0]

    def final_state(
        self,
        x: Real[ArrayLike, " T W"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: tuple[Float[ArrayLike, "conv L"], Float[ArrayLike, " L"]] | None = None,
    ) -> tuple[Float[Array, "conv L"], Float[Array, " L"]]:
        """The state `(conv_state, rglru_state)` after the last step of `x`: calling
        the block chunk after chunk with `h0=` this state gives one call's outputs.
        The convolution's part holds the last `conv_size - 1` inputs of the last
        segment (zeros for those before its start)."""
        return self._run(x, reset, h0)[1]

    def init_state(self) -> tuple[Float[Array, "conv L"], Float[Array, " L"]]:
        """The zero state `(conv_state, rglru_state)` to start step mode from."""
        return self.conv.init_state(), self.rglru.init_state()

    def step(
        self,
        state: tuple[Float[ArrayLike, "conv L"], Float[ArrayLike, " L"]],
        x_t: Real[ArrayLike, " W"],
        *,
        reset: bool | Bool[ArrayLike, ""] = False,
    ) -> tuple[tuple[Float[Array, "conv L"], Float[Array, " L"]], Float[Array, " W"]]:
        """One step (RNN mode), equal to the parallel call.

        **Arguments:**

        - `state`: the previous `(conv_state, rglru_state)`.
        - `x_t`: this step's input, shape `(width,)`.
        - `reset`: whether a segment starts at this step (a bool scalar).

        **Returns:**

        `(state, y_t)`, `y_t` of shape `(width,)`.
        """
        x_t, reset = jnp.asarray(x_t), jnp.asarray(reset)
        if x_t.shape != (self.width,):
            raise ValueError(
                f"`HawkBlock.step` takes one real input of shape ({self.width},), got "
                f"{x_t.dtype} of shape {x_t.shape}."
            )
        x_t = real_input(x_t, "HawkBlock.step", self.rglru.a_param.dtype)
        if reset.shape != () or reset.dtype != jnp.bool_:
            raise ValueError(
                f"`reset` in `step` must be a bool scalar, got {reset.dtype} of shape "
                f"{reset.shape}."
            )
        conv_state, lru_state = self._check_state(state, "state")
        block, x_t = self._in_dtype(x_t)
        gate, u = block._branches(x_t)
        conv_state, u = block.conv.step(conv_state, u, reset)
        lru_state, h = block.rglru.step(lru_state, u, reset=reset)
        return (conv_state, lru_state), block._finish(x_t, gate, h)
