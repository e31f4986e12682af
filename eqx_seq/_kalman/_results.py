"""What the filter and the smoother return."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float


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
    cross_covs: Float[Array, "T-1 n n"]
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


def _filter_result(ms, Ps, mps, Pps, lls, logdet) -> KalmanFilterResult:
    """The result from the filter's outputs on whitened observations: the whitening's
    log-determinant `logdet` (per step) completes the log-likelihoods."""
    lls = lls - logdet
    return KalmanFilterResult(ms, Ps, mps, Pps, lls, jnp.sum(lls))
