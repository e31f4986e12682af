"""The LRU layer: a diagonal complex recurrence with exponential parameterisation."""

import math
from typing import ClassVar

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Complex, Float, PRNGKeyArray

from .._misc import check_parameter_dtype, check_positive_int, check_real
from .._scan import AbstractScan, AutoScan, check_scan
from ._base import AbstractDiagonalSSM


class LRU(AbstractDiagonalSSM):
    """The Linear Recurrent Unit: a stable-by-construction diagonal complex recurrence.

    Orvieto et al., "Resurrecting Recurrent Neural Networks for Long Sequences", ICML
    2023. Discrete-time, with eigenvalues
    `λ = exp(-exp(nu_log) + i exp(theta_log))`, so `|λ| < 1` for any parameters,
    and the input normalised by `γ = exp(gamma_log)`, initialised to
    `sqrt(1 - |λ|²)`:

    `h_t = λ ⊙ h_{t-1} + γ ⊙ (B̃ u_t)`,  `y_t = Re(C̃ h_t) + D ⊙ u_t`.

    Eigenvalues start uniform on the ring `r_min ≤ |λ| ≤ r_max` with phases in
    `[0, max_phase]`. The recurrence is [`eqx_seq.linear_recurrence`][]; step mode,
    streaming and `parameter_jacobians` come from
    [`eqx_seq.AbstractDiagonalSSM`][] (there is no `dt`: the LRU is discrete-time).

    !!! Example

        ```python
        import jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.LRU(16, 32, r_min=0.9, key=jr.key(0))
        y = layer(jnp.ones((500, 16)))          # (500, 16)
        ```
    """

    nu_log: Float[Array, " P"]
    theta_log: Float[Array, " P"]
    gamma_log: Float[Array, " P"]
    B: Float[Array, "P H 2"]
    C: Float[Array, "H P 2"]
    C_backward: Float[Array, "H P 2"] | None
    D: Float[Array, " H"]
    input_size: int = eqx.field(static=True)
    state_size: int = eqx.field(static=True)
    scan: AbstractScan

    per_state_fields: ClassVar[tuple[str, ...]] = ("nu_log", "theta_log", "gamma_log")
    recurrence_fields: ClassVar[tuple[str, ...]] = (*per_state_fields, "B")

    def __init__(
        self,
        input_size: int,
        state_size: int,
        *,
        r_min: float = 0.0,
        r_max: float = 1.0,
        max_phase: float = 2 * math.pi,
        bidirectional: bool = False,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: `H`, the number of input (and output) features.
        - `state_size`: `P`, the number of complex states.
        - `r_min`, `r_max`: the eigenvalue moduli start uniform on this ring
            (`0 <= r_min < r_max <= 1`); close to 1 for long memory.
        - `max_phase`: the eigenvalue phases start uniform in `[0, max_phase]`.
        - `bidirectional`: add a second recurrence run backwards in time, with its own
            output matrix `C_backward` (non-causal; no step mode or `h0`).
        - `scan`: the recurrence backend, an [`eqx_seq.AbstractScan`][]: its
            `recurrence` runs the layer (any backend works).
        - `dtype`: the real parameter dtype, float32 or float64 (default: JAX's
            default float). Half-precision inputs are computed in this dtype.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        check_positive_int("input_size", input_size)
        check_positive_int("state_size", state_size)
        r_min, r_max = check_real("r_min", r_min), check_real("r_max", r_max)
        if not 0 <= r_min < r_max <= 1:
            raise ValueError(
                f"Need 0 <= r_min < r_max <= 1, got r_min={r_min}, r_max={r_max}."
            )
        max_phase = check_real("max_phase", max_phase, positive=True)
        check_scan(scan, name="eqx_seq.LRU", splits_time=True)
        dtype = check_parameter_dtype("LRU", dtype)
        rkey, pkey, bkey, ckey, cbkey, dkey = jr.split(key, 6)
        # |λ|² uniform in [r_min², r_max²): λ uniform in area on the ring. Kept below
        # 1 so that γ = sqrt(1 - |λ|²) stays positive.
        u1 = jr.uniform(rkey, (state_size,), dtype)
        radius_sq = u1 * (r_max**2 - r_min**2) + r_min**2
        radius_sq = jnp.minimum(radius_sq, 1 - jnp.finfo(dtype).eps)
        self.nu_log = jnp.log(-0.5 * jnp.log(radius_sq))
        self.theta_log = jnp.log(
            max_phase * jr.uniform(pkey, (state_size,), dtype, minval=1e-4)
        )
        self.gamma_log = 0.5 * jnp.log(1 - radius_sq)

        # As in the paper: real and imaginary parts N(0, 1/(2H)) for B, N(0, 1/P)
        # for C.
        def pair(key, shape, variance):
            return jr.normal(key, (*shape, 2), dtype) * math.sqrt(variance / 2)

        self.B = pair(bkey, (state_size, input_size), 1 / input_size)
        self.C = pair(ckey, (input_size, state_size), 2 / state_size)
        self.C_backward = (
            pair(cbkey, (input_size, state_size), 2 / state_size)
            if bidirectional
            else None
        )
        self.D = jr.normal(dkey, (input_size,), dtype)
        self.input_size = input_size
        self.state_size = state_size
        self.scan = scan

    @property
    def output_scale(self) -> float:
        return 1.0

    @property
    def eigenvalues(self) -> Complex[Array, " P"]:
        """The (discrete-time) eigenvalues `λ`, complex `(P,)`, all with `|λ| < 1`."""
        return jnp.exp(lax.complex(-jnp.exp(self.nu_log), jnp.exp(self.theta_log)))

    def _discretise(self, dt: Array | None) -> tuple[Array, Array]:
        if dt is not None:
            raise ValueError(
                "`LRU` is a discrete-time layer and takes no `dt`; use `eqx_seq.S5` "
                "for irregular sampling."
            )
        lam = self.eigenvalues
        return lam, jnp.exp(self.gamma_log).astype(lam.dtype)
