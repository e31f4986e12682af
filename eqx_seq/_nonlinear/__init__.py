"""Nonlinear state-space models: extended and sigma-point filters and smoothers,
and the iterated smoothers, built on the linear Kalman layer's algorithms.

Each file imports only files below it: `_layer` -> `_interface`, `_iterated` ->
`_filter` -> `_linearize`.
"""

from ._interface import NonlinearSmootherResult as NonlinearSmootherResult
from ._layer import NonlinearKalmanFilter as NonlinearKalmanFilter
