"""The filter and the smoother with the time axis split over the devices of a mesh
axis (`eqx_seq.ShardedScan` inside `jax.shard_map`).

Filter: each device reduces its block to one Särkkä & García-Fernández element,
`p(x_e | x_{s-1}, y_s..y_e)` with the information its observations carry about
`x_{s-1}` (the first device's with the prior folded in); the devices gather those
elements, each conditions on the ones before it to get the filtered state before its
block, and runs the inner backend's filter on its block from there. Smoother: the
same backwards with the Rauch-Tung-Striebel elements, from the smoothed state after
the block. What crosses devices is a few `n x n` matrices per device, whatever the
length. See `docs/devdocs/sequence-parallel.md`, "Kalman filter".
"""

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import full_precision
from .._scan import AbstractScan, check_scan, mesh_axis
from ._dispatch import by_whitening, filter_problem
from ._linalg import (
    _factor,
    _sandwich,
    _sym,
)
from ._parallel import _sqrt_combine, filter_parallel
from ._problem import _per_step, prepare
from ._results import KalmanFilterResult, KalmanSmootherResult
from ._sequential import filter_exact
from ._sharded_element import _CHUNK, block_element, block_log_likelihood, from_state
from ._smoother import _element, combine, smooth_elements, smoother_elements


if TYPE_CHECKING:
    from .._scan import ShardedScan
    from ._layer import KalmanFilter


def splits_time(scan: AbstractScan) -> bool:
    """Whether `scan` splits the time axis over devices (`eqx_seq.ShardedScan`)."""
    return scan.select().splits_time


def inner_backend(scan: "ShardedScan") -> AbstractScan:
    """The backend of each device's block, checked as `KalmanFilter` checks one."""
    return check_scan(scan.inner, name="eqx_seq.KalmanFilter", pytree_scan=True)


def _filtered_before(element, axis_name: str, index: Array):
    """The filtered mean and factor of the state before this device's block: the
    gathered elements of the blocks before it, applied in order (the first has the
    prior folded in, so the start is immaterial)."""
    gathered = lax.all_gather(element, axis_name)
    n = element[1].shape[-1]
    zero = jnp.zeros((n, n), element[1].dtype)
    m, L = jnp.zeros_like(element[1]), zero
    for j in range(gathered[1].shape[0] - 1):
        elem_j = jax.tree.map(lambda x: x[j], gathered)
        _, m_j, L_j, _, _ = _sqrt_combine((zero, m, L, jnp.zeros_like(m), zero), elem_j)
        m, L = jnp.where(j < index, m_j, m), jnp.where(j < index, L_j, L)
    return m, L


def _exchange(kf, ys, us, scan: "ShardedScan", chunk: int = _CHUNK):
    """This block's element and `log p(y_s..y_e | x_{s-1} = 0)` (computed `chunk`
    steps at a time), and the filtered state before the block from the elements
    of all the blocks before it."""
    _, index = mesh_axis(scan.axis_name)
    inner = inner_backend(scan)
    first = index == 0
    # the data-dependent whitening is a branch per device; the exchange stays out
    element, ll0 = by_whitening(
        ys,
        inner,
        lambda w: block_element(prepare(kf, ys, us, w), first, inner, kf, chunk),
        remat=True,
    )
    return element, ll0, _filtered_before(element, scan.axis_name, index)


def _finish(kf, ys, us, scan: "ShardedScan", state, whitening):
    """The problem of this block, its step 1 predicted from the filtered `state`
    before it (from the prior on the first device)."""
    first = mesh_axis(scan.axis_name)[1] == 0
    return from_state(prepare(kf, ys, us, whitening), first, *state)


@full_precision
def log_likelihood_sharded(
    kf: "KalmanFilter",
    ys: Array,
    us: Array | None,
    scan: "ShardedScan",
    *,
    chunk: int = _CHUNK,
) -> Array:
    """The whole sequence's log-likelihood: each block's given the filtered state
    before it, in closed form from its element, summed over the devices. `chunk`:
    how many steps of a block's element are computed at a time (a static int; the
    tests pass a short one)."""
    element, ll0, (m, L) = _exchange(kf, ys, us, scan, chunk)
    ll = block_log_likelihood(element, ll0, m, L)
    return lax.psum(ll, scan.axis_name)


@full_precision
def filter_sharded(
    kf: "KalmanFilter", ys: Array, us: Array | None, scan: "ShardedScan"
) -> KalmanFilterResult:
    """The filter of this device's block; the log-likelihood is the whole
    sequence's (summed over the devices)."""
    inner = inner_backend(scan)
    _, _, state = _exchange(kf, ys, us, scan)
    run = lambda w: filter_problem(_finish(kf, ys, us, scan, state, w), inner, kf)
    result = by_whitening(ys, inner, run, remat=True)
    total = lax.psum(result.log_likelihood, scan.axis_name)
    return eqx.tree_at(lambda r: r.log_likelihood, result, total)


