"""A block's filtering element, for the filter split over devices (`_sharded`).

Given the state `x_{s-1}` before block `s..e`, the block's filter is the filter with
the covariance started at zero, and its means are affine in `x_{s-1}`: `m_t = b_t +
A_t x_{s-1}`. The element is `(A_e, b_e, U, eta, Z)` in `_parallel._sqrt_combine`'s
form (`C = U U^T` the last filtered covariance, `J = Z Z^T`), with the information
`(eta, J)` that the block's observations carry about `x_{s-1}`: the innovations
given `x_{s-1}` are independent, `nu_t = nu0_t + N_t x_{s-1}`, so `J = sum N_t^T N_t`
and `eta = -sum N_t^T nu0_t`. See `docs/devdocs/sequence-parallel.md`, "The Kalman
filter".
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import vary_like
from .._scan import AbstractScan
from ._linalg import (
    _bmm,
    _chol,
    _eye_like,
    _mT,
    _sym,
    inverse_cholesky,
    tria,
    tria_gram,
    tril_inverse_by_rows,
)
from ._parallel import _sqrt_combine, filter_parallel
from ._problem import _Model, _per_step, _Problem
from ._sequential import filter_exact
from ._steady import _dense_recurrence, _head, _may_settle, _settle, _steady_tail
from ._step import _covariances, _predicted_covs, _sequential_step, first_factor


def from_state(problem: _Problem, first: Array, m: Array, L: Array) -> _Problem:
    """`problem` with step 1 predicted from the filtered state `N(m, L L^T)` before
    the block (from the prior on the first device), as a prior of the block's step 1
    itself (`prior_at="x1"`)."""
    model = problem.model
    before = _Model(model.F, model.L_Q, model.H, m, L, prior_at="x0")
    m1, L1 = jax.tree.map(
        lambda a, b: jnp.where(first, a, b),
        first_factor(model, problem.c),
        first_factor(before, problem.c),
    )
    model = _Model(model.F, model.L_Q, model.H, m1, L1, prior_at="x1")
    return eqx.tree_at(lambda pr: pr.model, problem, model)


def _columns(problem: _Problem, first: Array):
    """The `n + 1` mean columns as inputs of `jax.vmap`, and the problem of one
    column: from `0` with the data (column 0), and from each unit vector with the
    data, the controls and the prior mean zeroed (the linear part). Only the means
    are batched: the covariances do not depend on the batched inputs."""
    model, c = problem.model, problem.c
    n, dtype = model.m0.shape[0], problem.yw.dtype
    starts = jnp.concatenate([jnp.zeros((1, n), dtype), jnp.eye(n, dtype=dtype)])
    weights = jnp.zeros((n + 1,), dtype).at[0].set(1)

    def column(start, weight):
        scaled = _Model(model.F, model.L_Q, model.H, model.m0 * weight, model.L_P0,
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
    S = _bmm(_bmm(Hw, Pps), _mT(Hw))
    W = inverse_cholesky(_sym(S) + _eye_like(S))
    v0 = yw - jnp.sum(Hw * mps[0][:, None, :], axis=-1)
    nu0 = jnp.sum(W * v0[:, None, :], axis=-1)
    N = -_bmm(_bmm(W, Hw), jnp.moveaxis(mps[1:], 0, -1))
    return nu0, N


def _exact_element(problem: _Problem, first: Array, inner: AbstractScan):
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
    element = (ms[1:].T, ms[0], _chol(C), eta, tria_gram(N.reshape(-1, n).T))
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


def _steady_element(problem: _Problem, first: Array):
    """The element of a time-invariant model with complete data: `K` exact steps
    of the columns, then, once the covariance has settled, the steady-state filter
    (`_steady`) for the data column alone. There the linear part is
    `A_t = Phi^(t-K) A_K` with the closed loop `Phi = M F`, and the innovations'
    derivatives `N_t = E_m F A_{t-1}`, so the tail's information is a sum over
    powers of `Phi` (by doubling) and one reverse recurrence over the data
    column's innovations. Also returns whether the covariance settled."""
    model = problem.model
    columns, column = _columns(problem, first)
    dtype = problem.yw.dtype

    def head(start, weight):
        pr = column(start, weight)
        steps, xs, _ = _sequential_step(pr, square_root=True, complete=True)
        init = (pr.model.m0, pr.model.L_P0)
        (ms, Ss, mps, lls), (m, S), _ = _head(steps[False], init, xs, dtype)
        return (m, mps, lls), (S, Ss, pr.model.L_P0)

    (m_K, mps_h, lls_h), (S_K, Ss, L1) = jax.vmap(head, out_axes=(0, None))(*columns)
    K = mps_h.shape[1]
    Hw = _sequential_step(problem, square_root=True, complete=True)[2]
    settled = _settle(model, m_K[0], S_K, Hw, True)
    # the head's information, from its predicted covariances
    first_model = _Model(model.F, model.L_Q, model.H, m_K[0], L1, prior_at="x1")
    Pps = _predicted_covs(first_model, _covariances(Ss, True))
    nu0_h, N_h = _information(problem.Hw[:K], Pps, problem.yw[:K], mps_h)
    # the data column's tail: the steady-state filter
    tail = {"y": problem.yw[K:]}
    if problem.c is not None:
        tail["c"] = problem.c[K:]
    ms, _, mps, _, lls = _steady_tail(model, settled, m_K[0], tail)
    nu0 = mps @ settled.E_m.T + tail["y"] @ settled.E_y.T
    Phi, Om = settled.M @ model.F, settled.E_m @ model.F
    A_K = m_K[1:].T
    power, R = _powers(Phi, Om, ms.shape[0])
    n = A_K.shape[0]
    u = (nu0 @ Om)[::-1]
    r = _dense_recurrence(Phi.T, u, vary_like(jnp.zeros((n,), dtype), u))[-1]
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


