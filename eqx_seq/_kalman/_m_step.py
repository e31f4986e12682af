"""The M-step of `KalmanFilter.fit_em`: each regression (`x_0` on 1, `x_t` on
`[x_{t-1}; u_t]`, `y_t` on `[x_t; u_t]`) solved in closed form from the E-step's
`Moments`, with the entries the `Fixed` spec holds, and the new covariances kept
positive definite. See `docs/devdocs/kalman.md`, "Expectation-maximisation".
"""

from typing import NamedTuple

import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array

from .._misc import error_if_any
from ._e_step import Moments
from ._linalg import (
    bmm,
    cho_solve,
    chol,
    eye_like,
    factor,
    mT,
    sym,
    tria,
    unfactor,
)
from ._model import (
    Parameters,
    PriorAt,
)


# --- what `fit_em` holds fixed, as the M-step reads it ---

WHERE = "eqx_seq.KalmanFilter.fit_em"

Mask = bool | tuple


class Fixed(NamedTuple):
    F: Mask = False
    H: Mask = False
    B: Mask = False
    D: Mask = False
    m0: Mask = False
    Q: Mask = False
    R: Mask = False
    P0: Mask = False


def as_array(mask: Mask, shape: tuple[int, ...]) -> np.ndarray:
    """A normalised mask as a boolean array of `shape` (`True`: held fixed)."""
    return np.broadcast_to(np.asarray(mask, bool), shape)


def _outer_sum(a: Array, b: Array) -> Array:
    """`sum over sequences and steps of a b^T`, for `a` `(B, T, d)`, `b` `(B, T, k)`."""
    return jnp.einsum("btd,btk->dk", a, b)


def _vsum(V: Array, per_step: bool) -> Array:
    return jnp.sum(V, axis=(0, 1) if per_step else 0)


def _spd_solve(A: Array, B: Array) -> Array:
    """`A^{-1} B` for symmetric positive (semi-)definite `A`, via its Cholesky
    factor with jitter scaled to the dtype (a regressor that never varies, as a
    control that is always zero, leaves `A` singular)."""
    return cho_solve(chol(A), B)


# The Gramian's Cholesky factor is used where every pivot keeps at least this many
# units of round-off of its diagonal entry (its relative error, about `eps / f`
# for a pivot that is a fraction `f` of the entry, is then at most 1e-4).
_GRAM_PIVOT_ULPS = 1e4


def _sqrt_regression(mo: Moments) -> tuple[Array, Array]:
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
    V = sym(jnp.block([[Vzz, mT(Vyz)], [Vyz, Vyy]]))
    means = jnp.concatenate([mo.mz, mo.my], axis=-1).reshape(N, k + d)
    gram = sym(mT(means) @ means + V)
    L_gram = jnp.linalg.cholesky(gram)
    eps = jnp.finfo(gram.dtype).eps
    pivots = jnp.diagonal(L_gram) ** 2 / jnp.diagonal(gram)
    # NaN (not positive definite, or a zero diagonal entry) fails the test too
    keeps_digits = jnp.all(pivots >= _GRAM_PIVOT_ULPS * eps)

    def by_data():
        # a factor of the positive semi-definite V, singular ones included
        # (complete data: no covariance in y), without jitter
        lam, U = jnp.linalg.eigh(V)
        G = jnp.sqrt(jnp.maximum(lam, 0))[:, None] * mT(U)
        return tria(mT(jnp.concatenate([means, G])))

    L = lax.cond(keeps_digits, lambda: L_gram, by_data)
    L_zz, L_yz, L_yy = L[:k, :k], L[k:, :k], L[k:, k:]
    # a regressor with nothing left after the ones before it (a control that is
    # always zero): a zero row of L_zz and zero column of L_yz; its coefficient 0
    eye = jnp.eye(k, dtype=bool)
    L_zz = jnp.where(eye & (L_zz == 0), 1, L_zz)
    A = mT(jsl.solve_triangular(L_zz, mT(L_yz), lower=True, trans=1))
    return A, L_yy / np.sqrt(N).astype(L.dtype)


