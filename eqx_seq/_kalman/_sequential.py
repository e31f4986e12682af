"""The sequential filter: a `lax.scan` of `_step`, with the steady-state shortcut
(`_steady`) where it applies."""

import jax.lax as lax
from jaxtyping import Array

from ._problem import _Problem
from ._results import _filter_result, KalmanFilterResult
from ._steady import _may_settle, filter_steady
from ._step import _covariances, _initial, _predicted_covs, _sequential_step


def filter_exact(
    problem: _Problem, *, square_root: bool
) -> tuple[KalmanFilterResult, Array]:
    """The filter with every step exact, and its carries: the filtered covariances'
    factors (square-root form) or the covariances themselves."""
    steps, xs, _ = _sequential_step(problem, square_root=square_root)
    init = (problem.model.m0, _initial(problem.model, square_root))
    _, (ms, Ss, mps, lls) = lax.scan(steps[True], init, xs)
    covs = _covariances(Ss, square_root)
    result = _filter_result(
        ms, covs, mps, _predicted_covs(problem.model, covs), lls, problem.logdet
    )
    return result, Ss


def filter_sequential(
    problem: _Problem, *, steady_state: bool = True, square_root: bool = True
) -> KalmanFilterResult:
    """The filter in a `lax.scan`. With `steady_state`, for a time-invariant model
    with complete data (`W` one matrix), the steps after the covariance has settled
    are the steady-state filter (`_steady`); until then, and otherwise, every step
    is exact."""
    if steady_state and _may_settle(problem):
        return filter_steady(problem, square_root=square_root)[0]
    return filter_exact(problem, square_root=square_root)[0]
