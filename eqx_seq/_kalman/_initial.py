"""The prior the filters start from: the options `prior_at` and `initialization`,
and the stationary prior (a discrete Lyapunov equation)."""

from typing import Literal, TYPE_CHECKING

import jax.numpy as jnp
from jaxtyping import Array

from .._misc import error_if_any, full_precision
from ._linalg import _factor, _gram, _sym


if TYPE_CHECKING:
    from ._layer import KalmanFilter

# Which state the prior `(m0, P0)` is the law of: `x_0`, before the first
# observation, or `x_1`, the first observed state.
PriorAt = Literal["x0", "x1"]
Initialization = Literal["known", "stationary", "diffuse"]


def check_options(prior_at: object, initialization: object, time_varying: bool):
    """A `ValueError` for an unknown option, or a stationary prior of a model
    whose transition varies with time (it has no stationary law)."""
    if prior_at not in ("x0", "x1"):
        raise ValueError(
            f'eqx_seq.KalmanFilter: `prior_at` must be "x0" or "x1", got {prior_at!r}.'
        )
    if initialization not in ("known", "stationary", "diffuse"):
        raise ValueError(
            'eqx_seq.KalmanFilter: `initialization` must be "known", '
            f'"stationary" or "diffuse", got {initialization!r}.'
        )
    if initialization == "stationary" and time_varying:
        raise ValueError(
            'eqx_seq.KalmanFilter: initialization="stationary" needs a '
            "time-invariant `F` and `Q` (a time-varying model has no stationary law)."
        )


@full_precision
def stationary_covariance(F: Array, L_Q: Array) -> Array:
    """The solution `P` of `P = F P F^T + Q` (`Q = L_Q L_Q^T`), by the Kronecker
    form `(I - F (x) F) vec P = vec Q`; a run-time error unless `F` is stable.

    With `Q` positive definite, a positive definite solution exists iff every
    eigenvalue of `F` lies inside the unit circle (Lyapunov), so the check is a
    Cholesky factorisation of the solution, and no eigenvalues are computed.
    """
    n = F.shape[-1]
    Q = _gram(L_Q)
    lhs = jnp.eye(n * n, dtype=F.dtype) - jnp.kron(F, F)
    P = _sym(jnp.linalg.solve(lhs, Q.reshape(n * n)).reshape(n, n))
    L = jnp.linalg.cholesky(P)
    return error_if_any(
        L,
        ~jnp.all(jnp.isfinite(L)),
        'eqx_seq.KalmanFilter: initialization="stationary" needs a stable `F` '
        "(every eigenvalue inside the unit circle); this one has no stationary law.",
    )


def prior(kf: "KalmanFilter") -> tuple[Array, Array]:
    """The prior's mean and Cholesky factor: the parameters `m0`, `P0` ("known"),
    or the stationary law (mean zero). A diffuse prior is handled by the filter
    (`_diffuse`); here it is the zero mean and a unit factor, never read as a
    covariance."""
    if kf.initialization == "known":
        return kf.m0, _factor(kf.P0_factor)
    zero = jnp.zeros_like(kf.m0)
    if kf.initialization == "stationary":
        return zero, stationary_covariance(kf.F, _factor(kf.Q_factor))
    return zero, jnp.eye(kf.state_size, dtype=kf.m0.dtype)
