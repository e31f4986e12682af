"""Expectation-maximisation for `KalmanFilter.fit_em`.

Each iteration runs the smoother on every sequence (the E-step; for complete data
and a time-invariant model, the steady-state filter's sums, `smoothed_sums_steady`),
turns its moments into the expected sufficient statistics of three linear
regressions with Gaussian noise (`x_0` on 1 for `m0, P0`; `x_t` on
`[x_{t-1}; u_t]` for `[F B], Q`; `y_t` on `[x_t; u_t]` for `[H D], R`), and solves
each in closed form (the M-step). Missing entries of `y_t` are latent too, with
their conditional moments given `x_t` and the observed entries. Entries held fixed
make a coefficient's M-step a weighted least squares on its free entries. See
`docs/devdocs/kalman.md`, "Expectation-maximisation".
"""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._misc import check_positive_int, full_precision
from .._scan import AbstractScan
from ._e_step import sequence_moments
from ._interface import (
    inputs,
)
from ._m_step import Fixed, m_step, Mask, WHERE
from ._model import (
    Initialization,
    model_of,
    Parameters,
    PriorAt,
)


# --- what `fit_em` holds fixed ---
#
# The `fixed` argument, checked against the model and normalised to one static spec
# (`Fixed`), and the checks of its inputs.
#
# A parameter is free (`False`), fixed (`True`), or, for `F`, `H`, `B`, `D` and `m0`,
# fixed entry by entry (a tuple of tuples of bools, `True` where held): hashable, so
# that the compiled EM loop is specialised to it.


# the parameters by their matrix names; covariances are fixed or free as a whole
_NAMES = ("F", "H", "B", "D", "m0", "Q", "R", "P0")
_COVARIANCES = ("Q", "R", "P0")
# the filter-spec field of each name
_FIELDS = {"Q": "Q_factor", "R": "R_factor", "P0": "P0_factor"}


def _value(params: Parameters, name: str) -> Array | None:
    return getattr(params, _FIELDS.get(name, name))


def _shape(params: Parameters, name: str) -> tuple[int, ...]:
    """The shape of one step's `name` (a mask's shape)."""
    n, p, c = params.state_size, params.obs_size, params.control_size
    shapes = {"F": (n, n), "H": (p, n), "B": (n, c), "D": (p, c), "m0": (n,)}
    shapes.update(Q=(n, n), R=(p, p), P0=(n, n))
    return shapes[name]


