"""Batched tridiagonal solves along any axis, differentiated implicitly.

The backend picks the method: Thomas for [`eqx_seq.SequentialScan`][] (sweeps over
blocks of systems, `_tridiagonal/_thomas.py`), parallel cyclic reduction for
[`eqx_seq.AssociativeScan`][] (`_tridiagonal/_pcr.py`), and
`jax.lax.linalg.tridiagonal_solve` for `pivoting=True`. Derivatives are implicit,
never autodiff through the sweeps: Thomas's `jax.custom_jvp` reuses the factors of
its primal pass for the tangent and the adjoint, and the other two methods solve
with `A^T` inside `jax.lax.custom_linear_solve`. See `docs/devdocs/tridiagonal.md`.
"""

import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Inexact

from .._misc import error_if_any, vary_like
from .._scan import AbstractScan, AutoScan, check_scan
from ._pcr import pcr, shift, zero_corners
from ._thomas import lu_solve, thomas


# ------------------------------------------------------------- the public solve
def _matvec(l, d, u, x, *, axis: int) -> Array:
    """`A x` for the tridiagonal `A`: `l[i] x[i-1] + d[i] x[i] + u[i] x[i+1]`."""
    below = shift(x, 1, axis, 0, down=True)
    above = shift(x, 1, axis, 0, down=False)
    return l * below + d * x + u * above


@ft.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6))
def _thomas_solve(
    l, d, u, r, axis: int, unroll: int, block_bytes: int | None = None
) -> Array:
    """Thomas, differentiated by the rule below (never through the sweeps).
    `block_bytes`: as `thomas`'s (`None`: the backend's default)."""
    return thomas(l, d, u, r, axis=axis, unroll=unroll, block_bytes=block_bytes)


@_thomas_solve.defjvp
def _thomas_solve_jvp(axis, unroll, block_bytes, primals, tangents):
    # one primal sweep that also keeps the factors; the tangent is one solve with
    # them, x' = A^{-1}(r' - A' x), and its transpose (reverse mode) one solve with
    # A^T = U^T L^T: two sweeps of multiplications, then elementwise products
    l, d, u, r = primals
    dl, dd, du, dr = tangents
    x, factors = thomas(
        l, d, u, r, axis=axis, unroll=unroll, factors=True, block_bytes=block_bytes
    )
    full = x.shape
    matvec = lambda v: jnp.broadcast_to(_matvec(l, d, u, v, axis=axis), full)
    rhs = jnp.broadcast_to(dr - _matvec(dl, dd, du, x, axis=axis), full)
    dx = lax.custom_linear_solve(
        matvec,
        rhs,
        lambda _, b: lu_solve(factors, b, transpose=False),
        lambda _, b: lu_solve(factors, b, transpose=True),
    )
    return x, dx


def _pivoting_solve(l, d, u, r, *, axis: int) -> Array:
    full = r.shape
    # LAPACK and cuSPARSE have no half precision: solve those in float32
    work = r.dtype if jnp.finfo(r.dtype).bits >= 32 else jnp.dtype(jnp.float32)
    move = lambda x: jnp.moveaxis(jnp.broadcast_to(x, full), axis, -1).astype(work)
    x = lax.linalg.tridiagonal_solve(move(l), move(d), move(u), move(r)[..., None])
    return jnp.moveaxis(x[..., 0], -1, axis).astype(r.dtype)


def _checked(l, d, u, r, x, *, axis: int, dominance: bool) -> Array:
    """`x`, raising through `eqx.error_if` for non-dominant or singular systems."""
    if dominance:
        l, u = zero_corners(l, u, axis)
        a_l, a_d, a_u = jnp.abs(l), jnp.abs(d), jnp.abs(u)
        by_rows = jnp.all(a_d >= a_l + a_u, axis=axis)
        below = shift(a_u, 1, axis, 0, down=True)  # |A[i-1, i]|
        above = shift(a_l, 1, axis, 0, down=False)  # |A[i+1, i]|
        by_columns = jnp.all(a_d >= below + above, axis=axis)
        x = error_if_any(
            x,
            ~(by_rows | by_columns),
            "eqx_seq.tridiagonal_solve: a system is not diagonally dominant (by rows "
            "or by columns), so the solve without pivoting may be inaccurate. Use "
            "`pivoting=True`, or build a dominant matrix (see "
            "eqx_seq.TridiagonalImplicit).",
        )
    return error_if_any(
        x,
        ~jnp.all(jnp.isfinite(x)),
        "eqx_seq.tridiagonal_solve: the solution is not finite: a system is singular "
        "(a zero pivot) or its inputs are not finite.",
    )


