"""The diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t`, its derivatives, and
the structured Jacobians of its time-invariant case.

Derivatives are written by hand, once, for every backend:

- The recurrence is the lower-bidiagonal solve `(I - diag(a) S) h = b`, `S` the shift
  down in time. Its tangent is one more solve with right-hand side
  `db_t + da_t * h_{t-1}`, expressed with `jax.lax.custom_linear_solve`, whose
  transpose (the reverse-mode adjoint) is the same recurrence run backwards in time:
  `g_t = ct_t + a_{t+1} * g_{t+1}`, then `db = g`, `da_t = g_t * h_{t-1}`. No
  conjugation: JAX's cotangents are plain transposes, also for complex dtypes.
- For a time-invariant `a` the Jacobians with respect to `a` and `h0` are diagonal
  (`dh_t/da = s_t`, `dh_t/dh0 = p_t`, each one more recurrence). When `b` is not
  being differentiated, the tangent is then `s * da + p * dh0`: elementwise, so a
  `jax.jacrev` over many outputs costs one multiply-reduce per output instead of one
  reverse solve per output.
"""

import functools as ft

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, ArrayLike, Inexact

from ._misc import vary_like
from ._scan import AbstractScan, AutoScan, check_scan, forgotten_as_zero


def _per_step(x: Array, like: Array) -> Array:
    """A time-invariant `x` (shape `S`) with a leading time axis, to broadcast."""
    return x if x.ndim == like.ndim else x[None]


def _linear_solve(scan: AbstractScan, a: Array, rhs: Array, *, reverse: bool) -> Array:
    """`h = (I - diag(a) S)^{-1} rhs`, linear in `rhs`, with a transpose rule."""
    time_invariant = a.ndim < rhs.ndim
    a = vary_like(a, rhs)  # for `shard_map`: see `vary_like`

    def matvec(h):
        return h - _per_step(a, h) * scan.shift(
            h, jnp.zeros((), h.dtype), reverse=reverse
        )

    def solve(_, r):
        return scan.recurrence(a, r, reverse=reverse)

    def transpose_solve(_, r):
        # Transpose of the shift: the same recurrence backwards in time, with the
        # decay of the step that follows, `a_{t+1}` (zero past the end).
        if time_invariant:
            a_t = a
        else:
            a_t = scan.shift(a, jnp.zeros((), a.dtype), reverse=not reverse)
        return scan.recurrence(a_t, r, reverse=not reverse)

    return lax.custom_linear_solve(matvec, rhs, solve, transpose_solve)


@ft.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _recurrence(scan: AbstractScan, reverse: bool, a: Array, b: Array, h0: Array):
    return scan.recurrence(a, b, h0, reverse=reverse)


def _previous(
    scan: AbstractScan, reverse: bool, a: Array, h: Array, h0: Array
) -> Array:
    """The state each step reads, `h_{t-1}` (`h0` first), which `da_t` multiplies
    in the derivatives: zero where a zero decay forgets a state that is not finite
    (a segment start after a bad segment), as in `decayed`'s derivative."""
    previous = scan.shift(h, h0, reverse=reverse)
    return forgotten_as_zero(_per_step(a, previous), previous)


def _is_zero(tangent) -> bool:
    return isinstance(tangent, SymbolicZero)


def _sensitivities(
    scan: AbstractScan,
    reverse: bool,
    a: Array,
    h: Array,
    h0: Array,
    *,
    wrt_a: bool,
    wrt_h0: bool,
) -> tuple[Array | None, Array | None]:
    """Diagonal Jacobians of the states for a time-invariant `a` (shape `S`).

    `s_t = dh_t/da` solves `s_t = a * s_{t-1} + h_{t-1}` from `s_{-1} = 0`;
    `p_t = dh_t/dh0 = a^(t+1)` solves `p_t = a * p_{t-1}` from `p_{-1} = 1`.
    Both are holomorphic derivatives for complex dtypes. Computed with
    `_recurrence`, so they are differentiable in turn.
    """
    s = p = None
    if wrt_a:
        previous = _previous(scan, reverse, a, h, h0)
        s = _recurrence(scan, reverse, a, previous, jnp.zeros_like(h0))
    if wrt_h0:
        p = _recurrence(scan, reverse, a, jnp.zeros_like(h), jnp.ones_like(h0))
    return s, p


def _recurrence_jvp(scan, reverse, primals, tangents):
    a, b, h0 = primals
    da, db, dh0 = tangents
    h = _recurrence(scan, reverse, a, b, h0)
    time_invariant = a.ndim < b.ndim
    if time_invariant and _is_zero(db):
        s, p = _sensitivities(
            scan, reverse, a, h, h0, wrt_a=not _is_zero(da), wrt_h0=not _is_zero(dh0)
        )
        terms = []
        if s is not None:
            terms.append(s * da[None])
        if p is not None:
            terms.append(p * dh0[None])
        return h, ft.reduce(jnp.add, terms)
    rhs = jnp.zeros_like(b) if _is_zero(db) else db
    if not _is_zero(da):
        rhs = rhs + _per_step(da, h) * _previous(scan, reverse, a, h, h0)
    if not _is_zero(dh0):
        # `dh0` enters at the first step of the whole run (of the first device's
        # block, under `ShardedScan`)
        entry = scan.shift(jnp.zeros_like(rhs), dh0, reverse=reverse)
        rhs = rhs + _per_step(a, rhs) * entry
    return h, _linear_solve(scan, a, rhs, reverse=reverse)


