"""The learnable parameters of a `KalmanFilter`: a random stable model, or one given
by its matrices (checked)."""

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._misc import check_parameter_dtype, error_if_any
from ._linalg import _mT, _sym, _unfactor


class _Parameters(NamedTuple):
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


def random_parameters(n: int, p: int, c: int, dtype, key: PRNGKeyArray) -> _Parameters:
    """A stable, stationary model (see `KalmanFilter.__init__`)."""
    kF, kH, kB = jr.split(key, 3)
    U, _ = jnp.linalg.qr(jr.normal(kF, (n, n), dtype))
    return _Parameters(
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


def _spd_factor(name: str, A: Array) -> Array:
    """Cholesky factor of a given covariance; a run-time error unless it is SPD."""
    scale = jnp.max(jnp.abs(A), axis=(-2, -1), keepdims=True)
    tol = math.sqrt(jnp.finfo(A.dtype).eps) * scale
    asymmetric = jnp.any(jnp.abs(A - _mT(A)) > tol)
    L = jnp.linalg.cholesky(_sym(A))
    bad = asymmetric | ~jnp.all(jnp.isfinite(L))
    return error_if_any(
        L,
        bad,
        f"eqx_seq.KalmanFilter.from_matrices: `{name}` must be symmetric positive "
        "definite.",
    )


# One compiled program per shape (`eqx.filter_jit`, so that a failed check raises
# Equinox's readable error): run op by op, the dozen small operations of the check
# and the factorisation were compiled one at a time, for every new shape.
@eqx.filter_jit
def _checked_raw_factor(name: str, A: Array) -> Array:
    """The unconstrained parameter (`_unfactor`) of a checked covariance `A`."""
    return _unfactor(_spd_factor(name, A))


def parameters_from_matrices(arrays: dict[str, Any], dtype: Any) -> _Parameters:
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
    raw = {k: _checked_raw_factor(k, a[k]) for k in ("Q", "R", "P0")}
    return _Parameters(
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
