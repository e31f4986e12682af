"""The predictive methods of `KalmanFilter`: forecasts, posterior samples and online
filtering, in a base class so that the layer's file keeps its size."""

import equinox as eqx
import jax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._misc import check_positive_int
from ._checks import inputs, not_diffuse
from ._dispatch import backend
from ._forecast import check_forecast, forecast
from ._posterior_sample import posterior_sample
from ._results import KalmanForecastResult, KalmanState
from ._streaming import (
    check_control,
    check_state,
    check_streamable,
    check_vector,
    init_state,
    predict,
    update,
)


class _Predictive(eqx.Module):
    """`KalmanFilter`'s `forecast`, `posterior_sample`, `init_state`, `predict` and
    `update`; no fields of its own (`KalmanFilter` holds them)."""

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
        ys, us = check_forecast(self, ys, us, horizon)
        return forecast(self, ys, us, horizon)

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
        ys, us = inputs(self, ys, us, "posterior_sample")
        not_diffuse(self, "posterior_sample")
        return posterior_sample(self, key, ys, us, num_samples)

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
        check_streamable(self, "init_state")
        return init_state(self)

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
        check_streamable(self, "predict")
        state = check_state(self, state, "predict")
        return predict(self, state, check_control(self, u, "predict"))

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
        check_streamable(self, "update")
        state = check_state(self, state, "update")
        y = check_vector(self, y, "y", self.obs_size, "update")
        return update(self, state, y, check_control(self, u, "update"))
