"""Non-finite values in a chunked scan: what keeps packed documents apart.

A masked weight times a value that is not finite is NaN (`0 * nan`), and every
product of a chunk sums over steps that its mask leaves out, in the forward pass
and in the backward. So the chunks only ever meet finite values:

- each non-finite input entry is replaced by zero (`finite`), and the outputs (and
  the final state) that depend on one are set to NaN afterwards by a select. Which
  ones do is counted: per step, the non-finite inputs since its segment's start
  (`met_within` and `count_last`, inside a chunk; the scan carries them between chunks).
- the cotangents of the outputs are made finite before they enter the chunks'
  products (`finite_cotangent`: a NaN cotangent at a finite output comes from the
  layers after it, e.g. a convolution's backward over a bad step). What a
  non-finite one means reaches the derivatives through a link instead: zero in
  value, a sum of the inputs over the steps each output depends on, computed by
  selection (`segment_sums`, a running sum), whose transpose gives those inputs a
  NaN derivative, as autodiff through the recurrent form would, and nothing else.

The derivation is in `docs/devdocs/ssd.md`.
"""

import functools as ft

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._misc import vary_like
from .._recurrence import linear_recurrence


def into_chunks(chunk: int, v: Array, *shape: int) -> Array:
    """`v` `(T, *shape, ...)` padded with zeros to whole chunks of `chunk` steps, cut
    into them and made head-major: `(K, *shape, chunk, ...)`, `shape` the axes
    before the steps."""
    v = jnp.pad(v, [(0, -v.shape[0] % chunk)] + [(0, 0)] * (v.ndim - 1))
    v = v.reshape(-1, chunk, *v.shape[1:])
    return jnp.moveaxis(v, 1, 1 + len(shape))


@jax.checkpoint
def finite(v: Array) -> tuple[Array, Array]:
    """`(v with its non-finite entries zero, where they were)`."""
    bad = ~jnp.isfinite(v)
    return jnp.where(bad, jnp.zeros((), v.dtype), v), bad


@jax.custom_jvp
def finite_cotangent(v: Array) -> Array:
    """`v`, whose cotangent has its non-finite entries replaced by zero. Only the
    tangent carries the rule, so a program that does not differentiate is left
    as it was."""
    return v


@finite_cotangent.defjvp
def _finite_cotangent_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    clean = lambda _, g: jnp.where(jnp.isfinite(g), g, jnp.zeros((), g.dtype))
    return v, jax.lax.custom_linear_solve(lambda u: u, dv, lambda _, u: u, clean)


def segment_mask(starts: Array | None, Q: int) -> Array:
    """Which steps reach which inside a chunk, `(K, Q, Q)` (`(1, Q, Q)` without
    resets): `[k, s, t]` for `t <= s` in one segment (`starts` `(K, Q)`, the
    resets, or `None`)."""
    same = (jnp.arange(Q)[:, None] >= jnp.arange(Q)[None, :])[None]
    if starts is not None:
        segment = jnp.cumsum(starts, axis=1)
        same = (segment[:, :, None] == segment[:, None, :]) & same
    return same


def met_within(bad: Array, starts: Array | None) -> Array:
    """Whether each step has met one of `bad` `(K, Q, M)` (zeros and ones) since
    its segment started in its chunk, `(K, Q, M)` bools: a product of the counts
    with the segment mask (no gradient flows here)."""
    same = segment_mask(starts, bad.shape[1]).astype(bad.dtype)
    return jnp.einsum("kst,ktm->ksm", same, jax.lax.stop_gradient(bad)) > 0


def count_last(bad: Array, starts: Array | None) -> Array:
    """How many of `bad` `(K, Q, M)` the last segment of each chunk holds, `(K, M)`."""
    same = segment_mask(starts, bad.shape[1])[:, -1].astype(bad.dtype)
    return jnp.einsum("kt,ktm->km", same, jax.lax.stop_gradient(bad))


