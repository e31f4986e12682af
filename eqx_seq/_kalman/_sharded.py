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

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .._misc import full_precision, vary_like
from .._scan import AbstractScan, check_scan, mesh_axis, ShardedScan
from ._dispatch import (
    by_whitening,
    filter_problem,
    steady_applies,
    steady_or_exact,
)
from ._filter import (
    covariances,
    dense_recurrence,
    filter_exact,
    first_factor,
    may_settle,
    predicted_covs,
    run_head,
    sequential_step,
    settle,
    steady_tail,
)
from ._interface import (
    KalmanFilterResult,
    KalmanSmootherResult,
    splits_time,
)
from ._linalg import (
    bmm,
    chol,
    eye_like,
    inverse_cholesky,
    mT,
    sandwich,
    sym,
    tria,
    tria_gram,
    tril_inverse_by_rows,
)
from ._model import (
    Model,
    per_step,
    prepare,
    Problem,
)
from ._parallel import filter_parallel, sqrt_combine
from ._smoother import combine, element, smooth_elements, smoother_elements


# --- a block's filtering element ---
#
# Given the state `x_{s-1}` before block `s..e`, the block's filter is the filter with
# the covariance started at zero, and its means are affine in `x_{s-1}`: `m_t = b_t +
# A_t x_{s-1}`. The element is `(A_e, b_e, U, eta, Z)` in `_parallel.sqrt_combine`'s
# form (`C = U U^T` the last filtered covariance, `J = Z Z^T`), with the information
# `(eta, J)` that the block's observations carry about `x_{s-1}`: the innovations
# given `x_{s-1}` are independent, `nu_t = nu0_t + N_t x_{s-1}`, so `J = sum N_t^T N_t`
# and `eta = -sum N_t^T nu0_t`. See `docs/devdocs/sequence-parallel.md`, "The Kalman
# filter".


# Whether a block, or a chunk of one, starts the whole sequence: traced on a device
# (`index == 0`), `False` for a block's later chunks.
First = Bool[Array, ""] | bool


def from_state(problem: Problem, first: First, m: Array, L: Array) -> Problem:
    """`problem` with step 1 predicted from the filtered state `N(m, L L^T)` before
    the block (from the prior on the first device), as a prior of the block's step 1
    itself (`prior_at="x1"`)."""
    model = problem.model
    before = Model(model.F, model.L_Q, model.H, m, L, prior_at="x0")
    m1, L1 = jax.tree.map(
        lambda a, b: jnp.where(first, a, b),
        first_factor(model, problem.c),
        first_factor(before, problem.c),
    )
    model = Model(model.F, model.L_Q, model.H, m1, L1, prior_at="x1")
    return eqx.tree_at(lambda pr: pr.model, problem, model)


def _columns(problem: Problem, first: First):
    """The `n + 1` mean columns as inputs of `jax.vmap`, and the problem of one
    column: from `0` with the data (column 0), and from each unit vector with the
    data, the controls and the prior mean zeroed (the linear part). Only the means
    are batched: the covariances do not depend on the batched inputs."""
    model, c = problem.model, problem.c
    n, dtype = model.m0.shape[0], problem.yw.dtype
    starts = jnp.concatenate([jnp.zeros((1, n), dtype), jnp.eye(n, dtype=dtype)])
    weights = jnp.zeros((n + 1,), dtype).at[0].set(1)

    def column(start, weight):
        scaled = Model(model.F, model.L_Q, model.H, model.m0 * weight, model.L_P0,
                       prior_at=model.prior_at)  # fmt: skip
        out = eqx.tree_at(
            lambda pr: (pr.model, pr.c, pr.yw),
            problem,
            (scaled, None if c is None else c * weight, problem.yw * weight),
            is_leaf=lambda x: x is None,
        )
        return from_state(out, first, start, jnp.zeros((n, n), dtype))

    return (starts, weights), column


def _information(Hw: Array, Pps: Array, yw: Array, mps: Array):
    """The whitened innovations `nu0_t` of the data column and their derivatives
    `N_t` in `x_{s-1}`, from the columns' predicted means `mps` `(n + 1, T, n)` and
    the predicted covariances `Pps`."""
    S = bmm(bmm(Hw, Pps), mT(Hw))
    W = inverse_cholesky(sym(S) + eye_like(S))
    v0 = yw - jnp.sum(Hw * mps[0][:, None, :], axis=-1)
    nu0 = jnp.sum(W * v0[:, None, :], axis=-1)
    N = -bmm(bmm(W, Hw), jnp.moveaxis(mps[1:], 0, -1))
    return nu0, N


