"""Expectation-maximisation for `KalmanFilter.fit_em`.

Each iteration runs the smoother on every sequence (the E-step; for complete data
and a time-invariant model, the steady-state filter's sums, `_smooth_steady`),
turns its moments into the expected sufficient statistics of three linear
regressions with Gaussian noise (`x_0` on 1 for `m0, P0`; `x_t` on
`[x_{t-1}; u_t]` for `[F B], Q`; `y_t` on `[x_t; u_t]` for `[H D], R`), and solves
each in closed form (the M-step). Missing entries of `y_t` are latent too, with
their conditional moments given `x_t` and the observed entries. Entries held fixed
make a coefficient's M-step a weighted least squares on its free entries. See
`docs/devdocs/kalman.md`, "Expectation-maximisation".
"""

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array

from .._misc import error_if_any, full_precision
from .._scan import AbstractScan
from ._dispatch import by_whitening, smooth_problem
from ._em_spec import _Fixed, _WHERE, as_array
from ._linalg import (
    _bmm,
    _cho_solve,
    _chol,
    _eye_like,
    _factor,
    _gram,
    _mT,
    _sym,
    _unfactor,
    tria,
    tril_inverse_by_rows,
)
from ._problem import _bt, _Model, _model, _Problem, prepare
from ._smooth_steady import _SmoothedSums, smoothed_sums_steady
from ._steady import _may_settle


if TYPE_CHECKING:
    from ._layer import KalmanFilter


class _Moments(eqx.Module):
    """The expected sufficient statistics of a regression of targets `y` on
    regressors `z`, per sequence: the posterior means `my` `(T, d)` and `mz`
    `(T, k)` of every step, and the posterior covariances `Vyy`, `Vyz`, `Vzz`,
    summed over the steps, or per step (a leading `T`) where a coefficient held
    fixed varies with time. `E[y z^T]` at a step is `Vyz + my mz^T`."""

    my: Array
    mz: Array
    Vyy: Array
    Vyz: Array
    Vzz: Array


def _pad(V: Array, rows: int, cols: int) -> Array:
    """`V` with zero rows and columns appended up to `(rows, cols)` (the controls',
    which are known)."""
    pad = [(0, 0)] * (V.ndim - 2) + [(0, rows - V.shape[-2]), (0, cols - V.shape[-1])]
    return jnp.pad(V, pad)


def _with_controls(x: Array, us: Array | None) -> Array:
    return x if us is None else jnp.concatenate([x, us], axis=-1)


def _smoothed_x0(model: _Model, m1: Array, P1: Array, c1: Array | None):
    """The smoothed moments of `x_0`, the state before the first observation, and
    `Cov[x_0, x_1 | y]`: one RTS step back from the smoothed `x_1`, whose
    prediction from the prior has no data in between, `x_0 | x_1 ~ N(J x_1 + g,
    C)`. `C` in information form, `C^{-1} = P0^{-1} + F^T Q^{-1} F` (a sum; from
    the triangularisation of the factors' inverses), `J = C F^T Q^{-1}` and `g = C
    P0^{-1} m0 - J B u_1`: the covariance form, `J = P0 F^T S_1^{-1}` and `C = (I -
    J F) P0 (I - J F)^T + J Q J^T`, cancels in `I - J F` where the prior is vague
    (with `P0 = 1e6 I`, float32's smoothed `P0` came out 0.3% of its variances
    off, and its square-root element no better). `c1 = B u_1` as `(1, n)`."""
    F = model.F[0] if model.F.ndim == 3 else model.F
    L_Q = model.L_Q[0] if model.L_Q.ndim == 3 else model.L_Q
    W0 = tril_inverse_by_rows(model.L_P0)
    WQF = tril_inverse_by_rows(L_Q)  # then W_Q F, W_Q^T W_Q = Q^{-1}
    WQ, WQF = WQF, WQF @ F
    U = tria(jnp.concatenate([W0.T, WQF.T], axis=1))  # U U^T = C^{-1}
    Y = _mT(tril_inverse_by_rows(U))  # Y Y^T = C
    C = Y @ Y.T
    J = C @ (WQF.T @ WQ)
    g = C @ (W0.T @ (W0 @ model.m0))
    if c1 is not None:
        g = g - J @ c1[0]
    return J @ m1 + g, _sym(J @ P1 @ J.T + C), J @ P1


