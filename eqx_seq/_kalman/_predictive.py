"""The predictive side of the model: forecasts, draws of the posterior's state
paths and of the model itself, and online filtering, as functions of a model
(`_model.Model`); the layer's methods check their inputs and compile them."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._misc import full_precision
from .._scan import AbstractScan
from ._dispatch import backend, filter_
from ._filter import predict
from ._interface import (
    controls,
    KalmanForecastResult,
    KalmanState,
    observations,
)
from ._linalg import (
    cholesky,
    gram,
    jittered,
    mm,
    mv,
    sandwich,
    sqrt_update,
    sym,
    tria,
    whitened_log_density,
)
from ._model import (
    Model,
    Parameters,
    per_step,
    prepare,
)
from ._smoother import combine, smoother_elements


# --- forecasts ---
#
# Forecasts: the predictive distributions of the states and observations after the
# data, by iterating the filter's prediction step from the last filtered moments.


def check_forecast(
    params: Parameters, ys: Any, us: Any, horizon: Any
) -> tuple[Array, Array | None]:
    """`ys` and `us` checked and cast, or a `ValueError` that says what is wrong."""
    where = "eqx_seq.KalmanFilter.forecast"
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 0:
        raise ValueError(
            f"{where}: `horizon` must be a non-negative int, got {horizon!r}."
        )
    ys = observations(params, ys, "forecast")
    T = ys.shape[0]
    if params.num_steps is not None and T + horizon > params.num_steps:
        raise ValueError(
            f"{where}: this model is time-varying with {params.num_steps} steps, so it "
            f"cannot forecast past them: T + horizon = {T} + {horizon} > "
            f"{params.num_steps}."
        )
    if us is not None and horizon and jnp.shape(us)[:1] == (T,):
        raise ValueError(
            f"{where}: `us` must also hold the controls of the forecast steps: "
            f"shape (T + horizon, control_size) = ({T + horizon}, "
            f"{params.control_size}), got {jnp.shape(us)}."
        )
    return ys, controls(params, us, T + horizon, "forecast")


def _steps(model: Model, start: int, stop: int) -> Model:
    """`model` with its time-varying matrices cut to the steps `start + 1..stop`."""
    names = [k for k in ("F", "H", "L_Q", "L_R") if getattr(model, k).ndim == 3]
    if not names:
        return model
    return eqx.tree_at(
        lambda k: [getattr(k, name) for name in names],
        model,
        [getattr(model, name)[start:stop] for name in names],
    )


@full_precision
def forecast(
    model: Model,
    ys: Array,
    us: Array | None,
    horizon: int,
    scan: AbstractScan,
) -> KalmanForecastResult:
    """The forecast of `model` for `horizon` steps after `ys` (checked; `us` holds
    the controls of the data's steps and then of the forecast's)."""
    scan = backend(scan, caller="forecast")
    T = ys.shape[0]
    filtered = filter_(_steps(model, 0, T), ys, None if us is None else us[:T], scan)
    ahead = _steps(model, T, T + horizon)
    # the matrices that vary come in per step; the others are closed over
    mats = {"F": ahead.F, "L_Q": ahead.L_Q, "H": ahead.H, "L_R": ahead.L_R}
    xs = {name: x for name, x in mats.items() if per_step(x, 2)}
    if us is not None:
        xs["c"] = us[T:] @ model.B.T
        xs["d"] = us[T:] @ model.D.T

    def step(carry, x):
        get = lambda name: x[name] if name in x else mats[name]
        m, P = predict(*carry, get("F"), get("L_Q"), x.get("c"))
        H = get("H")
        y = mv(H, m)
        if "d" in x:
            y = y + x["d"]
        S = sym(sandwich(H, P) + gram(get("L_R")))
        return (m, P), (m, P, y, S)

    init = (filtered.means[-1], filtered.covs[-1])
    _, (ms, Ps, y, S) = lax.scan(step, init, xs, length=horizon)
    return KalmanForecastResult(ms, Ps, y, S)


# --- posterior samples ---
#
# Draws of the whole state path from `p(x_1..x_T | y_1..y_T)`: forward filtering,
# backward sampling (Frühwirth-Schnatter 1994; Carter & Kohn 1994).
#
# Backwards, `x_t | x_{t+1}, y_1..y_t ~ N(E_t x_{t+1} + g_t, L_t)` (the RTS elements
# of `smoother_elements`; `x_T ~ N(m_T, P_T)`). With the noise drawn
# first, `x_t = E_t x_{t+1} + g_t + chol(L_t) eps_t` is an affine recursion: a
# backward `lax.scan` on a sequential backend, and on a parallel one the composition
# of the affine maps by the backend's `associative_scan` (the smoother's combine,
# whose covariance part then carries the smoothed covariances along unused).


@full_precision
def posterior_sample(
    model: Model,
    key: PRNGKeyArray,
    ys: Array,
    us: Array | None,
    num_samples: int,
    scan: AbstractScan,
) -> Array:
    """`num_samples` paths `x_1..x_T` given `ys` and `us` (checked), shape
    `(num_samples, T, n)`; the filter and the elements are computed once."""
    scan = backend(scan, caller="posterior_sample")
    filtered = filter_(model, ys, us, scan)
    E, g, L = smoother_elements(model, filtered)
    # every L_t is positive definite (Q and P_t are); factored without LAPACK,
    # whose call batched over the steps can deadlock (`_linalg`)
    C = cholesky(jittered(L))
    T, n = g.shape
    eps = jr.normal(key, (num_samples, T, n), g.dtype)

    def one(eps):
        w = g + jnp.einsum("tij,tj->ti", C, eps)
        if scan.parallel:
            # a reverse scan composes step t's map after those of t+1..T
            _, xs, _ = scan.associative_scan(jax.vmap(combine), (E, w, L), reverse=True)
            return xs

        def step(x_next, e):
            E_t, w_t = e
            x = E_t @ x_next + w_t
            return x, x

        # E_T = 0: the first step back draws x_T from the last filtered moments
        _, xs = lax.scan(step, jnp.zeros_like(w[0]), (E, w), reverse=True)
        return xs

    return jax.vmap(one)(eps)


# --- draws of states and observations from the model (`KalmanFilter.sample`) ---


@full_precision
def sample_prior(model: Model, key, num_steps: int, us: Array | None):
    L_R = model.L_R
    n, p = model.m0.shape[0], model.H.shape[-2]
    dtype = model.m0.dtype
    k0, kq, kr = jr.split(key, 3)
    x0 = model.m0 + model.L_P0 @ jr.normal(k0, (n,), dtype)
    q = jr.normal(kq, (num_steps, n), dtype)
    r = jr.normal(kr, (num_steps, p), dtype)
    xs = {"q": q, "r": r}
    mats = {"F": model.F, "L_Q": model.L_Q, "H": model.H, "L_R": L_R}
    for name, x in mats.items():
        if per_step(x, 2):
            xs[name] = x
    if us is not None:
        xs["Bu"] = us @ model.B.T
        xs["Du"] = us @ model.D.T

    if model.prior_at == "x1":
        # the prior's draw is x_1 itself: step 1 has no transition
        xs["first"] = jnp.arange(num_steps) == 0

    def step(x_prev, s):
        get = lambda name: s[name] if name in s else mats[name]
        x = get("F") @ x_prev + get("L_Q") @ s["q"]
        if "Bu" in s:
            x = x + s["Bu"]
        if "first" in s:
            x = jnp.where(s["first"], x_prev, x)
        y = get("H") @ x + get("L_R") @ s["r"]
        if "Du" in s:
            y = y + s["Du"]
        return x, (x, y)

    _, (states, observations) = lax.scan(step, x0, xs)
    return states, observations


# --- online filtering: the square-root filter's predict and update (`sqrt_update`)
# on one observation at a time, carried in a public `KalmanState` ---


def _where(caller: str) -> str:
    return f"eqx_seq.KalmanFilter.{caller}"


def check_streamable(params: Parameters, initialization: str, caller: str) -> None:
    """A time-invariant model with a proper prior, or an error that says why not."""
    if params.num_steps is not None:
        raise ValueError(
            f"{_where(caller)}: online filtering needs a time-invariant model; this "
            f"one is time-varying with {params.num_steps} steps. Build one "
            "`KalmanFilter.from_matrices` per step, or filter the whole sequence."
        )
    if initialization == "diffuse":
        raise NotImplementedError(
            f'{_where(caller)}: not available with initialization="diffuse" (a '
            "`KalmanState` holds a proper Gaussian); filter the whole sequence, or "
            'use "known" with a large `P0` (approximately diffuse).'
        )


def check_state(params: Parameters, state: Any, caller: str) -> KalmanState:
    """`state` as a `KalmanState` of this model's sizes, in its dtype."""
    n = params.state_size
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
    dtype = params.m0.dtype
    return KalmanState(
        *(jnp.asarray(getattr(state, name)).astype(dtype) for name in shapes)
    )


