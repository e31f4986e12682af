"""Continuous-time linear models observed at given times: the exact discretisation
of `dx = A x dt + L dβ` between them (Van Loan's matrix fraction), and the steps of
`KalmanFilter.from_continuous` (in `_layer.py`). See `docs/devdocs/kalman.md`,
"Continuous-time models"."""

from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Real

from .._misc import check_parameter_dtype, error_if_any, full_precision
from ._linalg import mT, sym
from ._model import PriorAt


# Doublings of a step at most: a step whose Van Loan matrix has a 1-norm up to
# 2^32 is split into halves until that norm is at most 1 (see `_first_step`).
_MAX_DOUBLINGS = 32


def _real(name: str, x: Any, where: str) -> None:
    if not (
        jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
    ):
        raise ValueError(f"{where}: `{name}` must be a real array, got {x.dtype}.")


def model_dtype(arrays: dict[str, Any], dtype: Any, where: str) -> Any:
    """`dtype`, or the common floating dtype of the model's `arrays` (the times
    excluded: they are data, and their gaps are taken before any cast)."""
    given = {k: jnp.asarray(v) for k, v in arrays.items() if v is not None}
    for k, v in given.items():
        _real(k, v, where)
    if dtype is None:
        dtype = jnp.result_type(*[v.dtype for v in given.values()])
        if not jnp.issubdtype(dtype, jnp.floating):
            dtype = None
    return check_parameter_dtype("KalmanFilter", dtype)


def _check_steps(dts: Any, strict: bool, msg: str) -> Any:
    """`dts`, with an error unless every entry is finite and positive (`strict`) or
    non-negative: a `ValueError` now if `dts` is concrete, else at run time."""
    if isinstance(dts, jax.core.Tracer):
        bad = ~jnp.isfinite(dts) | ((dts <= 0) if strict else (dts < 0))
        return error_if_any(dts, bad, msg)
    d = np.asarray(dts)
    if not np.all(np.isfinite(d)) or np.any(d <= 0 if strict else d < 0):
        raise ValueError(msg)
    return dts


@full_precision
def _first_step(A: Array, G: Array, dt: Array) -> tuple[Array, Array, Array, Array]:
    """`(F, Q / g, k, g)`: the step `dt / 2^k` that `k` doublings make `dt`, with
    `G = L Qc L^T` and `g` its scale.

    Van Loan: `expm([[-A, G], [0, A^T]] dt) = [[., U], [0, V]]`, `F = V^T`,
    `Q = F U`. The exponential grows like `e^{|A| dt}` in its upper blocks, which
    overflows for a long step of a stable model (float32: `|A| dt` near 88), and
    `jax.scipy.linalg.expm` returns NaN beyond 16 squarings of its own. So a step
    whose matrix has a 1-norm `ν > 1` is computed for `dt / 2^k`, `k = ⌈log2 ν⌉`,
    then doubled `k` times (`_doubled`). `G` enters linearly, so it is scaled to
    unit norm first, and the scale put back on `Q`: its units never decide the
    number of halvings.
    """
    n = A.shape[-1]
    g = lax.stop_gradient(jnp.max(jnp.sum(jnp.abs(G), axis=-2)))
    g = jnp.where(g > 0, g, jnp.ones_like(g))
    M = jnp.block([[-A, G / g], [jnp.zeros_like(A), mT(A)]]) * dt
    nu = lax.stop_gradient(jnp.max(jnp.sum(jnp.abs(M), axis=-2)))
    # nu = 0 (dt = 0) gives log2 = -inf: clipped to no halving
    k = jnp.clip(jnp.ceil(jnp.log2(nu)), 0, _MAX_DOUBLINGS)
    E = jsl.expm(M / 2**k)
    F = mT(E[n:, n:])
    return F, sym(F @ E[:n, n:]), k, g


@full_precision
def _doubled(F: Array, Q: Array, k: Array) -> tuple[Array, Array, Array]:
    """`k` doublings of a step: `F ← F F`, `Q ← Q + F Q F^T` (a sum of positive
    semi-definite terms), in a scan of fixed length that masks those beyond `k`,
    and whether all `k` were done.

    A doubling whose products could overflow (by a bound on their entries) is not
    done, and its inputs are zeroed: an inf in a product, even one masked out,
    would make the reverse-mode derivative NaN (a zero cotangent times the inf).
    `_doubled_rescaled` does those steps.
    """
    n = F.shape[-1]
    big = jnp.finfo(F.dtype).max / 4

    def double(carry, i):
        F, Q, done = carry
        f2 = n * jnp.max(jnp.abs(lax.stop_gradient(F))) ** 2
        q = jnp.max(jnp.abs(lax.stop_gradient(Q)))
        safe = (f2 <= big) & (q + n * f2 * q <= big)  # NaN (0 · inf): not safe
        F, Q = jnp.where(safe, F, 0), jnp.where(safe, Q, 0)
        doubled = (F @ F, sym(Q + F @ Q @ mT(F)), done + 1)
        keep = (i < k) & safe
        return jax.tree.map(lambda d, c: jnp.where(keep, d, c), doubled, carry), None

    steps = jnp.arange(_MAX_DOUBLINGS, dtype=k.dtype)
    (F, Q, done), _ = lax.scan(double, (F, Q, jnp.zeros_like(k)), steps)
    return F, Q, done == k


