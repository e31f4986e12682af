"""From a model and observations to the algorithm that runs: the backend's
sequential or parallel filter and smoother, on the observations whitened one way or
the other."""

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun
from jaxtyping import Array

from .._misc import full_precision, zeros_like_inputs
from .._scan import AbstractScan, check_scan
from ._diffuse import filter_diffuse
from ._filter import (
    filter_exact,
    filter_sequential,
    filter_steady,
    head_steps,
)
from ._interface import (
    KalmanFilterResult,
    KalmanSmootherResult,
)
from ._linalg import chol
from ._model import (
    all_observed,
    Model,
    per_step,
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


def steady_applies(model: Model, ys: Array, scan: AbstractScan) -> bool:
    """Static: whether the steady-state algorithms may apply, which `steady_or_exact`
    then tries: the sequential backend, the layer's `steady_state` switch on, no
    diffuse prior, a time-invariant model (`F`, `Q`, `H`, `R` one matrix each) and
    steps to spare after the exact head (`_filter.head_steps`)."""
    if scan.parallel or not model.steady_state or model.initialization == "diffuse":
        return False
    varies = any(per_step(a, 2) for a in (model.F, model.L_Q, model.H, model.L_R))
    return not varies and ys.shape[0] > head_steps(model.F.dtype) + 1


def steady_or_exact(
    ys: Array,
    steady: Callable[[], tuple[_Out, Array]],
    exact: Callable[[str], _Out],
    *,
    remat: bool = False,
) -> _Out:
    """`steady()`'s result where every entry of `ys` is observed and the covariance
    settled (`steady` returns `(out, settled)` and prepares its own complete-data
    problem), else `exact("missing")`.

    The exact algorithm appears once in the program: the missing-data whitening
    serves complete data as well, so there is no exact complete-data copy, neither
    beside the missing-data one nor behind the steady state. `steady` is traced
    once; the branch for data with missing entries returns zeros of its type
    (varying under `jax.shard_map` like the data, as what `prepare` makes does).
    `remat`: as `by_whitening`'s.
    """
    closed, shapes = jax.make_jaxpr(steady, return_shape=True)()
    tree = jax.tree.structure(shapes)

    run = lambda: jax.tree.unflatten(tree, jaxpr_as_fun(closed)())
    skip = lambda: jax.tree.map(
        lambda s: zeros_like_inputs(s.shape, s.dtype, ys), shapes
    )
    if remat:
        run, exact = jax.checkpoint(run), jax.checkpoint(exact, static_argnums=0)
    out, settled = lax.cond(all_observed(~jnp.isnan(ys)), run, skip)
    return lax.cond(settled, lambda: out, lambda: exact("missing"))


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
    problem: Problem, scan: AbstractScan, square_root: bool = True
) -> KalmanSmootherResult:
    """The smoother from the filtered means and covariance factors (square-root,
    unless `square_root` is off), every filter step exact."""
    model = problem.model
    if scan.parallel:
        filtered, factors = filter_parallel(problem, scan, square_root=square_root)
        return smooth_parallel(model, filtered, factors, scan)
    filtered, carries = filter_exact(problem, square_root=square_root)
    factors = carries if square_root else chol(carries)
    return smooth_sequential(model, filtered, factors)


def smooth_steady(problem: Problem) -> tuple[KalmanSmootherResult, Array]:
    """The smoother of a problem that the steady state may apply to (square-root
    form), from the steady-state filter, whose fixed factor gives the tail one
    smoother element; and whether the filter's covariance settled (if not, the
    result is not the smoother's)."""
    filtered, settled, factors = filter_steady(
        problem, exact_fallback=False, factors=True
    )
    return smooth_sequential(problem.model, filtered, factors), settled


@full_precision
def filter_(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> KalmanFilterResult:
    """The filter of `model` on `ys` and `us` (checked) with the backend `scan`."""
    square_root = model.square_root

    def exact(whitening):
        problem = prepare(model, ys, us, whitening)
        run = lambda problem: filter_problem(
            problem, scan, steady_state=model.steady_state, square_root=square_root
        )
        if model.initialization == "diffuse":
            return filter_diffuse(problem, run)
        return run(problem)

    if not steady_applies(model, ys, scan):
        return by_whitening(ys, scan, exact)
    steady = lambda: filter_steady(
        prepare(model, ys, us, "complete"),
        square_root=square_root,
        exact_fallback=False,
    )
    return steady_or_exact(ys, steady, exact)


@full_precision
def smooth(
    model: Model, ys: Array, us: Array | None, scan: AbstractScan
) -> KalmanSmootherResult:
    """The smoother of `model` on `ys` and `us` (checked) with the backend `scan`."""
    exact = lambda w: smooth_problem(prepare(model, ys, us, w), scan, model.square_root)
    if not (model.square_root and steady_applies(model, ys, scan)):
        return by_whitening(ys, scan, exact)
    steady = lambda: smooth_steady(prepare(model, ys, us, "complete"))
    return steady_or_exact(ys, steady, exact)
