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

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array

from .._misc import check_positive_int, error_if_any, full_precision
from .._scan import AbstractScan
from ._dispatch import by_whitening, smooth_problem
from ._filter import affine_scan, filter_steady, head_steps, may_settle
from ._linalg import (
    bmm,
    cho_solve,
    chol,
    eye_like,
    factor,
    gram,
    mT,
    sym,
    tria,
    tril_inverse_by_rows,
    unfactor,
)
from ._model import (
    bt,
    Initialization,
    inputs,
    Model,
    model_of,
    Parameters,
    prepare,
    PriorAt,
    Problem,
)
from ._smoother import element


# --- what `fit_em` holds fixed ---
#
# The `fixed` argument, checked against the model and normalised to one static spec
# (`_Fixed`), and the checks of its inputs.
#
# A parameter is free (`False`), fixed (`True`), or, for `F`, `H`, `B`, `D` and `m0`,
# fixed entry by entry (a tuple of tuples of bools, `True` where held): hashable, so
# that the compiled EM loop is specialised to it.


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


def from_filter_spec(params: Parameters, spec: Parameters) -> dict[str, Any]:
    """The entries of a filter spec (a `KalmanFilter`-shaped pytree of bools or
    masks, as its `Parameters`)."""
    out = {}
    for name in _NAMES:
        field = _FIELDS.get(name, name)
        value = getattr(spec, field)
        if (value is None) != (_value(params, name) is None):
            raise ValueError(
                f"{_WHERE}: the filter spec `fixed` does not match the model: its "
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
) -> _Fixed:
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
                f"{_WHERE}: unknown names in `fixed`: {unknown}; the parameters are "
                f"{list(_NAMES)} (B and D with controls only)."
            )
        absent = [k for k in entries if _value(params, k) is None]
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
    spec = _Fixed(**{k: _normalise(params, k, v) for k, v in entries.items()})
    _check_time_varying(params, spec)
    return _check_prior(params, spec, num_steps, prior_at, initialization)


def _check_prior(
    params: Parameters,
    spec: _Fixed,
    num_steps: int,
    prior_at: PriorAt,
    initialization: Initialization,
) -> _Fixed:
    """The prior's options (a diffuse one is refused by the layer, with the
    smoother): a stationary prior is a function of `F` and `Q` (its `m0`, `P0`
    unused), whose M-step would then have no closed form, so they are held; with
    `prior_at="x1"` one step has no transition to fit."""
    if initialization == "stationary":
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
        if _value(params, k) is not None and getattr(spec, k) is not True
    ]
    if prior_at == "x1" and num_steps == 1 and free:
        raise ValueError(
            f'{_WHERE}: with prior_at="x1" sequences of one step have no transition, '
            "so F, B and Q cannot be fitted; hold them fixed."
        )
    return spec


def _check_time_varying(params: Parameters, spec: _Fixed) -> None:
    """A free parameter is time-invariant; a free coefficient needs a time-invariant
    noise covariance to weigh it (its regression weighs every step alike)."""
    for name in ("F", "H", "Q", "R"):
        if _value(params, name).ndim == 3 and getattr(spec, name) is not True:
            raise ValueError(
                f"{_WHERE}: `{name}` varies with time, so it cannot be fitted; hold "
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
                f"{_WHERE}: `{cov}` varies with time, so {' and '.join(free)} cannot "
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
            f"{_WHERE}: `ys` must have shape (T, obs_size) or (batch, T, obs_size) "
            f"with obs_size = {params.obs_size} and batch >= 1, got {ys.shape}."
        )
    if us is not None and (us.ndim != 3 or us.shape[:2] != ys.shape[:2]):
        raise ValueError(
            f"{_WHERE}: with a batch of sequences `us` must have shape (batch, T, "
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
            f"{_WHERE}: every observed entry of `ys` is zero, so the observation "
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
) -> tuple[Array, Array | None, _Fixed]:
    """`fit_em`'s inputs, checked: the data as batches (`check_data`), the
    normalised spec (`fixed_spec`), and, with `R` free, that some observed entry
    is not zero."""
    ys, us = check_data(params, scan, ys, us, num_iters)
    spec = fixed_spec(params, fixed, ys.shape[1], prior_at, initialization)
    if spec.R is not True:
        _check_not_all_zero(ys)
    return ys, us, spec


