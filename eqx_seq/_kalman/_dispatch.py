"""From a model and observations to the algorithm that runs: the backend's
sequential or parallel filter and smoother, on the observations whitened one way or
the other."""

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from .._scan import AbstractScan, check_scan
from ._diffuse import filter_diffuse
from ._filter import (
    filter_exact,
    filter_sequential,
    filter_steady,
    may_settle,
)
from ._interface import (
    KalmanFilterResult,
    KalmanSmootherResult,
)
from ._linalg import chol
from ._model import (
    all_observed,
    Model,
    prepare,
    Problem,
    Whitening,
)
from ._parallel import filter_parallel
from ._smoother import smooth_parallel, smooth_sequential


_Out = TypeVar("_Out")


def backend(
    scan: AbstractScan, *, caller: str = "", splits_time: bool = False
) -> AbstractScan:
    """The backend that runs; it declares whether it is `parallel`, and a parallel
    one implements `associative_scan`. With `splits_time`, the caller also takes
    one that splits time over devices (`eqx_seq.ShardedScan`, `_sharded`)."""
    return check_scan(
        scan,
        name="eqx_seq.KalmanFilter" + (f".{caller}" if caller else ""),
        pytree_scan=True,
        splits_time=splits_time,
    )


def by_whitening(
    ys: Array,
    scan: AbstractScan,
    work: Callable[[Whitening], _Out],
    *,
    remat: bool = False,
) -> _Out:
    """`work(whitening)` with the whitening that suits the data and the backend.

    With complete data `W` is one constant matrix: for the sequential backend `work`
    runs in one branch of a `lax.cond` per case (so that the loop keeps `W` outside);
    for the parallel backend only the whitening is cond'ed (inside `prepare`), so
    that the (slow to compile) parallel program appears once. With `remat`, for
    plain autodiff through it, both branches are rematerialised: reverse mode
    through a `cond` keeps the residuals of both branches, the one not taken too.
    """
    if scan.parallel:
        return work("either")
    branches = [lambda w=w: work(w) for w in ("complete", "missing")]
    if remat:
        branches = [jax.checkpoint(b) for b in branches]
    return lax.cond(all_observed(~jnp.isnan(ys)), *branches)


def filter_problem(
    problem: Problem, scan: AbstractScan, *, steady_state: bool, square_root: bool
) -> KalmanFilterResult:
    """The filter of `problem` with the backend `scan` and the layer's private
    switches (`steady_state`, `square_root`)."""
    if scan.parallel:
        return filter_parallel(problem, scan, square_root=square_root)[0]
    return filter_sequential(
        problem, steady_state=steady_state, square_root=square_root
    )


def smooth_problem(
    problem: Problem,
    scan: AbstractScan,
    square_root: bool = True,
    steady_state: bool = False,
) -> KalmanSmootherResult:
    """The smoother from the filtered means and covariance factors (square-root,
    unless `square_root` is off). With `steady_state` (sequential backend,
    square-root form) the filter is the steady-state one where its covariance
    settles, whose fixed factor gives the tail one smoother element (a `lax.cond`
    on the model alone, as the gradient's); else every filter step is exact."""
    model = problem.model
    if scan.parallel:
        filtered, factors = filter_parallel(problem, scan, square_root=square_root)
        return smooth_parallel(model, filtered, factors, scan)
    if steady_state and square_root and may_settle(problem):
        filtered, settled, factors = filter_steady(
            problem, exact_fallback=False, factors=True
        )
        return lax.cond(
            settled,
            lambda: smooth_sequential(model, filtered, factors),
            lambda: smooth_problem(problem, scan),
        )
    filtered, carries = filter_exact(problem, square_root=square_root)
    factors = carries if square_root else chol(carries)
    return smooth_sequential(model, filtered, factors)


@full_precision
def filter_(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> KalmanFilterResult:
    """The filter of `model` on `ys` and `us` (checked) with the backend `scan`."""
    switches = dict(steady_state=model.steady_state, square_root=model.square_root)

    def work(whitening):
        problem = prepare(model, ys, us, whitening)
        run = lambda problem: filter_problem(problem, scan, **switches)
        if model.initialization == "diffuse":
            return filter_diffuse(problem, run)
        return run(problem)

    return by_whitening(ys, scan, work)


@full_precision
def smooth(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> KalmanSmootherResult:
    """The smoother of `model` on `ys` and `us` (checked) with the backend `scan`."""
    return by_whitening(
        ys,
        scan,
        lambda whitening: smooth_problem(
            prepare(model, ys, us, whitening),
            scan,
            model.square_root,
            model.steady_state,
        ),
    )
