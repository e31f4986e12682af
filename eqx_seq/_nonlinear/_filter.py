"""The model in computational form, and the sequential nonlinear filters and
smoothers: extended (Taylor) and sigma-point (cubature, unscented), square-root.

Each filter step linearises the transition about the previous filtered
distribution and the observation about the predicted one (`_linearize`), then runs
the linear square-root step of `_kalman` on the linearised model: the prediction's
factor is `[A L, L_Q, S_Lam]` (`S_Lam` the transition's regression residuals), and
the update is `_kalman._linalg.sqrt_update` on observations whitened by a factor
of `R + Omega` (the observation's regression residuals included). The smoother is
the linear Rauch-Tung-Striebel smoother of `_kalman._smoother` on the transitions
the filter linearised (Sarkka, *Bayesian Filtering and Smoothing*, 2013: the
extended and the sigma-point RTS smoothers).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._kalman._interface import filter_result, KalmanFilterResult
from .._kalman._linalg import gram, mm, mv, sqrt_update, tria, whitened_log_density
from .._kalman._model import _whiten, Model, per_step, PriorAt
from .._kalman._smoother import smooth_sequential
from .._misc import full_precision
from ._linearize import linearize, SigmaPoints


# Unrolled triangularisations in the filter's step: at the state sizes of these
# models, a loop over the rows costs more per step than the larger program
_LOOP = False


class NonlinearModel(eqx.Module):
    """What the algorithms read: the transition `f` and observation `h` (called as
    `f(x, u)` with controls, `f(x)` without), the noise factors (each `(..)` or
    `(T, ..)`), the prior `N(m0, L_P0 L_P0^T)` of `x_0` or `x_1` (`prior_at`)."""

    f: Callable
    h: Callable
    L_Q: Array
    L_R: Array
    m0: Array
    L_P0: Array
    prior_at: PriorAt = eqx.field(static=True)

    @property
    def state_size(self) -> int:
        return self.m0.shape[0]

    @property
    def obs_size(self) -> int:
        return self.L_R.shape[-1]


def at(fn: Callable, u: Array | None) -> Callable[[Array], Array]:
    """`fn` as a function of the state alone, at the control `u` (if any)."""
    return fn if u is None else (lambda x: fn(x, u))


def per_step_inputs(model: NonlinearModel, ys: Array, us: Array | None) -> dict:
    """The scanned inputs: observations and their mask, controls, and the noise
    factors that vary with time."""
    obs = ~jnp.isnan(ys)
    xs = {"y": jnp.where(obs, ys, 0), "obs": obs}
    if us is not None:
        xs["u"] = us
    if per_step(model.L_Q, 2):
        xs["L_Q"] = model.L_Q
    if per_step(model.L_R, 2):
        xs["L_R"] = model.L_R
    return xs


def observe(
    model: NonlinearModel,
    points: SigmaPoints | None,
    m_pred: Array,
    FL: Array,
    L_Q: Array,
    x: dict,
):
    """Condition the prediction `N(m_pred, FL FL^T + L_Q L_Q^T)` (any factors) on
    step `x`'s observation through the observation's linearisation about it: the
    filtered mean and factor and the log-density of the observed entries."""
    if points is not None:  # the sigma points need a square factor
        FL = tria(jnp.concatenate([FL, L_Q], axis=1))
        L_Q = jnp.zeros((FL.shape[0], 0), FL.dtype)
    H, d, S_om = linearize(at(model.h, x.get("u")), m_pred, FL, points)
    L_R = x.get("L_R", model.L_R)
    if S_om is not None:
        L_R = tria(jnp.concatenate([L_R, S_om], axis=1))
    obs = x["obs"]
    W, logdet = _whiten(L_R[None], obs[None], True)
    W, logdet = W[0], logdet[0]
    yw = mv(W, jnp.where(obs, x["y"] - d, 0))
    m, L, nu, log_s = sqrt_update(m_pred, FL, L_Q, mm(W, H), yw, loop=_LOOP)
    return m, L, whitened_log_density(nu, log_s, obs) - logdet


def predict(
    model: NonlinearModel, points: SigmaPoints | None, m: Array, L: Array, x: dict
):
    """The transition's linearisation about `N(m, L L^T)` and the prediction:
    `(m_pred, A L, S_Q, A)`, with `S_Q` a factor of `Q + Lam` (`[L_Q, S_Lam]`, not
    square with sigma points), so that the predicted covariance is
    `A L L^T A^T + S_Q S_Q^T`."""
    A, b, S_lam = linearize(at(model.f, x.get("u")), m, L, points)
    L_Q = x.get("L_Q", model.L_Q)
    if S_lam is not None:
        L_Q = jnp.concatenate([L_Q, S_lam], axis=1)
    return mv(A, m) + b, mm(A, L), L_Q, A


@full_precision
def filter_nonlinear(
    model: NonlinearModel, ys: Array, us: Array | None, points: SigmaPoints | None
) -> tuple[KalmanFilterResult, Array, Array, Array]:
    """The filter in a `lax.scan`; with its filtered factors and the linearised
    transitions `(A_t, L_Qt)` (for the smoother; step 1's with `prior_at="x1"` is
    not used)."""
    xs = per_step_inputs(model, ys, us)
    T = ys.shape[0]
    if model.prior_at == "x1":
        xs["first"] = jnp.arange(T) == 0

    def step(carry, x):
        m, L = carry
        m_pred, FL, S_Q, A = predict(model, points, m, L, x)
        FL_step, S_Q_step = FL, S_Q
        if "first" in x:  # prior_at="x1": the carry into step 1 is the prior of x_1
            m_pred = jnp.where(x["first"], m, m_pred)
            FL_step = jnp.where(x["first"], L, FL)
            S_Q_step = jnp.where(x["first"], 0, S_Q)
        m, L, ll = observe(model, points, m_pred, FL_step, S_Q_step, x)
        P_pred = gram(FL_step) + gram(S_Q_step)
        out = (m, L, m_pred, P_pred, ll, A)
        # the smoother's noise per step: with sigma points, the regression's too
        return (m, L), out + ((S_Q,) if points is not None else ())

    # rematerialised in the backward pass, as the linear filter's loop
    init = (model.m0, model.L_P0)
    _, (ms, Ls, mps, Pps, lls, As, *S_Qs) = lax.scan(jax.checkpoint(step), init, xs)
    result = filter_result(ms, gram(Ls), mps, Pps, lls, jnp.zeros_like(lls))
    L_Qs = tria(S_Qs[0]) if S_Qs else model.L_Q
    return result, Ls, As, L_Qs


def linear_model(model: NonlinearModel, F: Array, L_Q: Array, H: Array) -> Model:
    """The linear model with these (linearised) matrices and `model`'s prior."""
    return Model(
        F=F, L_Q=L_Q, H=H, m0=model.m0, L_P0=model.L_P0, prior_at=model.prior_at,
        steady_state=False,
    )  # fmt: skip


