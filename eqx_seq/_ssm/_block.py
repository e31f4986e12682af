"""The residual block around an S5 or LRU layer: norm, SSM, GLU, dropout, skip."""

from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Complex, Float, PRNGKeyArray, Real

from .._misc import check_sequence, real_input
from ._base import AbstractDiagonalSSM
from ._recurrent import AbstractRecurrentLayer


_ACTIVATIONS = ("gelu", "full_glu", "half_glu1", "half_glu2")


class S5Block(AbstractRecurrentLayer):
    """A residual block around an S5 or LRU layer, as in the S5 paper's models.

    `x -> [norm] -> ssm -> activation -> dropout -> + x -> [norm]`, with the norm
    before the SSM (`prenorm=True`) or after the sum. Activations (each starts with a
    GELU of the SSM output `y`; `W`, `V` are linear maps over features):

    - `"gelu"`: `gelu(y)`;
    - `"full_glu"`: `W g ⊙ σ(V g)` with `g = gelu(y)`;
    - `"half_glu1"`: `g ⊙ σ(W g)`;
    - `"half_glu2"`: `y ⊙ σ(W g)` (only the gate sees the GELU).

    Dropout uses one mask for all time steps (as the reference implementation) and,
    as every Equinox dropout, is switched off by `eqx.nn.inference_mode`. Norms are
    `eqx.nn.LayerNorm` or `eqx.nn.RMSNorm` over features: per time step, so the block
    has a step mode. (Batch norm needs state across a batch and breaks step mode;
    not offered.)

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        k1, k2 = jr.split(jr.key(0))
        block = eqx_seq.S5Block(eqx_seq.S5(32, 64, key=k1), key=k2)
        y = block(jnp.ones((100, 32)))                     # (100, 32)
        ```
    """

    recurrence_fields: ClassVar[tuple[str, ...]] = ()
    ssm: AbstractDiagonalSSM
    norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    gate_in: eqx.nn.Linear | None
    gate: eqx.nn.Linear | None
    dropout: eqx.nn.Dropout
    prenorm: bool = eqx.field(static=True)
    activation: str = eqx.field(static=True)

    def __init__(
        self,
        ssm: AbstractDiagonalSSM,
        *,
        norm: Literal["layer", "rms"] = "layer",
        prenorm: bool = True,
        activation: Literal["gelu", "full_glu", "half_glu1", "half_glu2"] = "half_glu1",
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `ssm`: the sequence mixer, an [`eqx_seq.S5`][] or [`eqx_seq.LRU`][]; the
            block's feature size is its `input_size`, and its backend (`ssm.scan`) is
            the block's.
        - `norm`: `"layer"` (`eqx.nn.LayerNorm`) or `"rms"` (`eqx.nn.RMSNorm`).
        - `prenorm`: normalise the block's input (`True`) or its output (`False`).
        - `activation`: `"gelu"`, `"full_glu"`, `"half_glu1"` or `"half_glu2"`.
        - `dropout`: the dropout probability.
        - `key`: a `jax.random` key for the gate weights. (Keyword only.)
        """
        if not isinstance(ssm, AbstractDiagonalSSM):
            raise ValueError(
                f"`ssm` must be an `eqx_seq.S5` or `eqx_seq.LRU`, got {type(ssm)}."
            )
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {_ACTIVATIONS}, got {activation!r}."
            )
        if norm not in ("layer", "rms"):
            raise ValueError(f'`norm` must be "layer" or "rms", got {norm!r}.')
        if not 0 <= dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout}.")
        size = ssm.input_size
        dtype = ssm.D.dtype
        k1, k2 = jr.split(key)
        self.ssm = ssm
        norm_cls = eqx.nn.LayerNorm if norm == "layer" else eqx.nn.RMSNorm
        self.norm = norm_cls(size, dtype=dtype)
        self.gate_in = (
            eqx.nn.Linear(size, size, dtype=dtype, key=k1)
            if activation == "full_glu"
            else None
        )
        self.gate = (
            None
            if activation == "gelu"
            else eqx.nn.Linear(size, size, dtype=dtype, key=k2)
        )
        self.dropout = eqx.nn.Dropout(dropout)
        self.prenorm = prenorm
        self.activation = activation

    def _activate(self, y: Array) -> Array:
        # On one time step, `(H,)`; vmapped over time by the callers.
        g = jax.nn.gelu(y)
        if self.activation == "gelu":
            return g
        gate = jax.nn.sigmoid(self.gate(g))
        if self.activation == "full_glu":
            return self.gate_in(g) * gate
        if self.activation == "half_glu1":
            return g * gate
        return y * gate

    def _normalise(self, x: Array) -> Array:
        return jax.vmap(self.norm)(x) if x.ndim == 2 else self.norm(x)

    @jax.named_scope("eqx_seq.S5Block")
    def __call__(
        self,
        x: Real[ArrayLike, " T H"],
        *,
        dt: Real[ArrayLike, " T"] | None = None,
        h0: Complex[ArrayLike, " P"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " T H"]:
        """**Arguments:**

        - `x`: one sequence, shape `(T, H)`.
        - `dt`, `h0`: passed to the SSM (irregular steps; streaming state).
        - `key`: for dropout (needed when `dropout > 0` outside inference mode).

        **Returns:**

        Shape `(T, H)`.
        """
        x = check_sequence(x, self.ssm.input_size, "S5Block", dtype=self.ssm.D.dtype)
        z = self._normalise(x) if self.prenorm else x
        y = jax.vmap(self._activate)(self.ssm(z, dt=dt, h0=h0))
        mask = self.dropout(jnp.ones(y.shape[-1], y.dtype), key=key)
        out = x.astype(y.dtype) + y * mask[None]
        return out if self.prenorm else self._normalise(out)

    def init_state(self) -> Complex[Array, " P"]:
        """The SSM's zero state, for step mode."""
        return self.ssm.init_state()

    def final_state(
        self,
        x: Real[ArrayLike, " T H"],
        *,
        dt: Real[ArrayLike, " T"] | None = None,
        h0: Complex[ArrayLike, " P"] | None = None,
    ) -> Complex[Array, " P"]:
        """The SSM's state after the last step of `x` (streaming in chunks)."""
        x = check_sequence(x, self.ssm.input_size, "S5Block", dtype=self.ssm.D.dtype)
        z = self._normalise(x) if self.prenorm else x
        return self.ssm.final_state(z, dt=dt, h0=h0)

    def step(
        self,
        state: Complex[ArrayLike, " P"],
        x_t: Real[ArrayLike, " H"],
        *,
        dt: Real[ArrayLike, ""] | None = None,
    ) -> tuple[Complex[Array, " P"], Float[Array, " H"]]:
        """One step (RNN mode), equal to the parallel call in inference mode.

        Step mode is for inference and generation: dropout is not applied.

        **Returns:**

        `(state, y_t)`, `y_t` of shape `(H,)`.
        """
        x_t = jnp.asarray(x_t)
        if x_t.shape != (self.ssm.input_size,):
            raise ValueError(
                f"`S5Block.step` takes one input of shape ({self.ssm.input_size},), "
                f"got shape {x_t.shape}."
            )
        x_t = real_input(x_t, "S5Block.step", self.ssm.D.dtype)
        z = self._normalise(x_t) if self.prenorm else x_t
        state, y = self.ssm.step(state, z, dt=dt)
        out = x_t.astype(y.dtype) + self._activate(y)
        return state, out if self.prenorm else self._normalise(out)
