"""Input checks of `KalmanFilter`'s methods: observations, controls, lengths."""

from typing import Any, TYPE_CHECKING

import jax.numpy as jnp
from jaxtyping import Array

from .._scan import mesh_axis


if TYPE_CHECKING:
    from ._layer import KalmanFilter


def inputs(
    kf: "KalmanFilter", ys: Any, us: Any, caller: str
) -> tuple[Array, Array | None]:
    """Validate observations and controls; cast them to the parameters' dtype."""
    ys = observations(kf, ys, caller)
    T = ys.shape[0]
    if kf.scan.select().splits_time:
        check_block(kf, T, caller)
    else:
        check_length(kf, T, caller)
    return ys, controls(kf, us, T, caller)


def observations(kf: "KalmanFilter", ys: Any, caller: str) -> Array:
    """Validate observations (any length); cast them to the parameters' dtype."""
    ys = jnp.asarray(ys)
    if not jnp.issubdtype(ys.dtype, jnp.floating):
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: `ys` must be floating (NaN marks a "
            f"missing entry), got dtype {ys.dtype}."
        )
    if ys.ndim != 2 or ys.shape[1] != kf.obs_size or ys.shape[0] < 1:
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: `ys` must have shape (T, obs_size) "
            f"= (T, {kf.obs_size}) with T >= 1, got {ys.shape}. Use `jax.vmap` "
            "for a batch of sequences."
        )
    return ys.astype(kf.m0.dtype)


def not_diffuse(kf: "KalmanFilter", caller: str) -> None:
    if kf.initialization == "diffuse":
        raise NotImplementedError(
            f"eqx_seq.KalmanFilter.{caller}: not available with "
            'initialization="diffuse" (the exact diffuse smoother is not '
            'implemented); use "known" with a large `P0` (approximately '
            "diffuse)."
        )


def check_length(kf: "KalmanFilter", T: int, caller: str) -> None:
    if kf.num_steps is not None and T != kf.num_steps:
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: this model is time-varying with "
            f"{kf.num_steps} steps, but the sequence has {T}."
        )


def check_block(kf: "KalmanFilter", T: int, caller: str) -> None:
    """With the time axis split over devices (`eqx_seq.ShardedScan`): `T` is this
    device's block, and the time-varying matrices must be split like it."""
    num_devices, _ = mesh_axis(kf.scan.axis_name)
    check_length(kf, T * num_devices, caller)
    leaves = (kf.F, kf.H, kf.Q_factor, kf.R_factor)
    lengths = {x.shape[0] for x in leaves if x.ndim == 3}
    if lengths and lengths != {T}:
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: with the time axis split over devices, "
            "split the time-varying matrices like the observations (in_specs "
            f"`P({kf.scan.axis_name!r})` for them): this device has {T} steps of "
            f"observations but matrices of {sorted(lengths)} steps."
        )


def controls(kf: "KalmanFilter", us: Any, T: int, caller: str) -> Array | None:
    c = kf.control_size
    if c == 0:
        if us is not None:
            raise ValueError(
                f"eqx_seq.KalmanFilter.{caller}: got controls `us` but this model "
                "has control_size=0."
            )
        return None
    if us is None:
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: this model has control_size={c}; "
            f"pass `us` of shape (T, {c})."
        )
    us = jnp.asarray(us)
    if us.shape != (T, c) or not jnp.issubdtype(us.dtype, jnp.floating):
        raise ValueError(
            f"eqx_seq.KalmanFilter.{caller}: `us` must be a floating array of "
            f"shape (T, control_size) = ({T}, {c}), got {us.shape} {us.dtype}."
        )
    return us.astype(kf.m0.dtype)
