"""Equinox layers for sequence models, differentiated by hand-written adjoints."""

import importlib.metadata

from ._embedding import Embedding as Embedding
from ._kalman import (
    KalmanFilter as KalmanFilter,
    KalmanFilterResult as KalmanFilterResult,
    KalmanForecastResult as KalmanForecastResult,
    KalmanSmootherResult as KalmanSmootherResult,
    KalmanState as KalmanState,
)
from ._models._classifier import SequenceClassifier as SequenceClassifier
from ._models._denoising import DenoisingClassifier as DenoisingClassifier
from ._models._language_model import LanguageModel as LanguageModel
from ._recurrence import (
    linear_recurrence as linear_recurrence,
    recurrence_jacobians as recurrence_jacobians,
    RecurrenceJacobians as RecurrenceJacobians,
)
from ._scan import (
    AbstractScan as AbstractScan,
    AssociativeScan as AssociativeScan,
    AutoScan as AutoScan,
    SequentialScan as SequentialScan,
)
from ._sharded_scan import ShardedScan as ShardedScan
from ._ssm._base import (
    AbstractDiagonalSSM as AbstractDiagonalSSM,
    SSMJacobians as SSMJacobians,
)
from ._ssm._block import S5Block as S5Block
from ._ssm._hawk import HawkBlock as HawkBlock
from ._ssm._lru import LRU as LRU
from ._ssm._mamba import Mamba as Mamba
from ._ssm._mamba_block import MambaBlock as MambaBlock
from ._ssm._optim import (
    s5_optimizer as s5_optimizer,
    ssm_param_labels as ssm_param_labels,
)
from ._ssm._rglru import RGLRU as RGLRU
from ._ssm._s5 import S5 as S5
from ._ssm._selective_scan import selective_scan as selective_scan
from ._tridiagonal import tridiagonal_solve as tridiagonal_solve
from ._tridiagonal_implicit import TridiagonalImplicit as TridiagonalImplicit


try:
    __version__ = importlib.metadata.version("eqx_seq")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