def _completed_observations(
    problem: _Problem, ms, Ps, ys, us, L_R, D, per_step, complete
):
    """The moments of the completed observations `y_t` (missing entries latent)
    from the smoothed means `ms` and covariances `Ps`: their means `(T, p)`, and
    the covariances `Cov[y_t]` and `Cov[y_t, x_t]` (summed over the steps unless
    `per_step`).

    Given `x_t` and the observed entries, `y_t = H x_t + D u_t + K_t (w_t - W_t H
    x_t) + eta_t` with `K_t = R W_t^T`, `w_t` the whitened observed entries and
    `eta_t ~ N(0, R - K_t W_t R)`, the conditional law of the missing entries
    (`K_t W_t = R Pi_t`, `Pi_t` the inverse of `R` on the observed entries,
    padded with zeros). With complete data `y_t` is known.
    """
    T, p = ys.shape
    n = problem.model.m0.shape[0]
    if complete:
        shape = (T,) if per_step else ()
        zeros = lambda *s: jnp.zeros((*shape, *s), ys.dtype)
        return ys, zeros(p, p), zeros(p, n)
    W = _bt(problem.W, T)
    R = _bt(_gram(L_R), T)
    H = _bt(problem.model.H, T)
    K = _bmm(R, _mT(W))
    Hw = _bmm(W, H)
    w = problem.yw - jnp.einsum("tpn,tn->tp", Hw, ms)
    my = jnp.einsum("tpn,tn->tp", H, ms) + jnp.einsum("tpq,tq->tp", K, w)
    if D is not None:
        my = my + us @ D.T
    A = H - _bmm(K, Hw)  # the missing entries' dependence on x_t
    Vyx = _bmm(A, Ps)
    Vyy = _bmm(Vyx, _mT(A)) + R - _bmm(_bmm(K, W), R)
    if not per_step:
        Vyx, Vyy = jnp.sum(Vyx, axis=0), jnp.sum(Vyy, axis=0)
    return my, _sym(Vyy), Vyx


def _smoothed(kf: "KalmanFilter", ys, us, scan: AbstractScan, per_step: bool):
    """The smoother's statistics (summed over the steps unless `per_step`) and the
    completed observations' moments. For a time-invariant model with complete data
    the sums come from the steady-state filter (`_smooth_steady`) where it settles
    and the smoother converges, else from the smoother."""
    L_R = _factor(kf.R_factor)

    def exact(problem, complete):
        sm = smooth_problem(problem, scan)
        ms, Ps, cross = sm.means, sm.covs, sm.cross_covs
        obs = _completed_observations(
            problem, ms, Ps, ys, us, L_R, kf.D, per_step, complete
        )
        if not per_step:
            Ps, cross = jnp.sum(Ps, axis=0), jnp.sum(cross, axis=0)
        ll = sm.filtered.log_likelihood
        return _SmoothedSums(ms, sm.covs[0], sm.covs[-1], Ps, cross, ll), obs

    def work(whitening):
        problem = prepare(kf, ys, us, whitening)
        complete = whitening == "complete"
        steady = not (per_step or scan.parallel) and kf._steady_state
        if not (complete and steady and _may_settle(problem)):
            return exact(problem, complete)
        sums, ok = smoothed_sums_steady(problem)
        obs = _completed_observations(
            problem, None, None, ys, us, L_R, kf.D, per_step, complete
        )
        return lax.cond(ok, lambda: (sums, obs), lambda: exact(problem, complete))

    return by_whitening(ys, scan, work)


