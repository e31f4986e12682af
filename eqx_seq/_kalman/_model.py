"""The model: its parameters and their matrices, the prior's options, the model in
computational form (`Model`) and the observations of one call prepared once
(`Problem`). The results and the methods' input checks are in `_interface.py`.

Observations are whitened by the Cholesky factor of `R_t` (see
`docs/devdocs/kalman.md`, "Whitening"): every filter, smoother and gradient then
conditions on unit-variance scalars and reads one `Problem`.
"""

import math
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg as jsl
from jaxtyping import Array, PRNGKeyArray

from .._misc import check_parameter_dtype, error_if_any, full_precision, vary_like
from ._linalg import eye_like, factor, gram, inverse_cholesky, mT, sym, unfactor


# --- the parameters: a random stable model, or one given by its matrices ---


class Parameters(NamedTuple):
    """What `KalmanFilter.__init__` stores: the arrays and the length `T` of a
    time-varying model (`None` if none varies)."""

    F: Array
    H: Array
    B: Array | None
    D: Array | None
    m0: Array
    Q_factor: Array
    R_factor: Array
    P0_factor: Array
    num_steps: int | None

    @property
    def state_size(self) -> int:
        return self.m0.shape[0]

    @property
    def obs_size(self) -> int:
        return self.H.shape[-2]

    @property
    def control_size(self) -> int:
        return 0 if self.B is None else self.B.shape[1]


def random_parameters(n: int, p: int, c: int, dtype, key: PRNGKeyArray) -> Parameters:
    """A stable, stationary model (see `KalmanFilter.__init__`)."""
    kF, kH, kB = jr.split(key, 3)
    U, _ = jnp.linalg.qr(jr.normal(kF, (n, n), dtype))
    return Parameters(
        F=0.9 * U,
        H=jr.normal(kH, (p, n), dtype) / math.sqrt(n),
        B=jr.normal(kB, (n, c), dtype) / math.sqrt(c) if c else None,
        D=jnp.zeros((p, c), dtype) if c else None,
        m0=jnp.zeros((n,), dtype),
        Q_factor=jnp.diag(jnp.full((n,), 0.5 * math.log(0.19), dtype)),
        R_factor=jnp.zeros((p, p), dtype),
        P0_factor=jnp.zeros((n, n), dtype),
        num_steps=None,
    )


def _check_matrix(name: str, x: Array, shape: tuple[int, ...]) -> None:
    """`x` has per-step shape `shape`, optionally with a leading time axis."""
    ok = x.shape == shape or (x.ndim == len(shape) + 1 and x.shape[1:] == shape)
    if not ok:
        raise ValueError(
            f"eqx_seq.KalmanFilter: `{name}` must have shape {shape} (or (T, *{shape}) "
            f"for a time-varying model), got {x.shape}."
        )


def _spd_factor(name: str, A: Array, caller: str) -> Array:
    """Cholesky factor of a given covariance; a run-time error unless it is SPD."""
    scale = jnp.max(jnp.abs(A), axis=(-2, -1), keepdims=True)
    tol = math.sqrt(jnp.finfo(A.dtype).eps) * scale
    asymmetric = jnp.any(jnp.abs(A - mT(A)) > tol)
    L = jnp.linalg.cholesky(sym(A))
    bad = asymmetric | ~jnp.all(jnp.isfinite(L))
    return error_if_any(
        L,
        bad,
        f"eqx_seq.{caller}: `{name}` must be symmetric positive definite.",
    )


# One compiled program per shape (`eqx.filter_jit`, so that a failed check raises
# Equinox's readable error): run op by op, the dozen small operations of the check
# and the factorisation were compiled one at a time, for every new shape.
@eqx.filter_jit
def checked_raw_factor(
    name: str, A: Array, caller: str = "KalmanFilter.from_matrices"
) -> Array:
    """The unconstrained parameter (`unfactor`) of a checked covariance `A`; the
    error names `caller`."""
    return unfactor(_spd_factor(name, A, caller))