def _exact_element(problem: Problem, first: First, inner: AbstractScan):
    """The element with every step exact: the inner backend's filter under
    `jax.vmap` over the columns, the information summed after it."""
    columns, column = _columns(problem, first)

    def run(start, weight):
        pr = column(start, weight)
        if inner.parallel:
            r = filter_parallel(pr, inner)[0]
        else:
            r = filter_exact(pr, square_root=True)[0]
        return (r.means[-1], r.predicted_means, r.log_likelihood), (
            r.covs[-1],
            r.predicted_covs,
        )

    (ms, mps, lls), (C, Pps) = jax.vmap(run, out_axes=(0, None))(*columns)
    nu0, N = _information(problem.Hw, Pps, problem.yw, mps)
    n = ms.shape[-1]
    eta = -jnp.sum(N * nu0[:, :, None], axis=(0, 1))
    element = (ms[1:].T, ms[0], chol(C), eta, tria_gram(N.reshape(-1, n).T))
    return element, lls[0]


def _powers(Phi: Array, Om: Array, count: int) -> tuple[Array, Array]:
    """`Phi^count` and a factor `R` of `sum_{k < count} (Phi^k)^T Om^T Om Phi^k`, by
    doubling (`count` is static): `log2(count)` small steps, not one per step."""
    n = Phi.shape[0]
    eye = jnp.eye(n, dtype=Phi.dtype)
    power, factor = eye, jnp.zeros((n, n), Phi.dtype)  # the sum over no steps
    block_power, block_factor = Phi, tria_gram(Om.T)  # over one step
    while count:
        if count & 1:  # the block's steps after those accumulated
            factor = tria_gram(jnp.concatenate([factor, power.T @ block_factor], 1))
            power = block_power @ power
        count >>= 1
        if count:
            block_factor = tria_gram(
                jnp.concatenate([block_factor, block_power.T @ block_factor], 1)
            )
            block_power = block_power @ block_power
    return power, factor


def _steady_element(problem: Problem, first: First):
    """The element of a time-invariant model with complete data: `K` exact steps
    of the columns, then, once the covariance has settled, the steady-state filter
    (`_filter.steady_tail`) for the data column alone. There the linear part is
    `A_t = Phi^(t-K) A_K` with the closed loop `Phi = M F`, and the innovations'
    derivatives `N_t = E_m F A_{t-1}`, so the tail's information is a sum over
    powers of `Phi` (by doubling) and one reverse recurrence over the data
    column's innovations. Also returns whether the covariance settled."""
    model = problem.model
    columns, column = _columns(problem, first)
    dtype = problem.yw.dtype

    def head(start, weight):
        pr = column(start, weight)
        steps, xs, _ = sequential_step(pr, square_root=True, complete=True)
        init = (pr.model.m0, pr.model.L_P0)
        (ms, Ss, mps, lls), (m, S), _ = run_head(steps[False], init, xs, dtype)
        return (m, mps, lls), (S, Ss, pr.model.L_P0)

    (m_K, mps_h, lls_h), (S_K, Ss, L1) = jax.vmap(head, out_axes=(0, None))(*columns)
    K = mps_h.shape[1]
    Hw = sequential_step(problem, square_root=True, complete=True)[2]
    settled = settle(model, m_K[0], S_K, Hw, True)
    # the head's information, from its predicted covariances
    first_model = Model(model.F, model.L_Q, model.H, m_K[0], L1, prior_at="x1")
    Pps = predicted_covs(first_model, covariances(Ss, True))
    nu0_h, N_h = _information(problem.Hw[:K], Pps, problem.yw[:K], mps_h)
    # the data column's tail: the steady-state filter
    tail = {"y": problem.yw[K:]}
    if problem.c is not None:
        tail["c"] = problem.c[K:]
    ms, _, mps, _, lls = steady_tail(model, settled, m_K[0], tail)
    nu0 = mps @ settled.E_m.T + tail["y"] @ settled.E_y.T
    Phi, Om = settled.M @ model.F, settled.E_m @ model.F
    A_K = m_K[1:].T
    power, R = _powers(Phi, Om, ms.shape[0])
    n = A_K.shape[0]
    u = (nu0 @ Om)[::-1]
    r = dense_recurrence(Phi.T, u, vary_like(jnp.zeros((n,), dtype), u))[-1]
    eta = -jnp.sum(N_h * nu0_h[:, :, None], axis=(0, 1)) - A_K.T @ r
    Z = tria_gram(jnp.concatenate([N_h.reshape(-1, n).T, A_K.T @ R], axis=1))
    ll0 = jnp.sum(lls_h[0]) + jnp.sum(lls) - jnp.sum(problem.logdet)
    return ((power @ A_K, ms[-1], settled.S_filt, eta, Z), ll0), settled.ok


