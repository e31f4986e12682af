"""The Kalman filter: the layer and its results.

Read top-down: `_layer` (the layer; `_checks` its input checks, `_sample` its prior
sampler, `_predictive` the base holding its predictive methods) -> `_fisher` (the
log-likelihood's gradient) -> `_em` / `_em_spec` / `_smooth_steady`
(expectation-maximisation) -> `_forecast`, `_posterior_sample`, `_streaming`
(forecasts, posterior paths, online filtering: built on the filter) -> `_dispatch`
(backend and whitening) -> `_diffuse` (the exact diffuse start) -> `_sequential` /
`_parallel` (the filters) -> `_smoother` (the smoother of both) -> `_steady` (the
steady-state shortcut) -> `_step` (one filter step; `_sqrt`, its square-root form)
-> `_problem` (the prepared observations) / `_initial` (the prior's options) /
`_parameters` -> `_linalg`.
"""

from ._layer import KalmanFilter as KalmanFilter
from ._results import (
    KalmanFilterResult as KalmanFilterResult,
    KalmanForecastResult as KalmanForecastResult,
    KalmanSmootherResult as KalmanSmootherResult,
    KalmanState as KalmanState,
)
