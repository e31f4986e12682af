"""The iterated smoothers: iterated posterior linearisation around a trajectory.

Linearise the model about the current smoothed trajectory (Taylor about the means:
the iterated extended Kalman smoother, a Gauss-Newton method for the MAP
trajectory; statistical linear regression about the smoothed Gaussians: the
iterated posterior linearisation smoother), smooth the linearised *linear,
time-varying* model with the linear layer's smoother on whatever backend runs it
(sequential, parallel in time, or split over devices), and repeat until the means
stop moving (Bell 1994; Garcia-Fernandez, Svensson & Sarkka 2017; in parallel,
Yaghoobi, Corenflos, Hassan & Sarkka 2021).

The linearised model is a linear `_kalman.Model` whose offsets `b_t` (transition)
and `d_t` (observation) enter as controls `u_t = [b_t, d_t]` with `B = [I, 0]` and
`D = [0, I]`, so that every linear smoother runs it as it is.

Derivatives of the converged smoother go through the fixed point `x* = G(x*)`
(`G`: linearise about `x`, smooth), by the implicit function theorem
(`jax.lax.custom_root`), never through the iterations: the tangent system
`(I - dG/dx) z = v` is solved by the same fixed-point iteration, which contracts
at the rate of the smoother's own iteration. See `docs/devdocs/nonlinear.md`.
"""

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._kalman._dispatch import smooth_problem
from .._kalman._interface import KalmanSmootherResult, splits_time
from .._kalman._linalg import cholesky, gram, jittered, mT, sym, tria
from .._kalman._model import Model, per_step, prepare
from .._kalman._sharded import smooth_sharded
from .._kalman._smoother import element
from .._misc import full_precision
from .._scan import AbstractScan
from ._filter import at, NonlinearModel
from ._linearize import linearize, SigmaPoints


# The fixed-point variable: the smoothed means of this block's steps, and the
# linearisation point of the block's first transition (the smoothed `x_0` on the
# first block with `prior_at="x0"`, else the previous block's last state); with
# sigma points, their covariances too.
Trajectory = dict[str, Array]


def _factors(P: Array) -> Array:
    return cholesky(jittered(P))


def linearized(
    model: NonlinearModel,
    traj: Trajectory,
    us: Array | None,
    points: SigmaPoints | None,
    scan: AbstractScan,
) -> tuple[Model, Array]:
    """The linear model of `model` linearised about `traj`, and its controls (the
    offsets `[b_t, d_t]`)."""
    means = traj["means"]
    prev = scan.shift(means, traj["first_mean"])
    n, p = model.state_size, model.obs_size
    dtype = means.dtype
    if points is None:
        L_prev = L_here = jnp.zeros((means.shape[0], 0, 0), dtype)  # unread
    else:
        L_here = _factors(traj["covs"])
        L_prev = scan.shift(L_here, _factors(traj["first_cov"]))
    u_axis = None if us is None else 0

    def one(m_prev, L_prev, m, L, u):
        A, b, S_lam = linearize(at(model.f, u), m_prev, L_prev, points)
        H, d, S_om = linearize(at(model.h, u), m, L, points)
        return A, b, S_lam, H, d, S_om

    A, b, S_lam, H, d, S_om = jax.vmap(one, in_axes=(0, 0, 0, 0, u_axis))(
        prev, L_prev, means, L_here, us
    )
    L_Q, L_R = model.L_Q, model.L_R
    if S_lam is not None:  # sigma points: the regression residuals are noise
        L_Q = _with_residuals(L_Q, S_lam)
        L_R = _with_residuals(L_R, S_om)
    eye_n, eye_p = jnp.eye(n, dtype=dtype), jnp.eye(p, dtype=dtype)
    linear = Model(
        F=A,
        L_Q=L_Q,
        H=H,
        m0=model.m0,
        L_P0=model.L_P0,
        prior_at=model.prior_at,
        L_R=L_R,
        B=jnp.concatenate([eye_n, jnp.zeros((n, p), dtype)], axis=1),
        D=jnp.concatenate([jnp.zeros((p, n), dtype), eye_p], axis=1),
        steady_state=False,
    )
    return linear, jnp.concatenate([b, d], axis=1)


def _with_residuals(L: Array, S: Array) -> Array:
    """Per-step square factors of `L L^T + S S^T`."""
    L = jnp.broadcast_to(L, (S.shape[0], *L.shape[-2:])) if not per_step(L, 2) else L
    return tria(jnp.concatenate([L, S], axis=-1))


