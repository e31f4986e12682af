"""A depthwise causal convolution over time, with a step mode: the short
convolution in front of the selective recurrences (Hawk's and Mamba's)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._scan import AbstractScan


class CausalConv(eqx.Module):
    """`y_t[c] = bias[c] + sum_k weight[k, c] * x_{t - K + 1 + k}[c]`: each channel
    convolved with its own `K` taps over the current and the `K - 1` previous steps.

    The state of step mode (and of streaming in chunks) is the last `K - 1` inputs,
    shape `(K - 1, C)`, zeros before the sequence starts. Without a bias
    (`use_bias=False`, Gated DeltaNet's), `bias` is `None`.
    """

    weight: Float[Array, "K C"]
    bias: Float[Array, " C"] | None

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        *,
        use_bias: bool = True,
        dtype,
        key: PRNGKeyArray,
    ):
        # PyTorch's default for a depthwise `Conv1d` (fan-in = kernel_size), which
        # Mamba and Griffin both start from
        bound = kernel_size**-0.5
        wkey, bkey = jr.split(key)
        self.weight = jr.uniform(
            wkey, (kernel_size, channels), dtype, minval=-bound, maxval=bound
        )
        self.bias = (
            jr.uniform(bkey, (channels,), dtype, minval=-bound, maxval=bound)
            if use_bias
            else None
        )

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[0]

    def init_state(self) -> Float[Array, "K1 C"]:
        return jnp.zeros(
            (self.kernel_size - 1, self.weight.shape[1]), self.weight.dtype
        )

    def _padded(self, x: Array, state: Array | None) -> Array:
        if state is None:
            state = jnp.zeros((self.kernel_size - 1, x.shape[1]), x.dtype)
        return jnp.concatenate([state.astype(x.dtype), x])

    @staticmethod
    def _padded_segments(reset: Array, width: int) -> tuple[Array, Array]:
        """The segment of every step, and of every entry of the state and steps
        (`width` more in front, segment 0: the carried state's)."""
        segment = jnp.cumsum(reset, dtype=jnp.int32)
        return segment, jnp.concatenate([jnp.zeros(width, jnp.int32), segment])

    def _segments(self, x: Array, state: Array | None, reset: Array) -> Array:
        """The outputs with no step seeing an input from before the segment it is
        in: each output is `step` on its own window of `K` inputs, the entries from
        earlier segments (the carried `state` too, after a reset) zeroed, which is
        what a separate call on each segment gives."""
        T, K = x.shape[0], self.kernel_size
        padded = self._padded(x, state)  # (K - 1 + T, C), the state first
        segment, padded_segment = self._padded_segments(reset, K - 1)
        index = jnp.arange(T)[:, None] + jnp.arange(K)[None]  # (T, K) windows
        same = padded_segment[index] == segment[:, None]
        windows = jnp.where(same[..., None], padded[index], jnp.zeros((), x.dtype))
        return jax.vmap(self.step)(windows[:, :-1], windows[:, -1])[1]

    def block_state(
        self,
        x: Float[Array, "T C"],
        state: Float[Array, "K1 C"] | None,
        reset: Bool[Array, " T"] | None,
        scan: AbstractScan,
    ) -> Float[Array, "K1 C"]:
        """The state a block `x` of the sequence starts from, by `scan.halo`:
        `state` (zeros if `None`) where the sequence starts, which is every block on
        one device; with a backend that splits time over devices
        ([`eqx_seq.ShardedScan`][]), the last `K - 1` inputs of the device before,
        zeros for those before a segment start there (its `final_state`), which
        needs blocks of at least `K - 1` steps."""
        fill = None if state is None else state.astype(x.dtype)
        if reset is not None:
            # what the next block reads: the inputs of this block's last segment
            segment = jnp.cumsum(reset, dtype=jnp.int32)
            last = segment == segment[-1]
            x = jnp.where(last[:, None], x, jnp.zeros((), x.dtype))
        return scan.halo(x, self.kernel_size - 1, fill)

    def __call__(
        self,
        x: Float[Array, "T C"],
        state: Float[Array, "K1 C"] | None = None,
        reset: Bool[Array, " T"] | None = None,
    ) -> Float[Array, "T C"]:
        """The outputs for `x`, from `state`; `reset` (bool, `True` where a segment
        starts) keeps every window inside its own segment."""
        if reset is not None:
            return self._segments(x, state, reset)
        T = x.shape[0]
        padded = self._padded(x, state)
        weight = self.weight.astype(x.dtype)
        # K shifted products: K is small, so this beats a general convolution
        y = None if self.bias is None else self.bias.astype(x.dtype)[None]
        for k in range(self.kernel_size):
            term = weight[k][None] * padded[k : k + T]
            y = term if y is None else y + term
        return y

    def final_state(
        self,
        x: Float[Array, "T C"],
        state: Float[Array, "K1 C"] | None = None,
        reset: Bool[Array, " T"] | None = None,
    ) -> Float[Array, "K1 C"]:
        """The last `K - 1` inputs (zeros for those before the last segment's
        start), the state to continue from."""
        T = x.shape[0]
        final = self._padded(x, state)[T:]
        if reset is None:
            return final
        segment, padded_segment = self._padded_segments(reset, self.kernel_size - 1)
        last = padded_segment[T:] == segment[-1]
        return jnp.where(last[:, None], final, jnp.zeros((), x.dtype))

    def step(
        self,
        state: Float[Array, "K1 C"],
        x_t: Float[Array, " C"],
        reset: Bool[Array, ""] | bool = False,
    ) -> tuple[Float[Array, "K1 C"], Float[Array, " C"]]:
        """One step: `(state, y_t)`; `reset` starts a segment at this step."""
        state = jnp.where(reset, jnp.zeros((), x_t.dtype), state.astype(x_t.dtype))
        window = jnp.concatenate([state, x_t[None]])
        y = jnp.sum(self.weight.astype(x_t.dtype) * window, axis=0)
        if self.bias is not None:
            y = self.bias.astype(x_t.dtype) + y
        return window[1:], y
