"""Recurrence backends. Import order: `_sharded` (the time axis split over devices)
-> `_local` (the backends of one device) -> `_level` (a pytree scan for them) and
`_base` (the contract, the one-device layout, `check_scan`)."""

from ._base import (
    AbstractLocalScan as AbstractLocalScan,
    AbstractScan as AbstractScan,
    check_scan as check_scan,
    compose as compose,
    decayed as decayed,
    forgotten_as_zero as forgotten_as_zero,
)
from ._level import level_scan as level_scan
from ._local import (
    AssociativeScan as AssociativeScan,
    AutoScan as AutoScan,
    SequentialScan as SequentialScan,
)
from ._sharded import mesh_axis as mesh_axis, ShardedScan as ShardedScan
