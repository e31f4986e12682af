"""Non-finite values in a chunked scan: what keeps packed documents apart.

A masked weight times a value that is not finite is NaN (`0 * nan`), and every
product of a chunk sums over steps that its mask leaves out, in the forward pass
and in the backward. So the chunks only ever meet finite values:

- each non-finite input entry is replaced by zero (`finite`), and the outputs (and
  the final state) that depend on one are set to NaN afterwards by a select. Which
  ones do is counted: per step, the non-finite inputs since its segment's start
  (`count_since_start`, inside a chunk; the scan carries them between chunks).
- the cotangents of the outputs are made finite before they enter the chunks'
  products (`finite_cotangent`: a NaN cotangent at a finite output comes from the
  layers after it, e.g. a convolution's backward over a bad step). What a
  non-finite one means reaches the derivatives through a link instead: zero in
  value, a sum of the inputs over the steps each output depends on, computed by
  selection (`segment_sums`), whose transpose gives those inputs a NaN derivative,
  as autodiff through the recurrent form would, and nothing else.

The derivation is in `docs/devdocs/ssd.md`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array


@jax.checkpoint
def finite(v: Array) -> tuple[Array, Array]:
    """`(v with its non-finite entries zero, where they were)`."""
    bad = ~jnp.isfinite(v)
    return jnp.where(bad, jnp.zeros((), v.dtype), v), bad


def finite_cotangent(v: Array) -> Array:
    """`v`, whose cotangent has its non-finite entries replaced by zero."""
    return jax.lax.custom_linear_solve(
        lambda u: u,
        v,
        lambda _, u: u,
        lambda _, g: jnp.where(jnp.isfinite(g), g, jnp.zeros((), g.dtype)),
    )


def count_since_start(bad: Array, starts: Array | None) -> Array:
    """How many of `bad` `(K, Q, M)` (zero or one) each step has met since its
    segment started in its chunk (`starts` `(K, Q)`: the resets, or `None`)."""
    total = jnp.cumsum(bad, axis=1)
    if starts is None:
        return total
    before = jnp.where(starts[..., None] > 0, total - bad, 0)
    return total - jax.lax.cummax(before, axis=1)


@jax.checkpoint  # the backward pass recomputes the `(Q, Q)` masks
def segment_sums(v: Array, starts: Array | None) -> Array:
    """The sums of `v` `(K, Q, M)` over each step's segment in its chunk, up to it,
    by selection (the transpose of a masked product would spread a NaN)."""
    Q = v.shape[1]
    same = (jnp.arange(Q)[:, None] >= jnp.arange(Q)[None, :])[None]
    if starts is not None:
        segment = jnp.cumsum(starts, axis=1)
        same = (segment[:, :, None] == segment[:, None, :]) & same
    return jnp.sum(jnp.where(same[..., None], v[:, None], 0), axis=2)
