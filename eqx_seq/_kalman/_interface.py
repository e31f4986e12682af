"""What the layer's methods take and return: the result types of the filter, the
smoother and the forecasts, the state of online filtering, and the checks of the
observations, controls and lengths the methods are given."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._scan import AbstractScan, mesh_axis
from ._model import Initialization, Parameters


# --- what the filter and the smoother return ---


class KalmanFilterResult(eqx.Module):
    """What [`eqx_seq.KalmanFilter.filter`][] returns.

    Row `t - 1` of each array is about step `t`: `means[t-1]` and `covs[t-1]` are
    the filtered `E[x_t | y_1..y_t]` and `Cov[x_t | y_1..y_t]`; `predicted_means` and
    `predicted_covs` the one-step predictions given `y_1..y_{t-1}`;
    `log_likelihoods[t-1]` is `log p(y_t | y_1..y_{t-1})` over the observed (non-NaN)
    entries of `y_t` (zero for a step with none); `log_likelihood` is their sum,
    `log p(y_1..y_T)`.
    """

    means: Float[Array, "T n"]
    covs: Float[Array, "T n n"]
    predicted_means: Float[Array, "T n"]
    predicted_covs: Float[Array, "T n n"]
    log_likelihoods: Float[Array, " T"]
    log_likelihood: Float[Array, ""]


class KalmanSmootherResult(eqx.Module):
    """What [`eqx_seq.KalmanFilter.smooth`][] returns.

    `means[t-1]` and `covs[t-1]` are the smoothed `E[x_t | y_1..y_T]` and
    `Cov[x_t | y_1..y_T]`; `cross_covs[t-1]` is `Cov[x_t, x_{t+1} | y_1..y_T]` for
    `t < T` (what EM needs); `filtered` is the filter's result, log-likelihood
    included. With the time axis split over devices ([`eqx_seq.ShardedScan`][]),
    each device's `cross_covs` has a row per step, the last being the one across
    the boundary with the next block (zero on the last device).
    """

    means: Float[Array, "T n"]
    covs: Float[Array, "T n n"]
    # `T` rows on each device with the time axis split (see above)
    cross_covs: Float[Array, "T-1 n n"] | Float[Array, "T n n"]
    filtered: KalmanFilterResult


class KalmanForecastResult(eqx.Module):
    """What [`eqx_seq.KalmanFilter.forecast`][] returns.

    Row `h - 1` of each array is about step `T + h` after `T` observations:
    `means[h-1]` and `covs[h-1]` are `E[x_{T+h} | y_1..y_T]` and
    `Cov[x_{T+h} | y_1..y_T]`; `obs_means[h-1]` and `obs_covs[h-1]` those of
    `y_{T+h}`, whose covariance `H P H^T + R` includes the observation noise.
    """

    means: Float[Array, "horizon n"]
    covs: Float[Array, "horizon n n"]
    obs_means: Float[Array, "horizon p"]
    obs_covs: Float[Array, "horizon p p"]


class KalmanState(eqx.Module):
    """The state of online filtering: what [`eqx_seq.KalmanFilter.init_state`][],
    [`eqx_seq.KalmanFilter.predict`][] and [`eqx_seq.KalmanFilter.update`][] pass
    along.

    `mean` and `cov` are the current Gaussian belief about the state (after an
    update, the filtered moments given the observations so far; after a predict,
    the one-step prediction); `log_likelihood` is the log-likelihood of the
    observed entries so far, `log p(y_1..y_t)`. The state holds a square root of
    the covariance, `cov = cov_factor @ cov_factor.T` (lower triangular as the
    steps return it; any square factor is accepted), because the steps are the
    square-root filter's.
    """

    mean: Float[Array, " n"]
    cov_factor: Float[Array, "n n"]
    log_likelihood: Float[Array, ""]

    @property
    def cov(self) -> Float[Array, "n n"]:
        """The covariance, `cov_factor @ cov_factor.T`."""
        L = self.cov_factor
        return L @ L.T


def filter_result(ms, Ps, mps, Pps, lls, logdet) -> KalmanFilterResult:
    """The result from the filter's outputs on whitened observations: the whitening's
    log-determinant `logdet` (per step) completes the log-likelihoods."""
    lls = lls - logdet
    return KalmanFilterResult(ms, Ps, mps, Pps, lls, jnp.sum(lls))


# --- input checks of `KalmanFilter`'s methods: observations, controls, lengths ---


def splits_time(scan: AbstractScan) -> bool:
    """Whether `scan` splits the time axis over devices (`eqx_seq.ShardedScan`)."""
    return scan.select().splits_time


def inputs(
    params: Parameters, scan: AbstractScan, ys: Any, us: Any, caller: str
) -> tuple[Array, Array | None]:
    """Validate observations and controls; cast them to the parameters' dtype."""
    ys = observations(params, ys, caller)
    T = ys.shape[0]
    if splits_time(scan):
        check_block(params, scan, T, caller)
    else:
        check_length(params, T, caller)
    return ys, controls(params, us, T, caller)


