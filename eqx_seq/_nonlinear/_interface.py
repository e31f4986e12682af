"""What `NonlinearKalmanFilter`'s methods return and the checks of what they are
given: the smoother's result, the backend, the covariances, the observations,
controls and functions, the iterated smoother's start."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._kalman._interface import (
    checked_controls,
    checked_observations,
    KalmanFilterResult,
    splits_time,
)
from .._kalman._model import checked_raw_factor
from .._scan import AbstractScan, check_scan


class NonlinearSmootherResult(eqx.Module):
    """What [`eqx_seq.NonlinearKalmanFilter.smooth`][] returns.

    `means[t-1]`, `covs[t-1]` and `cross_covs[t-1]` are the smoothed moments of
    step `t` (and of steps `t`, `t + 1`) under the model linearised as the method
    says; `filtered` is the filter of that linearised model, whose
    `log_likelihood` is the method's approximation of `log p(y_1..y_T)`. For the
    iterated smoothers, `num_iterations` counts the smoothing passes of the
    iteration and `converged` says whether the means stopped moving within the
    tolerance; for the one-pass smoothers they are `1` and `True`. With the time
    axis split over devices, `cross_covs` has a row per step, as in
    [`eqx_seq.KalmanSmootherResult`][].
    """

    means: Float[Array, "T n"]
    covs: Float[Array, "T n n"]
    cross_covs: Float[Array, "T-1 n n"] | Float[Array, "T n n"]
    filtered: KalmanFilterResult
    num_iterations: Int[Array, ""]
    converged: Bool[Array, ""]


def backend_of(scan: Any) -> AbstractScan:
    """The backend that runs (`AutoScan` resolved), after checking it."""
    return check_scan(
        scan, name="eqx_seq.NonlinearKalmanFilter", pytree_scan=True,
        splits_time=True,
    )  # fmt: skip


def spd_raw(name: str, A: Any, shape: tuple[int, ...], dtype) -> Array:
    """The unconstrained factor of a covariance `A` of per-step shape `shape`
    (optionally with a leading time axis), checked to be SPD at run time."""
    A = jnp.asarray(A, dtype)
    ok = A.shape == shape or (A.ndim == len(shape) + 1 and A.shape[1:] == shape)
    if not ok:
        raise ValueError(
            f"eqx_seq.NonlinearKalmanFilter: `{name}` must have shape {shape} (or "
            f"(T, *{shape}) for one per step), got {A.shape}."
        )
    return checked_raw_factor(name, A, "NonlinearKalmanFilter")


def _num_steps(nkf: Any) -> int | None:
    lengths = {x.shape[0] for x in (nkf.Q_factor, nkf.R_factor) if x.ndim == 3}
    return next(iter(lengths), None)


def inputs(nkf: Any, ys: Any, us: Any, caller: str, *, sequential: bool):
    """`ys` and `us` checked for the layer `nkf`'s method `caller` and cast to its
    dtype; `sequential`: the method refuses a time axis split over devices."""
    name = f"eqx_seq.NonlinearKalmanFilter.{caller}"
    if sequential and splits_time(nkf.scan):
        raise ValueError(
            f"{name}: the filters and the one-pass smoothers linearise each step "
            "about the previous step's result, a recursion that does not split "
            f"over devices (`{type(nkf.scan).__name__}`); use "
            "`smooth(..., iterated=True)`, or a one-device backend."
        )
    dtype = nkf.m0.dtype
    ys = checked_observations(ys, nkf.obs_size, dtype, name)
    T = ys.shape[0]
    num_steps = _num_steps(nkf)
    if num_steps is not None and num_steps != T:
        where = "this device's block" if splits_time(nkf.scan) else "the sequence"
        raise ValueError(
            f"{name}: `Q` or `R` has {num_steps} steps but {where} has {T} "
            "(with time split over devices, split per-step noise like `ys`)."
        )
    us = checked_controls(us, nkf.control_size, T, dtype, name)
    _check_functions(nkf, us, name)
    return ys, us


def _check_functions(nkf: Any, us: Array | None, name: str) -> None:
    """The shapes `f` and `h` return, by tracing them once (no computation)."""
    x = jax.ShapeDtypeStruct((nkf.state_size,), nkf.m0.dtype)
    args = () if us is None else (jax.ShapeDtypeStruct(us.shape[1:], us.dtype),)
    for fn, label, size in (
        (nkf.transition, "transition", nkf.state_size),
        (nkf.observation, "observation", nkf.obs_size),
    ):
        out = eqx.filter_eval_shape(fn, x, *args)
        if not (
            isinstance(out, jax.ShapeDtypeStruct)
            and out.shape == (size,)
            and jnp.issubdtype(out.dtype, jnp.floating)
        ):
            got = getattr(out, "shape", type(out).__name__)
            raise ValueError(
                f"{name}: `{label}` must return a floating array of shape "
                f"({size},), got {got}."
            )


def checked_init(nkf: Any, init: Any, T: int) -> tuple[Array, Array]:
    """The iterated smoother's `init`, `(means, covs)`, checked and cast."""
    n = nkf.state_size
    try:
        means, covs = (jnp.asarray(a, nkf.m0.dtype) for a in init)
    except (TypeError, ValueError) as e:
        raise ValueError(
            "eqx_seq.NonlinearKalmanFilter.smooth: `init` must be a pair (means, covs)."
        ) from e
    if means.shape != (T, n) or covs.shape != (T, n, n):
        raise ValueError(
            "eqx_seq.NonlinearKalmanFilter.smooth: `init` must be (means, covs) "
            f"of shapes ({T}, {n}) and ({T}, {n}, {n}), got {means.shape} and "
            f"{covs.shape}."
        )
    return means, covs
