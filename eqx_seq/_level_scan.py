"""An associative scan whose operator appears a fixed number of times in the program.

`jax.lax.associative_scan` unrolls its `O(log T)` levels in Python, and each level
traces the operator again on arrays of a different length: for a heavy operator
(the Kalman filter's, with Cholesky solves) the program grows with `log T` and took
tens of seconds to compile at `T = 10^4` on CPU. Here the levels are a loop:

1. the sequence is cut into `T / K` blocks of `K` steps (padded with copies of the
   last element), and every block is scanned sequentially, all blocks at once:
   one `lax.scan` of `K - 1` steps whose body applies the operator to a batch of
   `T / K` elements;
2. the block totals are scanned by Hillis & Steele's doubling ("Data parallel
   algorithms", CACM 1986): at level `k` element `i` absorbs element `i - 2^k`;
   the levels are one `lax.scan` over the shifts `2^k`;
3. every element of block `b > 0` absorbs the total of blocks `0..b-1`: one batched
   application.

So the operator is traced three times whatever `T` is, and the work is about
`2 T + (T / K) log2(T / K)` applications, at a depth of `K + log2(T / K) + 1`
sequential applications (`lax.associative_scan`: about `2 T` and `2 log2 T`).
All loops have static trip counts, so reverse-mode autodiff works.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp


def default_block_size(num_steps: int) -> int:
    """`K = ceil(log2 T)`: depth about `2 log2 T`, as `lax.associative_scan`'s."""
    return max(1, math.ceil(math.log2(max(num_steps, 2))))


def _doubling_scan(fn: Callable, elems: Any, n: int) -> Any:
    """Inclusive scan of `n` elements by Hillis-Steele doubling, the levels a loop."""
    if n == 1:
        return elems
    num_levels = math.ceil(math.log2(n))
    shifts = 2 ** jnp.arange(num_levels)
    idx = jnp.arange(n, dtype=shifts.dtype)

    def level(x, shift):
        keep = idx < shift  # these already hold their full prefix
        src = jnp.where(keep, 0, idx - shift)
        prev = jax.tree.map(lambda a: jnp.take(a, src, axis=0), x)
        new = fn(prev, x)
        x = jax.tree.map(
            lambda a, b: jnp.where(keep.reshape(-1, *([1] * (a.ndim - 1))), a, b),
            x,
            new,
        )
        return x, None

    x, _ = lax.scan(level, elems, shifts)
    return x


def level_scan(
    fn: Callable, elems: Any, *, reverse: bool = False, block_size: int | None = None
) -> Any:
    """A drop-in for `jax.lax.associative_scan(fn, elems, reverse=reverse)`.

    **Arguments:**

    - `fn`: an associative operator on batches of elements: `fn(a, b)` takes two
        pytrees whose leaves have the same leading (batch) length and returns one
        like them, combining `a` (earlier; later when `reverse`) with `b`, as for
        `lax.associative_scan`. It is applied to valid elements only (padding
        repeats the last element), so it need not handle dummy inputs.
    - `elems`: a pytree of arrays sharing the leading (time) length `T >= 1`.
    - `reverse`: scan from the end, with `lax.associative_scan`'s convention
        (`fn` then receives the element later in time first).
    - `block_size`: the block length `K` of the sequential first phase; default
        `ceil(log2 T)`. `K = 1` is pure doubling (`T log2 T` work); `K = T` a
        sequential scan.

    **Returns:**

    The inclusive scan, a pytree like `elems`.
    """
    leaves = jax.tree.leaves(elems)
    if not leaves:
        raise ValueError("level_scan: `elems` has no arrays.")
    T = leaves[0].shape[0] if leaves[0].ndim else 0
    if T < 1 or any(x.ndim < 1 or x.shape[0] != T for x in leaves):
        raise ValueError(
            "level_scan: every array of `elems` needs the same leading length T >= 1, "
            f"got shapes {[x.shape for x in leaves]}."
        )
    if reverse:
        flip = lambda tree: jax.tree.map(lambda x: jnp.flip(x, 0), tree)
        return flip(level_scan(fn, flip(elems), block_size=block_size))
    K = default_block_size(T) if block_size is None else block_size
    if not isinstance(K, int) or K < 1:
        raise ValueError(f"level_scan: `block_size` must be an int >= 1, got {K!r}.")
    K = min(K, T)
    nb = -(-T // K)
    pad = nb * K - T

    def to_blocks(x):
        if pad:
            x = jnp.concatenate([x, jnp.broadcast_to(x[-1:], (pad, *x.shape[1:]))])
        return x.reshape(nb, K, *x.shape[1:])

    blocks = jax.tree.map(to_blocks, elems)
    # 1. every block scanned sequentially, all blocks at once
    if K > 1:
        first = jax.tree.map(lambda x: x[:, 0], blocks)
        rest = jax.tree.map(lambda x: jnp.moveaxis(x[:, 1:], 1, 0), blocks)

        def step(carry, x):
            carry = fn(carry, x)
            return carry, carry

        _, scanned = lax.scan(step, first, rest)
        blocks = jax.tree.map(
            lambda f, s: jnp.concatenate([f[:, None], jnp.moveaxis(s, 0, 1)], axis=1),
            first,
            scanned,
        )
    if nb > 1:
        # 2. the block totals by doubling
        totals = _doubling_scan(fn, jax.tree.map(lambda x: x[:, -1], blocks), nb)
        # 3. blocks 1.. absorb the totals of the blocks before them
        before = jax.tree.map(
            lambda t: jnp.broadcast_to(t[:-1, None], (nb - 1, K, *t.shape[1:])), totals
        )
        flat = lambda x: x.reshape((nb - 1) * K, *x.shape[2:])
        later = fn(
            jax.tree.map(flat, before), jax.tree.map(lambda x: flat(x[1:]), blocks)
        )
        blocks = jax.tree.map(
            lambda b, c: jnp.concatenate([b[:1], c.reshape(nb - 1, K, *c.shape[1:])]),
            blocks,
            later,
        )
    return jax.tree.map(lambda x: x.reshape(nb * K, *x.shape[2:])[:T], blocks)
