from ._layer import (
    GatedDeltaNet as GatedDeltaNet,
    GatedDeltaNetBlock as GatedDeltaNetBlock,
    GatedDeltaNetState as GatedDeltaNetState,
)
from ._scan import (
    delta_rule_scan as delta_rule_scan,
    delta_rule_step as delta_rule_step,
)
