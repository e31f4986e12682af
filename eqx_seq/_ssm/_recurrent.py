"""The contract of a layer with a state carried along time."""

import abc

import equinox as eqx
from jaxtyping import Array, ArrayLike, PRNGKeyArray, PyTree


class AbstractRecurrentLayer(eqx.Module):
    """Abstract base class for layers that carry a state along time: a whole
    sequence at once (`__call__`), its final state (`final_state`), and one step
    at a time from `init_state()` (`step`), all three agreeing.

    [`eqx_seq.S5`][], [`eqx_seq.LRU`][], [`eqx_seq.S5Block`][], [`eqx_seq.RGLRU`][],
    [`eqx_seq.HawkBlock`][], [`eqx_seq.Mamba`][], [`eqx_seq.MambaBlock`][],
    [`eqx_seq.Mamba2`][], [`eqx_seq.Mamba2Block`][], [`eqx_seq.GatedDeltaNet`][]
    and [`eqx_seq.GatedDeltaNetBlock`][] are such layers. Subclass it to write one
    of your own: implement the four methods and declare `recurrence_fields`. A
    layer may take more keyword arguments than these (S5's `dt`, the selective
    layers' `reset`).

    `recurrence_fields` (a class variable) names the layer's own fields that
    parameterise its recurrence (the decays and what shapes them), which
    [`eqx_seq.ssm_param_labels`][] labels `"ssm"`: trained without weight decay,
    and for S5 and LRU at their own learning rate. It is empty for a block whose
    recurrence is a layer inside it.
    """

    recurrence_fields: eqx.AbstractClassVar[tuple[str, ...]]

    @abc.abstractmethod
    def __call__(
        self,
        x: ArrayLike,
        *,
        h0: PyTree[ArrayLike] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        """The outputs of one sequence `x`, shape `(T, ...)`, time first (`jax.vmap`
        for a batch), from the state `h0` (`init_state()`'s if `None`)."""

    @abc.abstractmethod
    def final_state(
        self, x: ArrayLike, *, h0: PyTree[ArrayLike] | None = None
    ) -> PyTree[Array]:
        """The state after the last step of `x`: calling the layer on chunk after
        chunk, each from the `final_state` of the chunks before, gives the outputs
        of one call on the whole sequence."""

    @abc.abstractmethod
    def init_state(self) -> PyTree[Array]:
        """The state before the first step."""

    @abc.abstractmethod
    def step(
        self, state: PyTree[ArrayLike], x_t: ArrayLike
    ) -> tuple[PyTree[Array], Array]:
        """`(state, y_t)`: one step from `state` with this step's input `x_t`. From
        `init_state()`, step after step, the outputs of `__call__`."""
