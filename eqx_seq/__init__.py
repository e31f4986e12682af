"""Equinox layers for sequence models, differentiated by hand-written adjoints."""

import importlib.metadata

from ._delta import (
    delta_rule_scan as delta_rule_scan,
    delta_rule_step as delta_rule_step,
    GatedDeltaNet as GatedDeltaNet,
    GatedDeltaNetBlock as GatedDeltaNetBlock,
    GatedDeltaNetState as GatedDeltaNetState,
)
from ._embedding import Embedding as Embedding
from ._kalman import (
    discretize as discretize,
    KalmanFilter as KalmanFilter,
    KalmanFilterResult as KalmanFilterResult,
    KalmanForecastResult as KalmanForecastResult,
    KalmanSmootherResult as KalmanSmootherResult,
    KalmanState as KalmanState,
)
from ._models import (
    DenoisingClassifier as DenoisingClassifier,
    LanguageModel as LanguageModel,
    SequenceClassifier as SequenceClassifier,
)
from ._nonlinear import (
    NonlinearKalmanFilter as NonlinearKalmanFilter,
    NonlinearSmootherResult as NonlinearSmootherResult,
)
from ._recurrence import (
    linear_recurrence as linear_recurrence,
    recurrence_jacobians as recurrence_jacobians,
    RecurrenceJacobians as RecurrenceJacobians,
)
from ._scan import (
    AbstractLocalScan as AbstractLocalScan,
    AbstractScan as AbstractScan,
    AssociativeScan as AssociativeScan,
    AutoScan as AutoScan,
    SequentialScan as SequentialScan,
    ShardedScan as ShardedScan,
)
from ._ssm import (
    AbstractDiagonalSSM as AbstractDiagonalSSM,
    AbstractRecurrentLayer as AbstractRecurrentLayer,
    HawkBlock as HawkBlock,
    LRU as LRU,
    Mamba as Mamba,
    Mamba2 as Mamba2,
    Mamba2Block as Mamba2Block,
    Mamba2State as Mamba2State,
    MambaBlock as MambaBlock,
    MambaState as MambaState,
    RGLRU as RGLRU,
    S5 as S5,
    s5_optimizer as s5_optimizer,
    S5Block as S5Block,
    selective_scan as selective_scan,
    ssd_scan as ssd_scan,
    ssd_step as ssd_step,
    ssm_param_labels as ssm_param_labels,
    SSMJacobians as SSMJacobians,
)
from ._tridiagonal import (
    tridiagonal_solve as tridiagonal_solve,
    TridiagonalImplicit as TridiagonalImplicit,
)


try:
    __version__ = importlib.metadata.version("eqx_seq")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