def _composite(elements, inner: AbstractScan):
    """The block's smoother elements composed backwards: the map from the state
    after the block to its first state."""
    if inner.parallel:
        combined = inner.associative_scan(jax.vmap(combine), elements, reverse=True)
        return jax.tree.map(lambda x: x[0], combined)

    def step(later, x):
        return combine(later, x), None

    last = jax.tree.map(lambda x: x[-1], elements)
    earlier = jax.tree.map(lambda x: x[:-1], elements)
    composite, _ = lax.scan(step, last, earlier, reverse=True)
    return composite


def _smoothed_after(composite, axis_name: str, index: Array):
    """The smoothed mean and covariance of the state after this device's block: the
    gathered maps of the blocks after it, applied backwards (the last device's has
    `E = 0`, so the start is immaterial)."""
    gathered = lax.all_gather(composite, axis_name)
    m, P = jnp.zeros_like(composite[1]), jnp.zeros_like(composite[2])
    for j in range(gathered[1].shape[0] - 1, 0, -1):
        E, g, C = jax.tree.map(lambda x: x[j], gathered)
        after = j > index
        m = jnp.where(after, E @ m + g, m)
        P = jnp.where(after, _sym(_sandwich(E, P) + C), P)
    return m, P


def _next_first(scan: "ShardedScan", x: Array) -> Array:
    """`x`'s first row on the next device (zeros on the last)."""
    return scan.shift(x[:1], jnp.zeros_like(x[0]), reverse=True)[0]


@full_precision
def smooth_sharded(
    kf: "KalmanFilter", ys: Array, us: Array | None, scan: "ShardedScan"
) -> KalmanSmootherResult:
    """The smoother of this device's block. `cross_covs` has a row per step: the
    last is the covariance with the next block's first state (zero on the last
    device)."""
    num_devices, index = mesh_axis(scan.axis_name)
    inner = inner_backend(scan)
    last = index == num_devices - 1
    _, _, state = _exchange(kf, ys, us, scan)

    def local(whitening):
        problem = _finish(kf, ys, us, scan, state, whitening)
        if inner.parallel:
            filtered, factors = filter_parallel(problem, inner)
        else:
            filtered, factors = filter_exact(problem, square_root=True)
        return filtered, factors, smoother_elements(problem.model, filtered, factors)

    filtered, factors, (E, g, C) = by_whitening(ys, inner, local)
    # the block's last step, given the next block's first
    F, L_Q = kf.F, _factor(kf.Q_factor)
    F = _next_first(scan, F) if _per_step(F, 2) else F
    L_Q = _next_first(scan, L_Q) if _per_step(L_Q, 2) else L_Q
    m_pred = _next_first(scan, filtered.predicted_means)
    boundary = _element(filtered.means[-1], factors[-1], m_pred, F, L_Q)
    E_e, g_e, C_e = jax.tree.map(
        lambda here, b: jnp.where(last, here[-1], b), (E, g, C), boundary
    )
    E, g, C = E.at[-1].set(E_e), g.at[-1].set(g_e), C.at[-1].set(C_e)
    m_after, P_after = _smoothed_after(
        _composite((E, g, C), inner), scan.axis_name, index
    )
    # the last element as the smoothed moments of the block's last step
    g = g.at[-1].set(E_e @ m_after + g_e)
    C = C.at[-1].set(_sym(_sandwich(E_e, P_after) + C_e))
    smoothed = smooth_elements(filtered, (E.at[-1].set(0), g, C), inner)
    cross = jnp.concatenate([smoothed.cross_covs, (E_e @ P_after)[None]])
    total = lax.psum(filtered.log_likelihood, scan.axis_name)
    filtered = eqx.tree_at(lambda r: r.log_likelihood, filtered, total)
    return KalmanSmootherResult(smoothed.means, smoothed.covs, cross, filtered)


def check_sharded(scan: AbstractScan, initialization: str) -> None:
    """The backend check of `KalmanFilter`'s constructors: a backend that splits
    time is taken, but not with a diffuse prior (whose exact first steps are not
    reduced to an element here)."""
    check_scan(
        scan, name="eqx_seq.KalmanFilter", pytree_scan=True,
        splits_time=True,
    )  # fmt: skip
    if splits_time(scan):
        inner_backend(scan)
        if initialization == "diffuse":
            raise ValueError(
                'eqx_seq.KalmanFilter: initialization="diffuse" does not run on a '
                f"time axis split over devices (`{type(scan).__name__}`); use "
                '"known" with a large `P0` (approximately diffuse).'
            )
