"""The S5 layer: a diagonal, HiPPO-initialised, continuous-time state-space layer."""

import math
from typing import ClassVar, Literal

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Complex, Float, PRNGKeyArray

from .._misc import (
    check_parameter_dtype,
    check_positive_int,
    check_real,
    default_floating_dtype,
)
from .._scan import AbstractScan, AutoScan, check_scan
from ._base import AbstractDiagonalSSM, complex_dtype


# The largest HiPPO block S5 initialises: its dense eigendecomposition costs
# memory in the square of the block size and time in the cube.
_MAX_HIPPO_BLOCK = 4096


def hippo_normal_eigens(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues and (unitary) eigenvectors of the normal part of HiPPO-LegS.

    HiPPO-LegS is `A[n, k] = -sqrt(2n+1) sqrt(2k+1)` below the diagonal and
    `-(n + 1)` on it. Adding the rank-one `p p^T`, `p_n = sqrt(n + 1/2)`, leaves
    `-I/2` plus a skew-symmetric matrix `K`: the eigenvalues are `-1/2 + i mu` with
    `mu, V` from the Hermitian eigenproblem of `-i K`, in float64 NumPy. Ascending
    `mu`, so the first half holds one of each conjugate pair.
    """
    q = np.sqrt(2 * np.arange(size) + 1.0)
    skew = 0.5 * (np.triu(np.outer(q, q), 1) - np.tril(np.outer(q, q), -1))
    mu, vectors = np.linalg.eigh(-1j * skew)
    return -0.5 + 1j * mu, vectors


def _block_diagonal_init(state_size: int, blocks: int, conj_sym: bool):
    """Λ tiled over `blocks`, and the per-block eigenvectors kept with them."""
    block = state_size // blocks
    eigenvalues, vectors = hippo_normal_eigens(block)
    if conj_sym:
        eigenvalues, vectors = eigenvalues[: block // 2], vectors[:, : block // 2]
    return np.tile(eigenvalues, blocks), vectors


class S5(AbstractDiagonalSSM):
    """The S5 layer: a diagonal complex state-space model run as a linear recurrence.

    Smith, Warrington and Linderman, "Simplified State Space Layers for Sequence
    Modeling", ICLR 2023. The continuous-time system `x' = Λ x + B̃ u`, `y = C̃ x + D u`
    with diagonal complex `Λ` is discretised per state with a learned step
    `Δ = exp(log_step) * step_rescale` (times `dt[t]` for irregular sampling):

    - zero-order hold (`"zoh"`): `Λ̄ = exp(ΛΔ)`, `B̄ = (Λ̄ - 1)/Λ · B̃`;
    - bilinear: `Λ̄ = (1 + ΔΛ/2)/(1 - ΔΛ/2)`, `B̄ = Δ/(1 - ΔΛ/2) · B̃`;

    then run as `h_t = Λ̄ ⊙ h_{t-1} + B̄ u_t` with [`eqx_seq.linear_recurrence`][]
    (so gradients are its adjoint, one reverse recurrence) and read out as
    `y_t = Re(C̃ h_t) + D ⊙ u_t` (`2 Re(...)` with `conj_sym`).

    Parameters are real arrays: `lambda_re`, `lambda_im` (`(P,)`, Λ), `log_step`
    (`(P,)`), `B` (`(P, H, 2)`, B̃ as real and imaginary parts), `C` and
    `C_backward` (`(H, P, 2)`), `D` (`(H,)`). Step mode (`init_state`, `step`),
    streaming (`h0=`, `final_state`) and `parameter_jacobians` come from
    [`eqx_seq.AbstractDiagonalSSM`][].

    !!! Example

        ```python
        import jax, jax.numpy as jnp, jax.random as jr
        import eqx_seq

        layer = eqx_seq.S5(16, 64, blocks=4, key=jr.key(0))   # H=16, 64 -> 32 states
        u = jnp.ones((1000, 16))
        y = layer(u)                                          # (1000, 16)
        ys = jax.vmap(layer)(jnp.ones((8, 1000, 16)))         # a batch, by vmap
        ```
    """

    lambda_re: Float[Array, " P"]
    lambda_im: Float[Array, " P"]
    log_step: Float[Array, " P"]
    B: Float[Array, "P H 2"]
    C: Float[Array, "H P 2"]
    C_backward: Float[Array, "H P 2"] | None
    D: Float[Array, " H"]
    step_rescale: float
    input_size: int = eqx.field(static=True)
    state_size: int = eqx.field(static=True)
    discretisation: Literal["zoh", "bilinear"] = eqx.field(static=True)
    conj_sym: bool = eqx.field(static=True)
    clip_eigs: bool = eqx.field(static=True)
    scan: AbstractScan

    per_state_fields: ClassVar[tuple[str, ...]] = ("lambda_re", "lambda_im", "log_step")
    recurrence_fields: ClassVar[tuple[str, ...]] = (*per_state_fields, "B")

    def __init__(
        self,
        input_size: int,
        state_size: int,
        *,
        blocks: int = 1,
        discretisation: Literal["zoh", "bilinear"] = "zoh",
        conj_sym: bool = True,
        clip_eigs: bool = False,
        bidirectional: bool = False,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        step_rescale: float = 1.0,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `input_size`: `H`, the number of input (and output) features.
        - `state_size`: the size of the (real-equivalent) state, `J` HiPPO blocks of
            `state_size / blocks`. With `conj_sym`, only one of each conjugate pair
            of eigenvalues is kept: the recurrence has `P = state_size / 2` complex
            states.
        - `blocks`: `J`, the number of blocks Λ is initialised with (block-diagonal
            eigenvectors). Must divide `state_size` (into even blocks with
            `conj_sym`), into blocks of at most 4096 states (each block's
            initialisation is a dense eigendecomposition).
        - `discretisation`: `"zoh"` (zero-order hold) or `"bilinear"`.
        - `conj_sym`: keep half of the conjugate pairs and output `2 Re(C̃ h)`.
        - `clip_eigs`: clip the real parts of Λ to at most `-1e-4` in the forward pass
            (stable, for unbounded lengths and step mode).
        - `bidirectional`: add a second recurrence run backwards in time, with its own
            output matrix `C_backward` (non-causal; no step mode or `h0`).
        - `dt_min`, `dt_max`: the learned steps start log-uniform in this range.
        - `step_rescale`: multiplies every step, e.g. `2.0` to run a layer trained at
            one sampling rate on data sampled at half the rate (zero-shot).
        - `scan`: the recurrence backend, an [`eqx_seq.AbstractScan`][]: its
            `recurrence` runs the layer (any backend works).
        - `dtype`: the real parameter dtype, float32 or float64 (default: JAX's
            default float). Half-precision inputs are computed in this dtype.
        - `key`: a `jax.random` key for the initialisation. (Keyword only.)
        """
        check_positive_int("input_size", input_size)
        check_positive_int("state_size", state_size)
        check_positive_int("blocks", blocks)
        if state_size % blocks:
            raise ValueError(
                f"`blocks` ({blocks}) must divide `state_size` ({state_size})."
            )
        if conj_sym and (state_size // blocks) % 2:
            raise ValueError(
                "`conj_sym=True` keeps one of each conjugate pair of eigenvalues, so "
                f"each block needs an even size; state_size={state_size} in "
                f"{blocks} block(s) gives blocks of {state_size // blocks}. Use an "
                "even block size or `conj_sym=False`."
            )
        if discretisation not in ("zoh", "bilinear"):
            raise ValueError(
                f'`discretisation` must be "zoh" or "bilinear", got {discretisation!r}.'
            )
        dt_min = check_real("dt_min", dt_min, positive=True)
        dt_max = check_real("dt_max", dt_max, positive=True)
        if dt_min > dt_max:
            raise ValueError(
                f"Need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}."
            )
        step_rescale = check_real("step_rescale", step_rescale, positive=True)
        check_scan(scan, name="eqx_seq.S5", splits_time=True)
        dtype = check_parameter_dtype("S5", dtype)
        block = state_size // blocks
        if block > _MAX_HIPPO_BLOCK:
            raise ValueError(
                f"`eqx_seq.S5` initialises each of its `blocks` from the "
                f"eigendecomposition of a dense HiPPO matrix of size state_size / "
                f"blocks = {block}, whose memory grows with the square of that size "
                f"and time with its cube; use `blocks=` so that blocks have at most "
                f"{_MAX_HIPPO_BLOCK} states (e.g. blocks={-(-state_size // 256)})."
            )
        eigenvalues, vectors = _block_diagonal_init(state_size, blocks, conj_sym)
        num_states = eigenvalues.shape[0]
        bkey, ckey, cbkey, dkey, skey = jr.split(key, 5)
        # in JAX, not NumPy: the draws may be traced (an ensemble of layers built
        # under `eqx.filter_vmap`); drawn at the default float whatever `dtype` is,
        # projected in the matching complex dtype, then cast
        cdtype = complex_dtype(default_floating_dtype())
        vectors = jnp.asarray(vectors, cdtype)

        def to_pair(x):  # complex -> real (..., 2) array
            return jnp.stack([x.real, x.imag], -1).astype(dtype)

        def product(subscripts, real, complex_):
            return jnp.einsum(
                subscripts,
                real.astype(cdtype),
                complex_,
                precision=lax.Precision.HIGHEST,
            )

        # B̃ = V^{-1} B (V unitary: V^{-1} = V^H), block by block.
        B = jr.normal(bkey, (blocks, block, input_size)) / math.sqrt(input_size)
        B_tilde = product("jkh,kp->jph", B, vectors.conj()).reshape(
            num_states, input_size
        )

        def output_matrix(key):  # C̃ = C V, block by block
            C = jr.normal(key, (input_size, blocks, block))
            C = C / math.sqrt(state_size)
            return to_pair(product("hjk,kp->hjp", C, vectors).reshape(input_size, -1))

        self.lambda_re = jnp.asarray(eigenvalues.real, dtype)
        self.lambda_im = jnp.asarray(eigenvalues.imag, dtype)
        self.log_step = jr.uniform(
            skey,
            (num_states,),
            dtype,
            minval=math.log(dt_min),
            maxval=math.log(dt_max),
        )
        self.B = to_pair(B_tilde)
        self.C = output_matrix(ckey)
        self.C_backward = output_matrix(cbkey) if bidirectional else None
        self.D = jr.normal(dkey, (input_size,), dtype)
        self.step_rescale = step_rescale
        self.input_size = input_size
        self.state_size = state_size
        self.discretisation = discretisation
        self.conj_sym = conj_sym
        self.clip_eigs = clip_eigs
        self.scan = scan

    @property
    def output_scale(self) -> float:
        return 2.0 if self.conj_sym else 1.0

    @property
    def eigenvalues(self) -> Complex[Array, " P"]:
        """The continuous-time eigenvalues Λ (clipped if `clip_eigs`), shape `(P,)`."""
        re = jnp.minimum(self.lambda_re, -1e-4) if self.clip_eigs else self.lambda_re
        return lax.complex(re, self.lambda_im)

    def _discretise(self, dt: Array | None) -> tuple[Array, Array]:
        lam = self.eigenvalues
        step = jnp.exp(self.log_step) * self.step_rescale
        if dt is not None:
            step = dt.astype(step.dtype)[..., None] * step.reshape(
                (1,) * dt.ndim + step.shape
            )
        step = step.astype(lam.dtype)
        lam = lam.reshape((1,) * (step.ndim - 1) + lam.shape)
        if self.discretisation == "zoh":
            decay = jnp.exp(lam * step)
            return decay, (decay - 1) / lam
        half = lam * step / 2
        return (1 + half) / (1 - half), step / (1 - half)
