"""The input checks of `ssd_scan` and `ssd_step`: shapes read from `x` and `B`, real
floating arrays, the step sizes' limits, flags that are bools."""

import math

import jax
import jax.numpy as jnp


def checked_arrays(name: str, given: dict, required: tuple[str, ...]) -> dict:
    """The given arrays (the optional ones that are `None` left out), each real
    floating."""
    arrays = {}
    for key, x in given.items():
        if x is None:
            if key in required:
                raise ValueError(f"`{name}`: `{key}` is required, got None.")
            continue
        try:
            x = jnp.asarray(x)
        except TypeError as e:
            raise ValueError(f"`{name}`: `{key}` must be an array: {e}") from None
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"`{name}` needs real floating arrays, got {x.dtype} for `{key}`; "
                f"cast it, e.g. `{key}.astype(jnp.float32)`."
            )
        arrays[key] = x
    return arrays


def check_shapes(name: str, arrays: dict, time: tuple) -> None:
    """Shapes against those `x` and `B` give (`time`: `(T,)`, or `()` for a step);
    groups that divide the heads."""
    x, B = arrays["x"], arrays["B"]
    if x.ndim != len(time) + 2 or (time and x.shape[0] == 0):
        what = "(T, H, P) with T >= 1" if time else "(H, P)"
        raise ValueError(
            f"`{name}`: `x` must have shape {what}, got shape {x.shape}"
            + ("; use `jax.vmap` for a batch." if time else ".")
        )
    if B.ndim != len(time) + 2:
        what = "(T, G, N)" if time else "(G, N)"
        raise ValueError(f"`{name}`: `B` must have shape {what}, got {B.shape}.")
    *_, H, P = x.shape
    *_, G, N = B.shape
    if not min(H, P, G, N):
        raise ValueError(
            f"`{name}`: every axis of the heads must have a size: got H = {H} "
            f"heads of P = {P} channels (`x` {x.shape}), G = {G} groups of N = {N} "
            f"states (`B` {B.shape})."
        )
    if H % G:
        raise ValueError(
            f"`{name}`: the {G} groups of `B` and `C` must divide the {H} heads of "
            f"`x` (each group serves H / G heads), got H = {H}, G = {G}."
        )
    T = x.shape[:1] if time else ()
    expected = {
        "dt": (*T, H), "A": (H,), "B": (*T, G, N), "C": (*T, G, N),
        "z": (*T, H, P), "dt_bias": (H,), "h0": (H, P, N), "state": (H, P, N),
    }  # fmt: skip
    sizes = f"H = {H} heads, P = {P} channels per head, G = {G} groups, N = {N}"
    if T:
        sizes = f"T = {T[0]} steps, " + sizes
    for key, a in arrays.items():
        want = expected.get(key)
        ok = a.shape in ((H,), (H, P)) if key == "D" else a.shape == want
        if key != "x" and not ok:
            want = "(H,) or (H, P)" if key == "D" else want
            raise ValueError(
                f"`{name}`: `{key}` must have shape {want} (with {sizes} states, "
                f"read from `x` {x.shape} and `B` {B.shape}), got {a.shape}."
            )


def check_dt_limit(name: str, dt_limit) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(
            f"`{name}`: `dt_limit` must be a pair of numbers (low, high), got "
            f"{dt_limit!r}."
        ) from None
    if not (0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(
            f"`{name}`: `dt_limit` must satisfy 0 <= low <= high, got {dt_limit!r}."
        )
    return lo, hi


def compute_dtype(arrays: dict):
    """The inputs' dtype, and the one they are computed in (float32 for half)."""
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*arrays.values())
        return dtype, jnp.promote_types(dtype, jnp.float32)