_recurrence.defjvp(_recurrence_jvp, symbolic_zeros=True)

# Compiled as one program even when called eagerly: op-by-op dispatch of an
# associative scan compiles dozens of small programs for every new shape. Inside a
# user's `jax.jit` this is simply inlined.
_compiled_recurrence = eqx.filter_jit(_recurrence)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return jnp.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _prepare(
    a: ArrayLike, b: ArrayLike, h0: ArrayLike | None, scan: AbstractScan, caller: str
) -> tuple[Array, Array, Array]:
    """Validate shapes, dtypes and the backend; return `(a, b, h0)` in one dtype.

    `a` comes back as `(T, *S)` (time-varying) or `S` (time-invariant).
    """
    check_scan(scan, name=f"eqx_seq.{caller}", splits_time=True)
    try:
        a, b = jnp.asarray(a), jnp.asarray(b)
        h0 = None if h0 is None else jnp.asarray(h0)
    except TypeError as e:
        raise ValueError(f"`{caller}` needs arrays for `a`, `b` and `h0`: {e}") from e
    for name, x in (("a", a), ("b", b), ("h0", h0)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"`{caller}` needs floating or complex arrays, got {x.dtype} for "
                f"`{name}`; cast it, e.g. `{name}.astype(jnp.float32)`."
            )
    if b.ndim == 0 or b.shape[0] == 0:
        raise ValueError(
            f"`{caller}` needs `b` of shape (T, *S) with at least one time step on "
            f"axis 0, got b.shape={b.shape}."
        )
    num_steps, state_shape = b.shape[0], b.shape[1:]
    expected_a = (
        f"`a` must have shape (T, *S) = {b.shape} for a time-varying decay, or "
        f"broadcast to S = {state_shape} for a time-invariant one (fewer dimensions "
        f"than `b`), got a.shape={a.shape}."
    )
    if a.ndim > b.ndim:
        raise ValueError(expected_a)
    if a.ndim == b.ndim:
        if a.shape[0] == 1:
            a = a[0]
        elif a.shape[0] != num_steps:
            raise ValueError(expected_a)
    target = b.shape if a.ndim == b.ndim else state_shape
    if not _broadcasts_to(a.shape, target):
        raise ValueError(expected_a)
    if h0 is not None and not _broadcasts_to(h0.shape, state_shape):
        raise ValueError(
            f"`h0` must broadcast to the state shape S = {state_shape} (b.shape = "
            f"(T, *S) = {b.shape}), got h0.shape={h0.shape}."
        )
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*(x for x in (a, b, h0) if x is not None))
    a = jnp.broadcast_to(a.astype(dtype), target)
    b = b.astype(dtype)
    h0 = (
        jnp.zeros(state_shape, dtype)
        if h0 is None
        else jnp.broadcast_to(h0.astype(dtype), state_shape)
    )
    return a, b, h0


def linear_recurrence(
    a: Inexact[ArrayLike, "..."],
    b: Inexact[ArrayLike, " T *S"],
    h0: Inexact[ArrayLike, "..."] | None = None,
    *,
    scan: AbstractScan = AutoScan(),
    reverse: bool = False,
) -> Inexact[Array, " T *S"]:
    r"""Solve the diagonal linear recurrence $h_t = a_t \odot h_{t-1} + b_t$.

    Differentiable in every mode (`jax.grad`, `jax.jacrev`, `jax.jacfwd`,
    `jax.hessian`) with respect to `a`, `b` and `h0`, by hand-written adjoints that
    cost one more recurrence, not autodiff through the loop; works under `jax.jit`
    and `jax.vmap`, for real and complex dtypes, with any backend.

    **Arguments:**

    - `a`: the decay. Either `(T, *S)`, time-varying (a leading axis of size 1 is
        taken as time-invariant), or anything with fewer dimensions than `b` that
        broadcasts to `S`: time-invariant. A zero decay forgets the state: there
        $h_t = b_t$ whatever $h_{t-1}$ holds, NaN and inf included (a segment start
        of packed sequences), in the values and the derivatives.
    - `b`: the inputs, shape `(T, *S)`: time on axis 0, any state shape `S`.
    - `h0`: the initial state $h_{-1}$, broadcasting to `S`; zeros if `None`.
    - `scan`: the backend, an [`eqx_seq.AbstractScan`][]. Defaults to
        [`eqx_seq.AutoScan`][].
    - `reverse`: if `True`, run from the last step to the first:
        $h_t = a_t \odot h_{t+1} + b_t$ with $h_T =$ `h0`.

    **Returns:**

    All states, shape `(T, *S)`, in the common dtype of the inputs (JAX's standard
    promotion, so a real decay with complex inputs gives complex states).

    **Raises:**

    `ValueError` at trace time for shapes that do not fit together, non-floating
    dtypes, an empty sequence, or a `scan` that is not an `AbstractScan`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_seq

        a = jnp.full(4, 0.9)          # time-invariant decay, state size 4
        b = jnp.ones((100, 4))        # 100 steps
        h = eqx_seq.linear_recurrence(a, b, scan=eqx_seq.AssociativeScan())
        ```
    """
    a, b, h0 = _prepare(a, b, h0, scan, "linear_recurrence")
    return _compiled_recurrence(scan, reverse, a, b, h0)


