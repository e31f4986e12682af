"""The RG-LRU: Griffin's real-gated linear recurrent unit, a selective (input-gated)
diagonal recurrence run on `eqx_seq.linear_recurrence`."""

import math
from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real

from .._misc import (
    check_bool,
    check_parameter_dtype,
    check_positive_int,
    check_real,
    check_reset,
    check_sequence,
    check_state,
)
from .._recurrence import linear_recurrence
from .._scan import AbstractScan, AutoScan, check_scan, decayed
from ._recurrent import AbstractRecurrentLayer


# `sqrt`'s derivative `0.5 / sqrt(x)` is capped at this value, reached where
# `x = 1 - a^2 < (0.5 / cap)^2`, i.e. `1 - a` below about 1e-7: closer to 1 than
# float32 resolves `a`, so no gradient that float32 can represent changes.
_SQRT_DERIVATIVE_CAP = 1000.0
_SQRT_FLOOR = (0.5 / _SQRT_DERIVATIVE_CAP) ** 2


@jax.custom_jvp
def sqrt_bounded_derivative(x: Array) -> Array:
    """`sqrt(x)` for `x >= 0`, whose derivative is capped at `_SQRT_DERIVATIVE_CAP`.

    The true derivative is infinite at `x = 0`, where the RG-LRU's decay `a_t`
    reaches 1 (the gate `r_t` or `softplus(a_param)` at 0): uncapped, the gradient
    w.r.t. the gates and `a_param` would be `inf` (or `inf * 0 = nan` where a reset
    masks the gain).
    """
    return jnp.sqrt(x)


@sqrt_bounded_derivative.defjvp
def _sqrt_bounded_derivative_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    floor = jnp.asarray(_SQRT_FLOOR, x.dtype)
    return jnp.sqrt(x), dx * (0.5 / jnp.sqrt(jnp.maximum(x, floor)))