def parameters_from_matrices(arrays: dict[str, Any], dtype: Any) -> Parameters:
    """The parameters of the model with the matrices `arrays` (`F`, `H`, `Q`, `R`,
    `m0`, `P0`, and `B`, `D` or `None`), in `dtype` (default: theirs); see
    `KalmanFilter.from_matrices`."""
    arrays = {k: v if v is None else jnp.asarray(v) for k, v in arrays.items()}
    given = [v for v in arrays.values() if v is not None]
    if dtype is None:
        dtype = jnp.result_type(*[v.dtype for v in given])
        if not jnp.issubdtype(dtype, jnp.floating):
            dtype = None
    dtype = check_parameter_dtype("KalmanFilter", dtype)
    for k, v in arrays.items():
        if v is not None and not (
            jnp.issubdtype(v.dtype, jnp.floating)
            or jnp.issubdtype(v.dtype, jnp.integer)
        ):
            raise ValueError(f"`{k}` must be a real array, got dtype {v.dtype}.")
    a = {k: v if v is None else v.astype(dtype) for k, v in arrays.items()}
    F, H = a["F"], a["H"]
    if F.ndim not in (2, 3) or F.shape[-1] != F.shape[-2]:
        raise ValueError(
            "eqx_seq.KalmanFilter.from_matrices: `F` must be square, shape (n, n) "
            f"or (T, n, n), got {F.shape}."
        )
    n = F.shape[-1]
    if H.ndim not in (2, 3) or H.shape[-1] != n:
        raise ValueError(
            "eqx_seq.KalmanFilter.from_matrices: `H` must have shape (p, n) or "
            f"(T, p, n) with n = {n} (from `F`), got {H.shape}."
        )
    p = H.shape[-2]
    if a["m0"].shape != (n,):
        raise ValueError(f"`m0` must have shape ({n},), got {a['m0'].shape}.")
    _check_matrix("Q", a["Q"], (n, n))
    _check_matrix("R", a["R"], (p, p))
    if a["P0"].shape != (n, n):
        raise ValueError(f"`P0` must have shape ({n}, {n}), got {a['P0'].shape}.")
    c = 0
    for name, rows in (("B", n), ("D", p)):
        m = a[name]
        if m is not None:
            if m.ndim != 2 or m.shape[0] != rows or m.shape[1] < 1:
                raise ValueError(
                    f"`{name}` must have shape ({rows}, c) with c >= 1, got {m.shape}."
                )
            c = m.shape[1] if c == 0 else c
            if m.shape[1] != c:
                raise ValueError(
                    f"`B` and `D` must have the same number of columns (the "
                    f"control size), got {a['B'].shape} and {a['D'].shape}."
                )
    if c:
        a["B"] = jnp.zeros((n, c), dtype) if a["B"] is None else a["B"]
        a["D"] = jnp.zeros((p, c), dtype) if a["D"] is None else a["D"]
    lengths = {
        k: a[k].shape[0]
        for k, r in (("F", 2), ("H", 2), ("Q", 2), ("R", 2))
        if a[k].ndim > r
    }
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"Time-varying matrices must share one length T, got {lengths}."
        )
    raw = {k: checked_raw_factor(k, a[k]) for k in ("Q", "R", "P0")}
    return Parameters(
        F=F,
        H=H,
        B=a["B"],
        D=a["D"],
        m0=a["m0"],
        Q_factor=raw["Q"],
        R_factor=raw["R"],
        P0_factor=raw["P0"],
        num_steps=next(iter(lengths.values()), None),
    )


# --- the prior the filters start from: the options `prior_at` and `initialization`,
# and the stationary prior (a discrete Lyapunov equation) ---

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
    Q = gram(L_Q)
    lhs = jnp.eye(n * n, dtype=F.dtype) - jnp.kron(F, F)
    P = sym(jnp.linalg.solve(lhs, Q.reshape(n * n)).reshape(n, n))
    L = jnp.linalg.cholesky(P)
    return error_if_any(
        L,
        ~jnp.all(jnp.isfinite(L)),
        'eqx_seq.KalmanFilter: initialization="stationary" needs a stable `F` '
        "(every eigenvalue inside the unit circle); this one has no stationary law.",
    )


def prior(params: Parameters, initialization: Initialization) -> tuple[Array, Array]:
    """The prior's mean and Cholesky factor: the parameters `m0`, `P0` ("known"),
    or the stationary law (mean zero). A diffuse prior is handled by the filter
    (`_diffuse.filter_diffuse`); here it is the zero mean and a unit factor, never
    read as a covariance."""
    if initialization == "known":
        return params.m0, factor(params.P0_factor)
    zero = jnp.zeros_like(params.m0)
    if initialization == "stationary":
        return zero, stationary_covariance(params.F, factor(params.Q_factor))
    return zero, jnp.eye(params.state_size, dtype=params.m0.dtype)


# --- the model in computational form, and the observations of one call prepared
# once ---


