"""Nonlinear state-space models: extended and sigma-point filters and smoothers,
and the iterated smoothers, built on the linear Kalman layer's algorithms.

Each file imports only files below it: `_layer` -> `_iterated` -> `_filter` ->
`_linearize`.
"""

from ._layer import (
    NonlinearKalmanFilter as NonlinearKalmanFilter,
    NonlinearSmootherResult as NonlinearSmootherResult,
)
