"""What `KalmanFilter.fit_em` holds fixed: the `fixed` argument, checked against the
model and normalised to one static spec (`_Fixed`), and the checks of its inputs.

A parameter is free (`False`), fixed (`True`), or, for `F`, `H`, `B`, `D` and `m0`,
fixed entry by entry (a tuple of tuples of bools, `True` where held): hashable, so
that the compiled EM loop is specialised to it.
"""

from typing import Any, NamedTuple, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._misc import check_positive_int
from ._checks import inputs


if TYPE_CHECKING:
    from ._layer import KalmanFilter

_WHERE = "eqx_seq.KalmanFilter.fit_em"
# the parameters by their matrix names; covariances are fixed or free as a whole
_NAMES = ("F", "H", "B", "D", "m0", "Q", "R", "P0")
_COVARIANCES = ("Q", "R", "P0")
# the filter-spec field of each name
_FIELDS = {"Q": "Q_factor", "R": "R_factor", "P0": "P0_factor"}

Mask = bool | tuple


class _Fixed(NamedTuple):
    F: Mask = False
    H: Mask = False
    B: Mask = False
    D: Mask = False
    m0: Mask = False
    Q: Mask = False
    R: Mask = False
    P0: Mask = False


def as_array(mask: Mask, shape: tuple[int, ...]) -> np.ndarray:
    """A normalised mask as a boolean array of `shape` (`True`: held fixed)."""
    return np.broadcast_to(np.asarray(mask, bool), shape)


def _value(kf: "KalmanFilter", name: str) -> Array | None:
    return getattr(kf, _FIELDS.get(name, name))


def _shape(kf: "KalmanFilter", name: str) -> tuple[int, ...]:
    """The shape of one step's `name` (a mask's shape)."""
    n, p, c = kf.state_size, kf.obs_size, kf.control_size
    shapes = {"F": (n, n), "H": (p, n), "B": (n, c), "D": (p, c), "m0": (n,)}
    shapes.update(Q=(n, n), R=(p, p), P0=(n, n))
    return shapes[name]


