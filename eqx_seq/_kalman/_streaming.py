"""Online filtering: the filter's predict and update steps (`_step`) on one
observation at a time, carried in a public `KalmanState`."""

from typing import Any, TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from ._linalg import _gram
from ._problem import _model, prepare
from ._results import KalmanState
from ._step import _predict, _update


if TYPE_CHECKING:
    from ._layer import KalmanFilter


def _where(caller: str) -> str:
    return f"eqx_seq.KalmanFilter.{caller}"


def check_streamable(kf: "KalmanFilter", caller: str) -> None:
    """A time-invariant model with a proper prior, or an error that says why not."""
    if kf.num_steps is not None:
        raise ValueError(
            f"{_where(caller)}: online filtering needs a time-invariant model; this "
            f"one is time-varying with {kf.num_steps} steps. Build one "
            "`KalmanFilter.from_matrices` per step, or filter the whole sequence."
        )
    if kf.initialization == "diffuse":
        raise NotImplementedError(
            f'{_where(caller)}: not available with initialization="diffuse" (a '
            "`KalmanState` holds a proper Gaussian); filter the whole sequence, or "
            'use "known" with a large `P0` (approximately diffuse).'
        )


def check_state(kf: "KalmanFilter", state: Any, caller: str) -> KalmanState:
    """`state` as a `KalmanState` of this model's sizes, in its dtype."""
    n = kf.state_size
    shapes = {"mean": (n,), "cov": (n, n), "log_likelihood": ()}
    if not isinstance(state, KalmanState):
        raise ValueError(
            f"{_where(caller)}: `state` must be an `eqx_seq.KalmanState` (from "
            f"`init_state`, `predict` or `update`), got {type(state).__name__}."
        )
    for name, shape in shapes.items():
        x = jnp.asarray(getattr(state, name))
        if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{_where(caller)}: `state.{name}` must be a floating array of shape "
                f"{shape} (state_size={n}), got {x.dtype} of shape {x.shape}."
            )
    dtype = kf.m0.dtype
    return KalmanState(
        *(jnp.asarray(getattr(state, name)).astype(dtype) for name in shapes)
    )


def check_vector(
    kf: "KalmanFilter", x: Any, name: str, size: int, caller: str
) -> Array:
    """One step's observation or controls: a floating array of shape `(size,)`."""
    x = jnp.asarray(x)
    if x.shape != (size,) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{_where(caller)}: `{name}` is one step's, a floating array of shape "
            f"({size},), got {x.dtype} of shape {x.shape}. Use `jax.vmap` for a "
            "batch."
        )
    return x.astype(kf.m0.dtype)


def check_control(kf: "KalmanFilter", u: Any, caller: str) -> Array | None:
    c = kf.control_size
    if c == 0:
        if u is not None:
            raise ValueError(
                f"{_where(caller)}: got controls `u` but this model has control_size=0."
            )
        return None
    if u is None:
        raise ValueError(
            f"{_where(caller)}: this model has control_size={c}; pass this step's "
            f"controls `u` of shape ({c},)."
        )
    return check_vector(kf, u, "u", c, caller)


@eqx.filter_jit
def init_state(kf: "KalmanFilter") -> KalmanState:
    """The prior, with nothing observed yet: the law of `x_0` or of `x_1`
    (`prior_at`), known or stationary (`initialization`), as the filter starts."""
    model = _model(kf)
    zero = jnp.zeros((), model.m0.dtype)
    return KalmanState(model.m0, _gram(model.L_P0), zero)


@eqx.filter_jit
@full_precision
def predict(kf: "KalmanFilter", state: KalmanState, u: Array | None) -> KalmanState:
    """One transition (`u`, the step's controls, checked)."""
    model = _model(kf)
    c = None if u is None else kf.B @ u
    m, P = _predict(state.mean, state.cov, model.F, model.L_Q, c)
    return KalmanState(m, P, state.log_likelihood)


@eqx.filter_jit
@full_precision
def update(
    kf: "KalmanFilter", state: KalmanState, y: Array, u: Array | None
) -> KalmanState:
    """Conditioning on the observed entries of `y` (checked), whitened as the
    filter's observations are."""
    problem = prepare(kf, y[None], None if u is None else u[None], "missing")
    m, P, ll, _ = _update(
        state.mean, state.cov, problem.yw[0], problem.Hw[0], problem.obs[0]
    )
    log_likelihood = state.log_likelihood + (ll - problem.logdet[0])
    return KalmanState(m, P, log_likelihood)
