"""`KalmanFilter`: the layer, its methods and their compiled entry points. The
algorithms below it take the model in computational form (`_model.Model`)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Real

from .._misc import check_parameter_dtype, check_positive_int
from .._scan import AbstractScan, AutoScan
from ._continuous import continuous_matrices, model_dtype
from ._dispatch import backend, filter_, smooth
from ._em import check_fit_em, fit_em, from_filter_spec
from ._fisher import fisher_log_likelihood
from ._interface import (
    check_length,
    controls,
    inputs,
    KalmanFilterResult,
    KalmanForecastResult,
    KalmanSmootherResult,
    KalmanState,
    not_diffuse,
    splits_time,
)
from ._linalg import factor, gram
from ._model import (
    check_options,
    Initialization,
    Model,
    model_of,
    Parameters,
    parameters_from_matrices,
    prior,
    PriorAt,
    random_parameters,
)
from ._predictive import (
    check_control,
    check_forecast,
    check_state,
    check_streamable,
    check_vector,
    forecast,
    init_state,
    posterior_sample,
    predict_state,
    sample_prior,
    update_state,
)
from ._sharded import (
    check_sharded,
    filter_sharded,
    log_likelihood_sharded,
    smooth_sharded,
)


class KalmanFilter(eqx.Module):
    r"""A linear-Gaussian state-space model: Kalman filter, RTS smoother, sampler.

    The model, for steps `t = 1, ..., T` (row `t - 1` of every array), starting
    from `x_0 ~ N(m0, P0)` (before the first observation; `prior_at="x1"` puts the
    prior on `x_1`, and `initialization` may make it stationary or diffuse):

    $$x_t = F_t x_{t-1} + B u_t + q_t, \quad q_t \sim N(0, Q_t)$$
    $$y_t = H_t x_t + D u_t + r_t, \quad r_t \sim N(0, R_t)$$

    `F`, `H`, `Q` and `R` may carry a leading time axis of length `T`; `u_t` are
    optional controls; NaN entries of `ys` are missing, skipped exactly. `kf(ys)`
    returns the filtered means. Covariances are learnt as unconstrained Cholesky
    factors (`Q_factor`, `R_factor`, `P0_factor`): every parameter value is valid.

    `scan` selects the algorithm: a sequential backend ([`eqx_seq.SequentialScan`][])
    runs the filter (with a steady-state shortcut) and the smoother in a loop; a
    parallel one ([`eqx_seq.AssociativeScan`][]) those of Särkkä & García-Fernández
    (IEEE TAC 2021) in its `associative_scan`; [`eqx_seq.ShardedScan`][] splits one
    series over devices, a block each. All propagate Cholesky factors of
    the covariances (square-root form), which keeps float32 accurate when a vague
    prior meets precise observations. The log-likelihood is differentiated by
    Fisher's identity. See `docs/usage/kalman.md`.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import jax.random as jr
        import eqx_seq

        kf = eqx_seq.KalmanFilter(state_size=4, obs_size=2, key=jr.key(0))
        states, ys = kf.sample(jr.key(1), 100)
        ys = ys.at[10:20].set(jnp.nan)            # missing observations
        means = kf(ys)                             # (100, 4) filtered means
        smoothed = kf.smooth(ys)                   # .means, .covs, .filtered
        grads = jax.grad(lambda kf: -kf.log_likelihood(ys))(kf)
        ```
    """

    F: Float[Array, "*T n n"]
    H: Float[Array, "*T p n"]
    B: Float[Array, "n c"] | None
    D: Float[Array, "p c"] | None
    m0: Float[Array, " n"]
    Q_factor: Float[Array, "*T n n"]
    R_factor: Float[Array, "*T p p"]
    P0_factor: Float[Array, "n n"]
    scan: AbstractScan
    state_size: int = eqx.field(static=True)
    obs_size: int = eqx.field(static=True)
    control_size: int = eqx.field(static=True)
    num_steps: int | None = eqx.field(static=True)
    prior_at: PriorAt = eqx.field(static=True)
    initialization: Initialization = eqx.field(static=True)
    # False: every step of the sequential filter exact (for comparisons)
    _steady_state: bool = eqx.field(static=True, repr=False)
    # False: the filters in covariance form (for comparisons)
    _square_root: bool = eqx.field(static=True, repr=False)

    def __init__(
        self,
        state_size: int,
        obs_size: int,
        *,
        control_size: int = 0,
        scan: AbstractScan = AutoScan(),
        prior_at: PriorAt = "x0",
        initialization: Initialization = "known",
        dtype: Any = None,
        # `None` where `_parameters` is given (`from_matrices`), which needs no key
        key: PRNGKeyArray | None,
        _parameters: Parameters | None = None,
        _steady_state: bool = True,
        _square_root: bool = True,
    ):
        """**Arguments:**

        - `state_size`: the size `n` of the hidden state `x_t`.
        - `obs_size`: the size `p` of the observations `y_t`.
        - `control_size`: the size `c` of the controls `u_t`; `0` for none.
        - `scan`: the backend, see the class docstring.
        - `prior_at`: `"x0"` (the prior `(m0, P0)` is the law of `x_0`, the state
            before the first observation) or `"x1"` (the law of `x_1`, the first
            observed state, as in dynamax, pykalman and statsmodels).
        - `initialization`: `"known"` (the prior is `(m0, P0)`), `"stationary"`
            (the stationary law of a stable time-invariant model: mean zero, `P0`
            solving `P0 = F P0 F^T + Q`) or `"diffuse"` (exact diffuse: an
            infinite-variance prior). With the last two `m0` and `P0` are unused.
        - `dtype`: the parameters' dtype, float32 or float64 (default: JAX's
            default floating dtype).
        - `key`: a `jax.random.key` for the initialisation.

        The initial model is stable and stationary: `F = 0.9 U` with `U` a random
        orthogonal matrix, `Q = 0.19 I`, `m0 = 0` and `P0 = I` (the stationary
        covariance); `H` has `N(0, 1/n)` entries and `R = I`; `B` has `N(0, 1/c)`
        entries and `D = 0`.
        """
        check_positive_int("state_size", state_size)
        check_positive_int("obs_size", obs_size)
        if not (isinstance(control_size, int) and control_size >= 0) or isinstance(
            control_size, bool
        ):
            raise ValueError(
                f"`control_size` must be a non-negative int, got {control_size!r}."
            )
        check_sharded(scan, initialization)
        dtype = check_parameter_dtype("KalmanFilter", dtype)
        n, p, c = state_size, obs_size, control_size
        # `from_matrices` passes the parameters it made (and no key)
        if _parameters is None:
            _parameters = random_parameters(n, p, c, dtype, key)
        a = _parameters
        self.F, self.H, self.B, self.D, self.m0 = a.F, a.H, a.B, a.D, a.m0
        self.Q_factor, self.R_factor = a.Q_factor, a.R_factor
        self.P0_factor = a.P0_factor
        self.num_steps = a.num_steps
        check_options(prior_at, initialization, a.F.ndim > 2 or a.Q_factor.ndim > 2)
        self.prior_at, self.initialization = prior_at, initialization
        self.scan = scan
        self.state_size, self.obs_size, self.control_size = n, p, c
        self._steady_state = _steady_state
        self._square_root = _square_root

    @classmethod
    def from_matrices(
        cls,
        # each time-invariant or time-varying, those that vary with one length `T`
        F: Float[ArrayLike, "n n"] | Float[ArrayLike, "T n n"],
        H: Float[ArrayLike, "p n"] | Float[ArrayLike, "T p n"],
        Q: Float[ArrayLike, "n n"] | Float[ArrayLike, "T n n"],
        R: Float[ArrayLike, "p p"] | Float[ArrayLike, "T p p"],
        m0: Float[ArrayLike, " n"],
        P0: Float[ArrayLike, "n n"],
        *,
        B: Float[ArrayLike, "n c"] | None = None,
        D: Float[ArrayLike, "p c"] | None = None,
        scan: AbstractScan = AutoScan(),
        prior_at: PriorAt = "x0",
        initialization: Initialization = "known",
        dtype: Any = None,
    ) -> "KalmanFilter":
        """A Kalman filter for a given model.

        **Arguments:**

        - `F`: the transition matrix, `(n, n)` or `(T, n, n)`.
        - `H`: the emission matrix, `(p, n)` or `(T, p, n)`.
        - `Q`, `R`: the transition and observation noise covariances, `(n, n)` /
            `(p, p)` or with a leading `T`; symmetric positive definite.
        - `m0`, `P0`: mean and covariance of `x_0`, the state before the first
            observation (of `x_1` with `prior_at="x1"`); unused, but checked, with
            `initialization="stationary"` or `"diffuse"`.
        - `B`, `D`: optional control matrices `(n, c)` and `(p, c)`; give one or
            both to use controls (the missing one is zero).
        - `scan`: the backend, see the class docstring.
        - `prior_at`, `initialization`: as in `__init__`.
        - `dtype`: the parameters' dtype; default: the common dtype of the inputs
            (floating).

        All time-varying matrices must share the same length `T`, which the
        observations must then have.

        **Returns:**

        A [`eqx_seq.KalmanFilter`][] whose parameters encode these matrices.

        **Raises:**

        `ValueError` for inconsistent shapes; at run time (`eqx.error_if`) if `Q`,
        `R` or `P0` is not symmetric positive definite.
        """
        check_sharded(scan, initialization)
        arrays = {"F": F, "H": H, "Q": Q, "R": R, "m0": m0, "P0": P0, "B": B, "D": D}
        params = parameters_from_matrices(arrays, dtype)
        n, p = params.F.shape[-1], params.H.shape[-2]
        c = 0 if params.B is None else params.B.shape[1]
        return cls(
            n,
            p,
            control_size=c,
            scan=scan,
            prior_at=prior_at,
            initialization=initialization,
            dtype=params.F.dtype,
            key=None,
            _parameters=params,
        )

    @classmethod
    def from_continuous(
        cls,
        A: Float[ArrayLike, "n n"],
        H: Float[ArrayLike, "p n"] | Float[ArrayLike, "T p n"],
        Qc: Float[ArrayLike, "s s"],
        R: Float[ArrayLike, "p p"] | Float[ArrayLike, "T p p"],
        m0: Float[ArrayLike, " n"],
        P0: Float[ArrayLike, "n n"],
        times: Real[ArrayLike, " T"],
        *,
        L: Float[ArrayLike, "n s"] | None = None,
        prior_time: Real[ArrayLike, ""] | None = None,
        prior_at: PriorAt = "x1",
        initialization: Initialization = "known",
        scan: AbstractScan = AutoScan(),
        dtype: Any = None,
    ) -> "KalmanFilter":
        r"""A Kalman filter for a continuous-time model observed at given times.

        The state follows the linear stochastic differential equation
        $dx = A x\, dt + L\, d\beta$, $\beta$ a Brownian motion of diffusion `Qc`,
        and is observed at `times` $t_1 < \dots < t_T$, which may be unevenly
        spaced: $y_k = H x(t_k) + r_k$, $r_k \sim N(0, R)$. Between two times the
        model is discretised exactly ([`eqx_seq.discretize`][]): step `k` has
        $F_k = e^{A \Delta t_k}$ and
        $Q_k = \int_0^{\Delta t_k} e^{A s} L Q_c L^\top e^{A^\top s} ds$,
        $\Delta t_k = t_k - t_{k-1}$. The result is an ordinary time-varying
        filter (`F` and `Q` with a time axis of length `T`), differentiable with
        respect to `A`, `Qc` and `L` through the discretisation.

        **Forecasts at future times**: put them in `times`, with all-NaN rows of
        `ys` there. A step with no observation is a prediction only, so its
        filtered moments are the exact forecast of `x(t)` given the observations
        before it (and the smoother's, given all of them).

        **Arguments:**

        - `A`: the drift matrix, `(n, n)`.
        - `H`: the emission matrix, `(p, n)` or `(T, p, n)`.
        - `Qc`: the diffusion of the noise `β`, `(s, s)`, symmetric positive
            semi-definite.
        - `R`: the observation noise covariance, `(p, p)` or `(T, p, p)`,
            symmetric positive definite.
        - `m0`, `P0`: mean and covariance of `x(times[0])` (`prior_at="x1"`), or of
            `x(prior_time)` (`prior_at="x0"`).
        - `times`: the observation times, `(T,)`, finite and strictly increasing.
            The gaps are taken in the times' own dtype before the cast to the
            model's, so absolute times (seconds since 1970, say) keep their
            precision when given as a float64 NumPy array.
        - `L`: the noise's loading, `(n, s)`; default the identity (`s = n`).
        - `prior_time`: with `prior_at="x0"`, the time of the state the prior
            describes, before `times[0]`: the first step then runs from it.
        - `prior_at`: `"x1"` (default: the prior is the law of the first observed
            state, and the first rows of `F` and `Q`, which belong to no interval,
            hold the placeholders `I` and `I`, read by no algorithm) or `"x0"`
            (with `prior_time`).
        - `initialization`: `"known"` or `"diffuse"` (as in `__init__`; a
            time-varying model has no `"stationary"` prior).
        - `scan`: the backend, see the class docstring.
        - `dtype`: the parameters' dtype; default: the common dtype of the model's
            inputs (`times` excluded), floating.

        **Returns:**

        A time-varying [`eqx_seq.KalmanFilter`][] of `num_steps = T` steps: its
        `filter`, `smooth`, `log_likelihood`, `sample` and `posterior_sample` run
        on `T` observations. `fit_em` needs `F` and `Q` held
        (`fixed={"F": True, "Q": True}`) and fits `H`, `R`, `m0` and `P0` around
        them; `A`, `Qc` and `L` are fitted by gradients of the log-likelihood of
        a function that builds the filter (`docs/usage/kalman.md`, "Irregular
        time steps").

        **Raises:**

        `ValueError` for inconsistent shapes, `times` that are not finite and
        strictly increasing (repeated times would give `Q = 0`, which is not
        positive definite: merge their observations into one row instead), or a
        `prior_time` missing with `prior_at="x0"`, not before `times[0]`, or given
        with `"x1"`; for traced `times` (under `jax.jit`) the time checks run at
        run time (`eqx.error_if`), as does the check that `R`, `P0` and every
        `Q_k` are symmetric positive definite. `Q_k` is when `(A, L Qc^{1/2})` is
        controllable (noise reaches every state) and the step is not so short
        that `Q_k` is singular to round-off (in float32, steps far shorter than
        the model's time scales can be).
        """
        check_sharded(scan, initialization)
        check_options(prior_at, initialization, True)
        model = {"A": A, "H": H, "Qc": Qc, "R": R, "m0": m0, "P0": P0, "L": L}
        dtype = model_dtype(model, dtype, "eqx_seq.KalmanFilter.from_continuous")
        F, Q = continuous_matrices(A, Qc, times, L, prior_time, prior_at, dtype)
        return cls.from_matrices(
            F, H, Q, R, m0, P0, scan=scan, prior_at=prior_at,
            initialization=initialization, dtype=dtype,
        )  # fmt: skip

    def _params(self) -> Parameters:
        """The parameters, without the options."""
        return Parameters(
            self.F, self.H, self.B, self.D, self.m0, self.Q_factor, self.R_factor,
            self.P0_factor, self.num_steps,
        )  # fmt: skip

    def _model(self) -> Model:
        """The model in computational form, which the algorithms take."""
        return model_of(
            self._params(), self.prior_at, self.initialization,
            steady_state=self._steady_state, square_root=self._square_root,
        )  # fmt: skip

    def _with_private(self, **private: bool) -> "KalmanFilter":
        """The same model with the private switches (`_steady_state`,
        `_square_root`) changed, for the comparisons of the tests and benchmarks."""
        params = self._params()
        switches = {"_steady_state": self._steady_state}
        switches["_square_root"] = self._square_root
        return KalmanFilter(
            self.state_size, self.obs_size, control_size=self.control_size,
            scan=self.scan, prior_at=self.prior_at,
            initialization=self.initialization, dtype=self.m0.dtype, key=None,
            _parameters=params, **{**switches, **private},
        )  # fmt: skip

    # --- the matrices ---

    @property
    def Q(self) -> Float[Array, "*T n n"]:
        """The transition noise covariance `Q = L L^T` (from `Q_factor`)."""
        return gram(factor(self.Q_factor))

    @property
    def R(self) -> Float[Array, "*T p p"]:
        """The observation noise covariance `R = L L^T` (from `R_factor`)."""
        return gram(factor(self.R_factor))

    @property
    def P0(self) -> Float[Array, "n n"]:
        """The prior covariance (of `x_0`, or of `x_1` with `prior_at="x1"`): from
        `P0_factor`, the stationary one with `initialization="stationary"`, and
        infinite on the diagonal with `"diffuse"`."""
        if self.initialization == "diffuse":
            n = self.state_size
            return jnp.diag(jnp.full((n,), jnp.inf, self.m0.dtype))
        return gram(prior(self._params(), self.initialization)[1])

    # --- inference ---

    @jax.named_scope("eqx_seq.KalmanFilter")
    def __call__(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T n"]:
        """The filtered means: the layer's output.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.
        - `key`: ignored; for compatibility with the Equinox layer API.

        **Returns:**

        `E[x_t | y_1..y_t]` for every step, shape `(T, state_size)`.
        """
        del key
        return self.filter(ys, us=us).means

    @jax.named_scope("eqx_seq.KalmanFilter.filter")
    def filter(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> KalmanFilterResult:
        """Filtered moments and the log-likelihood.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        A [`eqx_seq.KalmanFilterResult`][]: filtered and predicted means and
        covariances, per-step log-likelihoods and their sum.
        """
        ys, us = inputs(self._params(), self.scan, ys, us, "filter")
        return _filter_jit(self, ys, us)

    @jax.named_scope("eqx_seq.KalmanFilter.log_likelihood")
    def log_likelihood(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> Float[Array, ""]:
        """The log-likelihood `log p(y_1..y_T)` of the observed entries.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        A scalar. Per-step terms are `filter(ys).log_likelihoods`.

        Its derivatives come from Fisher's identity with the smoother's statistics
        (`docs/devdocs/kalman.md`, "Fisher's identity"): a gradient costs about one
        filter and one smoother. `filter(ys).log_likelihood` is the same number with
        plain autodiff through the filter.
        """
        ys, us = inputs(self._params(), self.scan, ys, us, "log_likelihood")
        return _log_likelihood_jit(self, ys, us)

    @jax.named_scope("eqx_seq.KalmanFilter.smooth")
    def smooth(
        self,
        ys: Float[ArrayLike, "T p"],
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> KalmanSmootherResult:
        """Smoothed moments (Rauch-Tung-Striebel).

        Rauch, Tung & Striebel, "Maximum likelihood estimates of linear dynamic
        systems", AIAA Journal 1965, in square-root form (Park & Kailath); in
        parallel as an associative scan, Särkkä & García-Fernández 2021.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        A [`eqx_seq.KalmanSmootherResult`][]: smoothed means and covariances,
        lag-one cross-covariances, and the filter's result.
        """
        ys, us = inputs(self._params(), self.scan, ys, us, "smooth")
        not_diffuse(self.initialization, "smooth")
        return _smooth_jit(self, ys, us)

    @jax.named_scope("eqx_seq.KalmanFilter.sample")
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
        if self.initialization == "diffuse":
            raise ValueError(
                "eqx_seq.KalmanFilter.sample: a diffuse prior (initialization="
                '"diffuse") has no draws; use "known" or "stationary".'
            )
        check_length(self._params(), num_steps, "sample")
        us = controls(self._params(), us, num_steps, "sample")
        return _sample_jit(self, key, num_steps, us)

    @jax.named_scope("eqx_seq.KalmanFilter.fit_em")
    def fit_em(
        self,
        ys: Float[ArrayLike, "*batch T p"],
        *,
        num_iters: int,
        us: Float[ArrayLike, "*batch T c"] | None = None,
        fixed: Any = None,
    ) -> tuple["KalmanFilter", Float[Array, " num_iters"]]:
        """Fit the model by expectation-maximisation (Shumway & Stoffer 1982): the
        smoother, then closed-form updates, in one compiled loop. Missing (NaN)
        entries are latent too, so the log-likelihood never decreases.

        **Arguments:**

        - `ys`: observations `(T, obs_size)`, or `(batch, T, obs_size)` for several
            sequences (their statistics are summed); NaN marks a missing entry.
        - `num_iters`: the number of iterations, at least 1.
        - `us`: controls `(T, control_size)` (with the batch axis if `ys` has
            one), iff `control_size > 0`; `B` and `D` are then fitted too.
        - `fixed`: what to hold (`True`); `None` fits everything. A dict from
            `"F"`, `"H"`, `"B"`, `"D"`, `"m0"`, `"Q"`, `"R"`, `"P0"` to a bool or,
            except for the covariances, a boolean mask of the matrix's shape; or a
            `KalmanFilter`-shaped pytree of them (a filter spec, fields `Q_factor`,
            ...). Time-varying matrices must be held.

        **Returns:**

        `(fitted, log_likelihoods)`: the fitted [`eqx_seq.KalmanFilter`][], and
        `log_likelihoods[i]`, the log-likelihood of `ys` (summed over sequences)
        after iteration `i + 1`; the last is `fitted.log_likelihood(ys)`.

        New covariances are kept positive definite by a floor: each entry keeps a
        variance not explained by the entries before it of at least `256 eps` of
        its own variance (an entry with none at all gets `eps` times the mean
        variance). Only degenerate data reach it, such as duplicated sensors
        (identical columns of `ys`), whose maximum-likelihood `R` is singular; the
        log-likelihood of such a fit is set by the floor and need not increase at
        every iteration.

        **Raises:**

        `ValueError` for a `fixed` spec that does not match the parameters, a free
        time-varying matrix, `num_iters < 1`, bad shapes, or, with `R` free,
        observations whose every observed entry is zero (`R` then has no scale;
        when `ys` is traced, a `RuntimeError` at run time); `NotImplementedError`
        with `initialization="diffuse"`. See `docs/usage/kalman.md`.
        """
        not_diffuse(self.initialization, "fit_em")  # the E-step is the smoother
        scan = backend(self.scan, caller="fit_em")
        params = self._params()
        if isinstance(fixed, KalmanFilter):
            fixed = from_filter_spec(params, fixed._params())
        ys, us, spec = check_fit_em(
            params, self.scan, ys, us, num_iters, fixed, self.prior_at,
            self.initialization,
        )  # fmt: skip
        new, lls = fit_em(
            params, ys, us, num_iters, spec, scan, prior_at=self.prior_at,
            initialization=self.initialization, steady_state=self._steady_state,
        )  # fmt: skip
        names = [k for k in new._fields if eqx.is_array(getattr(new, k))]
        fitted = eqx.tree_at(
            lambda kf: [getattr(kf, k) for k in names],
            self,
            [getattr(new, k) for k in names],
        )
        return fitted, lls

    # --- prediction ---

    @jax.named_scope("eqx_seq.KalmanFilter.forecast")
    def forecast(
        self,
        ys: Float[ArrayLike, "T p"],
        horizon: int,
        *,
        us: Float[ArrayLike, "T_all c"] | None = None,
    ) -> KalmanForecastResult:
        """Forecast the states and observations of the `horizon` steps after `ys`.

        The exact predictive distributions: the filter's prediction step iterated
        from the last filtered moments, with the observation noise `R` in the
        observations' covariances.

        **Arguments:**

        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `horizon`: the number of steps to forecast, an int `>= 0`.
        - `us`: controls, iff `control_size > 0`: those of the data's steps and
            then of the forecast's, shape `(T + horizon, control_size)`.

        **Returns:**

        A [`eqx_seq.KalmanForecastResult`][]: `p(x_{T+h} | y_1..y_T)` and
        `p(y_{T+h} | y_1..y_T)` for `h = 1..horizon`.

        A time-varying model has matrices for its `num_steps` steps only: with it,
        `ys` may be shorter than `num_steps`, and `T + horizon <= num_steps`.
        """
        backend(self.scan, caller="forecast")
        ys, us = check_forecast(self._params(), ys, us, horizon)
        return _forecast_jit(self, ys, us, horizon)

    @jax.named_scope("eqx_seq.KalmanFilter.posterior_sample")
    def posterior_sample(
        self,
        key: PRNGKeyArray,
        ys: Float[ArrayLike, "T p"],
        num_samples: int,
        *,
        us: Float[ArrayLike, "T c"] | None = None,
    ) -> Float[Array, "num_samples T n"]:
        """Draw state paths from the posterior `p(x_1..x_T | y_1..y_T)`.

        Forward filtering, backward sampling (Frühwirth-Schnatter 1994; Carter &
        Kohn 1994): backwards from `x_T`, each `x_t` is drawn given `x_{t+1}` and
        the filtered moments of step `t`. A parallel backend composes these affine
        draws with its `associative_scan`. The filter runs once for all samples.

        **Arguments:**

        - `key`: a `jax.random.key`.
        - `ys`: observations, shape `(T, obs_size)`; NaN marks a missing entry.
        - `num_samples`: the number of paths, an int `>= 1`.
        - `us`: controls, shape `(T, control_size)`, iff `control_size > 0`.

        **Returns:**

        The paths `x_1..x_T`, shape `(num_samples, T, state_size)`.
        """
        check_positive_int("num_samples", num_samples)
        backend(self.scan, caller="posterior_sample")
        ys, us = inputs(self._params(), self.scan, ys, us, "posterior_sample")
        not_diffuse(self.initialization, "posterior_sample")
        return _posterior_sample_jit(self, key, ys, us, num_samples)

    def init_state(self) -> KalmanState:
        """The state to start online filtering from: the prior and a log-likelihood
        of zero.

        With `prior_at="x0"` the prior is the law of `x_0`, before the first
        observation: every step `t` is `state = kf.predict(state)` then `state =
        kf.update(state, y_t)`. With `prior_at="x1"` it is the law of `x_1`: the
        first call is `update` (with `y_1`), then `predict` and `update` for every
        later step. Either way the states are those of
        [`eqx_seq.KalmanFilter.filter`][], step by step. With
        `initialization="stationary"` the prior is the stationary law.

        **Returns:**

        An [`eqx_seq.KalmanState`][].

        **Raises:**

        `ValueError` for a time-varying model, whose matrices belong to given
        steps (filter it as a whole sequence); `NotImplementedError` with
        `initialization="diffuse"`.
        """
        check_streamable(self._params(), self.initialization, "init_state")
        return _init_state_jit(self)

    def predict(
        self,
        state: KalmanState,
        *,
        u: Float[ArrayLike, " c"] | None = None,
    ) -> KalmanState:
        """One transition of online filtering: `x_t = F x_{t-1} + B u_t + q_t`.

        **Arguments:**

        - `state`: an [`eqx_seq.KalmanState`][], about `x_{t-1}`.
        - `u`: the controls `u_t`, shape `(control_size,)`, iff
            `control_size > 0`.

        **Returns:**

        The predicted state, about `x_t` given the same observations; its
        `log_likelihood` is unchanged.
        """
        params = self._params()
        check_streamable(params, self.initialization, "predict")
        state = check_state(params, state, "predict")
        return _predict_jit(self, state, check_control(params, u, "predict"))

    def update(
        self,
        state: KalmanState,
        y: Float[ArrayLike, " p"],
        *,
        u: Float[ArrayLike, " c"] | None = None,
    ) -> KalmanState:
        """Condition the state of online filtering on one observation `y_t`.

        **Arguments:**

        - `state`: an [`eqx_seq.KalmanState`][], the prediction of `x_t`.
        - `y`: the observation `y_t`, shape `(obs_size,)`; NaN marks a missing
            entry (a step with none leaves the state as it is).
        - `u`: the controls `u_t` (for `D u_t`), shape `(control_size,)`, iff
            `control_size > 0`.

        **Returns:**

        The filtered state, about `x_t` given the observations up to `y_t`, its
        `log_likelihood` increased by `log p(y_t | y_1..y_{t-1})`.
        """
        params = self._params()
        check_streamable(params, self.initialization, "update")
        state = check_state(params, state, "update")
        y = check_vector(params, y, "y", self.obs_size, "update")
        return _update_jit(self, state, y, check_control(params, u, "update"))


# --- the compiled entry points: the model in computational form, and the algorithm
# the backend runs ---


@eqx.filter_jit
def _filter_jit(kf: KalmanFilter, ys: Array, us: Array | None) -> KalmanFilterResult:
    model = kf._model()
    if splits_time(kf.scan):
        return filter_sharded(model, ys, us, kf.scan)
    return filter_(model, ys, us, backend(kf.scan))


@eqx.filter_jit
def _smooth_jit(kf: KalmanFilter, ys: Array, us: Array | None) -> KalmanSmootherResult:
    model = kf._model()
    if splits_time(kf.scan):
        return smooth_sharded(model, ys, us, kf.scan)
    return smooth(model, ys, us, backend(kf.scan))


@eqx.filter_jit
def _log_likelihood_jit(kf: KalmanFilter, ys: Array, us: Array | None) -> Array:
    model = kf._model()
    if splits_time(kf.scan):  # differentiated by plain autodiff
        return log_likelihood_sharded(model, ys, us, kf.scan)
    if kf.initialization == "diffuse":
        # Fisher's identity needs the smoother, which has no diffuse form here
        return filter_(model, ys, us, backend(kf.scan)).log_likelihood
    return fisher_log_likelihood(model, ys, us, backend(kf.scan))


@eqx.filter_jit
def _sample_jit(kf: KalmanFilter, key, num_steps: int, us: Array | None):
    return sample_prior(kf._model(), key, num_steps, us)


@eqx.filter_jit
def _forecast_jit(
    kf: KalmanFilter, ys: Array, us: Array | None, horizon: int
) -> KalmanForecastResult:
    return forecast(kf._model(), ys, us, horizon, kf.scan)


@eqx.filter_jit
def _posterior_sample_jit(
    kf: KalmanFilter, key: PRNGKeyArray, ys: Array, us: Array | None, num_samples: int
) -> Array:
    return posterior_sample(kf._model(), key, ys, us, num_samples, kf.scan)


@eqx.filter_jit
def _init_state_jit(kf: KalmanFilter) -> KalmanState:
    return init_state(kf._model())


@eqx.filter_jit
def _predict_jit(kf: KalmanFilter, state: KalmanState, u: Array | None) -> KalmanState:
    return predict_state(kf._model(), state, u)


@eqx.filter_jit
def _update_jit(
    kf: KalmanFilter, state: KalmanState, y: Array, u: Array | None
) -> KalmanState:
    return update_state(kf._model(), state, y, u)