def _normalise(params: Parameters, name: str, value: Any) -> Mask:
    """One entry of the spec: a bool, or a boolean mask of the parameter's shape."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    shape = _shape(params, name)
    try:
        mask = np.asarray(value)
    except Exception as e:  # a traced mask, say
        raise ValueError(
            f"{WHERE}: `fixed[{name!r}]` must be a bool or a concrete boolean array "
            f"of shape {shape}, got {value!r}."
        ) from e
    if mask.dtype != bool or mask.shape not in ((), shape):
        raise ValueError(
            f"{WHERE}: `fixed[{name!r}]` must be a bool or a boolean array of shape "
            f"{shape} (True where held fixed), got {mask.dtype} of shape "
            f"{mask.shape}."
        )
    if mask.all() or not mask.any():
        return bool(mask.all())
    if name in _COVARIANCES:
        raise ValueError(
            f"{WHERE}: the covariance `{name}` is fixed or free as a whole: pass "
            f"`fixed[{name!r}]` True or False, not a mask with some entries fixed."
        )
    return tuple(map(tuple, mask.tolist())) if mask.ndim == 2 else tuple(mask.tolist())


def from_filter_spec(params: Parameters, spec: Parameters) -> dict[str, Any]:
    """The entries of a filter spec (a `KalmanFilter`-shaped pytree of bools or
    masks, as its `Parameters`)."""
    out = {}
    for name in _NAMES:
        field = _FIELDS.get(name, name)
        value = getattr(spec, field)
        if (value is None) != (_value(params, name) is None):
            raise ValueError(
                f"{WHERE}: the filter spec `fixed` does not match the model: its "
                f"`{field}` is {value!r} where the model's is "
                f"{'None' if _value(params, name) is None else 'an array'}. Build it "
                "from the model, e.g. `jax.tree.map(lambda _: False, kf)`."
            )
        if value is not None:
            out[name] = value
    return out


def fixed_spec(
    params: Parameters,
    fixed: Any,
    num_steps: int,
    prior_at: PriorAt,
    initialization: Initialization,
) -> Fixed:
    """The normalised spec of `fixed`: `None`, or a dict from parameter names to
    bools or masks (`KalmanFilter.fit_em` turns a `KalmanFilter`-shaped pytree of
    them, a filter spec, into one: `from_filter_spec`); checked against the model,
    time-varying matrices included."""
    if fixed is None:
        entries = {}
    elif isinstance(fixed, dict):
        entries = dict(fixed)
        unknown = [k for k in entries if k not in _NAMES]
        if unknown:
            raise ValueError(
                f"{WHERE}: unknown names in `fixed`: {unknown}; the parameters are "
                f"{list(_NAMES)} (B and D with controls only)."
            )
        absent = [k for k in entries if _value(params, k) is None]
        if absent:
            raise ValueError(
                f"{WHERE}: `fixed` names {absent}, but this model has no controls "
                "(control_size=0), so no B or D."
            )
    else:
        raise ValueError(
            f"{WHERE}: `fixed` must be None, a dict from parameter names to bools or "
            "boolean masks, or a KalmanFilter-shaped pytree of them (a filter spec), "
            f"got {type(fixed).__name__}."
        )
    spec = Fixed(**{k: _normalise(params, k, v) for k, v in entries.items()})
    _check_time_varying(params, spec)
    return _check_prior(params, spec, num_steps, prior_at, initialization)


def _check_prior(
    params: Parameters,
    spec: Fixed,
    num_steps: int,
    prior_at: PriorAt,
    initialization: Initialization,
) -> Fixed:
    """The prior's options (a diffuse one is refused by the layer, with the
    smoother): a stationary prior is a function of `F` and `Q` (its `m0`, `P0`
    unused), whose M-step would then have no closed form, so they are held; with
    `prior_at="x1"` one step has no transition to fit."""
    if initialization == "stationary":
        if spec.F is not True or spec.Q is not True:
            raise ValueError(
                f'{WHERE}: with initialization="stationary" the prior is a '
                "function of F and Q, which then have no closed-form M-step: hold "
                'them fixed (`fixed={"F": True, "Q": True}`) or use "known".'
            )
        spec = spec._replace(m0=True, P0=True)
    free = [
        k
        for k in ("F", "B", "Q")
        if _value(params, k) is not None and getattr(spec, k) is not True
    ]
    if prior_at == "x1" and num_steps == 1 and free:
        raise ValueError(
            f'{WHERE}: with prior_at="x1" sequences of one step have no transition, '
            "so F, B and Q cannot be fitted; hold them fixed."
        )
    return spec


def _check_time_varying(params: Parameters, spec: Fixed) -> None:
    """A free parameter is time-invariant; a free coefficient needs a time-invariant
    noise covariance to weigh it (its regression weighs every step alike)."""
    for name in ("F", "H", "Q", "R"):
        if _value(params, name).ndim == 3 and getattr(spec, name) is not True:
            raise ValueError(
                f"{WHERE}: `{name}` varies with time, so it cannot be fitted; hold "
                f"it fixed with `fixed={{{name!r}: True, ...}}`."
            )
    for cov, coefs in (("Q", ("F", "B")), ("R", ("H", "D"))):
        # a normalised mask is all-fixed only as `True`
        free = [
            k
            for k in coefs
            if _value(params, k) is not None and getattr(spec, k) is not True
        ]
        if _value(params, cov).ndim == 3 and free:
            raise ValueError(
                f"{WHERE}: `{cov}` varies with time, so {' and '.join(free)} cannot "
                "be fitted (their M-step weighs every step by one covariance); hold "
                f"them fixed too."
            )


def check_data(
    params: Parameters, scan: AbstractScan, ys: Any, us: Any, num_iters: Any
) -> tuple[Array, Array | None]:
    """`ys` as `(batch, T, obs_size)` and `us` as `(batch, T, control_size)` (or
    `None`), checked and cast to the parameters' dtype."""
    check_positive_int("num_iters", num_iters)
    ys = jnp.asarray(ys)
    us = None if us is None else jnp.asarray(us)
    if ys.ndim == 2:
        ys, us = inputs(params, scan, ys, us, "fit_em")
        return ys[None], None if us is None else us[None]
    if ys.ndim != 3 or ys.shape[0] < 1 or ys.shape[2] != params.obs_size:
        raise ValueError(
            f"{WHERE}: `ys` must have shape (T, obs_size) or (batch, T, obs_size) "
            f"with obs_size = {params.obs_size} and batch >= 1, got {ys.shape}."
        )
    if us is not None and (us.ndim != 3 or us.shape[:2] != ys.shape[:2]):
        raise ValueError(
            f"{WHERE}: with a batch of sequences `us` must have shape (batch, T, "
            f"control_size) = {(*ys.shape[:2], params.control_size)}, got {us.shape}."
        )
    # the other methods' checks (dtype, length, controls) on the first sequence
    inputs(params, scan, ys[0], None if us is None else us[0], "fit_em")
    dtype = params.m0.dtype
    return ys.astype(dtype), None if us is None else us.astype(dtype)