# --- the E-step's sums from the steady-state filter ---
#
# The smoother's statistics that EM needs, from the steady-state filter:
# time-invariant model, complete data.
#
# Once the filtered covariance has settled (`_filter.filter_steady`), the RTS gain
# `J = P_f F^T P_p^{-1}` is constant, and so is the backward recursion of the
# smoothed covariances, `P_t = C + J P_{t+1} J^T` with `C = P_f - J P_p J^T`: from
# the last step it approaches its fixed point `P_ss` as `P_t = P_ss + J^j D J^jT`
# (`j` steps back, `D = P_f - P_ss`). So the sums of the smoothed covariances and
# cross-covariances over the steady steps are Lyapunov sums, `O(log T)` products;
# the smoothed means are a backward loop of one matrix-vector product; the exact
# head runs the RTS recursion step by step. The gains and `C` are the square-root
# smoother's elements (`_smoother.element`, from the filtered factors), never the
# covariance form's `P_f - J P_p J^T`: on a stiff model (a vague prior meeting
# precise observations) the head's predicted covariances are many orders above the
# filtered ones, and that difference cancelled in float32. Only sums leave these
# functions (no per-step covariances): see `docs/devdocs/kalman.md`,
# "Expectation-maximisation".


# The fixed point is the sum of `J^j C J^jT` for `j < 2^_LOG2_TERMS`; it counts as
# converged when `|J^(2^_LOG2_TERMS)|^2` is below round-off.
_LOG2_TERMS = 12


class _SmoothedSums(eqx.Module):
    """What EM reads of the smoother: the means `(T, n)`, the first and last
    covariances, the sum of all covariances and of the lag-one cross-covariances
    `Cov[x_t, x_{t+1}]` (or, where noted by the caller, the per-step arrays), and
    the log-likelihood."""

    means: Array
    first: Array
    last: Array
    covs: Array
    cross: Array
    log_likelihood: Array


def lyapunov_sum(J: Array, X: Array, N: int) -> tuple[Array, Array]:
    """`sum_{j < N} J^j X J^jT` and `J^N`, by doubling over the binary digits of
    `N` (static)."""
    total = jnp.zeros_like(X)
    power = jnp.eye(J.shape[0], dtype=J.dtype)
    A, S = J, X  # S: the sum of the first 2^i terms, A = J^(2^i)
    while N:
        if N & 1:
            total = total + power @ S @ power.T
            power = power @ A
        N >>= 1
        if N:
            S = S + A @ S @ A.T
            A = A @ A
    return total, power


def _head(E, g, C, m_next, P_next):
    """The exact steps' RTS recursion, backwards from the smoothed moments of the
    first steady step, on their square-root elements `(E, g, C)`: the means,
    covariances (sums of positive semi-definite terms) and cross-covariances."""

    def step(carry, x):
        m1, P1 = carry
        E, g, C = x
        m = E @ m1 + g
        P = sym(E @ P1 @ E.T + C)
        return (m, P), (m, P, E @ P1)

    return lax.scan(step, (m_next, P_next), (E, g, C), reverse=True)[1]


