"""What S5 and LRU share: a diagonal complex state-space layer on top of the recurrence.

    h_t = decay_t * h_{t-1} + gain_t * (B u_t),    y_t = scale * Re(C h_t) + D * u_t

with `decay`, `gain` of shape `(P,)` (or `(T, P)` for irregular steps) computed by the
concrete layer from its per-state parameters, `B` `(P, H)` and `C` `(H, P)` complex
(stored as real `(..., 2)` pairs, so optimisers and `jax.grad` only see real arrays).
The states come from `eqx_seq.linear_recurrence`, so the layer's gradients are its
adjoint (one reverse recurrence), never autodiff through a scan.
"""

import abc
from typing import ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Complex, Float, PRNGKeyArray, Real

from .._misc import check_sequence, error_if_any, real_input
from .._recurrence import linear_recurrence
from .._scan import AbstractScan, check_scan
from ._recurrent import AbstractRecurrentLayer


def complex_dtype(dtype) -> jnp.dtype:
    """The complex dtype with the precision of the real `dtype`."""
    return jnp.dtype(jnp.complex128 if jnp.finfo(dtype).bits > 32 else jnp.complex64)


def as_complex(pair: Array) -> Array:
    """A real array of `(re, im)` pairs on its last axis, as one complex array."""
    return lax.complex(pair[..., 0], pair[..., 1])


def lecun_pair(key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int, dtype) -> Array:
    """Real and imaginary parts, each normal with variance `1 / (2 fan_in)`."""
    return jr.normal(key, (*shape, 2), dtype) * (0.5 / fan_in) ** 0.5


class SSMJacobians(eqx.Module):
    """Diagonal Jacobians of a diagonal SSM layer's states w.r.t. its parameters.

    State `p` depends only on row `p` of each per-state parameter, on row `p` of `B`
    and on `h0[p]`, so every Jacobian is diagonal in the state index and is returned
    as its diagonal. With `T` steps (or `T = 1` for `final=True`, without the axis):

    - `states`: `(T, P)` complex, the states $h_t$.
    - `wrt`: a dict from each per-state parameter field name (for `eqx_seq.S5`:
        `"lambda_re"`, `"lambda_im"`, `"log_step"`; for `eqx_seq.LRU`: `"nu_log"`,
        `"theta_log"`, `"gamma_log"`) to `(T, P)` complex:
        `wrt[name][t, p]` $= \\partial h_t[p] / \\partial\\,$`name[p]`.
        For S5, the states are holomorphic in Λ: `wrt["lambda_im"]` is `1j` times
        the complex derivative $\\partial h_t / \\partial \\Lambda$, and
        `wrt["lambda_re"]` is that derivative (zero where `clip_eigs` clips).
    - `wrt_B`: `(T, P, H)` complex, $\\partial h_t[p] / \\partial$ `B[p, k, 0]` (the
        real part of $\\tilde B_{pk}$); the derivative w.r.t. the imaginary part
        `B[p, k, 1]` is `1j * wrt_B`.
    - `wrt_h0`: `(T, P)` complex, $\\partial h_t[p] / \\partial h_0[p]$ (holomorphic).
    """

    states: Complex[Array, "*T P"]
    wrt: dict[str, Complex[Array, "*T P"]]
    wrt_B: Complex[Array, "*T P H"]
    wrt_h0: Complex[Array, "*T P"]