class RecurrenceJacobians(eqx.Module):
    """The states of a time-invariant diagonal recurrence and their diagonal Jacobians.

    Returned by [`eqx_seq.recurrence_jacobians`][]. Every field has shape `(T, *S)`:

    - `states[t]` is $h_t$;
    - `wrt_a[t]` is the diagonal of $\\partial h_t / \\partial a$: entry `i` is
        $\\partial h_t[i] / \\partial a[i]$ (with `a` broadcast to `S`);
    - `wrt_h0[t]` is the diagonal of $\\partial h_t / \\partial h_0$, i.e. $a^{t+1}$.

    For complex dtypes these are holomorphic (complex) derivatives, as returned by
    `jax.jacfwd(..., holomorphic=True)`.
    """

    states: Inexact[Array, " T *S"]
    wrt_a: Inexact[Array, " T *S"]
    wrt_h0: Inexact[Array, " T *S"]


def recurrence_jacobians(
    a: Inexact[ArrayLike, "..."],
    b: Inexact[ArrayLike, " T *S"],
    h0: Inexact[ArrayLike, "..."] | None = None,
    *,
    scan: AbstractScan = AutoScan(),
    reverse: bool = False,
) -> RecurrenceJacobians:
    r"""Jacobians of every state of $h_t = a \odot h_{t-1} + b_t$ w.r.t. `a` and `h0`.

    Because `a` is time-invariant and diagonal, $\partial h_t / \partial a$ and
    $\partial h_t / \partial h_0$ are diagonal, and their diagonals satisfy
    recurrences of their own:

    $s_t = a \odot s_{t-1} + h_{t-1}$ (from $s_{-1} = 0$) and
    $p_t = a \odot p_{t-1}$ (from $p_{-1} = 1$).

    So all `T` Jacobians cost two recurrences on top of the states, with the chosen
    backend, instead of `S` forward passes (`jax.jacfwd`) or `T * S` reverse passes
    (`jax.jacrev`) over a dense Jacobian. Under `jax.jit`, the recurrence for a field
    that is not used is removed. The result is differentiable in turn.

    **Arguments:**

    - `a`: the time-invariant decay: fewer dimensions than `b`, broadcasting to `S`.
    - `b`: the inputs, shape `(T, *S)`.
    - `h0`: the initial state, broadcasting to `S`; zeros if `None`.
    - `scan`: the backend, an [`eqx_seq.AbstractScan`][].
    - `reverse`: run from the last step to the first, as in
        [`eqx_seq.linear_recurrence`][].

    **Returns:**

    An [`eqx_seq.RecurrenceJacobians`][] with fields `states`, `wrt_a`, `wrt_h0`.

    **Raises:**

    `ValueError` for a time-varying `a` (its Jacobian is not diagonal in time: use
    `jax.jacfwd(eqx_seq.linear_recurrence)`), and for everything
    [`eqx_seq.linear_recurrence`][] rejects.
    """
    a, b, h0 = _prepare(a, b, h0, scan, "recurrence_jacobians")
    if a.ndim == b.ndim:
        raise ValueError(
            "`recurrence_jacobians` needs a time-invariant `a` (fewer dimensions than "
            f"`b`, broadcasting to S = {b.shape[1:]}), got a.shape={a.shape}. The "
            "Jacobian with respect to a time-varying decay is not diagonal in time; "
            "use `jax.jacfwd(eqx_seq.linear_recurrence)` for it."
        )
    return _jacobians(scan, reverse, a, b, h0)


@eqx.filter_jit
def _jacobians(
    scan: AbstractScan, reverse: bool, a: Array, b: Array, h0: Array
) -> RecurrenceJacobians:
    states = _recurrence(scan, reverse, a, b, h0)
    wrt_a, wrt_h0 = _sensitivities(
        scan, reverse, a, states, h0, wrt_a=True, wrt_h0=True
    )
    return RecurrenceJacobians(states=states, wrt_a=wrt_a, wrt_h0=wrt_h0)