def _sequence_moments(
    kf: "KalmanFilter", ys: Array, us: Array | None, scan: AbstractScan
) -> tuple[tuple[_Moments, _Moments, _Moments], Array]:
    """The E-step on one sequence: the moments of the prior, transition and
    emission regressions, and the log-likelihood."""
    per_step_x, per_step_y = kf.F.ndim == 3, kf.H.ndim == 3
    per_step = per_step_x or per_step_y
    sm, (my, Vyy, Vyx) = _smoothed(kf, ys, us, scan, per_step)
    T, n = sm.means.shape
    c = 0 if us is None else us.shape[1]
    k = n + c
    ms = sm.means
    x1 = kf.prior_at == "x1"
    if x1:
        # the prior is x_1's; transitions into x_2..x_T
        m0, P0 = ms[0], sm.first
        mprev, xs, u_x = ms[:-1], ms[1:], None if us is None else us[1:]
    else:
        # x_0 smoothed too; transitions into x_1..x_T
        c1 = None if us is None else us[:1] @ kf.B.T
        m0, P0, C01 = _smoothed_x0(_model(kf), ms[0], sm.first, c1)
        mprev, xs, u_x = jnp.concatenate([m0[None], ms[:-1]]), ms, us
    # the covariances of the targets x_t, of the regressors x_{t-1}, and
    # Cov[x_t, x_{t-1}]
    if per_step:
        Ps, cross = sm.covs, sm.cross
        if x1:
            Vyy_x, Vzz_x, Vyz_x = Ps[1:], Ps[:-1], _mT(cross)
        else:
            Vyy_x, Vzz_x = Ps, jnp.concatenate([P0[None], Ps[:-1]])
            Vyz_x = _mT(jnp.concatenate([C01[None], cross]))
        if not per_step_x:
            Vyy_x, Vyz_x, Vzz_x = (jnp.sum(V, 0) for V in (Vyy_x, Vyz_x, Vzz_x))
        Vzz_y = Ps if per_step_y else jnp.sum(Ps, axis=0)
    else:
        S = sm.covs
        if x1:
            Vyy_x, Vzz_x, Vyz_x = S - sm.first, S - sm.last, _mT(sm.cross)
        else:
            Vyy_x, Vzz_x, Vyz_x = S, P0 + S - sm.last, _mT(C01 + sm.cross)
        Vzz_y = S
    zero = lambda *shape: jnp.zeros(shape, ms.dtype)
    prior = _Moments(m0[None], zero(1, 1) + 1, P0, zero(n, 1), zero(1, 1))
    transition = _Moments(
        xs, _with_controls(mprev, u_x), Vyy_x, _pad(Vyz_x, n, k), _pad(Vzz_x, k, k)
    )
    emission = _Moments(
        my, _with_controls(ms, us), Vyy, _pad(Vyx, Vyx.shape[-2], k), _pad(Vzz_y, k, k)
    )
    return (prior, transition, emission), sm.log_likelihood


def _outer_sum(a: Array, b: Array) -> Array:
    """`sum over sequences and steps of a b^T`, for `a` `(B, T, d)`, `b` `(B, T, k)`."""
    return jnp.einsum("btd,btk->dk", a, b)


def _vsum(V: Array, per_step: bool) -> Array:
    return jnp.sum(V, axis=(0, 1) if per_step else 0)


def _spd_solve(A: Array, B: Array) -> Array:
    """`A^{-1} B` for symmetric positive (semi-)definite `A`, via its Cholesky
    factor with jitter scaled to the dtype (a regressor that never varies, as a
    control that is always zero, leaves `A` singular)."""
    return _cho_solve(_chol(A), B)


# The Gramian's Cholesky factor is used where every pivot keeps at least this many
# units of round-off of its diagonal entry (its relative error, about `eps / f`
# for a pivot that is a fraction `f` of the entry, is then at most 1e-4).
_GRAM_PIVOT_ULPS = 1e4


