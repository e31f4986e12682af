"""Parallel cyclic reduction, and the shifts along the solve axis that it shares with
[`eqx_seq.tridiagonal_solve`][]."""

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array


# ------------------------------------------------------ parallel cyclic reduction
def shift(x: Array, s: int, axis: int, fill: float, *, down: bool) -> Array:
    """`x[i - s]` (`down`) or `x[i + s]` along `axis`, `fill` outside the range."""
    n = x.shape[axis]
    s = min(s, n)
    pad = [(0, 0, 0)] * x.ndim
    if down:
        kept = lax.slice_in_dim(x, 0, n - s, axis=axis)
        pad[axis] = (s, 0, 0)
    else:
        kept = lax.slice_in_dim(x, s, n, axis=axis)
        pad[axis] = (0, s, 0)
    return lax.pad(kept, jnp.asarray(fill, x.dtype), pad)


def zero_corners(l: Array, u: Array, axis: int) -> tuple[Array, Array]:
    """`l[0]` and `u[-1]` along `axis` (the ignored entries) set to zero."""
    n = l.shape[axis]
    index = lax.broadcasted_iota(jnp.int32, (1,) * axis + (n,), axis)
    index = index.reshape(index.shape + (1,) * (l.ndim - axis - 1))
    l = jnp.where(index == 0, jnp.zeros((), l.dtype), l)
    u = jnp.where(index == n - 1, jnp.zeros((), u.dtype), u)
    return l, u


def pcr(l, d, u, r, *, axis: int, transpose: bool) -> Array:
    """Parallel cyclic reduction along `axis`.

    Round `k` (`s = 2^k`) eliminates each row's couplings to rows `i - s` and
    `i + s` with those rows, leaving couplings at distance `2s`; after
    `ceil(log2 n)` rounds every row is decoupled. Rows are kept scaled to a unit
    diagonal, so a round costs one reciprocal per row; rows outside the system act
    as identity rows. The rounds are a `fori_loop` (a dynamic shift): unrolled,
    XLA fused them, recomputed earlier rounds and compiled slower.
    """
    if transpose:
        l, u = shift(u, 1, axis, 0, down=True), shift(l, 1, axis, 0, down=False)
    n = r.shape[axis]
    index = lax.broadcasted_iota(jnp.int32, (1,) * axis + (n,), axis)
    index = index.reshape(index.shape + (1,) * (r.ndim - axis - 1))
    zero = jnp.zeros((), r.dtype)
    inv = 1 / d
    l, u = zero_corners(l * inv, u * inv, axis)
    full = jnp.broadcast_shapes(l.shape, u.shape, r.shape)
    l, u, r = (jnp.broadcast_to(x, full) for x in (l, u, r * inv))

    def round_(k, state):
        l, u, r = state
        s = jnp.left_shift(1, k)
        # x[i - s] and x[i + s], zero outside the system
        down = lambda x: jnp.where(index >= s, jnp.roll(x, s, axis=axis), zero)
        up = lambda x: jnp.where(index < n - s, jnp.roll(x, -s, axis=axis), zero)
        inv = 1 / (1 - l * down(u) - u * up(l))
        return (
            -l * down(l) * inv,
            -u * up(u) * inv,
            (r - l * down(r) - u * up(r)) * inv,
        )

    _, _, r = lax.fori_loop(0, (n - 1).bit_length(), round_, (l, u, r))
    return r