class RGLRU(AbstractRecurrentLayer):
    """The Real-Gated Linear Recurrent Unit of Griffin and Hawk (De et al., 2024).

    A diagonal real recurrence whose decay is chosen by the input, per channel:

    - gates `r_t = σ(W_a x_t + b_a)`, `i_t = σ(W_x x_t + b_x)` (block-diagonal
        `W`, `num_heads` blocks);
    - decay `a_t = exp(-c · r_t · softplus(a_param))`, in `(0, 1]`, or with
        `negative_decays=True` `2 exp(-c · r_t · softplus(a_param)) - 1`, in
        `(-1, 1]`;
    - `h_t = a_t ⊙ h_{t-1} + sqrt(1 - a_t²) ⊙ (i_t ⊙ x_t)`, output `y_t = h_t`.

    Decays in `(-1, 1]` let the layer track state (the parity of a bit string, a
    count modulo 2), which decays in `[0, 1]` cannot (Grazzi et al., "Unlocking
    State-Tracking in Linear RNNs Through Negative Eigenvalues", 2025).

    The square root has a bounded derivative, so gradients stay finite as
    `a_t → 1`. `reset[t] = True` starts a segment at `t` (packed documents): the
    state restarts from zero and the input enters unscaled, so each segment's output
    is that of a separate call on it (with its own `reset[0] = True`: Griffin's start
    of a document). The recurrence is [`eqx_seq.linear_recurrence`][] (gradients by
    its adjoint; any backend); step mode and streaming as in [`eqx_seq.S5`][].

    !!! Example

        ```python
        import jax, jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.RGLRU(16, num_heads=4, key=jr.key(0))
        x = jnp.ones((100, 16))
        y = layer(x)                                       # (100, 16)
        reset = jnp.zeros(100, bool).at[jnp.array([0, 60])].set(True)
        y2 = layer(x, reset=reset)                         # two packed segments
        assert jnp.allclose(y2[60:], layer(x[60:], reset=reset[60:]), atol=1e-5)
        ```
    """

    recurrence_fields: ClassVar[tuple[str, ...]] = ("a_param",)
    a_param: Float[Array, " N"]
    a_gate_weight: Float[Array, "heads block block"]
    a_gate_bias: Float[Array, "heads block"]
    input_gate_weight: Float[Array, "heads block block"]
    input_gate_bias: Float[Array, "heads block"]
    input_size: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    c: float = eqx.field(static=True)
    negative_decays: bool = eqx.field(static=True)
    scan: AbstractScan

    def __init__(
        self,
        input_size: int,
        *,
        num_heads: int = 1,
        c: float = 8.0,
        a_min: float = 0.9,
        a_max: float = 0.999,
        negative_decays: bool = False,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: `N`, the number of features, of the input, the state and
            the output.
        - `num_heads`: the number of diagonal blocks of the two gate matrices; must
            divide `input_size`.
        - `c`: the constant in `log a_t = -c · r_t · softplus(a_param)`, `> 0`.
        - `a_min`, `a_max`: `a_param` starts such that the decay at `r_t = 1`,
            `exp(-c · softplus(a_param))`, is uniform in `[a_min, a_max]`
            (`0 < a_min < a_max < 1`).
        - `negative_decays`: decays `2 a - 1` in `(-1, 1]` instead of `a` (the
            map is applied to the decay above, so `a_min`, `a_max` keep their
            meaning), for state tracking.
        - `scan`: the recurrence backend, an [`eqx_seq.AbstractScan`][]: its
            `recurrence` runs the layer (any backend works).
        - `dtype`: the parameter dtype, float32 or float64 (default: JAX's default
            float). Half-precision inputs are computed in this dtype.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        check_positive_int("input_size", input_size)
        check_positive_int("num_heads", num_heads)
        if input_size % num_heads:
            raise ValueError(
                f"`num_heads` ({num_heads}) must divide `input_size` ({input_size})."
            )
        c = check_real("c", c, positive=True)
        a_min, a_max = check_real("a_min", a_min), check_real("a_max", a_max)
        if not 0 < a_min < a_max < 1:
            raise ValueError(
                f"Need 0 < a_min < a_max < 1, got a_min={a_min}, a_max={a_max}."
            )
        check_scan(scan, name="eqx_seq.RGLRU", splits_time=True)
        dtype = check_parameter_dtype("RGLRU", dtype)
        akey, wakey, wxkey = jr.split(key, 3)
        block = input_size // num_heads
        # softplus(a_param) = -log(a) / c for a uniform decay `a` at r = 1; then
        # a_param = softplus^{-1}(s) = s + log(-expm1(-s)), accurate for small s
        a = jr.uniform(akey, (input_size,), dtype, minval=a_min, maxval=a_max)
        s = -jnp.log(a) / c
        self.a_param = s + jnp.log(-jnp.expm1(-s))
        std = 1 / math.sqrt(block)  # LeCun normal, per block
        self.a_gate_weight = std * jr.normal(wakey, (num_heads, block, block), dtype)
        self.a_gate_bias = jnp.zeros((num_heads, block), dtype)
        self.input_gate_weight = std * jr.normal(
            wxkey, (num_heads, block, block), dtype
        )
        self.input_gate_bias = jnp.zeros((num_heads, block), dtype)
        self.input_size = input_size
        self.num_heads = num_heads
        self.c = c
        self.negative_decays = check_bool("negative_decays", negative_decays)
        self.scan = scan

    # ---------------------------------------------------------------- pieces

    def _check(self, x, reset, h0, name="RGLRU"):
        x = check_sequence(x, self.input_size, name, dtype=self.a_param.dtype)
        reset = check_reset(reset, x.shape[0], name)
        if h0 is not None:
            h0 = check_state(h0, (self.input_size,), name)
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.result_type(self.a_param.dtype, x.dtype)
        x = x.astype(dtype)
        return x, reset, None if h0 is None else h0.astype(dtype)

    def _gate(self, weight: Array, bias: Array, x: Array) -> Array:
        """`σ(W x_t + b)` with block-diagonal `W`, for every step of `x` `(T, N)`."""
        blocks = x.reshape(x.shape[0], self.num_heads, -1)
        z = jnp.einsum("thi,hij->thj", blocks, weight.astype(x.dtype))
        return jax.nn.sigmoid(z + bias.astype(x.dtype)[None]).reshape(x.shape)

    def _coefficients(
        self, x: Float[Array, "T N"], reset: Bool[Array, " T"] | None = None
    ) -> tuple[Float[Array, "T N"], Float[Array, "T N"]]:
        """`(a, b)` of the recurrence `h_t = a_t ⊙ h_{t-1} + b_t` for the inputs `x`
        (already checked and in the compute dtype)."""
        r = self._gate(self.a_gate_weight, self.a_gate_bias, x)
        i = self._gate(self.input_gate_weight, self.input_gate_bias, x)
        log_a = -self.c * r * jax.nn.softplus(self.a_param.astype(x.dtype))[None]
        a = jnp.exp(log_a)
        if self.negative_decays:
            # 1 - (2a - 1)² = -4 a expm1(log a): exact near a = 1 and a = 0
            gain = sqrt_bounded_derivative(-4 * a * jnp.expm1(log_a))
            a = 2 * a - 1
        else:
            # 1 - a² as -expm1(2 log a): exact near a = 1, where 1 - a² cancels
            gain = sqrt_bounded_derivative(-jnp.expm1(2 * log_a))
        if reset is not None:
            a = jnp.where(reset[:, None], jnp.zeros((), a.dtype), a)
            gain = jnp.where(reset[:, None], jnp.ones((), gain.dtype), gain)
        return a, gain * (i * x)

    def _states(self, x, reset, h0) -> Array:
        a, b = self._coefficients(x, reset)
        return linear_recurrence(a, b, h0, scan=self.scan)

    # ---------------------------------------------------------------- public

    @jax.named_scope("eqx_seq.RGLRU")
    def __call__(
        self,
        x: Real[ArrayLike, " T N"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: Real[ArrayLike, " N"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " T N"]:
        """Run the layer over a whole sequence (all steps in parallel).

        **Arguments:**

        - `x`: the input sequence, shape `(T, input_size)`, real (integers are
            cast to the parameters' dtype). One example: `jax.vmap`
            over a batch.
        - `reset`: optional bool mask, shape `(T,)`: `True` where a segment starts.
            There the state restarts from zero (`a_t := 0`, which replaces the
            state whatever it held, NaN and inf included; `h0` is ignored at a reset
            on step 0) and `i_t ⊙ x_t` enters without the `sqrt(1 - a_t²)`
            factor.
        - `h0`: optional state before step 0, shape `(input_size,)`: continue from
            the [`eqx_seq.RGLRU.final_state`][] of a previous chunk.
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:**

        The states `h_t`, the layer's output: shape `(T, input_size)`.
        """
        del key
        x, reset, h0 = self._check(x, reset, h0)
        return self._states(x, reset, h0)

    def final_state(
        self,
        x: Real[ArrayLike, " T N"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: Real[ArrayLike, " N"] | None = None,
    ) -> Float[Array, " N"]:
        """The state after the last step of `x`, to continue from in the next chunk
        (`h0=`): chunk after chunk, the outputs equal one call's.

        **Arguments:** as for `__call__`.

        **Returns:**

        The state `h_{T-1}`, shape `(input_size,)`.
        """
        x, reset, h0 = self._check(x, reset, h0)
        return self._states(x, reset, h0)[-1]

    def init_state(self) -> Float[Array, " N"]:
        """The zero state to start step mode from, shape `(input_size,)`."""
        return jnp.zeros(self.input_size, self.a_param.dtype)

    def step(
        self,
        state: Real[ArrayLike, " N"],
        x_t: Real[ArrayLike, " N"],
        *,
        reset: bool | Bool[ArrayLike, ""] = False,
    ) -> tuple[Float[Array, " N"], Float[Array, " N"]]:
        """One step of the recurrence (RNN mode), equal to the parallel call.

        **Arguments:**

        - `state`: the previous state, shape `(input_size,)`.
        - `x_t`: this step's input, shape `(input_size,)`.
        - `reset`: whether a segment starts at this step (a bool scalar).

        **Returns:**

        `(state, y_t)`: the new state and the output, both `(input_size,)` and
        equal (the output is the state).
        """
        x_t, reset = jnp.asarray(x_t), jnp.asarray(reset)
        if x_t.shape != (self.input_size,):
            raise ValueError(
                f"`RGLRU.step` takes one input of shape ({self.input_size},), got "
                f"shape {x_t.shape}."
            )
        if reset.shape != ():
            raise ValueError(
                f"`reset` in `step` must be a bool scalar, got shape {reset.shape}."
            )
        state = check_state(state, (self.input_size,), "RGLRU.step", "state")
        x, reset, state = self._check(x_t[None], reset[None], state)
        a, b = self._coefficients(x, reset)
        state = decayed(a[0], state) + b[0]
        return state, state