def _sqrt_regression(mo: _Moments) -> tuple[Array, Array]:
    """`_regression` with every coefficient free and time-invariant moments, in
    square-root form: the coefficients `A` and a lower-triangular factor of the
    noise covariance, from the triangular factor `[[L_zz, 0], [L_yz, L_yy]]` of the
    Gramian `[[S, C^T], [C, sum E[y y^T]]]` of `(z, y)`: `A = L_yz L_zz^{-1}` (that
    is `C S^{-1}`), and the residual sum `L_yy L_yy^T`, without subtracting.

    The factor is the Gramian's Cholesky factor where that keeps its digits; else
    (a `lax.cond`) the triangularisation (`tria`, modified Gram-Schmidt, backward
    stable) of the data whose Gramian it is: the rows `[z_t^T, y_t^T]` of the
    posterior means, and `k + d` rows whose Gramian is the summed joint covariance.
    Forming the Gramian squares the data's condition number: on a stiff tracker
    whose states move little from one step to the next against their magnitude,
    `S` had a condition number of 6e6, and float32's `C S^{-1}` moved the
    transition matrix by 0.2 and `Q` by a factor of 80. The test is on the pivots:
    a Schur complement of the Gramian that is a fraction `f` of its diagonal entry
    loses `log10(1 / f)` digits. The triangularisation costs more (an iteration
    about twice as long at state 16 / obs 8), so it runs only where needed.
    """
    d, k = mo.my.shape[-1], mo.mz.shape[-1]
    N = mo.my.shape[0] * mo.my.shape[1]
    Vzz, Vyz, Vyy = (jnp.sum(V, axis=0) for V in (mo.Vzz, mo.Vyz, mo.Vyy))
    V = _sym(jnp.block([[Vzz, _mT(Vyz)], [Vyz, Vyy]]))
    means = jnp.concatenate([mo.mz, mo.my], axis=-1).reshape(N, k + d)
    gram = _sym(_mT(means) @ means + V)
    L_gram = jnp.linalg.cholesky(gram)
    eps = jnp.finfo(gram.dtype).eps
    pivots = jnp.diagonal(L_gram) ** 2 / jnp.diagonal(gram)
    # NaN (not positive definite, or a zero diagonal entry) fails the test too
    keeps_digits = jnp.all(pivots >= _GRAM_PIVOT_ULPS * eps)

    def by_data():
        # a factor of the positive semi-definite V, singular ones included
        # (complete data: no covariance in y), without jitter
        lam, U = jnp.linalg.eigh(V)
        G = jnp.sqrt(jnp.maximum(lam, 0))[:, None] * _mT(U)
        return tria(_mT(jnp.concatenate([means, G])))

    L = lax.cond(keeps_digits, lambda: L_gram, by_data)
    L_zz, L_yz, L_yy = L[:k, :k], L[k:, :k], L[k:, k:]
    # a regressor with nothing left after the ones before it (a control that is
    # always zero): a zero row of L_zz and zero column of L_yz; its coefficient 0
    eye = jnp.eye(k, dtype=bool)
    L_zz = jnp.where(eye & (L_zz == 0), 1, L_zz)
    A = _mT(jsl.solve_triangular(L_zz, _mT(L_yz), lower=True, trans=1))
    return A, L_yy / np.sqrt(N).astype(L.dtype)


def _regression(
    mo: _Moments, A: Array, L: Array, free: np.ndarray, cov_free: bool
) -> tuple[Array, Array | None]:
    """The M-step of `y = A z + e`, `e ~ N(0, L L^T)`: the coefficients `A`
    `(d, k)` (or `(T, d, k)` where its fixed entries vary with time) with their
    `free` entries maximising the expected log-likelihood at the current noise,
    then a lower-triangular factor of the noise covariance at the new `A` if
    `cov_free` (else `None`; `_m_step` floors it, `_floored_factor`).

    All entries free and time-invariant: `_sqrt_regression`. All free against
    per-step moments: `A = C S^{-1}`, `C = sum E[y z^T]`, `S = sum E[z z^T]`. Some
    fixed: the normal equations of the free entries,
    `(Lambda (x) S) vec(A) = vec(Lambda (C - A_fixed S))` restricted to them,
    `Lambda` the inverse noise covariance (row-major `vec`). The covariance is
    then the mean of `E[(y - A z)(y - A z)^T]`: outer products of the residuals of
    the means plus `[I, -A] V [I, -A]^T`, each positive semi-definite, not the
    difference of raw second moments, which cancels badly where states are large.
    """
    per_step = mo.Vyy.ndim == 4
    if free.all() and not per_step:
        A, L_new = _sqrt_regression(mo)
        return A, (L_new if cov_free else None)
    d, k = A.shape[-2:]
    # a time-varying `A` against per-step moments `(B, T, ..)`
    At = A[None] if per_step else A
    if free.any():
        S = _outer_sum(mo.mz, mo.mz) + _vsum(mo.Vzz, per_step)
        C = _outer_sum(mo.my, mo.mz) + _vsum(mo.Vyz, per_step)
        if free.all():
            A = _mT(_spd_solve(S, _mT(C)))
        else:
            A_fixed = jnp.where(np.broadcast_to(free, A.shape), 0, A)
            if per_step:
                # sum_t A_t E[z_t z_t^T] with the time-varying fixed entries
                Az = jnp.einsum("tdk,btk->btd", A_fixed, mo.mz)
                O = jnp.einsum("tdk,btkl->dl", A_fixed, mo.Vzz) + _outer_sum(Az, mo.mz)
            else:
                O = A_fixed @ S
            L_inv = jsl.solve_triangular(L, _eye_like(L), lower=True)
            Lam = L_inv.T @ L_inv
            idx = np.flatnonzero(free)
            G = jnp.kron(Lam, S)[idx[:, None], idx[None, :]]
            b = (Lam @ (C - O)).reshape(-1)[idx]
            theta = _spd_solve(G, b[:, None])[:, 0]
            A_free = jnp.zeros(d * k, A.dtype).at[idx].set(theta).reshape(d, k)
            A = A_fixed + (A_free[None] if per_step else A_free)
        At = A[None] if per_step else A
    if not cov_free:
        return A, None
    r = mo.my - (jnp.einsum("tdk,btk->btd", A, mo.mz) if per_step else mo.mz @ A.T)
    # [I, -A] V [I, -A]^T: per step for a time-varying A, else of the sums
    Vyy, Vyz, Vzz = (
        (mo.Vyy, mo.Vyz, mo.Vzz)
        if per_step
        else (jnp.sum(V, axis=0) for V in (mo.Vyy, mo.Vyz, mo.Vzz))
    )
    AVzy = _bmm(At, _mT(Vyz))
    V = Vyy - AVzy - _mT(AVzy) + _bmm(_bmm(At, Vzz), _mT(At))
    res = _outer_sum(r, r) + (jnp.sum(V, axis=(0, 1)) if per_step else V)
    return A, _psd_factor(res / (mo.my.shape[0] * mo.my.shape[1]))


