"""The model in computational form, and the observations of one call prepared once.

Observations are whitened by the Cholesky factor of `R_t` (see
`docs/devdocs/kalman.md`, "Whitening"): every filter, smoother and gradient then
conditions on unit-variance scalars and reads one `_Problem`.
"""

from typing import Literal, TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array

from .._misc import vary_like
from ._initial import prior, PriorAt
from ._linalg import _eye_like, _factor, _gram, inverse_cholesky


if TYPE_CHECKING:
    from ._layer import KalmanFilter


class _Model(eqx.Module):
    """The matrices the filters read, each `(..)` or `(T, ..)` (time-varying); the
    observation noise enters through the whitening (`_Problem.W`). `(m0, L_P0)` is
    the prior of `x_0` (`prior_at="x0"`) or of `x_1` (`"x1"`: step 1 does not
    predict)."""

    F: Array
    L_Q: Array
    H: Array
    m0: Array
    L_P0: Array
    prior_at: PriorAt = eqx.field(static=True)


def _model(kf: "KalmanFilter") -> _Model:
    m0, L_P0 = prior(kf)
    return _Model(
        F=kf.F,
        L_Q=_factor(kf.Q_factor),
        H=kf.H,
        m0=m0,
        L_P0=L_P0,
        prior_at=kf.prior_at,
    )


def _per_step(x: Array, ndim: int) -> bool:
    return x.ndim > ndim


def _bt(x: Array, T: int) -> Array:
    """A `(..)` or `(T, ..)` matrix as `(T, ..)`."""
    return x if x.ndim == 3 else jnp.broadcast_to(x, (T, *x.shape))


def _whiten(L_R: Array, obs: Array, R_varies: bool) -> tuple[Array, Array]:
    """Per-step whitening matrices `W_t` (missing columns zeroed) and log-dets.

    `W_t = L_t^{-1} M_t`, with `L_t` the Cholesky factor of `R_t` restricted to the
    observed entries (identity on the missing ones) and `M_t` the 0/1 mask. Then
    `W_t (y_t - D u_t)` is a vector of independent unit-variance observations of
    `W_t H_t x_t` (a missing entry gives `0 = 0 x + noise`, which conditions on
    nothing), and `log det L_t` counts observed entries only.
    """
    T, p = obs.shape
    dtype = L_R.dtype
    R = _gram(L_R)
    if not R_varies:
        R = jnp.broadcast_to(R, (T, p, p))
    both = obs[:, :, None] & obs[:, None, :]
    eye = jnp.broadcast_to(jnp.eye(p, dtype=bool), (T, p, p))
    R = jnp.where(both, R, jnp.where(eye, jnp.ones((), dtype), 0))
    # a factorisation per step, not batched LAPACK, which can deadlock (`_linalg`)
    W = inverse_cholesky(R)
    logdet = -jnp.sum(jnp.log(jnp.diagonal(W, axis1=-2, axis2=-1)), axis=-1)
    W = jnp.where(obs[:, None, :], W, 0)
    return W, logdet


def _complete_whitening(L_R: Array, T: int) -> tuple[Array, Array]:
    """`W = L_R^{-1}` (constant unless `R` varies) and `log det L_R` per step."""
    W = jsl.solve_triangular(L_R, _eye_like(L_R), lower=True)
    logdet = jnp.sum(jnp.log(jnp.diagonal(L_R, axis1=-2, axis2=-1)), axis=-1)
    return W, jnp.broadcast_to(logdet, (T,))


def _whitened(W: Array, y: Array) -> Array:
    return jnp.einsum("ij,tj->ti" if W.ndim == 2 else "tij,tj->ti", W, y)


@jax.custom_batching.custom_vmap
def _all_observed(obs: Array) -> Array:
    """Whether every entry of `obs` is true; under `jax.vmap`, over the whole batch.

    The filter branches on this (`lax.cond`). A batched predicate would turn the
    `cond` into a `select` that runs both branches for every sequence. One unbatched
    answer for the batch keeps the branch: a batch with any missing entry runs the
    exact filter for all its sequences, which gives complete ones the same numbers
    to round-off.
    """
    return jnp.all(obs)


@_all_observed.def_vmap
def _all_observed_vmap(axis_size, in_batched, obs):
    del axis_size, in_batched
    return _all_observed(obs), False


# How the observations are whitened: "complete" (every entry observed; one `W` unless
# `R` varies), "missing" (per step, masked), or "either" (per step, chosen at run
# time by a `lax.cond` on the data, for the parallel filter).
Whitening = Literal["complete", "missing", "either"]


class _Problem(eqx.Module):
    """The observations of one call prepared for the filters, the smoothers and the
    gradient: `yw = W (y - D u)` with NaNs zeroed, of unit noise variance, observing
    `W H x`; `c = B u`; `logdet` the whitening's log-determinant per step."""

    model: _Model
    c: Array | None
    obs: Array
    W: Array
    logdet: Array
    yw: Array

    @property
    def num_steps(self) -> int:
        return self.obs.shape[0]

    @property
    def Hw(self) -> Array:
        """The whitened emission per step, `(T, p, n)`."""
        T = self.num_steps
        return _bt(self.W, T) @ _bt(self.model.H, T)


def prepare(
    kf: "KalmanFilter", ys: Array, us: Array | None, whitening: Whitening
) -> _Problem:
    """The `_Problem` of `kf` on observations `ys` and controls `us`.

    Under `jax.shard_map` the model's matrices are made to vary like the data, so
    that every carry and `lax.cond` branch downstream has one type (a covariance
    computed from the model alone would otherwise be shared by the devices while
    one updated with per-device missing data is not).
    """
    data = (ys,) if us is None else (ys, us)
    model, L_R = jax.tree.map(
        lambda p: vary_like(p, *data), (_model(kf), _factor(kf.R_factor))
    )
    obs = ~jnp.isnan(ys)
    y = jnp.where(obs, ys, 0)  # zero NaNs before any arithmetic (double where)
    c = None if kf.B is None else us @ kf.B.T
    if kf.D is not None:
        y = jnp.where(obs, y - us @ kf.D.T, 0)
    T = ys.shape[0]
    R_varies = _per_step(L_R, 2)
    if whitening == "complete":
        W, logdet = _complete_whitening(L_R, T)
    elif whitening == "missing":
        W, logdet = _whiten(L_R, obs, R_varies)
    else:

        def full():
            W, logdet = _complete_whitening(L_R, T)
            return jnp.broadcast_to(W, (T, *W.shape[-2:])), logdet

        W, logdet = lax.cond(
            _all_observed(obs), full, lambda: _whiten(L_R, obs, R_varies)
        )
    return _Problem(model, c, obs, W, logdet, _whitened(W, y))