def _regression(
    mo: Moments, A: Array, L: Array, free: np.ndarray, cov_free: bool
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
            A = mT(_spd_solve(S, mT(C)))
        else:
            A_fixed = jnp.where(np.broadcast_to(free, A.shape), 0, A)
            if per_step:
                # sum_t A_t E[z_t z_t^T] with the time-varying fixed entries
                Az = jnp.einsum("tdk,btk->btd", A_fixed, mo.mz)
                O = jnp.einsum("tdk,btkl->dl", A_fixed, mo.Vzz) + _outer_sum(Az, mo.mz)
            else:
                O = A_fixed @ S
            L_inv = jsl.solve_triangular(L, eye_like(L), lower=True)
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
    AVzy = bmm(At, mT(Vyz))
    V = Vyy - AVzy - mT(AVzy) + bmm(bmm(At, Vzz), mT(At))
    res = _outer_sum(r, r) + (jnp.sum(V, axis=(0, 1)) if per_step else V)
    return A, _psd_factor(res / (mo.my.shape[0] * mo.my.shape[1]))


def _psd_factor(cov: Array) -> Array:
    """A lower-triangular factor of a positive semi-definite `cov`, singular ones
    included (a zero diagonal entry where a direction has no variance left), from
    its eigendecomposition: a Cholesky factorisation subtracts, and at a singular
    matrix its rounding gave NaN."""
    lam, U = jnp.linalg.eigh(sym(cov))
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

    First `chol`'s jitter, `eps * mean(diag)` on the diagonal (added in
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
    L = tria(jnp.concatenate([L, jitter * eye_like(L)], axis=-1))
    floor = jnp.sqrt(_COV_FLOOR_ULPS * eps * jnp.sum(L * L, axis=-1))
    d = jnp.diagonal(L)
    return L + jnp.diag(jnp.maximum(d, floor) - d)


def _checked_factor(L: Array, name: str) -> Array:
    """`L`, raising at run time if it is singular: its covariance is then zero
    (every residual of its regression exactly zero, so no scale to floor)."""
    return error_if_any(
        L,
        jnp.diagonal(L) == 0,
        f"{WHERE}: the M-step's new `{name}` is zero: every residual of its "
        "regression is exactly zero (for `R`: observations that are all zero, or "
        "exactly explained by the states and controls), so it has no scale. Hold "
        f"it fixed (`fixed={{{name!r}: True}}`) or fit data that vary.",
    )


def m_step(params: Parameters, moments, spec: Fixed, prior_at: PriorAt) -> Parameters:
    """The new parameters: the three regressions of `_regression`, fixed entries
    kept (the spec)."""
    prior, transition, emission = moments
    n, p, c = params.state_size, params.obs_size, params.control_size
    new = {}

    def free(names, shapes):
        masks = [~as_array(getattr(spec, k), s) for k, s in zip(names, shapes)]
        return np.concatenate(masks, axis=-1)

    # m0, P0: the prior's state on 1 (with a stationary prior, unused)
    m0, L_P0 = _regression(
        prior,
        params.m0[:, None],
        factor(params.P0_factor),
        ~as_array(spec.m0, (n,))[:, None],
        spec.P0 is False,
    )
    new["m0"], new["P0_factor"] = m0[:, 0], L_P0
    for (coef, ctrl, cov), mo, rows in (
        (("F", "B", "Q"), transition, n),
        (("H", "D", "R"), emission, p),
    ):
        A = getattr(params, coef)
        if coef == "F" and A.ndim == 3 and prior_at == "x1":
            A = A[1:]  # step 1 has no transition
        names, shapes = (coef,), ((rows, n),)
        if c:
            B = getattr(params, ctrl)
            A = jnp.concatenate([A, jnp.broadcast_to(B, (*A.shape[:-1], c))], -1)
            names, shapes = (coef, ctrl), ((rows, n), (rows, c))
        A, L_new = _regression(
            mo, A, factor(getattr(params, f"{cov}_factor")), free(names, shapes),
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
            unfactor(_checked_factor(_floored_factor(v), k.removesuffix("_factor")))
            if k.endswith("_factor")
            else v
        )
        for k, v in new.items()
        if v is not None and k.removesuffix("_factor") not in held
    }
    return params._replace(**new)
