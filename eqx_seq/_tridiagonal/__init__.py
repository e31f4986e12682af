"""Tridiagonal solves and the implicit layer. Import order: `_implicit` (the layer)
-> `_solve` (the method a backend picks, the implicit derivatives) -> `_thomas`
(Thomas and its LU factors) and `_pcr` (parallel cyclic reduction)."""

from ._implicit import TridiagonalImplicit as TridiagonalImplicit
from ._solve import tridiagonal_solve as tridiagonal_solve