def _exponent(x: Array) -> Array:
    """`⌊log2 |x|⌋` elementwise, `-inf` at 0; no derivative (a scale's exponent)."""
    return jnp.floor(jnp.log2(jnp.abs(lax.stop_gradient(x))))


def _finite_or_zero(e: Array) -> Array:
    # the exponent of an all-zero row: any scale is exact, 0 keeps the sums finite
    return jnp.where(jnp.isfinite(e), e, jnp.zeros_like(e))


def _pow2(e: Array, dtype: Any) -> Array:
    """`2^e` for integer-valued `e`, exactly (its bits are written, where `exp2`
    may round), for `e` in the normal range; `e` at or below `-bias` gives 0, above
    `bias` the largest power."""
    info = jnp.finfo(dtype)
    bias = info.maxexp - 1
    itype = jnp.int32 if info.bits == 32 else jnp.int64
    e = jnp.clip(e, -bias, bias).astype(itype)
    return lax.bitcast_convert_type((e + bias) << info.nmant, dtype)


def _times_pow2(x: Array, e: Array) -> Array:
    """`x 2^e` rounded once, for any integer-valued `e`: ±inf where it overflows,
    0 where it underflows or `x = 0` (never `0 · inf`), in three exact factors of
    the sign of `e`, which cover every `e` whose product with a nonzero `x` of at
    most a few units is representable."""
    bias = jnp.finfo(x.dtype).maxexp - 1
    for _ in range(3):
        part = jnp.clip(e, 1 - bias, bias - 1)
        x, e = x * _pow2(part, x.dtype), e - part
    return x


@full_precision
def _doubled_rescaled(F: Array, Q: Array, k: Array, g: Array) -> tuple[Array, Array]:
    """`_doubled`'s `(F, g Q)` for a step whose doublings may overflow: the
    doublings of `F = D F̂` and `Q = D Q̂ D`, `D = diag(2^s)`, with each row of
    `F̂` and diagonal entry of `Q̂` at most about 1 and one of them near 1, and only
    the last products rounded to the dtype.

    The products' sums are scaled by powers of two (exact) that bring their largest
    term near 1, so an entry comes out as the plain doublings would give it with an
    unbounded exponent range: ±inf where it overflows, and no `0 · inf` or
    `inf - inf` (NaN) where a zero or a finite entry meets an overflowing one. An
    entry smaller than the scale of its row (`2^{s_i}`, of `F`) or of its row and
    column (`2^{s_i + s_j}`, of `Q`) by more than the dtype's range comes out 0.
    """
    dtype = F.dtype

    def double(carry, i):
        F, Q, s = carry
        # F D: row i of F F and of F Q F^T is 2^{s_i} sum_j F̂_ij 2^{s_j} (...)_j,
        # whose largest term is 2^{m_i}: H is F̂ D scaled by 2^{-m_i}
        m = _finite_or_zero(jnp.max(s[None, :] + _exponent(F), axis=1))
        H = F * _pow2(s[None, :] - m[:, None], dtype)
        v = s + m
        # both in the scale u, the larger of the old and the product's
        u = jnp.maximum(s, v)
        a, b = _pow2(s - u, dtype), _pow2(v - u, dtype)
        F2 = (H @ F) * b[:, None]
        Q2 = Q * a[:, None] * a[None, :] + (H @ Q @ mT(H)) * b[:, None] * b[None, :]
        # back to rows of F̂ and a diagonal of Q̂ at most about 1 (and
        # |Q̂_ij| <= sqrt(Q̂_ii Q̂_jj) bounds the rest)
        row = _exponent(jnp.max(jnp.abs(F2), axis=1))
        diag = jnp.floor(_exponent(jnp.diagonal(Q2)) / 2)
        d = _finite_or_zero(jnp.maximum(row, diag))
        c = _pow2(-d, dtype)
        doubled = (F2 * c[:, None], sym(Q2 * c[:, None] * c[None, :]), u + d)
        keep = i < k
        return jax.tree.map(lambda d, c: jnp.where(keep, d, c), doubled, carry), None

    s = jnp.zeros(F.shape[-1], dtype)
    steps = jnp.arange(_MAX_DOUBLINGS, dtype=k.dtype)
    (F, Q, s), _ = lax.scan(double, (F, Q, s), steps)
    eg = _exponent(g)
    Q = _times_pow2(Q * (g * _pow2(-eg, dtype)), s[:, None] + s[None, :] + eg)
    return _times_pow2(F, jnp.broadcast_to(s[:, None], F.shape)), Q