def block_log_likelihood(element, ll0: Array, m: Array, L: Array) -> Array:
    """`log p(y_s..y_e | y_1..y_{s-1})` from `log p(y_s..y_e | x_{s-1} = 0)` and
    the information `(eta, J = Z Z^T)` of the block about `x_{s-1}`, with
    `x_{s-1} ~ N(m, L L^T)`: `ll0 + eta^T m - m^T J m / 2 - log|I + L^T J L| / 2 +
    |Xi^{-1} L^T (eta - J m)|^2 / 2`, where `Xi Xi^T = I + L^T J L`."""
    _, _, _, eta, Z = element
    n = m.shape[0]
    Xi = tria(jnp.concatenate([L.T @ Z, jnp.eye(n, dtype=m.dtype)], axis=1))
    Zm = Z.T @ m
    h = tril_inverse_by_rows(Xi) @ (L.T @ (eta - Z @ Zm))
    log_det = jnp.sum(jnp.log(jnp.diagonal(Xi)))
    return ll0 + eta @ m - 0.5 * Zm @ Zm - log_det + 0.5 * h @ h


def _combine_blocks(earlier, later):
    """The element over `(i, k]` from those over `(i, j]` and `(j, k]`, with
    `log p(y | x_i = 0)`: given `x_i = 0`, the earlier element's `N(b, U U^T)` is
    the prior of `x_j`, under which the later one's log-likelihood is closed
    form."""
    (e_i, ll_i), (e_j, ll_j) = earlier, later
    return sqrt_combine(e_i, e_j), ll_i + block_log_likelihood(e_j, ll_j, *e_i[1:3])


def _whole_element(
    problem: Problem, first: First, inner: AbstractScan, steady_state: bool
):
    """The element of `problem` whole: with a sequential backend and a problem that
    may settle, the steady-state element where the covariance settles (a
    `lax.cond`, exact otherwise, as the filter's own fallback); else every step
    exact."""
    if inner.parallel or not (steady_state and may_settle(problem)):
        return _exact_element(problem, first, inner)
    steady, ok = _steady_element(problem, first)
    # rematerialised: under reverse mode a `cond` keeps the residuals of both
    # branches, and the exact branch's grow with the block
    exact = jax.checkpoint(lambda pr, f: _exact_element(pr, f, inner))
    return lax.cond(ok, lambda: steady, lambda: exact(problem, first))


def _split_time(problem: Problem, head: int, chunk: int):
    """`problem`'s first `head` steps, and the rest as chunks of `chunk` steps
    stacked on a leading axis (a function of one chunk's arrays to its problem)."""
    model = problem.model
    by_step = {
        "obs": problem.obs, "logdet": problem.logdet, "yw": problem.yw,
        "c": problem.c,
        "W": problem.W if per_step(problem.W, 2) else None,
        "F": model.F if per_step(model.F, 2) else None,
        "L_Q": model.L_Q if per_step(model.L_Q, 2) else None,
        "H": model.H if per_step(model.H, 2) else None,
    }  # fmt: skip
    by_step = {k: v for k, v in by_step.items() if v is not None}

    def build(x):
        get = lambda name, default: x[name] if name in x else default
        md = Model(get("F", model.F), get("L_Q", model.L_Q), get("H", model.H),
                   model.m0, model.L_P0, prior_at=model.prior_at)  # fmt: skip
        return Problem(md, x.get("c"), x["obs"], get("W", problem.W), x["logdet"],
                       x["yw"])  # fmt: skip

    first = build({k: v[:head] for k, v in by_step.items()})
    rest = {k: v[head:].reshape(-1, chunk, *v.shape[1:]) for k, v in by_step.items()}
    return first, rest, build


# Steps per chunk of a block's element: the element is computed a chunk at a time
# and the chunks' elements combined in a loop, so that its per-step buffers (the
# mean columns, the predicted covariances) and the gradient's residuals stay a
# chunk long whatever the block's length.
_CHUNK = 4096


