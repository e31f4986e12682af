"""The recurrent layers: the contract they share, the diagonal state-space family
(S5, LRU and their residual block), the selective family (the selective scan,
RG-LRU, Hawk, Mamba), and the optimiser labels."""

from ._base import (
    AbstractDiagonalSSM as AbstractDiagonalSSM,
    SSMJacobians as SSMJacobians,
)
from ._block import S5Block as S5Block
from ._hawk import HawkBlock as HawkBlock
from ._lru import LRU as LRU
from ._mamba import Mamba as Mamba, MambaState as MambaState
from ._mamba2 import Mamba2 as Mamba2, Mamba2State as Mamba2State
from ._mamba_block import Mamba2Block as Mamba2Block, MambaBlock as MambaBlock
from ._optim import (
    s5_optimizer as s5_optimizer,
    ssm_param_labels as ssm_param_labels,
)
from ._recurrent import AbstractRecurrentLayer as AbstractRecurrentLayer
from ._rglru import RGLRU as RGLRU
from ._s5 import S5 as S5
from ._selective_scan import selective_scan as selective_scan
from ._ssd import ssd_scan as ssd_scan, ssd_step as ssd_step