def smooth_once(
    model: NonlinearModel,
    ys: Array,
    us: Array | None,
    traj: Trajectory,
    points: SigmaPoints | None,
    scan: AbstractScan,
) -> tuple[Trajectory, KalmanSmootherResult]:
    """`G(traj)`: the smoother of the model linearised about `traj`, and the
    trajectory it gives."""
    linear, offsets = linearized(model, traj, us, points, scan)
    if splits_time(scan):
        result = smooth_sharded(linear, ys, offsets, scan)
    else:
        # whitened per step whatever the data (one program, not a `lax.cond` of
        # two): the sigma-point linearisations make `R` vary with time anyway
        result = smooth_problem(prepare(linear, ys, offsets, "missing"), scan)
    # the smoothed x_0 (prior_at="x0"): one more backward step, from x_1's
    if model.prior_at == "x0":
        A1 = linear.F[0]
        L_Q1 = linear.L_Q[0] if per_step(linear.L_Q, 2) else linear.L_Q
        m_pred = A1 @ model.m0 + offsets[0, : model.state_size]
        E, g, C = element(model.m0, model.L_P0, m_pred, A1, L_Q1)
        m0s = E @ result.means[0] + g
        P0s = sym(E @ result.covs[0] @ mT(E) + C)
    else:
        m0s, P0s = model.m0, gram(model.L_P0)
    new = {
        "means": result.means,
        "first_mean": scan.shift(result.means[-1:], m0s)[0],
    }
    if "covs" in traj:
        new["covs"] = result.covs
        new["first_cov"] = scan.shift(result.covs[-1:], P0s)[0]
    return new, result


def _global_max(x: Array, scan: AbstractScan) -> Array:
    """`max(x)` over this block, and over the devices when time is split."""
    m = jnp.max(x)
    return lax.pmax(m, scan.axis_name) if splits_time(scan) else m


def _size(traj: Trajectory, scan: AbstractScan) -> Array:
    return 1 + _global_max(jnp.abs(traj["means"]), scan)


def _step_size(dx: Trajectory, scan: AbstractScan) -> Array:
    """The largest change of a mean, over all steps (and the first state)."""
    return jnp.maximum(
        _global_max(jnp.abs(dx["means"]), scan),
        _global_max(jnp.abs(dx["first_mean"]), scan),
    )


@full_precision
def smooth_iterated(
    model: NonlinearModel,
    ys: Array,
    us: Array | None,
    init: Trajectory,
    points: SigmaPoints | None,
    scan: AbstractScan,
    tol: float,
    max_iter: int,
) -> tuple[KalmanSmootherResult, Array, Array]:
    """The iterated smoother from the trajectory `init`: the smoother of the model
    linearised about its fixed point, the number of iterations and whether they
    converged (the largest change of a mean at most `tol * (1 + max |mean|)`)."""

    def f(traj):
        new, _ = smooth_once(model, ys, us, traj, points, scan)
        return jax.tree.map(jnp.subtract, new, traj)

    def solve(_, traj):
        def cond(carry):
            _, k, done = carry
            return (k < max_iter) & ~done

        def body(carry):
            traj, k, _ = carry
            # `G(x)` itself, not `x + f(x)`: a vague prior's covariance would
            # cancel against the next pass's (`f` is for the derivatives)
            new, _ = smooth_once(model, ys, us, traj, points, scan)
            dx = jax.tree.map(jnp.subtract, new, traj)
            done = _step_size(dx, scan) <= tol * _size(new, scan)
            return new, k + 1, done

        start = (traj, jnp.zeros((), jnp.int32), jnp.zeros((), bool))
        traj, k, done = lax.while_loop(cond, body, start)
        # floating diagnostics: `custom_root` gives the aux zero tangents of its
        # own dtype, which integers and booleans may not have
        dtype = traj["means"].dtype
        return traj, (k.astype(dtype), done.astype(dtype))

    def iterate(g, v):
        # g(z) = v for g = dG/dx - I (or its transpose) as z = dG/dx z - v
        # = z + g(z) - v, the iteration that contracts as the smoother's own does
        # near its fixed point
        def cond(carry):
            _, k, done = carry
            return (k < max_iter) & ~done

        def body(carry):
            z, k, _ = carry
            r = jax.tree.map(jnp.subtract, g(z), v)
            z = jax.tree.map(jnp.add, z, r)
            done = _step_size(r, scan) <= tol * _size(z, scan)
            return z, k + 1, done

        z0 = jax.tree.map(jnp.negative, v)
        start = (z0, jnp.zeros((), jnp.int32), jnp.zeros((), bool))
        return lax.while_loop(cond, body, start)[0]

    def tangent_solve(g, v):
        # a linear solve whose transpose is the same iteration on the transposed
        # map: reverse mode transposes the solve, never the loop
        return lax.custom_linear_solve(g, v, iterate, transpose_solve=iterate)

    init = lax.stop_gradient(init)
    traj, (k, done) = lax.custom_root(f, init, solve, tangent_solve, has_aux=True)
    _, result = smooth_once(model, ys, us, traj, points, scan)
    k, done = lax.stop_gradient((k, done))
    return result, k.astype(jnp.int32), done > 0
