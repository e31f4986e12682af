"""Equinox layers for sequence models, differentiated by hand-written adjoints."""

import importlib.metadata

from ._embedding import Embedding as Embedding
from ._jacobians import (
    recurrence_jacobians as recurrence_jacobians,
    RecurrenceJacobians as RecurrenceJacobians,
)
from ._kalman import (
    KalmanFilter as KalmanFilter,
    KalmanFilterResult as KalmanFilterResult,
    KalmanSmootherResult as KalmanSmootherResult,
)
from ._recurrence import linear_recurrence as linear_recurrence
from ._scan import (
    AbstractScan as AbstractScan,
    AssociativeScan as AssociativeScan,
    AutoScan as AutoScan,
    SequentialScan as SequentialScan,
)


try:
    __version__ = importlib.metadata.version("eqx_seq")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