@eqx.filter_jit
def _solve(l, d, u, r, axis, scan, pivoting, check):
    full = r.shape
    if not scan.parallel and not pivoting:
        x = _thomas_solve(l, d, u, r, axis, scan.unroll)
        if check:
            x = _checked(l, d, u, r, x, axis=axis, dominance=True)
        return x
    l, d, u = (vary_like(x, r) for x in (l, d, u))  # for `shard_map`: see `vary_like`
    if pivoting:
        solve = lambda _, b: _pivoting_solve(l, d, u, b, axis=axis)
        transpose_solve = lambda _, b: _pivoting_solve(
            shift(u, 1, axis, 0, down=True),
            d,
            shift(l, 1, axis, 0, down=False),
            b,
            axis=axis,
        )
    else:
        solve = lambda _, b: pcr(l, d, u, b, axis=axis, transpose=False)
        transpose_solve = lambda _, b: pcr(l, d, u, b, axis=axis, transpose=True)
    matvec = lambda x: jnp.broadcast_to(_matvec(l, d, u, x, axis=axis), full)
    x = lax.custom_linear_solve(matvec, r, solve, transpose_solve)
    if check:
        x = _checked(l, d, u, r, x, axis=axis, dominance=not pivoting)
    return x


def tridiagonal_solve(
    lower: Inexact[ArrayLike, "..."],
    diag: Inexact[ArrayLike, "..."],
    upper: Inexact[ArrayLike, "..."],
    rhs: Inexact[ArrayLike, "..."],
    *,
    axis: int = 0,
    scan: AbstractScan = AutoScan(),
    pivoting: bool = False,
    check: bool = False,
) -> Inexact[Array, "..."]:
    r"""Solve tridiagonal systems $A x = r$ along `axis`, many at once.

    Row $i$ of each system reads
    $\text{lower}_i x_{i-1} + \text{diag}_i x_i + \text{upper}_i x_{i+1} = r_i$;
    `lower[0]` and `upper[-1]` (along `axis`) are ignored, as in
    `jax.lax.linalg.tridiagonal_solve`. Every other axis indexes independent
    systems, and the four inputs broadcast against each other NumPy-style, so one
    set of diagonals can serve many right-hand sides (give it size 1 on those axes)
    without being copied.

    **Methods.** The backend picks the algorithm by what it declares: a sequential
    one (`parallel = False`, after `select()`) runs Thomas with its `unroll`, a
    parallel one PCR; a backend that declares neither is refused.

    - [`eqx_seq.SequentialScan`][] (the `AutoScan` choice on CPU): the Thomas
        algorithm (Gaussian elimination without pivoting; Thomas 1949), `O(n)` per
        system, swept over blocks of systems that stay in cache, never transposing
        the whole array. XLA runs it on one thread; for several cores, split the
        systems over CPU devices with `jax.shard_map`
        (`docs/usage/several-devices.md`): sharded inputs without it are gathered.
    - [`eqx_seq.AssociativeScan`][] (the `AutoScan` choice on GPU/TPU): parallel
        cyclic reduction (PCR; Hockney 1965), `ceil(log2 n)` rounds of elementwise
        updates, `O(n log n)` work in `O(log n)` depth, for a few long systems on
        parallel hardware.
    - `pivoting=True` (then `scan` is not used): `jax.lax.linalg.tridiagonal_solve`,
        LAPACK `gtsv` with partial pivoting on CPU, for matrices that are not
        diagonally dominant; it moves `axis` last and copies broadcast inputs. On a
        GPU it is the fastest method, but JAX's batched GPU path (cuSPARSE) does
        *not* pivot.

    `docs/devdocs/tridiagonal.md` explains the blocking and why PCR, not the
    associative-scan form of Thomas.

    **Stability.** Without pivoting, Thomas and PCR are backward stable for
    matrices that are diagonally dominant by rows or by columns, symmetric positive
    definite, or M-matrices (Higham 1990). Otherwise a pivot can be tiny or zero and
    the result inaccurate, `inf` or `NaN`; nothing is raised unless `check=True`.
    [`eqx_seq.TridiagonalImplicit`][] builds dominant matrices by construction.

    **Derivatives** by implicit differentiation, for every method, w.r.t. all four
    inputs: forward mode costs one more solve, $x' = A^{-1}(r' - A' x)$, reverse
    mode one solve with $A^\top$ and elementwise products; the Thomas path reuses
    the factors of its primal pass for both. `jax.grad`, `jax.jacfwd`, `jax.jacrev`,
    `jax.vmap`, `jax.jit` and higher orders all work. Complex dtypes follow JAX's
    convention (plain transposes, no conjugation).

    **Arguments:**

    - `lower`, `diag`, `upper`: the sub-, main and super-diagonal. After NumPy's
        rank alignment each must have the size `n` of `rhs` along `axis`, and
        broadcast with `rhs` elsewhere.
    - `rhs`: the right-hand sides.
    - `axis`: the axis along which the systems run (negative counts from the end),
        of the broadcast shape. Default 0: time-major, the package's convention.
    - `scan`: the backend, see above. Defaults to [`eqx_seq.AutoScan`][].
    - `pivoting`: if `True`, solve with partial pivoting (LAPACK on CPU; half
        precision is solved in float32 and returned in its own dtype).
    - `check`: if `True`, raise at run time (through `eqx.error_if`, so also under
        `jax.jit`) when a system is diagonally dominant neither by rows nor by
        columns (unless `pivoting`), or when the solution is not finite (a singular
        system, a zero pivot, or non-finite inputs). Costs a few extra passes over
        the inputs.

    **Returns:**

    The solution `x`, with the broadcast shape of the inputs and their common dtype
    (JAX's standard promotion).

    **Raises:**

    `ValueError` at trace time for an `axis` out of range, inputs whose sizes along
    `axis` differ or that do not broadcast, non-floating dtypes, an empty system, or
    an unsupported `scan`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_seq

        n, batch = 100, 8
        lower = jnp.full((n, 1), -1.0)  # shared by all 8 right-hand sides
        diag = jnp.full((n, 1), 4.0)
        upper = jnp.full((n, 1), -1.0)
        rhs = jnp.ones((n, batch))       # time-major: systems along axis 0
        x = eqx_seq.tridiagonal_solve(lower, diag, upper, rhs)
        x_pcr = eqx_seq.tridiagonal_solve(
            lower, diag, upper, rhs, scan=eqx_seq.AssociativeScan()
        )
        ```

    ??? cite "References"

        Thomas, "Elliptic problems in linear difference equations over a network",
        Watson Sci. Comput. Lab. report, 1949. Hockney, "A fast direct solution of
        Poisson's equation using Fourier analysis", J. ACM 12(1), 1965. Higham,
        "Bounding the error in Gaussian elimination for tridiagonal systems", SIAM
        J. Matrix Anal. Appl. 11(4), 1990.
    """
    scan = check_scan(scan, name="eqx_seq.tridiagonal_solve")
    try:
        arrays = [jnp.asarray(x) for x in (lower, diag, upper, rhs)]
    except TypeError as e:
        raise ValueError(f"`tridiagonal_solve` needs arrays: {e}") from e
    names = ("lower", "diag", "upper", "rhs")
    for name, x in zip(names, arrays):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"`tridiagonal_solve` needs floating or complex arrays, got {x.dtype} "
                f"for `{name}`; cast it, e.g. `{name}.astype(jnp.float32)`."
            )
    ndim = max(x.ndim for x in arrays)
    if ndim == 0:
        raise ValueError("`tridiagonal_solve` needs arrays with at least one axis.")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(
            f"`axis` must be an int in [-{ndim}, {ndim}) for inputs of up to {ndim} "
            f"dimensions, got {axis!r}."
        )
    axis %= ndim
    arrays = [x.reshape((1,) * (ndim - x.ndim) + x.shape) for x in arrays]
    sizes = {name: x.shape[axis] for name, x in zip(names, arrays)}
    n = sizes["rhs"]
    if n == 0 or any(s != n for s in sizes.values()):
        raise ValueError(
            f"`tridiagonal_solve` needs every input to have the same non-zero size "
            f"along axis={axis} (after aligning ranks as NumPy does), got {sizes}. "
            "For diagonals shared across systems, give them size 1 on the other "
            "axes, e.g. `diag[:, None]` for time-major `rhs` of shape (n, batch)."
        )
    try:
        full = jnp.broadcast_shapes(*(x.shape for x in arrays))
    except ValueError as e:
        raise ValueError(
            "The inputs of `tridiagonal_solve` must broadcast against each other, "
            f"got shapes {[x.shape for x in arrays]}."
        ) from e
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*arrays)
    l, d, u, r = (x.astype(dtype) for x in arrays)
    r = jnp.broadcast_to(r, full)
    return _solve(l, d, u, r, axis, scan, bool(pivoting), bool(check))
