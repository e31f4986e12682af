"""A depthwise causal convolution over time, with a step mode: the short
convolution in front of the selective recurrences (Hawk's and Mamba's)."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray


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

    def __call__(
        self, x: Float[Array, "T C"], state: Float[Array, "K1 C"] | None = None
    ) -> Float[Array, "T C"]:
        T = x.shape[0]
        padded = self._padded(x, state)
        weight = self.weight.astype(x.dtype)
        # K shifted products: K is small (4), so this beats a general convolution
        y = self.bias.astype(x.dtype)[None]
        for k in range(self.kernel_size):
            y = y + weight[k][None] * padded[k : k + T]
        return y

    def final_state(
        self, x: Float[Array, "T C"], state: Float[Array, "K1 C"] | None = None
    ) -> Float[Array, "K1 C"]:
        """The last `K - 1` inputs, the state to continue from."""
        return self._padded(x, state)[x.shape[0] :]

    def step(
        self, state: Float[Array, "K1 C"], x_t: Float[Array, " C"]
    ) -> tuple[Float[Array, "K1 C"], Float[Array, " C"]]:
        window = jnp.concatenate([state.astype(x_t.dtype), x_t[None]])
        y = self.bias.astype(x_t.dtype) + jnp.sum(
            self.weight.astype(x_t.dtype) * window, axis=0
        )
        return window[1:], y