def block_element(
    problem: Problem,
    first: First,
    inner: AbstractScan,
    steady_state: bool,
    chunk: int = _CHUNK,
):
    """The block's element and `log p(y_s..y_e | x_{s-1} = 0)`, `chunk` steps at a
    time (a static int, `_CHUNK` but in the tests; a block shorter than two chunks
    is one): the first chunk (the first device's with the prior folded in), then
    the others' elements combined with it in order."""
    T = problem.num_steps
    if T < 2 * chunk:
        return _whole_element(problem, first, inner, steady_state)
    head = T - (T // chunk - 1) * chunk  # between one and two chunks
    head_problem, rest, build = _split_time(problem, head, chunk)

    @jax.checkpoint
    def step(acc, x):
        block = _whole_element(build(x), False, inner, steady_state)
        return _combine_blocks(acc, block), None

    first_block = _whole_element(head_problem, first, inner, steady_state)
    return lax.scan(step, first_block, rest)[0]


# --- the filter and the smoother of the blocks ---


def inner_backend(scan: ShardedScan) -> AbstractScan:
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
        _, m_j, L_j, _, _ = sqrt_combine((zero, m, L, jnp.zeros_like(m), zero), elem_j)
        m, L = jnp.where(j < index, m_j, m), jnp.where(j < index, L_j, L)
    return m, L


def _exchange(model: Model, ys, us, scan: ShardedScan, chunk: int = _CHUNK):
    """This block's element and `log p(y_s..y_e | x_{s-1} = 0)` (computed `chunk`
    steps at a time), and the filtered state before the block from the elements
    of all the blocks before it."""
    _, index = mesh_axis(scan.axis_name)
    inner = inner_backend(scan)
    first = index == 0
    # the data-dependent whitening is a branch per device; the exchange stays out
    exact = lambda w: block_element(
        prepare(model, ys, us, w), first, inner, model.steady_state, chunk
    )
    if steady_applies(model, ys, inner) and ys.shape[0] < 2 * chunk:
        steady = lambda: _steady_element(prepare(model, ys, us, "complete"), first)
        element, ll0 = steady_or_exact(ys, steady, exact, remat=True)
    else:
        element, ll0 = by_whitening(ys, inner, exact, remat=True)
    return element, ll0, _filtered_before(element, scan.axis_name, index)


def _finish(model: Model, ys, us, scan: ShardedScan, state, whitening):
    """The problem of this block, its step 1 predicted from the filtered `state`
    before it (from the prior on the first device)."""
    first = mesh_axis(scan.axis_name)[1] == 0
    return from_state(prepare(model, ys, us, whitening), first, *state)


@full_precision
def log_likelihood_sharded(
    model: Model,
    ys: Array,
    us: Array | None,
    scan: ShardedScan,
    *,
    chunk: int = _CHUNK,
) -> Array:
    """The whole sequence's log-likelihood: each block's given the filtered state
    before it, in closed form from its element, summed over the devices. `chunk`:
    how many steps of a block's element are computed at a time (a static int; the
    tests pass a short one)."""
    element, ll0, (m, L) = _exchange(model, ys, us, scan, chunk)
    ll = block_log_likelihood(element, ll0, m, L)
    return lax.psum(ll, scan.axis_name)


@full_precision
def filter_sharded(
    model: Model, ys: Array, us: Array | None, scan: ShardedScan
) -> KalmanFilterResult:
    """The filter of this device's block; the log-likelihood is the whole
    sequence's (summed over the devices)."""
    inner = inner_backend(scan)
    _, _, state = _exchange(model, ys, us, scan)
    switches = dict(steady_state=model.steady_state, square_root=model.square_root)
    run = lambda w: filter_problem(
        _finish(model, ys, us, scan, state, w), inner, **switches
    )
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
        P = jnp.where(after, sym(sandwich(E, P) + C), P)
    return m, P


def _next_first(scan: ShardedScan, x: Array) -> Array:
    """`x`'s first row on the next device (zeros on the last)."""
    return scan.shift(x[:1], jnp.zeros_like(x[0]), reverse=True)[0]


@full_precision
def smooth_sharded(
    model: Model, ys: Array, us: Array | None, scan: ShardedScan
) -> KalmanSmootherResult:
    """The smoother of this device's block. `cross_covs` has a row per step: the
    last is the covariance with the next block's first state (zero on the last
    device)."""
    num_devices, index = mesh_axis(scan.axis_name)
    inner = inner_backend(scan)
    last = index == num_devices - 1
    _, _, state = _exchange(model, ys, us, scan)

    def local(whitening):
        problem = _finish(model, ys, us, scan, state, whitening)
        if inner.parallel:
            filtered, factors = filter_parallel(problem, inner)
        else:
            filtered, factors = filter_exact(problem, square_root=True)
        return filtered, factors, smoother_elements(problem.model, filtered, factors)

    filtered, factors, (E, g, C) = by_whitening(ys, inner, local)
    # the block's last step, given the next block's first
    F, L_Q = model.F, model.L_Q
    F = _next_first(scan, F) if per_step(F, 2) else F
    L_Q = _next_first(scan, L_Q) if per_step(L_Q, 2) else L_Q
    m_pred = _next_first(scan, filtered.predicted_means)
    boundary = element(filtered.means[-1], factors[-1], m_pred, F, L_Q)
    E_e, g_e, C_e = jax.tree.map(
        lambda here, b: jnp.where(last, here[-1], b), (E, g, C), boundary
    )
    E, g, C = E.at[-1].set(E_e), g.at[-1].set(g_e), C.at[-1].set(C_e)
    m_after, P_after = _smoothed_after(
        _composite((E, g, C), inner), scan.axis_name, index
    )
    # the last element as the smoothed moments of the block's last step
    g = g.at[-1].set(E_e @ m_after + g_e)
    C = C.at[-1].set(sym(sandwich(E_e, P_after) + C_e))
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
