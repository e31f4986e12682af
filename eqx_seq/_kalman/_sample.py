"""Draws of states and observations from the model (`KalmanFilter.sample`)."""

from typing import TYPE_CHECKING

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array

from .._misc import full_precision
from ._linalg import _factor
from ._problem import _model, _per_step


if TYPE_CHECKING:
    from ._layer import KalmanFilter


@eqx.filter_jit
@full_precision
def sample_prior(kf: "KalmanFilter", key, num_steps: int, us: Array | None):
    model = _model(kf)
    L_R = _factor(kf.R_factor)
    n, p = kf.state_size, kf.obs_size
    dtype = model.m0.dtype
    k0, kq, kr = jr.split(key, 3)
    x0 = model.m0 + model.L_P0 @ jr.normal(k0, (n,), dtype)
    q = jr.normal(kq, (num_steps, n), dtype)
    r = jr.normal(kr, (num_steps, p), dtype)
    xs = {"q": q, "r": r}
    mats = {"F": model.F, "L_Q": model.L_Q, "H": model.H, "L_R": L_R}
    for name, x in mats.items():
        if _per_step(x, 2):
            xs[name] = x
    if us is not None:
        xs["Bu"] = us @ kf.B.T
        xs["Du"] = us @ kf.D.T

    if kf.prior_at == "x1":
        # the prior's draw is x_1 itself: step 1 has no transition
        xs["first"] = jnp.arange(num_steps) == 0

    def step(x_prev, s):
        get = lambda name: s[name] if name in s else mats[name]
        x = get("F") @ x_prev + get("L_Q") @ s["q"]
        if "Bu" in s:
            x = x + s["Bu"]
        if "first" in s:
            x = jnp.where(s["first"], x_prev, x)
        y = get("H") @ x + get("L_R") @ s["r"]
        if "Du" in s:
            y = y + s["Du"]
        return x, (x, y)

    _, (states, observations) = lax.scan(step, x0, xs)
    return states, observations