def _discretize(
    A: Array, Qc: Array, dts: Array, L: Array | None
) -> tuple[Array, Array]:
    G = Qc if L is None else L @ Qc @ mT(L)
    with jax.default_matmul_precision("highest"):
        G = sym(G)
    F1, Q1, k, g = jax.vmap(_first_step, in_axes=(None, None, 0))(A, G, dts)
    F, Q, done = jax.vmap(_doubled)(F1, Q1, k)
    Q = g[:, None, None] * Q

    def rescaled(F, Q):
        # rematerialised in reverse mode: a `cond` computes the residuals of both
        # branches, and this one's would be zeros as large as the loop's carries
        Fr, Qr = jax.checkpoint(jax.vmap(_doubled_rescaled))(F1, Q1, k, g)
        keep = done[:, None, None]
        return jnp.where(keep, F, Fr), jnp.where(keep, Q, Qr)

    # the doublings again, rescaled, only if a step's could overflow (or its input
    # holds NaN): the plain ones are the cheaper loop
    return lax.cond(jnp.all(done), lambda F, Q: (F, Q), rescaled, F, Q)


def _check_model(A: Array, Qc: Array, L: Array | None, where: str) -> None:
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"{where}: `A` must be square, shape (n, n), got {A.shape}.")
    n = A.shape[0]
    s = n if L is None else (L.shape[1] if L.ndim == 2 else -1)
    if L is not None and (L.ndim != 2 or L.shape[0] != n or L.shape[1] < 1):
        raise ValueError(
            f"{where}: `L` must have shape ({n}, s) with s >= 1 (n = {n} from `A`), "
            f"got {L.shape}."
        )
    if Qc.shape != (s, s):
        raise ValueError(
            f"{where}: `Qc` must have shape ({s}, {s}) (the noise size s: "
            f"{'n without `L`' if L is None else 'the columns of `L`'}), got "
            f"{Qc.shape}."
        )


def discretize(
    A: Float[ArrayLike, "n n"],
    Qc: Float[ArrayLike, "s s"],
    dts: Real[ArrayLike, " T"],
    L: Float[ArrayLike, "n s"] | None = None,
) -> tuple[Float[Array, "T n n"], Float[Array, "T n n"]]:
    r"""The exact discretisation of a linear stochastic differential equation.

    For $dx = A x\, dt + L\, d\beta$, with $\beta$ a Brownian motion of diffusion
    `Qc`, the state after a step of length $\Delta t$ is
    $x(t + \Delta t) = F x(t) + q$, $q \sim N(0, Q)$, with

    $$F = e^{A \Delta t}, \qquad Q = \int_0^{\Delta t} e^{A s} L Q_c L^\top
    e^{A^\top s}\, ds.$$

    Both come from one matrix exponential per step (Van Loan, "Computing integrals
    involving the matrix exponential", IEEE TAC 1978), batched over the steps with
    `jax.vmap`, and are differentiable with respect to `A`, `Qc`, `L` and `dts`.
    A long step is split into halves and recombined exactly, so that the
    exponential neither overflows nor depends on the units of `Qc`
    (`docs/devdocs/kalman.md`, "Continuous-time models").

    Where the exact `F` or `Q` exceeds the dtype's range (an unstable `A` over a
    long step), those entries are ±inf and the others exact (0 where the exact
    value is 0 or underflows), never NaN, with finite derivatives for the finite
    entries. An index's scale is the larger of its row of `F` and the square root
    of its diagonal entry of `Q`: an entry smaller than the scale of its row (for
    `F`; of its row and column for `Q`) by more than the dtype's range comes out 0
    (the covariance of an overflowing and a finite state, say). Steps
    are exact up to `dts * (‖A‖ + 1)` of about `2^32` (`‖A‖` the largest absolute
    row or column sum of `A`); a longer one may come out NaN.

    **Arguments:**

    - `A`: the drift matrix, `(n, n)`.
    - `Qc`: the diffusion of the noise, `(s, s)`, symmetric positive
        semi-definite.
    - `dts`: the step lengths, `(T,)`, finite and non-negative; a step of length
        0 gives `F = I` and `Q = 0`.
    - `L`: the noise's loading, `(n, s)`; default the identity (`s = n`).

    **Returns:**

    `(F, Q)`, each of shape `(T, n, n)`, in the common floating dtype of `A`,
    `Qc` and `L` (the steps are cast to it).

    **Raises:**

    `ValueError` for bad shapes, or for concrete `dts` with a negative or
    non-finite entry; at run time (`eqx.error_if`) for such traced `dts`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_seq

        # the Wiener velocity model: position and velocity, noise on the velocity
        A = jnp.array([[0.0, 1.0], [0.0, 0.0]])
        L = jnp.array([[0.0], [1.0]])
        dts = jnp.array([0.1, 2.0])               # two steps of different lengths
        F, Q = eqx_seq.discretize(A, jnp.array([[0.5]]), dts, L=L)
        dt = 2.0                                  # the closed form of the second
        assert jnp.allclose(F[1], jnp.array([[1.0, dt], [0.0, 1.0]]))
        Q1 = 0.5 * jnp.array([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]])
        assert jnp.allclose(Q[1], Q1)
        ```
    """
    where = "eqx_seq.discretize"
    dtype = model_dtype({"A": A, "Qc": Qc, "L": L}, None, where)
    A, Qc = jnp.asarray(A, dtype), jnp.asarray(Qc, dtype)
    L = None if L is None else jnp.asarray(L, dtype)
    _check_model(A, Qc, L, where)
    dts = dts if isinstance(dts, jax.core.Tracer) else np.asarray(dts)
    if dts.ndim != 1:
        raise ValueError(f"{where}: `dts` must have shape (T,), got {dts.shape}.")
    _real("dts", dts, where)
    dts = _check_steps(dts, False, f"{where}: `dts` must be finite and non-negative.")
    return _discretize_jit(A, Qc, jnp.asarray(dts, dtype), L)


