"""Small helpers shared by the layers."""

import functools as ft
import math
from collections.abc import Callable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


_F = TypeVar("_F", bound=Callable)


def default_floating_dtype() -> jnp.dtype:
    """JAX's default floating dtype: float64 under `jax_enable_x64`, else float32.

    Every layer's parameters default to it, so that under x64 all layers agree.
    """
    return jnp.dtype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)


def check_positive_int(name: str, value: object) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def check_real(
    name: str, value: object, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """`value` as a float; a `ValueError` naming `name` unless it is a finite real
    number (`> 0` if `positive`, `>= 0` if `nonnegative`): range checks written as
    comparisons let `inf` through, and NaN too where they are negated."""
    real = (int, float, np.integer, np.floating, np.ndarray, jax.Array)
    if (
        isinstance(value, bool)
        or not isinstance(value, real)
        or np.shape(value) != ()
        or jnp.iscomplexobj(value)
    ):
        raise ValueError(f"`{name}` must be a real number, got {value!r}.")
    value = float(value)
    if positive and not value > 0:
        kind = "a finite positive"
    elif nonnegative and not value >= 0:
        kind = "a finite non-negative"
    elif not math.isfinite(value):
        kind = "a finite"
    else:
        return value
    raise ValueError(f"`{name}` must be {kind} number, got {value!r}.")


def check_reals(
    name: str, value: object, parts: tuple[str, ...], *, positive: bool = False
) -> tuple[float, ...]:
    """`value` as a tuple of floats, one per name in `parts`; a `ValueError` naming
    `name` and the tuple it expects unless `value` is a tuple, list or 1-d array of
    that many finite real numbers (`> 0` if `positive`)."""
    kind = "finite positive" if positive else "finite real"
    expected = f"a tuple ({', '.join(parts)}) of {len(parts)} {kind} numbers"
    is_sequence = isinstance(value, (tuple, list)) or (
        isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 1
    )
    if not is_sequence or len(value) != len(parts):
        raise ValueError(f"`{name}` must be {expected}, got {value!r}.")
    out = []
    for part, v in zip(parts, value):
        try:
            out.append(check_real(part, v, positive=positive))
        except ValueError:
            raise ValueError(
                f"`{name}` must be {expected}, got {value!r} ({part} = {v!r})."
            ) from None
    return tuple(out)


def check_bool(name: str, value: object) -> bool:
    """`value` if it is a bool, else a `ValueError` naming `name`."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool, got {value!r}.")
    return value


def check_parameter_dtype(layer: str, dtype) -> jnp.dtype:
    """`dtype` (JAX's default float if `None`) if it is float32 or float64, else a
    `ValueError` that says what to do: these layers factorise matrices (LAPACK has
    no half precision) or recur in complex numbers (JAX has no complex half)."""
    dtype = default_floating_dtype() if dtype is None else jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise ValueError(
            f"`eqx_seq.{layer}` keeps its parameters in float32 or float64, got "
            f"`dtype={dtype}`. For half precision, keep the layer in float32 and "
            "give it half-precision inputs: they are computed in float32."
        )
    return dtype


def check_reset(reset, length: int, name: str) -> Array | None:
    """`reset` as a bool array of shape `(length,)`, or a `ValueError`."""
    if reset is None:
        return None
    reset = jnp.asarray(reset)
    if reset.shape != (length,) or reset.dtype != jnp.bool_:
        raise ValueError(
            f"`{name}`: `reset` marks segment starts, a bool array of shape (T,) = "
            f"({length},), got {reset.dtype} of shape {reset.shape}."
        )
    return reset


def real_input(x, name: str, dtype=None, what: str = "input") -> Array:
    """`x` as an array of real numbers, as the layers' `Real` annotations promise:
    floating input as it is, integers (pixel values, counts) cast to `dtype`, the
    layer's parameter dtype (JAX's default floating dtype if `None`); a
    `ValueError` naming `name` for anything else. Bools are refused, as `Real`
    refuses them (jaxtyping's: floating and integer dtypes): accepted here they
    would pass without jaxtyping's runtime checks and fail with them."""
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError):  # `None`, a string, a ragged list, ...
        raise ValueError(
            f"`{name}` needs a real {what} (floating or integer), got {x!r}."
        ) from None
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(default_floating_dtype() if dtype is None else dtype)
    raise ValueError(
        f"`{name}` needs a real {what} (floating or integer), got {x.dtype}."
    )


def check_sequence(
    x, size: int | None, name: str, features: str = "H", dtype=None
) -> Array:
    """`x` if it is one real sequence of shape `(T, size)` (any width if `size` is
    `None`), `T >= 1`: the input check of every layer that takes one sequence, time
    first, and leaves a batch to `jax.vmap`. `features` names the width in the
    message. Integer input is cast to `dtype` (`real_input`)."""
    x = jnp.asarray(x)
    width = features if size is None else f"{features}) = (T, {size}"
    if x.ndim != 2 or x.shape[0] == 0 or (size is not None and x.shape[1] != size):
        raise ValueError(
            f"`{name}` takes one unbatched sequence of shape (T, {width}) with "
            f"T >= 1, got shape {x.shape}; use `jax.vmap` for a batch."
        )
    return real_input(x, name, dtype)


def check_state(h0, shape: tuple[int, ...], name: str, what: str = "h0") -> Array:
    """`h0` if it is a real array of `shape`."""
    try:
        h0 = jnp.asarray(h0)
    except (TypeError, ValueError):  # `None`, a tuple of arrays, ...
        raise ValueError(
            f"`{name}`: `{what}` must be a real array of shape {shape}, got {h0!r}."
        ) from None
    if h0.shape != shape or jnp.iscomplexobj(h0):
        raise ValueError(
            f"`{name}`: `{what}` must be a real array of shape {shape}, got "
            f"{h0.dtype} of shape {h0.shape}."
        )
    return h0


def check_state_parts(
    state, shapes: tuple[tuple[int, ...], ...], name: str, parts: tuple[str, ...]
) -> tuple[Array, ...]:
    """`state` as a tuple of arrays if it is a tuple (or list) of real floating
    arrays of `shapes`, the parts named `parts` (the state of a layer with a
    convolution and a recurrence); a `ValueError` naming `name` otherwise."""
    shown = " and ".join(map(str, shapes))
    expected = (
        f"a {'pair' if len(shapes) == 2 else 'tuple'} `({', '.join(parts)})` of real "
        f"floating arrays of shapes {shown}, as `init_state()` returns"
    )
    if not isinstance(state, (tuple, list)) or len(state) != len(shapes):
        given = (
            f"a {type(state).__name__} of length {len(state)}"
            if isinstance(state, (tuple, list))
            else type(state).__name__
        )
        raise ValueError(f"`{name}`: `state` must be {expected}, got {given}.")
    checked = []
    for i, (part, shape) in enumerate(zip(state, shapes)):
        want = (
            f"`{name}`: `state[{i}]` ({parts[i]}) must be a real floating array of "
            f"shape {shape}, as in `init_state()`, got"
        )
        try:
            part = jnp.asarray(part)
        except (TypeError, ValueError):  # None, a string, an object
            raise ValueError(f"{want} {type(part).__name__}.") from None
        # integers and bools would be cast silently into a state no step could
        # have produced
        if part.shape != shape or not jnp.issubdtype(part.dtype, jnp.floating):
            raise ValueError(f"{want} {part.dtype} of shape {part.shape}.")
        checked.append(part)
    return tuple(checked)


def zeros_like_inputs(shape: tuple[int, ...], dtype, *inputs: Array) -> Array:
    """Zeros of `shape` and `dtype` that vary over every mesh axis that one of
    `inputs` varies over, under `jax.shard_map`.

    For the initial carries and output buffers of loops: `jax.shard_map` (with its
    default `check_vma=True`) requires a carry's type to match its update's, and an
    update computed from per-device data varies over the mesh while `jnp.zeros`
    does not. Outside `shard_map` this is plain `jnp.zeros`.
    """
    out = jnp.zeros(shape, dtype)
    for x in inputs:
        out = out + jnp.zeros_like(x, dtype=dtype, shape=())
    return out


def vary_like(x: Array, *inputs: Array) -> Array:
    """`x`, varying under `jax.shard_map` over every mesh axis one of `inputs` varies
    over (`x` plus a zero scalar).

    For parameters that meet per-device data inside JAX's own rules, where JAX
    does not make them vary itself: the closures of a `lax.custom_linear_solve`
    (whose gradient otherwise failed to lower under `shard_map` in jax 0.10: a
    `pvary` of a varying value inside the solve), and the Kalman filter's
    parameters, so that every carry and `lax.cond` branch computed from them and
    from per-device data has one type.
    """
    return x + zeros_like_inputs((), x.dtype, *inputs)


def error_if_any(x: Array, pred: Array, msg: str) -> Array:
    """`x`, raising `msg` at run time (`eqx.error_if`) if any entry of `pred` is true.

    The check runs on a scalar that is shared by all devices, then added (as a zero)
    to `x`, so that it also traces under `jax.shard_map`: `eqx.error_if` on an
    array that varies over the mesh does not (equinox 0.13). With `EQX_ON_ERROR=nan`
    a floating `x` comes back NaN, as from `eqx.error_if`.
    """
    token = eqx.error_if(jnp.zeros((), x.dtype), jnp.any(pred), msg)
    return x + token


def full_precision(fn: _F) -> _F:
    """`fn`, with the matrix products it traces at `jax.lax.Precision.HIGHEST`.

    On GPUs and TPUs, JAX's default for float32 products is a faster, less precise
    one (TF32 on NVIDIA GPUs, 10 bits of mantissa): fine for a network's
    projections, not for a Kalman filter's covariance updates, whose float32
    log-likelihood it makes inaccurate (`docs/faq.md`, TF32). The precision is fixed
    when a product is traced, so this wraps every function that traces products
    for the filter: its bodies, and the rules of its `jax.custom_jvp`s, which JAX
    traces later, when it differentiates (outside any body). JAX's own derivative
    rules for the linear algebra (Cholesky, triangular solves) already ask for
    `HIGHEST`.
    """

    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapper
