"""Online filtering: the square-root filter's predict and update (`_sqrt`) on one
observation at a time, carried in a public `KalmanState`."""

from typing import Any, TYPE_CHECKING

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from ._linalg import _mm, _mv, tria
from ._problem import _model, prepare
from ._results import KalmanState
from ._sqrt import sqrt_update, whitened_log_density


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
    shapes = {"mean": (n,), "cov_factor": (n, n), "log_likelihood": ()}
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
    return KalmanState(model.m0, model.L_P0, zero)


@eqx.filter_jit
@full_precision
def predict(kf: "KalmanFilter", state: KalmanState, u: Array | None) -> KalmanState:
    """One transition (`u`, the step's controls, checked)."""
    model = _model(kf)
    m = _mv(model.F, state.mean)
    if u is not None:
        m = m + kf.B @ u
    L = tria(jnp.concatenate([_mm(model.F, state.cov_factor), model.L_Q], axis=1))
    return KalmanState(m, L, state.log_likelihood)


@eqx.filter_jit
@full_precision
def update(
    kf: "KalmanFilter", state: KalmanState, y: Array, u: Array | None
) -> KalmanState:
    """Conditioning on the observed entries of `y` (checked), whitened as the
    filter's observations are."""
    problem = prepare(kf, y[None], None if u is None else u[None], "missing")
    L = state.cov_factor
    no_noise = jnp.zeros_like(L)  # conditioning only: no transition here
    m, L, nu, log_s = sqrt_update(state.mean, L, no_noise, problem.Hw[0], problem.yw[0])
    ll = whitened_log_density(nu, log_s, problem.obs[0])
    return KalmanState(m, L, state.log_likelihood + (ll - problem.logdet[0]))