def segment_sums(v: Array, starts: Array | None) -> Array:
    """The sums of `v` `(K, Q, M)` over each step's segment in its chunk, up to it:
    a running sum along the steps that restarts at a reset by selection (the
    transpose of a masked product would spread a NaN), one `(K, M)` slice at a
    time, so that neither it nor its transpose forms a `(Q, Q)` weight per entry
    of `v`."""
    restart = jnp.zeros(v.shape[:2], bool) if starts is None else starts > 0

    def step(total, row):
        v_t, restart_t = row
        total = jnp.where(restart_t[:, None], v_t, total + v_t)
        return total, total

    rows = (jnp.moveaxis(v, 1, 0), jnp.moveaxis(restart, 1, 0))
    _, sums = jax.lax.scan(step, jnp.zeros_like(v[:, 0]), rows)
    return jnp.moveaxis(sums, 0, 1)


def keeps(starts: Array | None, K: int, dtype) -> Array:
    """`(K,)`: one for a chunk without a reset (it carries what enters it on), zero
    for one with."""
    if starts is None:
        return jnp.ones((K,), dtype)
    return (1 - jnp.max(starts, axis=1)).astype(dtype)


def reads(starts: Array | None, K: int, Q: int) -> Array:
    """`(K, Q)`: the steps of each chunk before its first reset, which read what
    enters it."""
    if starts is None:
        return jnp.ones((K, Q), bool)
    return jnp.cumsum(starts, axis=1) == 0


@ft.partial(jax.custom_jvp, nondiff_argnums=(0,))
def link(scan, per_step: Array, per_output: Array, starts, h0: Array):
    """Zeros like `per_output` `(K, Q, M)` and `h0` `(M,)`, whose derivative is zero
    times the sums of `per_step` `(K, Q, M)` over each step's segment up to it
    (from `h0` before the first reset), plus `per_output`. Added to outputs, its
    transpose gives a NaN derivative to what each output with a non-finite
    cotangent depends on. The sums are only computed when differentiating."""
    # zeros computed from every input, so that under `jax.vmap` they are batched
    # as the tangents are (a `zeros_like` of a batched input is not)
    inputs = (per_step, per_output, h0) + (() if starts is None else (starts,))
    touched = sum(jnp.sum(v).astype(per_output.dtype) for v in inputs)
    zero = jax.lax.select(False, touched, jnp.zeros((), touched.dtype))
    return (
        jnp.broadcast_to(zero.astype(per_output.dtype), per_output.shape),
        jnp.broadcast_to(zero.astype(h0.dtype), h0.shape),
    )


@link.defjvp
def _link_jvp(scan, primals, tangents):
    per_step, per_output, starts, h0 = primals
    d_step, d_output, _, d_h0 = tangents
    K, Q, M = per_step.shape
    sums = segment_sums(d_step, starts)
    keep = jnp.broadcast_to(keeps(starts, K, d_step.dtype)[:, None], (K, M))
    d_h0 = vary_like(d_h0, d_step)
    # the recurrence's tangent, not the recurrence of the tangents: this rule is
    # transposed, and the tangent has its transpose written out (the reverse
    # recurrence on the backend), where transposing the backend's own recurrence
    # would transpose its exchange, which need not be linear in the states (the
    # `ppermute` exchange sends a block's decays and state as one array)
    recurrence = lambda b, h0: linear_recurrence(keep, b, h0, scan=scan)
    zeros = (jnp.zeros_like(sums[:, -1]), jnp.zeros_like(d_h0))
    total = jax.jvp(recurrence, zeros, (sums[:, -1], d_h0))[1]
    entering = jnp.where(
        reads(starts, K, Q)[..., None], scan.shift(total, d_h0)[:, None], 0
    )
    tangent = (0 * (sums + entering + d_output), 0 * total[-1])
    return link(scan, *primals), tangent