def _psd_factor(cov: Array) -> Array:
    """A lower-triangular factor of a positive semi-definite `cov`, singular ones
    included (a zero diagonal entry where a direction has no variance left), from
    its eigendecomposition: a Cholesky factorisation subtracts, and at a singular
    matrix its rounding gave NaN."""
    lam, U = jnp.linalg.eigh(_sym(cov))
    return tria(U * jnp.sqrt(jnp.maximum(lam, 0))[None, :])


# A new covariance keeps, for each entry, a variance not explained by the entries
# before it (its factor's squared diagonal entry) of at least this many units of
# round-off (relative) of the entry's variance: a conditional standard deviation
# of at least `16 sqrt(eps)` of the marginal one (2.4e-7 in float64, 5.5e-3 in
# float32). Far above the rounding of the factor itself, so that the filter can
# whiten by it (and refactor it with missing entries); far below the correlation
# of any two sensors that are not copies of each other.
_COV_FLOOR_ULPS = 256


def _floored_factor(L: Array) -> Array:
    """The factor of a new covariance `L L^T`, kept positive definite.

    First `_chol`'s jitter, `eps * mean(diag)` on the diagonal (added in
    square-root form, `tria([L, sqrt(jitter) I])`, without the cancellation of
    factoring the sum), which also gives an entry with no variance at all a
    positive one. Then the floor, only where an entry's conditional variance
    `L_ii^2` falls under `_COV_FLOOR_ULPS * eps` of its variance: duplicated or
    exactly collinear observations (sensors), whose residuals vanish in one
    direction, so that the maximum-likelihood `R` is singular (the likelihood
    grows without bound towards it). Elsewhere `L` is unchanged.
    """
    eps = jnp.finfo(L.dtype).eps
    jitter = jnp.sqrt(eps * jnp.sum(L * L) / L.shape[-1])
    L = tria(jnp.concatenate([L, jitter * _eye_like(L)], axis=-1))
    floor = jnp.sqrt(_COV_FLOOR_ULPS * eps * jnp.sum(L * L, axis=-1))
    d = jnp.diagonal(L)
    return L + jnp.diag(jnp.maximum(d, floor) - d)