def smoothed_sums_steady(problem: Problem) -> tuple[_SmoothedSums, Array]:
    """The statistics of a problem that `may_settle`, and whether they are exact:
    the filter's covariance settled and the smoother's converges (`J` contracts)."""
    result, settled, (head_factors, tail_factor) = filter_steady(
        problem, exact_fallback=False, factors=True
    )
    model = problem.model
    F, L_Q = model.F, model.L_Q
    mf, mp = result.means, result.predicted_means
    T = mf.shape[0]
    K = head_steps(mf.dtype)
    N = T - K  # the steady steps
    Pf = result.covs[-1]
    # the steady steps' element: the gain J and C = Pf - J Pp J^T, by one
    # triangularisation of the settled factor (its `g` is per step, below)
    J, _, C = element(mf[K], tail_factor, mp[K + 1], F, L_Q)
    # means: the steady steps backwards from the last, then the head
    z = mf[K:-1] - mp[K + 1 :] @ J.T
    tail = affine_scan(J, z[::-1], mf[-1])[::-1]
    m_K = tail[0] if N > 1 else mf[-1]
    # covariances of the steady steps: P_ss + J^j D J^jT, j = 0..N-1 from the last
    P_ss, J_far = lyapunov_sum(J, C, 2**_LOG2_TERMS)
    D = Pf - P_ss
    tail_sum = N * P_ss + lyapunov_sum(J, D, N)[0]
    J_K = jnp.linalg.matrix_power(J, N - 1)
    P_K = sym(P_ss + J_K @ D @ J_K.T)
    # the head, rows 0..K-1: elements from their own filtered factors
    E_h, g_h, C_h = jax.vmap(element, in_axes=(0, 0, 0, None, None))(
        mf[:K], head_factors, mp[1 : K + 1], F, L_Q
    )
    ms_h, Ps_h, cross_h = _head(E_h, g_h, C_h, m_K, P_K)
    sums = _SmoothedSums(
        means=jnp.concatenate([ms_h, tail, mf[-1:]]),
        first=Ps_h[0],
        last=Pf,
        covs=jnp.sum(Ps_h, axis=0) + tail_sum,
        cross=jnp.sum(cross_h, axis=0) + J @ (tail_sum - P_K),
        log_likelihood=result.log_likelihood,
    )
    eps = jnp.finfo(mf.dtype).eps
    converged = jnp.sum(J_far * J_far) <= eps
    return sums, settled & converged


# --- the E-step and the M-step ---


class _Moments(eqx.Module):
    """The expected sufficient statistics of a regression of targets `y` on
    regressors `z`, per sequence: the posterior means `my` `(T, d)` and `mz`
    `(T, k)` of every step, and the posterior covariances `Vyy`, `Vyz`, `Vzz`,
    summed over the steps, or per step (a leading `T`) where a coefficient held
    fixed varies with time. `E[y z^T]` at a step is `Vyz + my mz^T`."""

    my: Array
    mz: Array
    Vyy: Array
    Vyz: Array
    Vzz: Array


def _pad(V: Array, rows: int, cols: int) -> Array:
    """`V` with zero rows and columns appended up to `(rows, cols)` (the controls',
    which are known)."""
    pad = [(0, 0)] * (V.ndim - 2) + [(0, rows - V.shape[-2]), (0, cols - V.shape[-1])]
    return jnp.pad(V, pad)


def _with_controls(x: Array, us: Array | None) -> Array:
    return x if us is None else jnp.concatenate([x, us], axis=-1)


def _smoothed_x0(model: Model, m1: Array, P1: Array, c1: Array | None):
    """The smoothed moments of `x_0`, the state before the first observation, and
    `Cov[x_0, x_1 | y]`: one RTS step back from the smoothed `x_1`, whose
    prediction from the prior has no data in between, `x_0 | x_1 ~ N(J x_1 + g,
    C)`. `C` in information form, `C^{-1} = P0^{-1} + F^T Q^{-1} F` (a sum; from
    the triangularisation of the factors' inverses), `J = C F^T Q^{-1}` and `g = C
    P0^{-1} m0 - J B u_1`: the covariance form, `J = P0 F^T S_1^{-1}` and `C = (I -
    J F) P0 (I - J F)^T + J Q J^T`, cancels in `I - J F` where the prior is vague
    (with `P0 = 1e6 I`, float32's smoothed `P0` came out 0.3% of its variances
    off, and its square-root element no better). `c1 = B u_1` as `(1, n)`."""
    F = model.F[0] if model.F.ndim == 3 else model.F
    L_Q = model.L_Q[0] if model.L_Q.ndim == 3 else model.L_Q
    W0 = tril_inverse_by_rows(model.L_P0)
    WQF = tril_inverse_by_rows(L_Q)  # then W_Q F, W_Q^T W_Q = Q^{-1}
    WQ, WQF = WQF, WQF @ F
    U = tria(jnp.concatenate([W0.T, WQF.T], axis=1))  # U U^T = C^{-1}
    Y = mT(tril_inverse_by_rows(U))  # Y Y^T = C
    C = Y @ Y.T
    J = C @ (WQF.T @ WQ)
    g = C @ (W0.T @ (W0 @ model.m0))
    if c1 is not None:
        g = g - J @ c1[0]
    return J @ m1 + g, sym(J @ P1 @ J.T + C), J @ P1


