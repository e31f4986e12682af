"""Forecasts: the predictive distributions of the states and observations after the
data, by iterating the filter's prediction step from the last filtered moments."""

from typing import Any, TYPE_CHECKING

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from ._checks import controls, observations
from ._dispatch import backend, filter_
from ._linalg import _factor, _gram, _mv, _sandwich, _sym
from ._problem import _model, _per_step
from ._results import KalmanForecastResult
from ._step import _predict


if TYPE_CHECKING:
    from ._layer import KalmanFilter


def check_forecast(
    kf: "KalmanFilter", ys: Any, us: Any, horizon: Any
) -> tuple[Array, Array | None]:
    """`ys` and `us` checked and cast, or a `ValueError` that says what is wrong."""
    where = "eqx_seq.KalmanFilter.forecast"
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 0:
        raise ValueError(
            f"{where}: `horizon` must be a non-negative int, got {horizon!r}."
        )
    ys = observations(kf, ys, "forecast")
    T = ys.shape[0]
    if kf.num_steps is not None and T + horizon > kf.num_steps:
        raise ValueError(
            f"{where}: this model is time-varying with {kf.num_steps} steps, so it "
            f"cannot forecast past them: T + horizon = {T} + {horizon} > "
            f"{kf.num_steps}."
        )
    if us is not None and horizon and jnp.shape(us)[:1] == (T,):
        raise ValueError(
            f"{where}: `us` must also hold the controls of the forecast steps: "
            f"shape (T + horizon, control_size) = ({T + horizon}, "
            f"{kf.control_size}), got {jnp.shape(us)}."
        )
    return ys, controls(kf, us, T + horizon, "forecast")


def _steps(kf: "KalmanFilter", start: int, stop: int) -> "KalmanFilter":
    """`kf` with its time-varying matrices cut to the steps `start + 1..stop`."""
    names = [k for k in ("F", "H", "Q_factor", "R_factor") if getattr(kf, k).ndim == 3]
    if not names:
        return kf
    return eqx.tree_at(
        lambda k: [getattr(k, name) for name in names],
        kf,
        [getattr(kf, name)[start:stop] for name in names],
    )


@eqx.filter_jit
@full_precision
def forecast(
    kf: "KalmanFilter",
    ys: Array,
    us: Array | None,
    horizon: int,
) -> KalmanForecastResult:
    """The forecast of `kf` for `horizon` steps after `ys` (checked; `us` holds the
    controls of the data's steps and then of the forecast's)."""
    scan = backend(kf.scan, caller="forecast")
    T = ys.shape[0]
    filtered = filter_(_steps(kf, 0, T), ys, None if us is None else us[:T], scan)
    ahead = _steps(kf, T, T + horizon)
    model = _model(ahead)
    L_R = _factor(ahead.R_factor)
    # the matrices that vary come in per step; the others are closed over
    mats = {"F": model.F, "L_Q": model.L_Q, "H": model.H, "L_R": L_R}
    xs = {name: x for name, x in mats.items() if _per_step(x, 2)}
    if us is not None:
        xs["c"] = us[T:] @ kf.B.T
        xs["d"] = us[T:] @ kf.D.T

    def step(carry, x):
        get = lambda name: x[name] if name in x else mats[name]
        m, P = _predict(*carry, get("F"), get("L_Q"), x.get("c"))
        H = get("H")
        y = _mv(H, m)
        if "d" in x:
            y = y + x["d"]
        S = _sym(_sandwich(H, P) + _gram(get("L_R")))
        return (m, P), (m, P, y, S)

    init = (filtered.means[-1], filtered.covs[-1])
    _, (ms, Ps, y, S) = lax.scan(step, init, xs, length=horizon)
    return KalmanForecastResult(ms, Ps, y, S)