class Model(eqx.Module):
    """The matrices the filters read, each `(..)` or `(T, ..)` (time-varying); the
    observation noise enters through the whitening (`Problem.W`). `(m0, L_P0)` is
    the prior of `x_0` (`prior_at="x0"`) or of `x_1` (`"x1"`: step 1 does not
    predict).

    The model of the whole layer (`model_of`) also holds what `prepare` and the
    entry points read: the observation noise's factor `L_R`, the controls'
    matrices `B`, `D` (or `None`), the prior's `initialization`, and the two
    switches kept for comparisons: `steady_state` (False: every step of the
    sequential filter exact) and `square_root` (False: the filters in covariance
    form). The models the filters build for part of a problem leave them at their
    defaults, and are run with the switches passed explicitly.
    """

    F: Array
    L_Q: Array
    H: Array
    m0: Array
    L_P0: Array
    prior_at: PriorAt = eqx.field(static=True)
    L_R: Array | None = None
    B: Array | None = None
    D: Array | None = None
    initialization: Initialization = eqx.field(static=True, default="known")
    steady_state: bool = eqx.field(static=True, default=True)
    square_root: bool = eqx.field(static=True, default=True)


def model_of(
    params: Parameters,
    prior_at: PriorAt,
    initialization: Initialization,
    *,
    steady_state: bool = True,
    square_root: bool = True,
) -> Model:
    """The model of the parameters `params` with these options."""
    m0, L_P0 = prior(params, initialization)
    return Model(
        F=params.F,
        L_Q=factor(params.Q_factor),
        H=params.H,
        m0=m0,
        L_P0=L_P0,
        prior_at=prior_at,
        L_R=factor(params.R_factor),
        B=params.B,
        D=params.D,
        initialization=initialization,
        steady_state=steady_state,
        square_root=square_root,
    )


def per_step(x: Array, ndim: int) -> bool:
    return x.ndim > ndim


def bt(x: Array, T: int) -> Array:
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
    R = gram(L_R)
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
    W = jsl.solve_triangular(L_R, eye_like(L_R), lower=True)
    logdet = jnp.sum(jnp.log(jnp.diagonal(L_R, axis1=-2, axis2=-1)), axis=-1)
    return W, jnp.broadcast_to(logdet, (T,))


def _whitened(W: Array, y: Array) -> Array:
    return jnp.einsum("ij,tj->ti" if W.ndim == 2 else "tij,tj->ti", W, y)


@jax.custom_batching.custom_vmap
def all_observed(obs: Array) -> Array:
    """Whether every entry of `obs` is true; under `jax.vmap`, over the whole batch.

    The filter branches on this (`lax.cond`). A batched predicate would turn the
    `cond` into a `select` that runs both branches for every sequence. One unbatched
    answer for the batch keeps the branch: a batch with any missing entry runs the
    exact filter for all its sequences, which gives complete ones the same numbers
    to round-off.
    """
    return jnp.all(obs)


@all_observed.def_vmap
def _all_observed_vmap(axis_size, in_batched, obs):
    del axis_size, in_batched
    return all_observed(obs), False


# How the observations are whitened: "complete" (every entry observed; one `W` unless
# `R` varies), "missing" (per step, masked), or "either" (per step, chosen at run
# time by a `lax.cond` on the data, for the parallel filter).
Whitening = Literal["complete", "missing", "either"]


class Problem(eqx.Module):
    """The observations of one call prepared for the filters, the smoothers and the
    gradient: `yw = W (y - D u)` with NaNs zeroed, of unit noise variance, observing
    `W H x`; `c = B u`; `logdet` the whitening's log-determinant per step."""

    model: Model
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
        return bt(self.W, T) @ bt(self.model.H, T)


def prepare(model: Model, ys: Array, us: Array | None, whitening: Whitening) -> Problem:
    """The `Problem` of `model` (a layer's, `model_of`) on observations `ys` and
    controls `us`.

    Under `jax.shard_map` the model's matrices are made to vary like the data, so
    that every carry and `lax.cond` branch downstream has one type (a covariance
    computed from the model alone would otherwise be shared by the devices while
    one updated with per-device missing data is not).
    """
    data = (ys,) if us is None else (ys, us)
    varied = jax.tree.map(lambda p: vary_like(p, *data), model)
    L_R = varied.L_R
    obs = ~jnp.isnan(ys)
    y = jnp.where(obs, ys, 0)  # zero NaNs before any arithmetic (double where)
    c = None if model.B is None else us @ model.B.T
    if model.D is not None:
        y = jnp.where(obs, y - us @ model.D.T, 0)
    T = ys.shape[0]
    R_varies = per_step(L_R, 2)
    if whitening == "complete":
        W, logdet = _complete_whitening(L_R, T)
    elif whitening == "missing":
        W, logdet = _whiten(L_R, obs, R_varies)
    else:

        def full():
            W, logdet = _complete_whitening(L_R, T)
            return jnp.broadcast_to(W, (T, *W.shape[-2:])), logdet

        W, logdet = lax.cond(
            all_observed(obs), full, lambda: _whiten(L_R, obs, R_varies)
        )
    return Problem(varied, c, obs, W, logdet, _whitened(W, y))
