"""A sequence-mixing layer that solves a diagonally dominant tridiagonal system."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Real

from .._misc import (
    check_positive_int,
    check_real,
    check_sequence,
    default_floating_dtype,
)
from .._scan import AbstractScan, AutoScan, check_scan
from ._solve import tridiagonal_solve


class TridiagonalImplicit(eqx.Module):
    r"""Implicit diffusion along time: $y = A^{-1} x$ with $A = I + L_\kappa$.

    For each channel, the output is the solution of the tridiagonal system

    $$(1 + \kappa_{t-1} + \kappa_t)\, y_t - \kappa_{t-1} y_{t-1} - \kappa_t y_{t+1}
    = x_t, \qquad \kappa_{-1} = \kappa_{T-1} = 0,$$

    where $\kappa_t \ge 0$ couples steps $t$ and $t+1$: a Whittaker smoother
    (Whittaker 1923; Eilers 2003) with a learnable roughness penalty, or one
    backward-Euler step of a diffusion along time. Every output depends on every
    input, at `O(T)` cost. $A$ is symmetric and strictly diagonally dominant with
    margin exactly 1 whatever the parameters, so both backends of
    [`eqx_seq.tridiagonal_solve`][] are stable without pivoting. The couplings are
    $\kappa = \operatorname{softplus}(\theta)$, one per channel, or input-dependent
    (see `__init__`); the guide is `docs/usage/tridiagonal.md`.

    !!! Example

        ```python
        import jax
        import jax.random as jr
        import eqx_seq

        layer = eqx_seq.TridiagonalImplicit(16, input_dependent=True, key=jr.key(0))
        x = jr.normal(jr.key(1), (8, 200, 16))  # a batch of 8 sequences
        y = jax.vmap(layer)(x)                   # (8, 200, 16)
        lower, diag, upper = layer.diagonals(x[0])
        ```

    ??? cite "References"

        E. T. Whittaker, "On a new method of graduation", Proc. Edinburgh Math.
        Soc. 41, 1923. P. H. C. Eilers, "A perfect smoother", Anal. Chem. 75(14),
        2003.
    """

    coupling_logit: Float[Array, " channels"]
    gate_weight: Float[Array, "channels twice_channels"] | None
    gate_bias: Float[Array, " channels"] | None
    channels: int = eqx.field(static=True)
    input_dependent: bool = eqx.field(static=True)
    scan: AbstractScan

    def __init__(
        self,
        channels: int,
        *,
        input_dependent: bool = False,
        coupling_range: tuple[float, float] = (0.1, 100.0),
        scan: AbstractScan = AutoScan(),
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        r"""**Arguments:**

        - `channels`: the number of channels `C`; inputs are `(T, C)`.
        - `input_dependent`: if `True`, each link's coupling also depends on the two
            steps it joins:
            $\kappa_t = \operatorname{softplus}(\theta + W [x_t; x_{t+1}] + b)$,
            with $W$ and $b$ initialised to zero (so the layer starts
            time-invariant).
        - `coupling_range`: `(low, high)`, `0 < low <= high`: $\theta$ is
            initialised so that the couplings $\kappa$ are log-uniform in this range
            across channels (a range of smoothing lengths).
        - `scan`: the backend of [`eqx_seq.tridiagonal_solve`][]: Thomas for a
            sequential one, PCR for a parallel one.
        - `dtype`: the parameters' dtype; JAX's default floating dtype by default.
        - `key`: a `jax.random.key` for the initial couplings.
        """
        check_positive_int("channels", channels)
        low, high = coupling_range
        low = check_real("coupling_range[0]", low, positive=True)
        high = check_real("coupling_range[1]", high, positive=True)
        if not low <= high:
            raise ValueError(
                f"`coupling_range` must be (low, high) with 0 < low <= high, got "
                f"{coupling_range!r}."
            )
        # the solve runs Thomas or PCR as the backend declares: checked here already
        check_scan(scan, name="eqx_seq.TridiagonalImplicit")
        dtype = default_floating_dtype() if dtype is None else jnp.dtype(dtype)
        log_kappa = jr.uniform(
            key, (channels,), dtype, jnp.log(low).item(), jnp.log(high).item()
        )
        # softplus^{-1}(kappa) = log(expm1(kappa)), written stably for large kappa
        kappa = jnp.exp(log_kappa)
        self.coupling_logit = kappa + jnp.log(-jnp.expm1(-kappa))
        if input_dependent:
            self.gate_weight = jnp.zeros((channels, 2 * channels), dtype)
            self.gate_bias = jnp.zeros((channels,), dtype)
        else:
            self.gate_weight = self.gate_bias = None
        self.channels = channels
        self.input_dependent = bool(input_dependent)
        self.scan = scan

    def _check(self, x: ArrayLike) -> Array:
        dtype = self.coupling_logit.dtype
        return check_sequence(
            x, self.channels, "TridiagonalImplicit", "channels", dtype
        )

    def couplings(
        self, x: Real[ArrayLike, " T channels"]
    ) -> Float[Array, " T-1 channels"]:
        r"""The couplings $\kappa_t \ge 0$ between steps `t` and `t + 1`.

        **Arguments:**

        - `x`: one sequence, shape `(T, channels)`.

        **Returns:**

        Shape `(T - 1, channels)`, in the dtype of `x` (of the parameters for
        integer `x`).
        """
        x = self._check(x)
        logit = self.coupling_logit.astype(x.dtype)
        if not self.input_dependent:
            return jnp.broadcast_to(
                jax.nn.softplus(logit), (x.shape[0] - 1, x.shape[1])
            )
        pairs = jnp.concatenate([x[:-1], x[1:]], axis=1)
        gate = pairs @ self.gate_weight.astype(x.dtype).T
        return jax.nn.softplus(
            logit[None] + gate + self.gate_bias.astype(x.dtype)[None]
        )

    def diagonals(
        self, x: Real[ArrayLike, " T channels"]
    ) -> tuple[
        Float[Array, " T channels"],
        Float[Array, " T channels"],
        Float[Array, " T channels"],
    ]:
        """The system solved for the input `x`, per channel along time.

        **Arguments:**

        - `x`: one sequence, shape `(T, channels)`.

        **Returns:**

        `(lower, diag, upper)`, each `(T, channels)` in the dtype of `x` (as in
        `couplings`), in the
        convention of [`eqx_seq.tridiagonal_solve`][] (`lower[0]` and `upper[-1]`
        are zero).
        """
        kappa = self.couplings(x)
        edge = jnp.zeros((1, kappa.shape[1]), kappa.dtype)
        before = jnp.concatenate([edge, kappa])  # kappa_{t-1}
        after = jnp.concatenate([kappa, edge])  # kappa_t
        return -before, 1 + before + after, -after

    @jax.named_scope("eqx_seq.TridiagonalImplicit")
    def __call__(
        self, x: Real[ArrayLike, " T channels"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " T channels"]:
        """**Arguments:**

        - `x`: one sequence, shape `(T, channels)`, time on axis 0.
        - `key`: ignored; for compatibility with the Equinox layer API.

        **Returns:**

        `y = A^{-1} x`, shape `(T, channels)`, in the dtype of `x`; integer `x` is
        cast to the parameters' dtype.

        **Raises:**

        `ValueError` at trace time for a shape other than `(T, channels)` or a
        complex input.
        """
        del key
        x = self._check(x)
        lower, diag, upper = self.diagonals(x)
        return tridiagonal_solve(lower, diag, upper, x, axis=0, scan=self.scan)
