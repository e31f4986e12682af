"""An associative scan whose operator appears once in the program.

`jax.lax.associative_scan` unrolls its `O(log T)` levels in Python, and each level
traces the operator again on arrays of a different length: for a heavy operator
(the Kalman filter's, with Cholesky solves) the program grows with `log T`, and so
does its compile time. Here the sequence is cut into `B = T / K` blocks of `K` steps
(padded with copies of the last element) and the scan runs in three phases, every
stage of which applies the operator to one batch of `B` elements:

1. every block is scanned sequentially, all blocks at once (`K - 1` stages: step `k`
   of every block absorbs step `k - 1`);
2. the block totals are scanned by Hillis & Steele's doubling ("Data parallel
   algorithms", CACM 1986): at level `l` total `b` absorbs total `b - 2^l`
   (`ceil(log2 B)` stages);
3. every step of block `b > 0` absorbs the total of blocks `0..b-1` (`K` stages).

All stages are one `lax.scan` whose body gathers its two operands by the stage's
indices, so the operator is traced once whatever `T` is. The work is about
`2 T + B log2 B` applications at a depth of `2 K + log2 B` stages
(`lax.associative_scan`: about `2 T` at a depth of `2 log2 T`). The loop has a
static trip count, so reverse-mode autodiff works.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np


def default_block_size(num_steps: int) -> int:
    """`K = ceil(log2 T)`: depth about `2 log2 T`, as `lax.associative_scan`'s."""
    return max(1, math.ceil(math.log2(max(num_steps, 2))))


def _stages(K: int, nb: int) -> tuple[Any, ...]:
    """Per stage: the phase (1, 2, 3, see the module doc), the row of the blocks that
    it reads on the right and writes (phase 2: the scratch row `K`), and the shift
    of the totals it reads on the left (phase 1: 0, the running prefix itself)."""
    rows = [(1, k, 0) for k in range(1, K)]
    if nb > 1:
        rows += [(2, K, 2**lvl) for lvl in range(math.ceil(math.log2(nb)))]
        rows += [(3, k, 1) for k in range(K)]
    return tuple(np.asarray(col, np.int32) for col in zip(*rows))


def level_scan(
    fn: Callable, elems: Any, *, reverse: bool = False, block_size: int | None = None
) -> Any:
    """A drop-in for `jax.lax.associative_scan(fn, elems, reverse=reverse)`.

    **Arguments:**

    - `fn`: an associative operator on batches of elements: `fn(a, b)` takes two
        pytrees whose leaves have the same leading (batch) length and returns one
        like them, combining `a` (earlier; later when `reverse`) with `b`, as for
        `lax.associative_scan`. It is applied to valid elements only (padding
        repeats the last element), so it need not handle dummy inputs; lanes
        whose result is discarded combine valid elements too (the first block's
        total with another total or step).
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
    if nb * K == 1:
        return elems

    def to_blocks(x):
        # (K + 1, nb, ...): row k holds step k of every block; row K is scratch,
        # written by the stages that only update the totals
        if pad:
            x = jnp.concatenate([x, jnp.broadcast_to(x[-1:], (pad, *x.shape[1:]))])
        x = jnp.swapaxes(x.reshape(nb, K, *x.shape[1:]), 0, 1)
        return jnp.concatenate([x, x[-1:]])

    blocks = jax.tree.map(to_blocks, elems)
    b_idx = jnp.arange(nb, dtype=np.int32)

    def where(c, x, y):
        expand = lambda a: c.reshape(c.shape + (1,) * (a.ndim - c.ndim))
        return jax.tree.map(lambda a, b: jnp.where(expand(a), a, b), x, y)

    def stage(carry, s):
        # `totals` is the running prefix of every block during phase 1, then the
        # block totals (phase 2 scans them; phase 3 reads them)
        blocks, totals = carry
        phase, row, shift = s
        left = jax.tree.map(
            lambda x: jnp.take(x, jnp.maximum(b_idx - shift, 0), axis=0), totals
        )
        right = where(
            phase == 2,
            totals,
            jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, row, 0, False), blocks),
        )
        new = where(b_idx >= shift, fn(left, right), right)
        totals = where(phase == 3, totals, new)
        blocks = jax.tree.map(
            lambda x, v: lax.dynamic_update_index_in_dim(x, v, row, 0), blocks, new
        )
        return (blocks, totals), None

    first = jax.tree.map(lambda x: x[0], blocks)
    (blocks, _), _ = lax.scan(stage, (blocks, first), _stages(K, nb))
    return jax.tree.map(
        lambda x: jnp.swapaxes(x[:K], 0, 1).reshape(nb * K, *x.shape[2:])[:T], blocks
    )
