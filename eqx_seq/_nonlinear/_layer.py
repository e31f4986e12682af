"""`NonlinearKalmanFilter`: the layer, its methods, their input checks and compiled
entry points."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._kalman._interface import KalmanFilterResult, KalmanSmootherResult, splits_time
from .._kalman._linalg import factor, gram
from .._kalman._model import checked_raw_factor, PriorAt
from .._misc import (
    check_parameter_dtype,
    check_positive_int,
    check_real,
    check_reals,
    vary_like,
)
from .._scan import AbstractScan, AutoScan
from ._filter import (
    filter_nonlinear,
    NonlinearModel,
    sample_nonlinear,
    smooth_nonlinear,
)
from ._interface import (
    backend_of,
    checked_init,
    inputs,
    NonlinearSmootherResult,
    spd_raw,
)
from ._iterated import smooth_iterated, Trajectory
from ._linearize import Method, METHODS, sigma_points, Unscented


class NonlinearKalmanFilter(eqx.Module):
    r"""A nonlinear state-space model with additive Gaussian noise: extended and
    sigma-point (cubature, unscented) filters and smoothers, and the iterated
    smoothers, all in square-root form.

    For steps `t = 1, ..., T` (row `t - 1` of every array), from
    `x_0 ~ N(m0, P0)` (`prior_at="x1"` puts the prior on `x_1`):

    $$x_t = f(x_{t-1}, u_t) + q_t, \quad q_t \sim N(0, Q_t)$$
    $$y_t = h(x_t, u_t) + r_t, \quad r_t \sim N(0, R_t)$$

    `f` (`transition`) and `h` (`observation`) are any JAX-traceable callables,
    Equinox modules included, whose parameters are then the layer's (learnt with
    `eqx.filter_grad`); they take `(x, u)` with controls and `x` alone without.
    NaN entries of `ys` are missing and skipped exactly. Time-varying steps (an
    irregular grid) enter through the controls: pass the step's `dt` in `u_t`,
    integrate over it in `f`, and give `Q` per step (for example from
    [`eqx_seq.discretize`][] of a linear drift).

    Methods linearise the model: `"extended"` by first-order Taylor expansion
    (Jacobians by `jax.jacfwd`), `"cubature"` and `"unscented"` by statistical
    linear regression on sigma points (with the regression's residual covariance
    added to the noise). The filters and the one-pass smoothers run the
    sequential recursion whatever the backend (each step linearises about the
    previous step's result); the iterated smoothers (`smooth(..., iterated=True)`)
    linearise about the whole previous trajectory and smooth it with the backend:
    sequentially, in parallel in time ([`eqx_seq.AssociativeScan`][]), or split
    over devices ([`eqx_seq.ShardedScan`][]). See `docs/usage/nonlinear.md`.

    !!! Example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import jax.random as jr
        import eqx_seq

        dt, g = 0.01, 9.81
        f = lambda x: jnp.stack([x[0] + dt * x[1], x[1] - g * dt * jnp.sin(x[0])])
        h = lambda x: jnp.sin(x[:1])
        q = 0.01 * jnp.array([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]])
        model = eqx_seq.NonlinearKalmanFilter(
            f, h, Q=q, R=0.1 * jnp.eye(1), m0=jnp.array([1.5, 0.0]), P0=0.1 * jnp.eye(2)
        )
        states, ys = model.sample(jr.key(0), 200)
        filtered = model.filter(ys, method="cubature")      # .means, .log_likelihood
        smoothed = model.smooth(ys, iterated=True)          # the IEKS
        grads = eqx.filter_grad(lambda m: -m.log_likelihood(ys))(model)
        ```
    """

    transition: Callable
    observation: Callable
    Q_factor: Float[Array, "*T n n"]
    R_factor: Float[Array, "*T p p"]
    m0: Float[Array, " n"]
    P0_factor: Float[Array, "n n"]
    scan: AbstractScan
    state_size: int = eqx.field(static=True)
    obs_size: int = eqx.field(static=True)
    control_size: int = eqx.field(static=True)
    prior_at: PriorAt = eqx.field(static=True)
    unscented: Unscented = eqx.field(static=True)

    def __init__(
        self,
        transition: Callable,
        observation: Callable,
        Q: Float[ArrayLike, "n n"] | Float[ArrayLike, "T n n"],
        R: Float[ArrayLike, "p p"] | Float[ArrayLike, "T p p"],
        m0: Float[ArrayLike, " n"],
        P0: Float[ArrayLike, "n n"],
        *,
        control_size: int = 0,
        scan: AbstractScan = AutoScan(),
        prior_at: PriorAt = "x0",
        unscented: tuple[float, float, float] = Unscented(),
        dtype: Any = None,
    ):
        """**Arguments:**

        - `transition`: `f`, mapping a state `(n,)` (and a control `(c,)` if
            `control_size > 0`) to the next state's mean `(n,)`.
        - `observation`: `h`, mapping a state `(n,)` (and a control) to the
            observation's mean `(p,)`.
        - `Q`, `R`: the transition and observation noise covariances, `(n, n)` and
            `(p, p)`, or one per step with a leading `T`; symmetric positive
            definite. Stored (and learnt) as unconstrained Cholesky factors
            (`Q_factor`, `R_factor`), as in [`eqx_seq.KalmanFilter`][].
        - `m0`, `P0`: mean and covariance of `x_0`, the state before the first
            observation (of `x_1` with `prior_at="x1"`).
        - `control_size`: the size `c` of the controls `u_t`; `0` for none.
        - `scan`: the backend of the iterated smoothers (see above).
        - `prior_at`: `"x0"` or `"x1"`, as in [`eqx_seq.KalmanFilter`][].
        - `unscented`: the unscented transform's `(alpha, beta, kappa)`; the
            default `(sqrt(3), 2, 1)` is dynamax's (`n + lambda = 3 (n + 1)`).
            Parameters that give the central point a negative covariance weight
            are refused (the square-root form has no downdate).
        - `dtype`: the parameters' dtype, float32 or float64 (default: the common
            dtype of `Q`, `R`, `m0`, `P0` if floating, else JAX's default).

        **Raises:**

        `ValueError` for inconsistent shapes or options; at run time
        (`eqx.error_if`) if `Q`, `R` or `P0` is not symmetric positive definite.
        """
        if not (callable(transition) and callable(observation)):
            raise ValueError(
                "eqx_seq.NonlinearKalmanFilter: `transition` and `observation` must "
                "be callables (functions or Equinox modules)."
            )
        if not (isinstance(control_size, int) and control_size >= 0) or isinstance(
            control_size, bool
        ):
            raise ValueError(
                f"`control_size` must be a non-negative int, got {control_size!r}."
            )
        if prior_at not in ("x0", "x1"):
            raise ValueError(
                'eqx_seq.NonlinearKalmanFilter: `prior_at` must be "x0" or "x1", '
                f"got {prior_at!r}."
            )
        backend_of(scan)
        arrays = [jnp.asarray(a) for a in (Q, R, m0, P0)]
        if dtype is None:
            common = jnp.result_type(*[a.dtype for a in arrays])
            dtype = common if jnp.issubdtype(common, jnp.floating) else None
        dtype = check_parameter_dtype("NonlinearKalmanFilter", dtype)
        m0 = arrays[2].astype(dtype)
        if m0.ndim != 1 or m0.shape[0] < 1:
            raise ValueError(
                f"eqx_seq.NonlinearKalmanFilter: `m0` must have shape (n,), got "
                f"{m0.shape}."
            )
        n = m0.shape[0]
        R_arr = arrays[1]
        if R_arr.ndim not in (2, 3) or R_arr.shape[-1] != R_arr.shape[-2]:
            raise ValueError(
                "eqx_seq.NonlinearKalmanFilter: `R` must have shape (p, p) or "
                f"(T, p, p), got {R_arr.shape}."
            )
        p = R_arr.shape[-1]
        self.Q_factor = spd_raw("Q", arrays[0], (n, n), dtype)
        self.R_factor = spd_raw("R", R_arr, (p, p), dtype)
        if arrays[3].shape != (n, n):
            raise ValueError(
                f"eqx_seq.NonlinearKalmanFilter: `P0` must have shape ({n}, {n}), "
                f"got {arrays[3].shape}."
            )
        self.P0_factor = checked_raw_factor(
            "P0", arrays[3].astype(dtype), "NonlinearKalmanFilter"
        )
        lengths = {x.shape[0] for x in (self.Q_factor, self.R_factor) if x.ndim == 3}
        if len(lengths) > 1:
            raise ValueError(
                "eqx_seq.NonlinearKalmanFilter: per-step `Q` and `R` must have the "
                f"same length T, got {sorted(lengths)}."
            )
        unscented = Unscented(
            *check_reals("unscented", unscented, ("alpha", "beta", "kappa"))
        )
        sigma_points("unscented", n, unscented)  # refuses a negative weight
        self.transition, self.observation = transition, observation
        self.m0 = m0
        self.scan = scan
        self.state_size, self.obs_size, self.control_size = n, p, control_size
        self.prior_at = prior_at
        self.unscented = unscented

    @property
    def Q(self) -> Float[Array, "*T n n"]:
        """The transition noise covariance `Q = L_Q L_Q^T`."""
        return gram(factor(self.Q_factor))

    @property
    def R(self) -> Float[Array, "*T p p"]:
        """The observation noise covariance `R = L_R L_R^T`."""
        return gram(factor(self.R_factor))

    @property
    def P0(self) -> Float[Array, "n n"]:
        """The prior covariance."""
        return gram(factor(self.P0_factor))

    def _model(self) -> NonlinearModel:
        return NonlinearModel(
            f=self.transition,
            h=self.observation,
            L_Q=factor(self.Q_factor),
            L_R=factor(self.R_factor),
            m0=self.m0,
            L_P0=factor(self.P0_factor),
            prior_at=self.prior_at,
        )

    def _points(self, method: Any, caller: str):
        if method not in METHODS:
            raise ValueError(
                f"eqx_seq.NonlinearKalmanFilter.{caller}: `method` must be one of "
                f"{METHODS}, got {method!r}."
            )
        if method == "extended":
            return None
        return sigma_points(method, self.state_size, self.unscented)

    # --- inference ---

    @jax.named_scope("eqx_seq.NonlinearKalmanFilter")
    def __call__(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
        method: Method = "extended",
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T n"]:
        """The filtered means: the layer's output.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.
        - `method`: `"extended"`, `"cubature"` or `"unscented"`.
        - `key`: ignored; for compatibility with the Equinox layer API.

        **Returns:**

        The filtered means, shape `(T, state_size)`.
        """
        del key
        return self.filter(ys, us=us, method=method).means

    @jax.named_scope("eqx_seq.NonlinearKalmanFilter.filter")
    def filter(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
        method: Method = "extended",
    ) -> KalmanFilterResult:
        """The extended, cubature or unscented Kalman filter, in square-root form.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.
        - `method`: `"extended"`, `"cubature"` or `"unscented"`.

        **Returns:**

        A [`eqx_seq.KalmanFilterResult`][]: filtered and predicted means and
        covariances, and the per-step log-likelihoods of the linearised model
        (each step's Gaussian approximation of `p(y_t | y_1..y_{t-1})`) and their
        sum. Differentiable with respect to every parameter (plain autodiff).

        **Raises:**

        `ValueError` for bad inputs, an unknown method, or a backend that splits
        time over devices.
        """
        points = self._points(method, "filter")
        ys, us = inputs(self, ys, us, "filter", sequential=True)
        return _filter_jit(self, ys, us, points)

    @jax.named_scope("eqx_seq.NonlinearKalmanFilter.log_likelihood")
    def log_likelihood(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
        method: Method = "extended",
    ) -> Float[Array, ""]:
        """The filter's approximation of `log p(y_1..y_T)`: `filter(ys,
        method=method).log_likelihood`.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.
        - `method`: `"extended"`, `"cubature"` or `"unscented"`.

        **Returns:**

        A scalar, differentiable with respect to every parameter of `f`, `h`, the
        noises and the prior.
        """
        return self.filter(ys, us=us, method=method).log_likelihood

    @jax.named_scope("eqx_seq.NonlinearKalmanFilter.smooth")
    def smooth(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
        method: Method = "extended",
        iterated: bool = False,
        tol: float | None = None,
        max_iter: int = 20,
        init: tuple[Float[ArrayLike, "T n"], Float[ArrayLike, "T n n"]] | None = None,
    ) -> NonlinearSmootherResult:
        """The extended or sigma-point Rauch-Tung-Striebel smoother, or with
        `iterated=True` the iterated smoother: the iterated extended Kalman
        smoother (IEKS, `method="extended"`, Gauss-Newton on the MAP trajectory)
        or the iterated posterior linearisation smoother (IPLS, sigma points).

        The iterated smoother linearises the model about the previous pass's
        smoothed trajectory and smooths the linearised model with the backend
        (sequential, parallel in time, or split over devices), until no smoothed
        mean moves by more than `tol * (1 + max |mean|)`, or `max_iter` passes.
        Its derivatives are those of the fixed point (implicit differentiation,
        `docs/devdocs/nonlinear.md`), not of the unrolled passes. The plain
        Gauss-Newton steps are undamped.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.
        - `method`: `"extended"`, `"cubature"` or `"unscented"`.
        - `iterated`: iterate the linearisation to a fixed point.
        - `tol`: the iteration's tolerance (default: the square root of the
            dtype's machine epsilon).
        - `max_iter`: the most passes (and the most steps of the derivatives'
            fixed-point solve).
        - `init`: the trajectory the first pass linearises about, `(means, covs)`
            of shapes `(T, n)` and `(T, n, n)` (on a split time axis, this
            device's block). Default: the one-pass smoother of `method`, or on a
            time axis split over devices (where that one does not run) the prior
            `(m0, P0)` at every step.

        **Returns:**

        A [`eqx_seq.NonlinearSmootherResult`][].
        """
        points = self._points(method, "smooth")
        if not isinstance(iterated, bool):
            raise ValueError(f"`iterated` must be a bool, got {iterated!r}.")
        ys, us = inputs(self, ys, us, "smooth", sequential=not iterated)
        if not iterated:
            if init is not None:
                raise ValueError(
                    "eqx_seq.NonlinearKalmanFilter.smooth: `init` is for the "
                    "iterated smoother (iterated=True)."
                )
            return _smooth_jit(self, ys, us, points)
        eps = float(jnp.finfo(self.m0.dtype).eps)
        tol = eps**0.5 if tol is None else check_real("tol", tol, positive=True)
        check_positive_int("max_iter", max_iter)
        if init is not None:
            init = checked_init(self, init, ys.shape[0])
        return _iterated_jit(self, ys, us, points, init, tol, max_iter)

    @jax.named_scope("eqx_seq.NonlinearKalmanFilter.sample")
    def sample(
        self,
        key: PRNGKeyArray,
        num_steps: int,
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> tuple[Float[Array, "T n"], Float[Array, "T p"]]:
        """Draw states and observations from the model.

        **Arguments:**

        - `key`: a `jax.random.key`.
        - `num_steps`: the number `T` of steps.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        `(states, observations)`: `x_1..x_T`, shape `(T, state_size)`, and
        `y_1..y_T`, shape `(T, obs_size)`.
        """
        check_positive_int("num_steps", num_steps)
        dtype = self.m0.dtype
        ys = jnp.zeros((num_steps, self.obs_size), dtype)
        _, us = inputs(self, ys, us, "sample", sequential=False)
        return _sample_jit(self, key, num_steps, us)


# --- the compiled entry points ---


@eqx.filter_jit
def _filter_jit(nkf, ys, us, points) -> KalmanFilterResult:
    return filter_nonlinear(nkf._model(), ys, us, points)[0]


def _as_result(result: KalmanSmootherResult, k, done) -> NonlinearSmootherResult:
    return NonlinearSmootherResult(
        result.means, result.covs, result.cross_covs, result.filtered, k, done
    )


@eqx.filter_jit
def _smooth_jit(nkf, ys, us, points) -> NonlinearSmootherResult:
    result = smooth_nonlinear(nkf._model(), ys, us, points)
    return _as_result(result, jnp.ones((), jnp.int32), jnp.ones((), bool))


@eqx.filter_jit
def _iterated_jit(nkf, ys, us, points, init, tol, max_iter) -> NonlinearSmootherResult:
    model = nkf._model()
    scan = backend_of(nkf.scan)
    if init is None and splits_time(scan):
        T = ys.shape[0]
        P0 = gram(model.L_P0)
        init = (
            jnp.broadcast_to(model.m0, (T, model.state_size)),
            jnp.broadcast_to(P0, (T, *P0.shape)),
        )
    elif init is None:
        first = smooth_nonlinear(model, ys, us, points)
        init = (first.means, first.covs)
    means, covs = init
    traj: Trajectory = {"means": means, "first_mean": model.m0}
    if points is not None:
        traj["covs"] = covs
        traj["first_cov"] = gram(model.L_P0)
    # the fixed point varies over a mesh as the data does (under `jax.shard_map`),
    # the prior's `first_mean` included, so that the loops' carries keep one type
    traj = jax.tree.map(lambda a: vary_like(a, ys), traj)
    result, k, done = smooth_iterated(model, ys, us, traj, points, scan, tol, max_iter)
    return _as_result(result, k, done)


@eqx.filter_jit
def _sample_jit(nkf, key, num_steps: int, us):
    return sample_nonlinear(nkf._model(), key, num_steps, us)