def _completed_observations(
    problem: Problem, ms, Ps, ys, us, L_R, D, per_step, complete
):
    """The moments of the completed observations `y_t` (missing entries latent)
    from the smoothed means `ms` and covariances `Ps`: their means `(T, p)`, and
    the covariances `Cov[y_t]` and `Cov[y_t, x_t]` (summed over the steps unless
    `per_step`).

    Given `x_t` and the observed entries, `y_t = H x_t + D u_t + K_t (w_t - W_t H
    x_t) + eta_t` with `K_t = R W_t^T`, `w_t` the whitened observed entries and
    `eta_t ~ N(0, R - K_t W_t R)`, the conditional law of the missing entries
    (`K_t W_t = R Pi_t`, `Pi_t` the inverse of `R` on the observed entries,
    padded with zeros). With complete data `y_t` is known.
    """
    T, p = ys.shape
    n = problem.model.m0.shape[0]
    if complete:
        shape = (T,) if per_step else ()
        zeros = lambda *s: jnp.zeros((*shape, *s), ys.dtype)
        return ys, zeros(p, p), zeros(p, n)
    W = bt(problem.W, T)
    R = bt(gram(L_R), T)
    H = bt(problem.model.H, T)
    K = bmm(R, mT(W))
    Hw = bmm(W, H)
    w = problem.yw - jnp.einsum("tpn,tn->tp", Hw, ms)
    my = jnp.einsum("tpn,tn->tp", H, ms) + jnp.einsum("tpq,tq->tp", K, w)
    if D is not None:
        my = my + us @ D.T
    A = H - bmm(K, Hw)  # the missing entries' dependence on x_t
    Vyx = bmm(A, Ps)
    Vyy = bmm(Vyx, mT(A)) + R - bmm(bmm(K, W), R)
    if not per_step:
        Vyx, Vyy = jnp.sum(Vyx, axis=0), jnp.sum(Vyy, axis=0)
    return my, sym(Vyy), Vyx


def _smoothed(model: Model, ys, us, scan: AbstractScan, per_step: bool):
    """The smoother's statistics (summed over the steps unless `per_step`) and the
    completed observations' moments. For a time-invariant model with complete data
    the sums come from the steady-state filter (`smoothed_sums_steady`) where it settles
    and the smoother converges, else from the smoother."""
    L_R = model.L_R

    def exact(problem, complete):
        sm = smooth_problem(problem, scan)
        ms, Ps, cross = sm.means, sm.covs, sm.cross_covs
        obs = _completed_observations(
            problem, ms, Ps, ys, us, L_R, model.D, per_step, complete
        )
        if not per_step:
            Ps, cross = jnp.sum(Ps, axis=0), jnp.sum(cross, axis=0)
        ll = sm.filtered.log_likelihood
        return _SmoothedSums(ms, sm.covs[0], sm.covs[-1], Ps, cross, ll), obs

    def work(whitening):
        problem = prepare(model, ys, us, whitening)
        complete = whitening == "complete"
        steady = not (per_step or scan.parallel) and model.steady_state
        if not (complete and steady and may_settle(problem)):
            return exact(problem, complete)
        sums, ok = smoothed_sums_steady(problem)
        obs = _completed_observations(
            problem, None, None, ys, us, L_R, model.D, per_step, complete
        )
        return lax.cond(ok, lambda: (sums, obs), lambda: exact(problem, complete))

    return by_whitening(ys, scan, work)


