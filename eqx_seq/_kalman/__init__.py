"""The Kalman filter: the layer and its results.

Each file imports only files below it: `_layer` (the layer) -> `_em`, `_fisher`,
`_predictive`, `_sharded`, `_continuous` -> `_m_step` -> `_e_step` -> `_dispatch` ->
`_smoother` -> `_parallel` -> `_diffuse` -> `_filter` -> `_model` -> `_linalg`.
"""

from ._continuous import discretize as discretize
from ._interface import (
    KalmanFilterResult as KalmanFilterResult,
    KalmanForecastResult as KalmanForecastResult,
    KalmanSmootherResult as KalmanSmootherResult,
    KalmanState as KalmanState,
)
from ._layer import KalmanFilter as KalmanFilter