def _normalise(kf: "KalmanFilter", name: str, value: Any) -> Mask:
    """One entry of the spec: a bool, or a boolean mask of the parameter's shape."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    shape = _shape(kf, name)
    try:
        mask = np.asarray(value)
    except Exception as e:  # a traced mask, say
        raise ValueError(
            f"{_WHERE}: `fixed[{name!r}]` must be a bool or a concrete boolean array "
            f"of shape {shape}, got {value!r}."
        ) from e
    if mask.dtype != bool or mask.shape not in ((), shape):
        raise ValueError(
            f"{_WHERE}: `fixed[{name!r}]` must be a bool or a boolean array of shape "
            f"{shape} (True where held fixed), got {mask.dtype} of shape "
            f"{mask.shape}."
        )
    if mask.all() or not mask.any():
        return bool(mask.all())
    if name in _COVARIANCES:
        raise ValueError(
            f"{_WHERE}: the covariance `{name}` is fixed or free as a whole: pass "
            f"`fixed[{name!r}]` True or False, not a mask with some entries fixed."
        )
    return tuple(map(tuple, mask.tolist())) if mask.ndim == 2 else tuple(mask.tolist())


def _from_filter_spec(kf: "KalmanFilter", spec: "KalmanFilter") -> dict[str, Any]:
    out = {}
    for name in _NAMES:
        field = _FIELDS.get(name, name)
        value = getattr(spec, field)
        if (value is None) != (_value(kf, name) is None):
            raise ValueError(
                f"{_WHERE}: the filter spec `fixed` does not match the model: its "
                f"`{field}` is {value!r} where the model's is "
                f"{'None' if _value(kf, name) is None else 'an array'}. Build it "
                "from the model, e.g. `jax.tree.map(lambda _: False, kf)`."
            )
        if value is not None:
            out[name] = value
    return out


def fixed_spec(kf: "KalmanFilter", fixed: Any, num_steps: int) -> _Fixed:
    """The normalised spec of `fixed`: `None`, a dict from parameter names to bools
    or masks, or a `KalmanFilter`-shaped pytree of them (a filter spec); checked
    against the model, time-varying matrices included."""
    from ._layer import KalmanFilter

    if fixed is None:
        entries = {}
    elif isinstance(fixed, KalmanFilter):
        entries = _from_filter_spec(kf, fixed)
    elif isinstance(fixed, dict):
        entries = dict(fixed)
        unknown = [k for k in entries if k not in _NAMES]
        if unknown:
            raise ValueError(
                f"{_WHERE}: unknown names in `fixed`: {unknown}; the parameters are "
                f"{list(_NAMES)} (B and D with controls only)."
            )
        absent = [k for k in entries if _value(kf, k) is None]
        if absent:
            raise ValueError(
                f"{_WHERE}: `fixed` names {absent}, but this model has no controls "
                "(control_size=0), so no B or D."
            )
    else:
        raise ValueError(
            f"{_WHERE}: `fixed` must be None, a dict from parameter names to bools or "
            "boolean masks, or a KalmanFilter-shaped pytree of them (a filter spec), "
            f"got {type(fixed).__name__}."
        )
    spec = _Fixed(**{k: _normalise(kf, k, v) for k, v in entries.items()})
    _check_time_varying(kf, spec)
    return _check_prior(kf, spec, num_steps)


def _check_prior(kf: "KalmanFilter", spec: _Fixed, num_steps: int) -> _Fixed:
    """The prior's options (a diffuse one is refused by the layer, with the
    smoother): a stationary prior is a function of `F` and `Q` (its `m0`, `P0`
    unused), whose M-step would then have no closed form, so they are held; with
    `prior_at="x1"` one step has no transition to fit."""
    if kf.initialization == "stationary":
        if spec.F is not True or spec.Q is not True:
            raise ValueError(
                f'{_WHERE}: with initialization="stationary" the prior is a '
                "function of F and Q, which then have no closed-form M-step: hold "
                'them fixed (`fixed={"F": True, "Q": True}`) or use "known".'
            )
        spec = spec._replace(m0=True, P0=True)
    free = [
        k
        for k in ("F", "B", "Q")
        if _value(kf, k) is not None and getattr(spec, k) is not True
    ]
    if kf.prior_at == "x1" and num_steps == 1 and free:
        raise ValueError(
            f'{_WHERE}: with prior_at="x1" sequences of one step have no transition, '
            "so F, B and Q cannot be fitted; hold them fixed."
        )
    return spec


def _check_time_varying(kf: "KalmanFilter", spec: _Fixed) -> None:
    """A free parameter is time-invariant; a free coefficient needs a time-invariant
    noise covariance to weigh it (its regression weighs every step alike)."""
    for name in ("F", "H", "Q", "R"):
        if _value(kf, name).ndim == 3 and getattr(spec, name) is not True:
            raise ValueError(
                f"{_WHERE}: `{name}` varies with time, so it cannot be fitted; hold "
                f"it fixed with `fixed={{{name!r}: True, ...}}`."
            )
    for cov, coefs in (("Q", ("F", "B")), ("R", ("H", "D"))):
        # a normalised mask is all-fixed only as `True`
        free = [
            k
            for k in coefs
            if _value(kf, k) is not None and getattr(spec, k) is not True
        ]
        if _value(kf, cov).ndim == 3 and free:
            raise ValueError(
                f"{_WHERE}: `{cov}` varies with time, so {' and '.join(free)} cannot "
                "be fitted (their M-step weighs every step by one covariance); hold "
                f"them fixed too."
            )


def check_data(
    kf: "KalmanFilter", ys: Any, us: Any, num_iters: Any
) -> tuple[Array, Array | None]:
    """`ys` as `(batch, T, obs_size)` and `us` as `(batch, T, control_size)` (or
    `None`), checked and cast to the parameters' dtype."""
    check_positive_int("num_iters", num_iters)
    ys = jnp.asarray(ys)
    us = None if us is None else jnp.asarray(us)
    if ys.ndim == 2:
        ys, us = inputs(kf, ys, us, "fit_em")
        return ys[None], None if us is None else us[None]
    if ys.ndim != 3 or ys.shape[0] < 1 or ys.shape[2] != kf.obs_size:
        raise ValueError(
            f"{_WHERE}: `ys` must have shape (T, obs_size) or (batch, T, obs_size) "
            f"with obs_size = {kf.obs_size} and batch >= 1, got {ys.shape}."
        )
    if us is not None and (us.ndim != 3 or us.shape[:2] != ys.shape[:2]):
        raise ValueError(
            f"{_WHERE}: with a batch of sequences `us` must have shape (batch, T, "
            f"control_size) = {(*ys.shape[:2], kf.control_size)}, got {us.shape}."
        )
    # the other methods' checks (dtype, length, controls) on the first sequence
    inputs(kf, ys[0], None if us is None else us[0], "fit_em")
    dtype = kf.m0.dtype
    return ys.astype(dtype), None if us is None else us.astype(dtype)


def _check_not_all_zero(ys: Array) -> None:
    """Observations whose every observed entry is zero leave `R` no scale: its
    maximum-likelihood value is zero, which no positive definite `R` reaches (the
    log-likelihood grows without bound; with missing entries `R` shrinks by the
    observed fraction at every iteration). Checked here when `ys` is concrete;
    traced, the M-step's check (`_em._checked_factor`) raises at run time."""
    if isinstance(ys, jax.core.Tracer):
        return
    y = np.asarray(ys)
    observed = y[~np.isnan(y)]
    if observed.size and not np.any(observed):
        raise ValueError(
            f"{_WHERE}: every observed entry of `ys` is zero, so the observation "
            "noise `R` has no scale to fit: its maximum-likelihood value is zero, "
            "which no positive definite `R` reaches. Hold `R` fixed "
            "(`fixed={'R': True}`) or fit data that vary."
        )


def check_fit_em(
    kf: "KalmanFilter", ys: Any, us: Any, num_iters: Any, fixed: Any
) -> tuple[Array, Array | None, _Fixed]:
    """`fit_em`'s inputs, checked: the data as batches (`check_data`), the
    normalised spec (`fixed_spec`), and, with `R` free, that some observed entry
    is not zero."""
    ys, us = check_data(kf, ys, us, num_iters)
    spec = fixed_spec(kf, fixed, ys.shape[1])
    if spec.R is not True:
        _check_not_all_zero(ys)
    return ys, us, spec
