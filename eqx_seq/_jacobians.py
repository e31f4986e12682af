"""Structured Jacobians of a time-invariant diagonal linear recurrence."""

import equinox as eqx
from jaxtyping import Array, ArrayLike, Inexact

from ._recurrence import _prepare, _recurrence, _sensitivities
from ._scan import AbstractScan, AutoScan


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