def _checked_factor(L: Array, name: str) -> Array:
    """`L`, raising at run time if it is singular: its covariance is then zero
    (every residual of its regression exactly zero, so no scale to floor)."""
    return error_if_any(
        L,
        jnp.diagonal(L) == 0,
        f"{_WHERE}: the M-step's new `{name}` is zero: every residual of its "
        "regression is exactly zero (for `R`: observations that are all zero, or "
        "exactly explained by the states and controls), so it has no scale. Hold "
        f"it fixed (`fixed={{{name!r}: True}}`) or fit data that vary.",
    )


def _m_step(kf: "KalmanFilter", moments, spec: _Fixed) -> "KalmanFilter":
    """The new parameters: the three regressions of `_regression`, fixed entries
    kept (the spec)."""
    prior, transition, emission = moments
    n, p, c = kf.state_size, kf.obs_size, kf.control_size
    new = {}

    def free(names, shapes):
        masks = [~as_array(getattr(spec, k), s) for k, s in zip(names, shapes)]
        return np.concatenate(masks, axis=-1)

    # m0, P0: the prior's state on 1 (with a stationary prior, unused)
    m0, L_P0 = _regression(
        prior,
        kf.m0[:, None],
        _factor(kf.P0_factor),
        ~as_array(spec.m0, (n,))[:, None],
        spec.P0 is False,
    )
    new["m0"], new["P0_factor"] = m0[:, 0], L_P0
    for (coef, ctrl, cov), mo, rows in (
        (("F", "B", "Q"), transition, n),
        (("H", "D", "R"), emission, p),
    ):
        A = getattr(kf, coef)
        if coef == "F" and A.ndim == 3 and kf.prior_at == "x1":
            A = A[1:]  # step 1 has no transition
        names, shapes = (coef,), ((rows, n),)
        if c:
            B = getattr(kf, ctrl)
            A = jnp.concatenate([A, jnp.broadcast_to(B, (*A.shape[:-1], c))], -1)
            names, shapes = (coef, ctrl), ((rows, n), (rows, c))
        A, L_new = _regression(
            mo, A, _factor(getattr(kf, f"{cov}_factor")), free(names, shapes),
            getattr(spec, cov) is False,
        )  # fmt: skip
        new[coef] = A[..., :n]
        if c:
            new[ctrl] = A[0, :, n:] if A.ndim == 3 else A[:, n:]
        new[f"{cov}_factor"] = L_new
    # what is held fixed stays as it is, bit for bit (a time-varying matrix too)
    held = {k for k, v in spec._asdict().items() if v is True}
    new = {
        k: (
            _unfactor(_checked_factor(_floored_factor(v), k.removesuffix("_factor")))
            if k.endswith("_factor")
            else v
        )
        for k, v in new.items()
        if v is not None and k.removesuffix("_factor") not in held
    }
    names = list(new)
    return eqx.tree_at(
        lambda kf: [getattr(kf, k) for k in names], kf, [new[k] for k in names]
    )


@eqx.filter_jit
@full_precision
def fit_em(
    kf: "KalmanFilter",
    ys: Array,
    us: Array | None,
    num_iters: int,
    spec: _Fixed,
    scan: AbstractScan,
) -> tuple["KalmanFilter", Array]:
    """`num_iters` EM iterations from `kf` on checked `ys` `(batch, T, p)` and `us`
    `(batch, T, c)`: the fitted filter and the log-likelihood after each iteration
    (summed over the sequences), in one compiled program."""
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    if ys.shape[0] == 1:
        # one sequence without `vmap`, under which the sequential loops run slower
        def e_step(kf, ys, us, scan):
            u = None if us is None else us[0]
            out = _sequence_moments(kf, ys[0], u, scan)
            return jax.tree.map(lambda x: x[None], out)

    else:
        e_step = jax.vmap(_sequence_moments, in_axes=(None, 0, 0, None))

    def iteration(params, last):
        kf = eqx.combine(params, static)
        moments, lls = e_step(kf, ys, us, scan)
        new = eqx.partition(_m_step(kf, moments, spec), eqx.is_inexact_array)[0]
        # the last pass is an E-step only: the final parameters' log-likelihood
        new = jax.tree.map(lambda a, b: jnp.where(last, a, b), params, new)
        return new, jnp.sum(lls)

    last = jnp.arange(num_iters + 1) == num_iters
    params, lls = lax.scan(iteration, params, last)
    return eqx.combine(params, static), lls[1:]