def _sequence_moments(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> tuple[tuple[_Moments, _Moments, _Moments], Array]:
    """The E-step on one sequence: the moments of the prior, transition and
    emission regressions, and the log-likelihood."""
    per_step_x, per_step_y = model.F.ndim == 3, model.H.ndim == 3
    per_step = per_step_x or per_step_y
    sm, (my, Vyy, Vyx) = _smoothed(model, ys, us, scan, per_step)
    T, n = sm.means.shape
    c = 0 if us is None else us.shape[1]
    k = n + c
    ms = sm.means
    x1 = model.prior_at == "x1"
    if x1:
        # the prior is x_1's; transitions into x_2..x_T
        m0, P0 = ms[0], sm.first
        mprev, xs, u_x = ms[:-1], ms[1:], None if us is None else us[1:]
    else:
        # x_0 smoothed too; transitions into x_1..x_T
        c1 = None if us is None else us[:1] @ model.B.T
        m0, P0, C01 = _smoothed_x0(model, ms[0], sm.first, c1)
        mprev, xs, u_x = jnp.concatenate([m0[None], ms[:-1]]), ms, us
    # the covariances of the targets x_t, of the regressors x_{t-1}, and
    # Cov[x_t, x_{t-1}]
    if per_step:
        Ps, cross = sm.covs, sm.cross
        if x1:
            Vyy_x, Vzz_x, Vyz_x = Ps[1:], Ps[:-1], mT(cross)
        else:
            Vyy_x, Vzz_x = Ps, jnp.concatenate([P0[None], Ps[:-1]])
            Vyz_x = mT(jnp.concatenate([C01[None], cross]))
        if not per_step_x:
            Vyy_x, Vyz_x, Vzz_x = (jnp.sum(V, 0) for V in (Vyy_x, Vyz_x, Vzz_x))
        Vzz_y = Ps if per_step_y else jnp.sum(Ps, axis=0)
    else:
        S = sm.covs
        if x1:
            Vyy_x, Vzz_x, Vyz_x = S - sm.first, S - sm.last, mT(sm.cross)
        else:
            Vyy_x, Vzz_x, Vyz_x = S, P0 + S - sm.last, mT(C01 + sm.cross)
        Vzz_y = S
    zero = lambda *shape: jnp.zeros(shape, ms.dtype)
    prior = _Moments(m0[None], zero(1, 1) + 1, P0, zero(n, 1), zero(1, 1))
    transition = _Moments(
        xs, _with_controls(mprev, u_x), Vyy_x, _pad(Vyz_x, n, k), _pad(Vzz_x, k, k)
    )
    emission = _Moments(
        my, _with_controls(ms, us), Vyy, _pad(Vyx, Vyx.shape[-2], k), _pad(Vzz_y, k, k)
    )
    return (prior, transition, emission), sm.log_likelihood


def _outer_sum(a: Array, b: Array) -> Array:
    """`sum over sequences and steps of a b^T`, for `a` `(B, T, d)`, `b` `(B, T, k)`."""
    return jnp.einsum("btd,btk->dk", a, b)


def _vsum(V: Array, per_step: bool) -> Array:
    return jnp.sum(V, axis=(0, 1) if per_step else 0)


def _spd_solve(A: Array, B: Array) -> Array:
    """`A^{-1} B` for symmetric positive (semi-)definite `A`, via its Cholesky
    factor with jitter scaled to the dtype (a regressor that never varies, as a
    control that is always zero, leaves `A` singular)."""
    return cho_solve(chol(A), B)


# The Gramian's Cholesky factor is used where every pivot keeps at least this many
# units of round-off of its diagonal entry (its relative error, about `eps / f`
# for a pivot that is a fraction `f` of the entry, is then at most 1e-4).
_GRAM_PIVOT_ULPS = 1e4


def _sqrt_regression(mo: _Moments) -> tuple[Array, Array]:
    """`_regression` with every coefficient free and time-invariant moments, in
    square-root form: the coefficients `A` and a lower-triangular factor of the
    noise covariance, from the triangular factor `[[L_zz, 0], [L_yz, L_yy]]` of the
    Gramian `[[S, C^T], [C, sum E[y y^T]]]` of `(z, y)`: `A = L_yz L_zz^{-1}` (that
    is `C S^{-1}`), and the residual sum `L_yy L_yy^T`, without subtracting.

    The factor is the Gramian's Cholesky factor where that keeps its digits; else
    (a `lax.cond`) the triangularisation (`tria`, modified Gram-Schmidt, backward
    stable) of the data whose Gramian it is: the rows `[z_t^T, y_t^T]` of the
    posterior means, and `k + d` rows whose Gramian is the summed joint covariance.
    Forming the Gramian squares the data's condition number: on a stiff tracker
    whose states move little from one step to the next against their magnitude,
    `S` had a condition number of 6e6, and float32's `C S^{-1}` moved the
    transition matrix by 0.2 and `Q` by a factor of 80. The test is on the pivots:
    a Schur complement of the Gramian that is a fraction `f` of its diagonal entry
    loses `log10(1 / f)` digits. The triangularisation costs more (an iteration
    about twice as long at state 16 / obs 8), so it runs only where needed.
    """
    d, k = mo.my.shape[-1], mo.mz.shape[-1]
    N = mo.my.shape[0] * mo.my.shape[1]
    Vzz, Vyz, Vyy = (jnp.sum(V, axis=0) for V in (mo.Vzz, mo.Vyz, mo.Vyy))
    V = sym(jnp.block([[Vzz, mT(Vyz)], [Vyz, Vyy]]))
    means = jnp.concatenate([mo.mz, mo.my], axis=-1).reshape(N, k + d)
    gram = sym(mT(means) @ means + V)
    L_gram = jnp.linalg.cholesky(gram)
    eps = jnp.finfo(gram.dtype).eps
    pivots = jnp.diagonal(L_gram) ** 2 / jnp.diagonal(gram)
    # NaN (not positive definite, or a zero diagonal entry) fails the test too
    keeps_digits = jnp.all(pivots >= _GRAM_PIVOT_ULPS * eps)

    def by_data():
        # a factor of the positive semi-definite V, singular ones included
        # (complete data: no covariance in y), without jitter
        lam, U = jnp.linalg.eigh(V)
        G = jnp.sqrt(jnp.maximum(lam, 0))[:, None] * mT(U)
        return tria(mT(jnp.concatenate([means, G])))

    L = lax.cond(keeps_digits, lambda: L_gram, by_data)
    L_zz, L_yz, L_yy = L[:k, :k], L[k:, :k], L[k:, k:]
    # a regressor with nothing left after the ones before it (a control that is
    # always zero): a zero row of L_zz and zero column of L_yz; its coefficient 0
    eye = jnp.eye(k, dtype=bool)
    L_zz = jnp.where(eye & (L_zz == 0), 1, L_zz)
    A = mT(jsl.solve_triangular(L_zz, mT(L_yz), lower=True, trans=1))
    return A, L_yy / np.sqrt(N).astype(L.dtype)


def _regression(
    mo: _Moments, A: Array, L: Array, free: np.ndarray, cov_free: bool
) -> tuple[Array, Array | None]:
    """The M-step of `y = A z + e`, `e ~ N(0, L L^T)`: the coefficients `A`
    `(d, k)` (or `(T, d, k)` where its fixed entries vary with time) with their
    `free` entries maximising the expected log-likelihood at the current noise,
    then a lower-triangular factor of the noise covariance at the new `A` if
    `cov_free` (else `None`; `_m_step` floors it, `_floored_factor`).

    All entries free and time-invariant: `_sqrt_regression`. All free against
    per-step moments: `A = C S^{-1}`, `C = sum E[y z^T]`, `S = sum E[z z^T]`. Some
    fixed: the normal equations of the free entries,
    `(Lambda (x) S) vec(A) = vec(Lambda (C - A_fixed S))` restricted to them,
    `Lambda` the inverse noise covariance (row-major `vec`). The covariance is
    then the mean of `E[(y - A z)(y - A z)^T]`: outer products of the residuals of
    the means plus `[I, -A] V [I, -A]^T`, each positive semi-definite, not the
    difference of raw second moments, which cancels badly where states are large.
    """
    per_step = mo.Vyy.ndim == 4
    if free.all() and not per_step:
        A, L_new = _sqrt_regression(mo)
        return A, (L_new if cov_free else None)
    d, k = A.shape[-2:]
    # a time-varying `A` against per-step moments `(B, T, ..)`
    At = A[None] if per_step else A
    if free.any():
        S = _outer_sum(mo.mz, mo.mz) + _vsum(mo.Vzz, per_step)
        C = _outer_sum(mo.my, mo.mz) + _vsum(mo.Vyz, per_step)
        if free.all():
            A = mT(_spd_solve(S, mT(C)))
        else:
            A_fixed = jnp.where(np.broadcast_to(free, A.shape), 0, A)
            if per_step:
                # sum_t A_t E[z_t z_t^T] with the time-varying fixed entries
                Az = jnp.einsum("tdk,btk->btd", A_fixed, mo.mz)
                O = jnp.einsum("tdk,btkl->dl", A_fixed, mo.Vzz) + _outer_sum(Az, mo.mz)
            else:
                O = A_fixed @ S
            L_inv = jsl.solve_triangular(L, eye_like(L), lower=True)
            Lam = L_inv.T @ L_inv
            idx = np.flatnonzero(free)
            G = jnp.kron(Lam, S)[idx[:, None], idx[None, :]]
            b = (Lam @ (C - O)).reshape(-1)[idx]
            theta = _spd_solve(G, b[:, None])[:, 0]
            A_free = jnp.zeros(d * k, A.dtype).at[idx].set(theta).reshape(d, k)
            A = A_fixed + (A_free[None] if per_step else A_free)
        At = A[None] if per_step else A
    if not cov_free:
        return A, None
    r = mo.my - (jnp.einsum("tdk,btk->btd", A, mo.mz) if per_step else mo.mz @ A.T)
    # [I, -A] V [I, -A]^T: per step for a time-varying A, else of the sums
    Vyy, Vyz, Vzz = (
        (mo.Vyy, mo.Vyz, mo.Vzz)
        if per_step
        else (jnp.sum(V, axis=0) for V in (mo.Vyy, mo.Vyz, mo.Vzz))
    )
    AVzy = bmm(At, mT(Vyz))
    V = Vyy - AVzy - mT(AVzy) + bmm(bmm(At, Vzz), mT(At))
    res = _outer_sum(r, r) + (jnp.sum(V, axis=(0, 1)) if per_step else V)
    return A, _psd_factor(res / (mo.my.shape[0] * mo.my.shape[1]))


def _psd_factor(cov: Array) -> Array:
    """A lower-triangular factor of a positive semi-definite `cov`, singular ones
    included (a zero diagonal entry where a direction has no variance left), from
    its eigendecomposition: a Cholesky factorisation subtracts, and at a singular
    matrix its rounding gave NaN."""
    lam, U = jnp.linalg.eigh(sym(cov))
    return tria(U * jnp.sqrt(jnp.maximum(lam, 0))[None, :])


# A new covariance keeps, for each entry, a variance not explained by the entries
# before it (its factor's squared diagonal entry) of at least this many units of
# round-off (relative) of the entry's variance: a conditional standard deviation
# of at least `16 sqrt(eps)` of the marginal one (2.4e-7 in float64, 5.5e-3 in
# float32). Far above the rounding of the factor itself, so that the filter can
# whiten by it (and refactor it with missing entries); far below the correlation
# of any two sensors that are not copies of each other.
_COV_FLOOR_ULPS = 256


def _floored_factor(L: Array) -> Array:
    """The factor of a new covariance `L L^T`, kept positive definite.

    First `chol`'s jitter, `eps * mean(diag)` on the diagonal (added in
    square-root form, `tria([L, sqrt(jitter) I])`, without the cancellation of
    factoring the sum), which also gives an entry with no variance at all a
    positive one. Then the floor, only where an entry's conditional variance
    `L_ii^2` falls under `_COV_FLOOR_ULPS * eps` of its variance: duplicated or
    exactly collinear observations (sensors), whose residuals vanish in one
    direction, so that the maximum-likelihood `R` is singular (the likelihood
    grows without bound towards it). Elsewhere `L` is unchanged.
    """
    eps = jnp.finfo(L.dtype).eps
    jitter = jnp.sqrt(eps * jnp.sum(L * L) / L.shape[-1])
    L = tria(jnp.concatenate([L, jitter * eye_like(L)], axis=-1))
    floor = jnp.sqrt(_COV_FLOOR_ULPS * eps * jnp.sum(L * L, axis=-1))
    d = jnp.diagonal(L)
    return L + jnp.diag(jnp.maximum(d, floor) - d)


def _checked_factor(L: Array, name: str) -> Array:
    """`L`, raising at run time if it is singular: its covariance is then zero
    (every residual of its regression exactly zero, so no scale to floor)."""
    return error_if_any(
        L,
        jnp.diagonal(L) == 0,
        f"{_WHERE}: the M-step's new `{name}` is zero: every residual of its "
        "regression is exactly zero (for `R`: observations that are all zero, or "
        "exactly explained by the states and controls), so it has no scale. Hold "
        f"it fixed (`fixed={{{name!r}: True}}`) or fit data that vary.",
    )


def _m_step(params: Parameters, moments, spec: _Fixed, prior_at: PriorAt) -> Parameters:
    """The new parameters: the three regressions of `_regression`, fixed entries
    kept (the spec)."""
    prior, transition, emission = moments
    n, p, c = params.state_size, params.obs_size, params.control_size
    new = {}

    def free(names, shapes):
        masks = [~as_array(getattr(spec, k), s) for k, s in zip(names, shapes)]
        return np.concatenate(masks, axis=-1)

    # m0, P0: the prior's state on 1 (with a stationary prior, unused)
    m0, L_P0 = _regression(
        prior,
        params.m0[:, None],
        factor(params.P0_factor),
        ~as_array(spec.m0, (n,))[:, None],
        spec.P0 is False,
    )
    new["m0"], new["P0_factor"] = m0[:, 0], L_P0
    for (coef, ctrl, cov), mo, rows in (
        (("F", "B", "Q"), transition, n),
        (("H", "D", "R"), emission, p),
    ):
        A = getattr(params, coef)
        if coef == "F" and A.ndim == 3 and prior_at == "x1":
            A = A[1:]  # step 1 has no transition
        names, shapes = (coef,), ((rows, n),)
        if c:
            B = getattr(params, ctrl)
            A = jnp.concatenate([A, jnp.broadcast_to(B, (*A.shape[:-1], c))], -1)
            names, shapes = (coef, ctrl), ((rows, n), (rows, c))
        A, L_new = _regression(
            mo, A, factor(getattr(params, f"{cov}_factor")), free(names, shapes),
            getattr(spec, cov) is False,
        )  # fmt: skip
        new[coef] = A[..., :n]
        if c:
            new[ctrl] = A[0, :, n:] if A.ndim == 3 else A[:, n:]
        new[f"{cov}_factor"] = L_new
    # what is held fixed stays as it is, bit for bit (a time-varying matrix too)
    held = {k for k, v in spec._asdict().items() if v is True}
    new = {
        k: (
            unfactor(_checked_factor(_floored_factor(v), k.removesuffix("_factor")))
            if k.endswith("_factor")
            else v
        )
        for k, v in new.items()
        if v is not None and k.removesuffix("_factor") not in held
    }
    return params._replace(**new)


@eqx.filter_jit
@full_precision
def fit_em(
    params: Parameters,
    ys: Array,
    us: Array | None,
    num_iters: int,
    spec: _Fixed,
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
            out = _sequence_moments(model, ys[0], u, scan)
            return jax.tree.map(lambda x: x[None], out)

    else:
        e_step = jax.vmap(_sequence_moments, in_axes=(None, 0, 0, None))

    def iteration(arrays, last):
        params = eqx.combine(arrays, static)
        model = model_of(params, prior_at, initialization, steady_state=steady_state)
        moments, lls = e_step(model, ys, us, scan)
        new = eqx.partition(
            _m_step(params, moments, spec, prior_at), eqx.is_inexact_array
        )[0]
        # the last pass is an E-step only: the final parameters' log-likelihood
        new = jax.tree.map(lambda a, b: jnp.where(last, a, b), arrays, new)
        return new, jnp.sum(lls)

    last = jnp.arange(num_iters + 1) == num_iters
    arrays, lls = lax.scan(iteration, arrays, last)
    return eqx.combine(arrays, static), lls[1:]