def observations(params: Parameters, ys: Any, caller: str) -> Array:
    """Validate observations (any length); cast them to the parameters' dtype."""
    return checked_observations(
        ys, params.obs_size, params.m0.dtype, f"eqx_seq.KalmanFilter.{caller}"
    )


def checked_observations(ys: Any, obs_size: int, dtype: Any, name: str) -> Array:
    """`ys` checked to be a floating `(T, obs_size)` array, `T >= 1`, in `dtype`;
    the errors name `name` (any Kalman layer's method)."""
    ys = jnp.asarray(ys)
    if not jnp.issubdtype(ys.dtype, jnp.floating):
        raise ValueError(
            f"{name}: `ys` must be floating (NaN marks a missing entry), got dtype "
            f"{ys.dtype}."
        )
    if ys.ndim != 2 or ys.shape[1] != obs_size or ys.shape[0] < 1:
        raise ValueError(
            f"{name}: `ys` must have shape (T, obs_size) = (T, {obs_size}) with "
            f"T >= 1, got {ys.shape}. Use `jax.vmap` for a batch of sequences."
        )
    return ys.astype(dtype)


def not_diffuse(initialization: Initialization, caller: str) -> None:
    if initialization == "diffuse":
        raise NotImplementedError(
            f"eqx_seq.KalmanFilter.{caller}: not available with "
            'initialization="diffuse" (the exact diffuse smoother is not '
            'implemented); use "known" with a large `P0` (approximately '
            "diffuse)."
        )


def check_length(params: Parameters, T: int, caller: str) -> None:
    if params.num_steps is not None and T != params.num_steps:
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: this model is time-varying with "
            f"{params.num_steps} steps, but the sequence has {T}."
        )


def check_block(params: Parameters, scan: AbstractScan, T: int, caller: str) -> None:
    """With the time axis split over devices (`eqx_seq.ShardedScan`): `T` is this
    device's block, and the time-varying matrices must be split like it."""
    num_devices, _ = mesh_axis(scan.axis_name)
    check_length(params, T * num_devices, caller)
    leaves = (params.F, params.H, params.Q_factor, params.R_factor)
    lengths = {x.shape[0] for x in leaves if x.ndim == 3}
    if lengths and lengths != {T}:
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: with the time axis split over devices, "
            "split the time-varying matrices like the observations (in_specs "
            f"`P({scan.axis_name!r})` for them): this device has {T} steps of "
            f"observations but matrices of {sorted(lengths)} steps."
        )


def controls(params: Parameters, us: Any, T: int, caller: str) -> Array | None:
    return checked_controls(
        us, params.control_size, T, params.m0.dtype, f"eqx_seq.KalmanFilter.{caller}"
    )


def checked_controls(us: Any, c: int, T: int, dtype: Any, name: str) -> Array | None:
    """`us` checked against a control size `c` (`None` iff `c == 0`) and `T`
    steps, in `dtype`; the errors name `name`."""
    if c == 0:
        if us is not None:
            raise ValueError(
                f"{name}: got controls `us` but this model has control_size=0."
            )
        return None
    if us is None:
        raise ValueError(
            f"{name}: this model has control_size={c}; pass `us` of shape (T, {c})."
        )
    us = jnp.asarray(us)
    if us.shape != (T, c) or not jnp.issubdtype(us.dtype, jnp.floating):
        raise ValueError(
            f"{name}: `us` must be a floating array of shape (T, control_size) = "
            f"({T}, {c}), got {us.shape} {us.dtype}."
        )
    return us.astype(dtype)
