"""A depthwise causal convolution over time, with a step mode: the short
convolution in front of the selective recurrences (Hawk's and Mamba's)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray


class CausalConv(eqx.Module):
    """`y_t[c] = bias[c] + sum_k weight[k, c] * x_{t - K + 1 + k}[c]`: each channel
    convolved with its own `K` taps over the current and the `K - 1` previous steps.

    The state of step mode (and of streaming in chunks) is the last `K - 1` inputs,
    shape `(K - 1, C)`, zeros before the sequence starts.
    """

    weight: Float[Array, "K C"]
    bias: Float[Array, " C"]

    def __init__(self, channels: int, kernel_size: int, *, dtype, key: PRNGKeyArray):
        # PyTorch's default for a depthwise `Conv1d` (fan-in = kernel_size), which
        # Mamba and Griffin both start from
        bound = kernel_size**-0.5
        wkey, bkey = jr.split(key)
        self.weight = jr.uniform(
            wkey, (kernel_size, channels), dtype, minval=-bound, maxval=bound
        )
        self.bias = jr.uniform(bkey, (channels,), dtype, minval=-bound, maxval=bound)

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[0]

    def init_state(self) -> Float[Array, "K1 C"]:
        return jnp.zeros((self.kernel_size - 1, self.weight.shape[1]), self.bias.dtype)

    def _padded(self, x: Array, state: Array | None) -> Array:
        if state is None:
            state = jnp.zeros((self.kernel_size - 1, x.shape[1]), x.dtype)
        return jnp.concatenate([state.astype(x.dtype), x])

    def _segments(
        self, x: Array, state: Array | None, reset: Array
    ) -> tuple[Array, Array]:
        """Outputs and final state with no step seeing an input from before the
        segment it is in: each output is `step` on its own window of `K` inputs,
        the entries from earlier segments (the carried `state` too, after a reset)
        zeroed, which is what a separate call on each segment gives."""
        T, K = x.shape[0], self.kernel_size
        padded = self._padded(x, state)  # (K - 1 + T, C), the state first
        # the segment of every padded entry: 0 for the carried state
        segment = jnp.cumsum(reset, dtype=jnp.int32)
        padded_segment = jnp.concatenate([jnp.zeros(K - 1, jnp.int32), segment])
        index = jnp.arange(T)[:, None] + jnp.arange(K)[None]  # (T, K) windows
        same = padded_segment[index] == segment[:, None]
        windows = jnp.where(same[..., None], padded[index], jnp.zeros((), x.dtype))
        _, y = jax.vmap(self.step)(windows[:, :-1], windows[:, -1])
        last = padded_segment[T:] == segment[-1]
        final = jnp.where(last[:, None], padded[T:], jnp.zeros((), x.dtype))
        return y, final

    def __call__(
        self,
        x: Float[Array, "T C"],
        state: Float[Array, "K1 C"] | None = None,
        reset: Bool[Array, " T"] | None = None,
    ) -> Float[Array, "T C"]:
        """The outputs for `x`, from `state`; `reset` (bool, `True` where a segment
        starts) keeps every window inside its own segment."""
        if reset is not None:
            return self._segments(x, state, reset)[0]
        T = x.shape[0]
        padded = self._padded(x, state)
        weight = self.weight.astype(x.dtype)
        # K shifted products: K is small, so this beats a general convolution
        y = self.bias.astype(x.dtype)[None]
        for k in range(self.kernel_size):
            y = y + weight[k][None] * padded[k : k + T]
        return y

    def final_state(
        self,
        x: Float[Array, "T C"],
        state: Float[Array, "K1 C"] | None = None,
        reset: Bool[Array, " T"] | None = None,
    ) -> Float[Array, "K1 C"]:
        """The last `K - 1` inputs (zeros for those before the last segment's
        start), the state to continue from."""
        if reset is not None:
            return self._segments(x, state, reset)[1]
        return self._padded(x, state)[x.shape[0] :]

    def step(
        self,
        state: Float[Array, "K1 C"],
        x_t: Float[Array, " C"],
        reset: Bool[Array, ""] | bool = False,
    ) -> tuple[Float[Array, "K1 C"], Float[Array, " C"]]:
        """One step: `(state, y_t)`; `reset` starts a segment at this step."""
        state = jnp.where(reset, jnp.zeros((), x_t.dtype), state.astype(x_t.dtype))
        window = jnp.concatenate([state, x_t[None]])
        y = self.bias.astype(x_t.dtype) + jnp.sum(
            self.weight.astype(x_t.dtype) * window, axis=0
        )
        return window[1:], y