def _combine(earlier, later):
    """The element over `(i, k]` from those over `(i, j]` and `(j, k]`, with
    `log p(y | x_i = 0)`: given `x_i = 0`, the earlier element's `N(b, U U^T)` is
    the prior of `x_j`, under which the later one's log-likelihood is closed
    form."""
    (e_i, ll_i), (e_j, ll_j) = earlier, later
    return _sqrt_combine(e_i, e_j), ll_i + block_log_likelihood(e_j, ll_j, *e_i[1:3])


def _element(problem: _Problem, first: Array, inner: AbstractScan, kf):
    """The element of `problem` whole: with a sequential backend and a problem that
    may settle, the steady-state element where the covariance settles (a
    `lax.cond`, exact otherwise, as the filter's own fallback); else every step
    exact."""
    if inner.parallel or not (kf._steady_state and _may_settle(problem)):
        return _exact_element(problem, first, inner)
    steady, ok = _steady_element(problem, first)
    # rematerialised: under reverse mode a `cond` keeps the residuals of both
    # branches, and the exact branch's grow with the block
    exact = jax.checkpoint(lambda pr, f: _exact_element(pr, f, inner))
    return lax.cond(ok, lambda: steady, lambda: exact(problem, first))


def _split_time(problem: _Problem, head: int, chunk: int):
    """`problem`'s first `head` steps, and the rest as chunks of `chunk` steps
    stacked on a leading axis (a function of one chunk's arrays to its problem)."""
    model = problem.model
    per_step = {
        "obs": problem.obs, "logdet": problem.logdet, "yw": problem.yw,
        "c": problem.c,
        "W": problem.W if _per_step(problem.W, 2) else None,
        "F": model.F if _per_step(model.F, 2) else None,
        "L_Q": model.L_Q if _per_step(model.L_Q, 2) else None,
        "H": model.H if _per_step(model.H, 2) else None,
    }  # fmt: skip
    per_step = {k: v for k, v in per_step.items() if v is not None}

    def build(x):
        get = lambda name, default: x[name] if name in x else default
        md = _Model(get("F", model.F), get("L_Q", model.L_Q), get("H", model.H),
                    model.m0, model.L_P0, prior_at=model.prior_at)  # fmt: skip
        return _Problem(md, x.get("c"), x["obs"], get("W", problem.W), x["logdet"],
                        x["yw"])  # fmt: skip

    first = build({k: v[:head] for k, v in per_step.items()})
    rest = {k: v[head:].reshape(-1, chunk, *v.shape[1:]) for k, v in per_step.items()}
    return first, rest, build


# Steps per chunk of a block's element: the element is computed a chunk at a time
# and the chunks' elements combined in a loop, so that its per-step buffers (the
# mean columns, the predicted covariances) and the gradient's residuals stay a
# chunk long whatever the block's length.
_CHUNK = 4096


def block_element(
    problem: _Problem, first: Array, inner: AbstractScan, kf, chunk: int = _CHUNK
):
    """The block's element and `log p(y_s..y_e | x_{s-1} = 0)`, `chunk` steps at a
    time (a static int, `_CHUNK` but in the tests; a block shorter than two chunks
    is one): the first chunk (the first device's with the prior folded in), then
    the others' elements combined with it in order."""
    T = problem.num_steps
    if T < 2 * chunk:
        return _element(problem, first, inner, kf)
    head = T - (T // chunk - 1) * chunk  # between one and two chunks
    head_problem, rest, build = _split_time(problem, head, chunk)

    @jax.checkpoint
    def step(acc, x):
        return _combine(acc, _element(build(x), False, inner, kf)), None

    return lax.scan(step, _element(head_problem, first, inner, kf), rest)[0]