@full_precision
def smooth_nonlinear(
    model: NonlinearModel, ys: Array, us: Array | None, points: SigmaPoints | None
):
    """The extended or sigma-point RTS smoother: the linear smoother's backward
    pass on the transitions the filter linearised about its filtered moments."""
    filtered, Ls, As, L_Qs = filter_nonlinear(model, ys, us, points)
    H = jnp.zeros((model.obs_size, model.state_size), model.m0.dtype)  # unread
    return smooth_sequential(linear_model(model, As, L_Qs, H), filtered, Ls)


@full_precision
def sample_nonlinear(
    model: NonlinearModel, key: PRNGKeyArray, num_steps: int, us: Array | None
) -> tuple[Array, Array]:
    """States `x_1..x_T` and observations drawn from the model."""
    n, p, dtype = model.state_size, model.obs_size, model.m0.dtype
    k0, kq, kr = jr.split(key, 3)
    x = model.m0 + model.L_P0 @ jr.normal(k0, (n,), dtype)
    xs = per_step_inputs(model, jnp.zeros((num_steps, p), dtype), us)
    xs["q"] = jr.normal(kq, (num_steps, n), dtype)
    xs["r"] = jr.normal(kr, (num_steps, p), dtype)
    xs["first"] = jnp.arange(num_steps) == 0

    def step(x_prev, s):
        u = s.get("u")
        x = at(model.f, u)(x_prev) + mv(s.get("L_Q", model.L_Q), s["q"])
        if model.prior_at == "x1":  # the prior's draw is x_1 itself
            x = jnp.where(s["first"], x_prev, x)
        y = at(model.h, u)(x) + mv(s.get("L_R", model.L_R), s["r"])
        return x, (x, y)

    _, (states, obs) = lax.scan(step, x, xs)
    return states, obs
