"""The residual blocks around the Mamba layers (and the Gated DeltaNet layer):
norm, mixer, dropout, skip."""

import abc
from collections.abc import Sequence
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real

from .._misc import check_real, check_sequence, check_state_parts, real_input
from ._mamba import Mamba
from ._mamba2 import Mamba2
from ._recurrent import AbstractRecurrentLayer


class AbstractMixerBlock(AbstractRecurrentLayer):
    """What `MambaBlock`, `Mamba2Block` and `GatedDeltaNetBlock` share: all but
    the mixer's type and the name of its field (`_layer`). The mixer has an
    `input_size`, an `out_proj` in the parameters' dtype and the recurrent
    layer's methods with `reset`."""

    recurrence_fields: ClassVar[tuple[str, ...]] = ()
    # the names of the state's parts, in the errors of `step`
    _parts: ClassVar[tuple[str, str]] = ("conv_state", "ssm_state")
    norm: eqx.AbstractVar[eqx.nn.LayerNorm | eqx.nn.RMSNorm]
    dropout: eqx.AbstractVar[eqx.nn.Dropout]

    @property
    @abc.abstractmethod
    def _layer(self) -> AbstractRecurrentLayer:
        """The mixer."""

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def _dtype(self) -> jnp.dtype:
        return self._layer.out_proj.dtype

    def _setup(
        self, field: str, layer, kind: type, norm: str, norm_eps: float, dropout: float
    ) -> None:
        if not isinstance(layer, kind):
            raise ValueError(
                f"`{field}` must be an `eqx_seq.{kind.__name__}`, got {type(layer)}."
            )
        if norm not in ("layer", "rms"):
            raise ValueError(f'`norm` must be "layer" or "rms", got {norm!r}.')
        if not 0 <= dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout}.")
        norm_eps = check_real("norm_eps", norm_eps, positive=True)
        size, dtype = layer.input_size, layer.out_proj.dtype
        setattr(self, field, layer)
        # RMS: a scale and no bias, as the reference models' norms
        self.norm = (
            eqx.nn.LayerNorm(size, eps=norm_eps, dtype=dtype)
            if norm == "layer"
            else eqx.nn.RMSNorm(size, eps=norm_eps, use_bias=False, dtype=dtype)
        )
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(
        self,
        x: Real[ArrayLike, "T H"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: tuple[Array, Array] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T H"]:
        """**Arguments:**

        - `x`: one sequence, shape `(T, H)`.
        - `reset`: optional bools, shape `(T,)`, `True` where a segment starts
            (packed sequences), see the layer's own `__call__`.
        - `h0`: the layer's state to continue from (streaming).
        - `key`: for dropout (needed when `dropout > 0` outside inference mode).

        **Returns:**

        Shape `(T, H)`.
        """
        with jax.named_scope(f"eqx_seq.{self._name}"):
            # checked before the norm, whose own error would name `RMSNorm`
            x = check_sequence(x, self._layer.input_size, self._name, dtype=self._dtype)
            y = self._layer(jax.vmap(self.norm)(x), reset=reset, h0=h0)
            mask = self.dropout(jnp.ones(y.shape[-1], y.dtype), key=key)
            return x.astype(y.dtype) + y * mask[None]

    def _check_state(self, state: object) -> tuple[Array, ...]:
        """`state` if it is a pair of real floating arrays shaped as those of
        `init_state()`."""
        shapes = tuple(s.shape for s in jax.eval_shape(self.init_state))
        return check_state_parts(state, shapes, f"{self._name}.step", self._parts)

    def init_state(self) -> tuple[Array, Array]:
        """The layer's zero state, for step mode."""
        return self._layer.init_state()

    def final_state(
        self,
        x: Real[ArrayLike, "T H"],
        *,
        reset: Bool[ArrayLike, " T"] | Sequence[bool] | None = None,
        h0: tuple[Array, Array] | None = None,
    ) -> tuple[Array, Array]:
        """The layer's state after the last step of `x` (streaming)."""
        x = check_sequence(x, self._layer.input_size, self._name, dtype=self._dtype)
        z = jax.vmap(self.norm)(x)
        return self._layer.final_state(z, reset=reset, h0=h0)

    def step(
        self,
        state: tuple[Array, Array],
        x_t: Real[ArrayLike, " H"],
        *,
        reset: bool | Bool[ArrayLike, ""] = False,
    ) -> tuple[tuple[Array, Array], Float[Array, " H"]]:
        """One step (RNN mode), equal to the parallel call in inference mode.

        **Arguments:**

        - `state`: the previous `(conv_state, ssm_state)`, as `init_state()` or
            the previous `step` returns it.
        - `x_t`: this step's input, shape `(H,)`, real (integers are cast to the
            parameters' dtype).
        - `reset`: whether a segment starts at this step (a bool scalar).

        **Returns:**

        `(state, y_t)`, `y_t` of shape `(H,)`.
        """
        # checked here, before the norm: the layer skips its check of a `None`
        # state, and a wrong shape would meet the norm's own error first
        state = self._check_state(state)
        x_t = jnp.asarray(x_t)
        size = self._layer.input_size
        if x_t.shape != (size,):
            raise ValueError(
                f"`{self._name}.step` takes one real input of shape ({size},), got "
                f"{x_t.dtype} of shape {x_t.shape}."
            )
        x_t = real_input(x_t, f"{self._name}.step", self._dtype)
        state, y = self._layer.step(state, self.norm(x_t), reset=reset)
        return state, x_t.astype(y.dtype) + y


class MambaBlock(AbstractMixerBlock):
    """A residual block around a [`eqx_seq.Mamba`][] layer, as in the Mamba
    paper's models: `x -> x + dropout(mamba(norm(x)))`.

    The norm (`eqx.nn.RMSNorm` with a scale and no bias by default, as the
    reference models', or `eqx.nn.LayerNorm`) acts on each time step, so the
    block has a step mode. Dropout uses one mask for all time
    steps and is switched off by `eqx.nn.inference_mode`.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        block = eqx_seq.MambaBlock(eqx_seq.Mamba(32, key=jr.key(0)))
        y = block(jnp.ones((100, 32)))                     # (100, 32)
        ```
    """

    mamba: Mamba
    norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    dropout: eqx.nn.Dropout

    @property
    def _layer(self) -> Mamba:
        return self.mamba

    def __init__(
        self,
        mamba: Mamba,
        *,
        norm: Literal["layer", "rms"] = "rms",
        norm_eps: float = 1e-5,
        dropout: float = 0.0,
    ):
        """**Arguments:**

        - `mamba`: the sequence mixer, an [`eqx_seq.Mamba`][]; the block's feature
            size is its `input_size`.
        - `norm`: `"rms"` (`eqx.nn.RMSNorm`) or `"layer"` (`eqx.nn.LayerNorm`).
        - `norm_eps`: the norm's epsilon (the reference models' 1e-5).
        - `dropout`: the dropout probability on the mixer's output.
        """
        self._setup("mamba", mamba, Mamba, norm, norm_eps, dropout)


class Mamba2Block(AbstractMixerBlock):
    """A residual block around a [`eqx_seq.Mamba2`][] layer, as in the Mamba-2
    paper's models: `x -> x + dropout(mamba(norm(x)))`.

    The norm (`eqx.nn.RMSNorm` with a scale and no bias by default, as the
    reference models', or `eqx.nn.LayerNorm`) acts on each time step, so the
    block has a step mode. Dropout uses one mask for all time
    steps and is switched off by `eqx.nn.inference_mode`.

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.Mamba2(32, state_size=16, head_dim=16, key=jr.key(0))
        block = eqx_seq.Mamba2Block(layer)
        y = block(jnp.ones((100, 32)))                     # (100, 32)
        ```
    """

    mamba: Mamba2
    norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm
    dropout: eqx.nn.Dropout

    @property
    def _layer(self) -> Mamba2:
        return self.mamba

    def __init__(
        self,
        mamba: Mamba2,
        *,
        norm: Literal["layer", "rms"] = "rms",
        norm_eps: float = 1e-5,
        dropout: float = 0.0,
    ):
        """**Arguments:**

        - `mamba`: the sequence mixer, an [`eqx_seq.Mamba2`][]; the block's
            feature size is its `input_size`.
        - `norm`: `"rms"` (`eqx.nn.RMSNorm`) or `"layer"` (`eqx.nn.LayerNorm`).
        - `norm_eps`: the norm's epsilon (the reference models' 1e-5).
        - `dropout`: the dropout probability on the mixer's output.
        """
        self._setup("mamba", mamba, Mamba2, norm, norm_eps, dropout)