def check_vector(
    params: Parameters, x: Any, name: str, size: int, caller: str
) -> Array:
    """One step's observation or controls: a floating array of shape `(size,)`."""
    x = jnp.asarray(x)
    if x.shape != (size,) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{_where(caller)}: `{name}` is one step's, a floating array of shape "
            f"({size},), got {x.dtype} of shape {x.shape}. Use `jax.vmap` for a "
            "batch."
        )
    return x.astype(params.m0.dtype)


def check_control(params: Parameters, u: Any, caller: str) -> Array | None:
    c = params.control_size
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
    return check_vector(params, u, "u", c, caller)


def init_state(model: Model) -> KalmanState:
    """The prior, with nothing observed yet: the law of `x_0` or of `x_1`
    (`prior_at`), known or stationary (`initialization`), as the filter starts."""
    zero = jnp.zeros((), model.m0.dtype)
    return KalmanState(model.m0, model.L_P0, zero)


@full_precision
def predict_state(model: Model, state: KalmanState, u: Array | None) -> KalmanState:
    """One transition (`u`, the step's controls, checked)."""
    m = mv(model.F, state.mean)
    if u is not None:
        m = m + model.B @ u
    L = tria(jnp.concatenate([mm(model.F, state.cov_factor), model.L_Q], axis=1))
    return KalmanState(m, L, state.log_likelihood)


@full_precision
def update_state(
    model: Model, state: KalmanState, y: Array, u: Array | None
) -> KalmanState:
    """Conditioning on the observed entries of `y` (checked), whitened as the
    filter's observations are."""
    problem = prepare(model, y[None], None if u is None else u[None], "missing")
    L = state.cov_factor
    no_noise = jnp.zeros_like(L)  # conditioning only: no transition here
    m, L, nu, log_s = sqrt_update(state.mean, L, no_noise, problem.Hw[0], problem.yw[0])
    ll = whitened_log_density(nu, log_s, problem.obs[0])
    return KalmanState(m, L, state.log_likelihood + (ll - problem.logdet[0]))