# one compiled program per shape: run op by op, the vmapped exponential and its
# doublings would dispatch many small programs at every call
_discretize_jit = eqx.filter_jit(_discretize)


def continuous_matrices(
    A: Any,
    Qc: Any,
    times: Any,
    L: Any,
    prior_time: Any,
    prior_at: PriorAt,
    dtype: Any,
) -> tuple[Array, Array]:
    """`(F, Q)` of `KalmanFilter.from_continuous`: the transitions into each of
    `times`, from `prior_time` (`prior_at="x0"`) or, for the first, a placeholder
    `(I, I)` that the filter never reads (`"x1"`)."""
    where = "eqx_seq.KalmanFilter.from_continuous"
    A, Qc = jnp.asarray(A, dtype), jnp.asarray(Qc, dtype)
    L = None if L is None else jnp.asarray(L, dtype)
    _check_model(A, Qc, L, where)
    traced = isinstance(times, jax.core.Tracer) or isinstance(
        prior_time, jax.core.Tracer
    )
    xp = jnp if traced else np
    times = xp.asarray(times)
    if times.ndim != 1 or times.shape[0] < 1:
        raise ValueError(
            f"{where}: `times` must have shape (T,) with T >= 1, got {times.shape}."
        )
    _real("times", times, where)
    if prior_at == "x0":
        if prior_time is None:
            raise ValueError(
                f'{where}: prior_at="x0" needs `prior_time`, the time of the state '
                "the prior `(m0, P0)` describes (before `times[0]`)."
            )
        prior_time = xp.asarray(prior_time)
        if prior_time.shape != ():
            raise ValueError(f"{where}: `prior_time` must be a scalar.")
        _real("prior_time", prior_time, where)
        if traced:
            times = jnp.concatenate(
                [prior_time[None].astype(dtype), times.astype(dtype)]
            )
        else:
            times = np.concatenate([prior_time[None], times])  # numpy's promotion
        what = "`prior_time` and `times`"
    elif prior_time is not None:
        raise ValueError(
            f'{where}: `prior_time` is for prior_at="x0"; with "x1" the prior '
            "`(m0, P0)` is the law of the state at `times[0]`."
        )
    else:
        what = "`times`"
    msg = f"{where}: {what} must be finite and strictly increasing."
    if traced:
        times = error_if_any(times, ~jnp.isfinite(times), msg)
    elif not np.all(np.isfinite(times)):
        raise ValueError(msg)
    # the gaps in the times' own precision, before any cast
    dts = _check_steps(xp.diff(times), True, msg)
    dts = jnp.asarray(dts, dtype)
    if prior_at == "x1":
        dts = jnp.concatenate([jnp.zeros((1,), dtype), dts])
    F, Q = _discretize_jit(A, Qc, dts, L)
    if prior_at == "x1":
        # no transition into the first time: Q = 0 there, which is not positive
        # definite, so a placeholder (read by no algorithm)
        Q = Q.at[0].set(jnp.eye(A.shape[0], dtype=dtype))
    return F, Q