class AbstractDiagonalSSM(AbstractRecurrentLayer):
    """Abstract base class of the diagonal complex state-space layers S5 and LRU.

    A concrete layer sets the fields below and implements `_discretise`; everything
    else (the parallel call, step mode, streaming, parameter Jacobians) lives here.
    """

    B: eqx.AbstractVar[Float[Array, "P H 2"]]
    C: eqx.AbstractVar[Float[Array, "H P 2"]]
    C_backward: eqx.AbstractVar[Float[Array, "H P 2"] | None]
    D: eqx.AbstractVar[Float[Array, " H"]]
    input_size: eqx.AbstractVar[int]
    scan: eqx.AbstractVar[AbstractScan]

    # Names of the fields with one entry per state (shape `(P,)`), in the order
    # `SSMJacobians.wrt` reports them; with `B`, the `recurrence_fields`.
    per_state_fields: ClassVar[tuple[str, ...]]

    @property
    @abc.abstractmethod
    def output_scale(self) -> float:
        """`y = output_scale * Re(C h) + D u`: 2 when only one of each conjugate pair
        of states is kept (S5's `conj_sym`), else 1."""

    @abc.abstractmethod
    def _discretise(
        self, dt: Array | None
    ) -> tuple[Complex[Array, "*T P"], Complex[Array, "*T P"]]:
        """`(decay, gain)` for relative steps `dt` (shape `()`, `(T,)` or `None`)."""

    @property
    def num_states(self) -> int:
        """`P`, the number of complex states in the recurrence (the size of `h0`)."""
        return self.B.shape[0]

    @property
    def bidirectional(self) -> bool:
        """Whether a second recurrence runs backwards in time (non-causal)."""
        return self.C_backward is not None

    # ---------------------------------------------------------------- validation

    def _name(self) -> str:
        return type(self).__name__

    def _check_inputs(self, u: Array, dt, h0, *, streaming: bool) -> tuple:
        name = self._name()
        u = check_sequence(u, self.input_size, name, "input_size", self.D.dtype)
        if dt is not None:
            dt = jnp.asarray(dt)
            if dt.shape != (u.shape[0],):
                raise ValueError(
                    f"`dt` must have one relative step per time step, shape "
                    f"(T,) = ({u.shape[0]},), got shape {dt.shape}."
                )
            dt = real_input(dt, name, self.D.dtype, "`dt`")
            dt = error_if_any(
                dt,
                ~(jnp.isfinite(dt) & (dt > 0)),
                f"eqx_seq.{name}: every relative step `dt` must be finite and > 0.",
            )
        if h0 is not None:
            if self.bidirectional:
                raise ValueError(
                    f"`h0` is for causal (streaming) use; this `{name}` is "
                    "bidirectional, so its output depends on the future as well."
                )
            h0 = jnp.asarray(h0)
            if h0.shape != (self.num_states,):
                raise ValueError(
                    f"`h0` (or the step-mode state) must be one state of shape "
                    f"({self.num_states},), got shape {h0.shape}."
                )
        if streaming and self.bidirectional:
            raise ValueError(
                f"Step mode and streaming need a causal layer; this `{name}` is "
                "bidirectional."
            )
        return u, dt, h0

    def _real_dtype(self, *arrays) -> jnp.dtype:
        with jax.numpy_dtype_promotion("standard"):
            return jnp.result_type(self.D.dtype, *arrays)

    # ------------------------------------------------------------------- pieces

    # Both projections are one real matmul with the real and imaginary parts side by
    # side: faster than two real matmuls or one complex one (benchmarks/bench_s5.py).

    def _drive(self, u: Array) -> Array:
        """`B u_t` for every step: `(..., P)` complex."""
        B = self.B.astype(u.dtype)
        re_im = u @ jnp.concatenate([B[..., 0], B[..., 1]]).T
        return lax.complex(re_im[..., : B.shape[0]], re_im[..., B.shape[0] :])

    def _read_out(self, C: Array, h: Array) -> Array:
        """`output_scale * Re(C h_t)` for every step: `(..., H)` real."""
        C = C.astype(h.real.dtype)
        weight = self.output_scale * jnp.concatenate([C[..., 0], -C[..., 1]], axis=-1)
        return jnp.concatenate([h.real, h.imag], axis=-1) @ weight.T

    def _coefficients(self, dt: Array | None, dtype) -> tuple[Array, Array]:
        decay, gain = self._discretise(dt)
        cdtype = complex_dtype(dtype)
        return decay.astype(cdtype), gain.astype(cdtype)

    def _states(
        self, drive: Array, dt: Array | None, h0: Array | None, *, reverse: bool = False
    ) -> Array:
        """All states, from `drive = self._drive(u)`."""
        if reverse and dt is not None:
            # Backwards, step t follows step t + 1: it decays over the interval
            # between them, dt[t + 1] (the last step reuses its own interval).
            dt = jnp.concatenate([dt[1:], dt[-1:]])
        decay, gain = self._coefficients(dt, drive.real.dtype)
        b = gain * drive if gain.ndim == 2 else gain[None] * drive
        return linear_recurrence(decay, b, h0, scan=self.scan, reverse=reverse)

    # ------------------------------------------------------------------- public

    def __call__(
        self,
        u: Real[ArrayLike, " T H"],
        *,
        dt: Real[ArrayLike, " T"] | None = None,
        h0: Complex[ArrayLike, " P"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " T H"]:
        """Run the layer over a whole sequence (the parallel or "convolution" mode).

        **Arguments:**

        - `u`: the input sequence, shape `(T, input_size)`, time on axis 0. One
            example: `jax.vmap` over a batch.
        - `dt`: optional relative step sizes, shape `(T,)`: `dt[t]` is the time from
            observation `t - 1` to `t` in units of the learned step (irregular
            sampling), finite and `> 0` (else a run-time error, `eqx.error_if`).
            `None` means all ones.
        - `h0`: optional initial state, shape `(num_states,)` complex (causal
            layers only): continue from the state a previous chunk ended in.
        - `key`: ignored; for compatibility with the rest of the Equinox API.

        **Returns:**

        The output sequence, shape `(T, input_size)`, real.
        """
        del key
        with jax.named_scope(f"eqx_seq.{self._name()}"):
            u, dt, h0 = self._check_inputs(u, dt, h0, streaming=False)
            u = u.astype(self._real_dtype(u))
            drive = self._drive(u)
            y = self._read_out(self.C, self._states(drive, dt, h0))
            if self.C_backward is not None:
                backward = self._states(drive, dt, None, reverse=True)
                y = y + self._read_out(self.C_backward, backward)
            return y + self.D.astype(u.dtype)[None] * u

    def final_state(
        self,
        u: Real[ArrayLike, " T H"],
        *,
        dt: Real[ArrayLike, " T"] | None = None,
        h0: Complex[ArrayLike, " P"] | None = None,
    ) -> Complex[Array, " P"]:
        """The state after the last step of `u`, for streaming in chunks.

        Calling the layer on chunk after chunk, each with `h0=` the `final_state` of
        the chunks so far, gives the same outputs as one call on the whole sequence.

        **Arguments:** as for `__call__`.

        **Returns:**

        The state $h_{T-1}$, shape `(num_states,)` complex.
        """
        u, dt, h0 = self._check_inputs(u, dt, h0, streaming=True)
        u = u.astype(self._real_dtype(u))
        return self._states(self._drive(u), dt, h0)[-1]

    def init_state(self) -> Complex[Array, " P"]:
        """The zero state to start step mode from: shape `(num_states,)`, complex."""
        if self.bidirectional:
            raise ValueError(
                f"Step mode needs a causal layer; this `{self._name()}` is "
                "bidirectional."
            )
        return jnp.zeros(self.num_states, complex_dtype(self.D.dtype))

    def step(
        self,
        state: Complex[ArrayLike, " P"],
        u_t: Real[ArrayLike, " H"],
        *,
        dt: Real[ArrayLike, ""] | None = None,
    ) -> tuple[Complex[Array, " P"], Float[Array, " H"]]:
        """One step of the recurrence (RNN mode), for generation or control.

        Stepping through a sequence from `init_state()` gives the same outputs as
        the parallel `__call__`, to float tolerance.

        **Arguments:**

        - `state`: the previous state, shape `(num_states,)`.
        - `u_t`: this step's input, shape `(input_size,)`.
        - `dt`: optional relative step size (a scalar), as in `__call__`.

        **Returns:**

        `(state, y_t)`: the new state and this step's output, shape `(input_size,)`.
        """
        u_t = jnp.asarray(u_t)
        if dt is not None and jnp.shape(dt) != ():
            raise ValueError(
                f"`dt` in `step` must be a scalar (one relative step), got shape "
                f"{jnp.shape(dt)}."
            )
        dt_seq = None if dt is None else jnp.reshape(jnp.asarray(dt), (1,))
        if u_t.shape != (self.input_size,):
            raise ValueError(
                f"`step` takes one input of shape ({self.input_size},), got shape "
                f"{u_t.shape}."
            )
        if state is None:
            raise ValueError(
                f"`step` needs the previous state, shape ({self.num_states},): "
                "`init_state()` to start, got None."
            )
        u, dt_seq, state = self._check_inputs(u_t[None], dt_seq, state, streaming=True)
        u = u.astype(self._real_dtype(u))
        decay, gain = self._coefficients(dt_seq, u.dtype)
        decay, gain = (decay[0], gain[0]) if decay.ndim == 2 else (decay, gain)
        state = decay * state.astype(decay.dtype) + gain * self._drive(u)[0]
        y = self._read_out(self.C, state) + self.D.astype(u.dtype) * u[0]
        return state, y

    def parameter_jacobians(
        self,
        u: Real[ArrayLike, " T H"],
        *,
        dt: Real[ArrayLike, " T"] | None = None,
        h0: Complex[ArrayLike, " P"] | None = None,
        final: bool = False,
    ) -> SSMJacobians:
        """Jacobians of the states w.r.t. the SSM parameters, in structured form.

        Every Jacobian is diagonal in the state index (see [`eqx_seq.SSMJacobians`][]),
        so it is returned as its diagonal and computed by recurrences, not by
        autodiff: the states and `dh/dh0` (one recurrence over two states), one
        tangent recurrence per per-state parameter (all in one call; the derivatives
        of the discretisation come from `jax.jvp` of the elementwise formulas), and
        for `B` one recurrence over `(T, P, H)` for all steps, or, with
        `final=True`, one reverse recurrence and one matmul.

        With [`eqx_seq.ShardedScan`][] (inside `jax.shard_map`, time split over
        devices) each device returns its block's steps, as for `__call__`.

        **Arguments:**

        - `u`, `dt`, `h0`: as for `__call__` (causal layers only).
        - `final`: if `True`, only the Jacobians of the last state $h_{T-1}$ (no
            time axis in the results). With `ShardedScan`, those of the last
            device are the whole sequence's (`wrt_B` is on every device).

        **Returns:**

        An [`eqx_seq.SSMJacobians`][].
        """
        # split over devices, the previous state and the step after cross a block
        # boundary through `scan.shift`, and the sums over time add the blocks'
        scan = check_scan(
            self.scan,
            name=f"eqx_seq.{type(self).__name__}.parameter_jacobians",
            splits_time=True,
        )
        u, dt, h0 = self._check_inputs(u, dt, h0, streaming=True)
        u = u.astype(self._real_dtype(u))
        cdtype = complex_dtype(u.dtype)
        h0 = jnp.zeros(self.num_states, cdtype) if h0 is None else h0.astype(cdtype)
        fields = self.per_state_fields
        values = [getattr(self, name) for name in fields]

        def coefficients(values):
            layer = eqx.tree_at(lambda m: [getattr(m, n) for n in fields], self, values)
            return layer._coefficients(dt, u.dtype)

        def derivative(i):
            # decay and gain are elementwise in the per-state parameters: one
            # forward-mode pass with an all-ones direction gives their diagonals.
            ones = [jnp.full_like(v, i == j) for j, v in enumerate(values)]
            return jax.jvp(coefficients, (values,), (ones,))[1]

        (decay, gain), (d_decay, d_gain) = (
            coefficients(values),
            jax.vmap(derivative)(jnp.arange(len(fields))),
        )  # d_decay, d_gain: (F, P) or (F, T, P)
        g = self._drive(u)  # B u_t, (T, P)

        def recurrence(a, b, h0=None, reverse=False):
            return linear_recurrence(a, b, h0, scan=scan, reverse=reverse)

        # p_t = dh_t/dh0 = prod_{s <= t} decay_s
        p = recurrence(decay, jnp.zeros_like(g), jnp.ones_like(h0))
        if decay.ndim == 1:
            # Time-invariant: every parameter moves h through the decay or the gain
            # only, h = gain * x + p * h0 with x the states driven by B u from zero.
            # So dh/dparam = s * d_decay + x * d_gain, with s = dh/d_decay solving
            # s_t = decay * s_{t-1} + h_{t-1}: three recurrences in all.
            x = recurrence(decay, g)
            h = gain[None] * x + p * h0[None]
            s = recurrence(decay, scan.shift(h, h0))
            wrt = {
                name: s * d_decay[i][None] + x * d_gain[i][None]
                for i, name in enumerate(fields)
            }
        else:
            # Time-varying: one tangent recurrence per parameter, all in one call,
            # s_t = decay_t s_{t-1} + d_decay_t h_{t-1} + d_gain_t (B u_t).
            h = recurrence(decay, gain * g, h0)
            previous = scan.shift(h, h0)
            rhs = d_decay * previous[None] + d_gain * g[None]  # (F, T, P)
            sensitivities = recurrence(decay[:, None], jnp.moveaxis(rhs, 0, 1))
            wrt = {name: sensitivities[:, i] for i, name in enumerate(fields)}
        gain = jnp.broadcast_to(gain, h.shape)
        if final:
            # dh_{T-1}/d(B u)_t = gain_t w_t, w_t = prod_{s > t} decay_s: one
            # reverse recurrence from the last step of the whole sequence (not
            # `p` reversed, which would read another device's block).
            one = jnp.ones((), decay.dtype)
            after = decay if decay.ndim == 1 else scan.shift(decay, one, reverse=True)
            last = scan.shift(jnp.zeros_like(h), one, reverse=True)
            w = recurrence(after, last, reverse=True)
            wg = w * gain  # (T, P) complex; u is real: one real matmul
            re_im = jnp.concatenate([wg.real, wg.imag], axis=1).T @ u
            re_im = scan.sum_over_blocks(re_im)
            num = self.num_states
            return SSMJacobians(
                states=h[-1],
                wrt={k: v[-1] for k, v in wrt.items()},
                wrt_B=lax.complex(re_im[:num], re_im[num:]),
                wrt_h0=p[-1],
            )
        # e_t[p, k] = decay_t[p] e_{t-1}[p, k] + gain_t[p] u_t[k]
        u_c = u.astype(cdtype)
        wrt_B = recurrence(decay[..., None], gain[:, :, None] * u_c[:, None, :])
        return SSMJacobians(states=h, wrt=wrt, wrt_B=wrt_B, wrt_h0=p)