def _check_not_all_zero(ys: Array) -> None:
    """Observations whose every observed entry is zero leave `R` no scale: its
    maximum-likelihood value is zero, which no positive definite `R` reaches (the
    log-likelihood grows without bound; with missing entries `R` shrinks by the
    observed fraction at every iteration). Checked here when `ys` is concrete;
    traced, the M-step's check (`_checked_factor`) raises at run time."""
    if isinstance(ys, jax.core.Tracer):
        return
    y = np.asarray(ys)
    observed = y[~np.isnan(y)]
    if observed.size and not np.any(observed):
        raise ValueError(
            f"{WHERE}: every observed entry of `ys` is zero, so the observation "
            "noise `R` has no scale to fit: its maximum-likelihood value is zero, "
            "which no positive definite `R` reaches. Hold `R` fixed "
            "(`fixed={'R': True}`) or fit data that vary."
        )


def check_fit_em(
    params: Parameters,
    scan: AbstractScan,
    ys: Any,
    us: Any,
    num_iters: Any,
    fixed: Any,
    prior_at: PriorAt,
    initialization: Initialization,
) -> tuple[Array, Array | None, Fixed]:
    """`fit_em`'s inputs, checked: the data as batches (`check_data`), the
    normalised spec (`fixed_spec`), and, with `R` free, that some observed entry
    is not zero."""
    ys, us = check_data(params, scan, ys, us, num_iters)
    spec = fixed_spec(params, fixed, ys.shape[1], prior_at, initialization)
    if spec.R is not True:
        _check_not_all_zero(ys)
    return ys, us, spec


@eqx.filter_jit
@full_precision
def fit_em(
    params: Parameters,
    ys: Array,
    us: Array | None,
    num_iters: int,
    spec: Fixed,
    scan: AbstractScan,
    *,
    prior_at: PriorAt,
    initialization: Initialization,
    steady_state: bool = True,
) -> tuple[Parameters, Array]:
    """`num_iters` EM iterations from `params` (with the prior's options and the
    private `steady_state`) on checked `ys` `(batch, T, p)` and `us` `(batch, T,
    c)`: the fitted parameters and the log-likelihood after each iteration (summed
    over the sequences), in one compiled program."""
    arrays, static = eqx.partition(params, eqx.is_inexact_array)
    if ys.shape[0] == 1:
        # one sequence without `vmap`, under which the sequential loops run slower
        def e_step(model, ys, us, scan):
            u = None if us is None else us[0]
            out = sequence_moments(model, ys[0], u, scan)
            return jax.tree.map(lambda x: x[None], out)

    else:
        e_step = jax.vmap(sequence_moments, in_axes=(None, 0, 0, None))

    def iteration(arrays, last):
        params = eqx.combine(arrays, static)
        model = model_of(params, prior_at, initialization, steady_state=steady_state)
        moments, lls = e_step(model, ys, us, scan)
        new = eqx.partition(
            m_step(params, moments, spec, prior_at), eqx.is_inexact_array
        )[0]
        # the last pass is an E-step only: the final parameters' log-likelihood
        new = jax.tree.map(lambda a, b: jnp.where(last, a, b), arrays, new)
        return new, jnp.sum(lls)

    last = jnp.arange(num_iters + 1) == num_iters
    arrays, lls = lax.scan(iteration, arrays, last)
    return eqx.combine(arrays, static), lls[1:]
