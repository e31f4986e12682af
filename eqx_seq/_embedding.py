"""Token embedding: one gather over any index shape, an explicit out-of-range policy."""

from typing import Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike, Float, Inexact, Integer, PRNGKeyArray

from ._misc import check_positive_int, default_floating_dtype, error_if_any


_POLICIES = ("error", "clip", "fill")


def _narrow(ids: ArrayLike, V: int) -> Array:
    """`ids` as int32, each out-of-range id kept out of range.

    Ids wider than 32 bits (int64 under x64, or NumPy's int64 without it) are first
    clamped into `[-V - 1, V]`, which keeps every id's meaning (in range, or out of
    range on the same side) where a plain cast would wrap it into range.
    """
    if not isinstance(ids, jax.Array):
        ids = np.asarray(ids)
        if np.issubdtype(ids.dtype, np.integer):
            ids = np.clip(ids, max(-V - 1, np.iinfo(ids.dtype).min), V)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"eqx_seq.Embedding needs integer ids, got dtype {ids.dtype}; "
            "cast them, e.g. `ids.astype(jnp.int32)`."
        )
    info = jnp.iinfo(ids.dtype)
    if info.min < -(2**31) or info.max > 2**31 - 1:
        ids = jnp.clip(ids, max(-V - 1, info.min), V)
    return ids.astype(jnp.int32)


class Embedding(eqx.Module):
    """A lookup table of `num_embeddings` vectors of size `embedding_size`.

    Unlike `eqx.nn.Embedding`, which looks up one scalar index and is `jax.vmap`-ed
    by its users, this takes an index array of any shape and does one gather for
    all of it (`jnp.take`): the canonical gather that accelerators fuse (equinox
    issue 920). It also works when `vmap`-ed, and under `jax.shard_map`.

    Ids are integers of any width in `[-num_embeddings, num_embeddings)`; a negative
    id counts from the end, as in NumPy (`-1` is the last row). Ids outside that
    range (wide ones included: never wrapped into range) raise, are clamped or give
    a row of NaN, as `out_of_range` says. With `padding_idx`, that row starts at zero
    and never receives a gradient, neither through lookups (an id clamped onto it
    included) nor through [`eqx_seq.Embedding.attend`][]. With `freeze=True` no
    gradient reaches the weight.

    !!! Example

        ```python
        import jax.random as jr
        import eqx_seq

        emb = eqx_seq.Embedding(1000, 64, padding_idx=0, key=jr.key(0))
        ids = jr.randint(jr.key(1), (8, 128), 0, 1000)  # any shape: one gather
        x = emb(ids)                                     # (8, 128, 64)
        logits = emb.attend(x)                           # (8, 128, 1000), tied
        ```
    """

    weight: Float[Array, "num_embeddings embedding_size"]
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)
    padding_idx: int | None = eqx.field(static=True)
    out_of_range: Literal["error", "clip", "fill"] = eqx.field(static=True)
    dtype: jnp.dtype | None = eqx.field(static=True)
    frozen: bool = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int | None = None,
        embedding_size: int | None = None,
        *,
        padding_idx: int | None = None,
        weight: Float[ArrayLike, "num_embeddings embedding_size"] | None = None,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike | None = None,
        out_of_range: Literal["error", "clip", "fill"] = "error",
        freeze: bool = False,
        key: PRNGKeyArray | None = None,
    ):
        """**Arguments:**

        - `num_embeddings`: the number of rows `V` (vocabulary size).
        - `embedding_size`: the size `D` of each vector.
        - `padding_idx`: a row (negative counts from the end) that starts at zero
            and never receives gradient; `None` for none.
        - `weight`: an explicit `(V, D)` table instead of a random one; the sizes
            may then be omitted (if given, they must match).
        - `dtype`: the compute dtype of lookups and `attend` (e.g. `jnp.bfloat16`
            over float32 weights); `None` computes in the weight's dtype.
        - `param_dtype`: the storage dtype of the weight; defaults to JAX's default
            floating dtype, or to `weight`'s dtype when `weight` is given.
        - `out_of_range`: what an id outside `[-V, V)` gives:
            - `"error"` (default): raise at run time through `eqx.error_if` (works
                under `jax.jit`; `EQX_ON_ERROR` controls it). If the check is
                switched off, ids are clamped as with `"clip"`. Its cost:
                `benchmarks/bench_embedding.py`.
            - `"clip"`: clamp to the nearest valid row (`-V - 3` gives row 0,
                `V + 3` the last row). The clamped row is what is looked up, so it
                also receives the gradient: forward and backward agree.
            - `"fill"`: return a row of NaN. Such a row does not depend on the
                weight and gives it no gradient.
        - `freeze`: if `True`, the weight is wrapped in `jax.lax.stop_gradient` in
            every use, so its gradient is zero and an optimizer driven only by
            gradients (SGD, Adam) leaves it unchanged. An update that does not come
            from the gradient, such as AdamW's weight decay, would still move it:
            exclude it from such optimizers with `eqx.partition` / `optax.masked`
            (or `eqx.filter` on a filter spec), the usual Equinox way.
        - `key`: a `jax.random.key` for the N(0, 1) initialisation; required unless
            `weight` is given.
        """
        if out_of_range not in _POLICIES:
            raise ValueError(
                f"`out_of_range` must be one of {_POLICIES}, got {out_of_range!r}."
            )
        if weight is None:
            if num_embeddings is None or embedding_size is None or key is None:
                raise ValueError(
                    "Give `eqx_seq.Embedding(num_embeddings, embedding_size, key=...)` "
                    "or `eqx_seq.Embedding(weight=...)`."
                )
            check_positive_int("num_embeddings", num_embeddings)
            check_positive_int("embedding_size", embedding_size)
            if param_dtype is None:
                param_dtype = default_floating_dtype()
            weight = jr.normal(key, (num_embeddings, embedding_size), param_dtype)
        else:
            weight = jnp.asarray(weight)
            if weight.ndim != 2 or 0 in weight.shape:
                raise ValueError(
                    "`weight` must be a non-empty 2-D (num_embeddings, embedding_size) "
                    f"array, got shape {weight.shape}."
                )
            if not jnp.issubdtype(weight.dtype, jnp.floating):
                raise ValueError(f"`weight` must be floating, got {weight.dtype}.")
            given = (num_embeddings, embedding_size)
            if any(g is not None and g != s for g, s in zip(given, weight.shape)):
                raise ValueError(
                    f"`weight` has shape {weight.shape} but num_embeddings, "
                    f"embedding_size = {given}."
                )
            if param_dtype is not None:
                weight = weight.astype(param_dtype)
        self.num_embeddings, self.embedding_size = weight.shape
        if padding_idx is not None:
            V = self.num_embeddings
            if not isinstance(padding_idx, int) or not -V <= padding_idx < V:
                raise ValueError(
                    f"`padding_idx` must be an int in [-{V}, {V}), got {padding_idx!r}."
                )
            padding_idx %= V
            weight = weight.at[padding_idx].set(0)
        self.weight = weight
        self.padding_idx = padding_idx
        self.out_of_range = out_of_range
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.frozen = bool(freeze)

    @classmethod
    def from_pretrained(
        cls,
        weight: Float[ArrayLike, "num_embeddings embedding_size"],
        *,
        freeze: bool = False,
        padding_idx: int | None = None,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike | None = None,
        out_of_range: Literal["error", "clip", "fill"] = "error",
    ) -> "Embedding":
        """An embedding with a given table, e.g. pretrained vectors.

        **Arguments:**

        - `weight`: the `(V, D)` table. With `padding_idx`, that row is set to zero.
        - `freeze`: if `True`, no gradient reaches the weight (see `__init__` for
            what that means for optimizers).
        - `padding_idx`, `dtype`, `param_dtype`, `out_of_range`: as in `__init__`.

        **Returns:**

        An [`eqx_seq.Embedding`][].
        """
        return cls(
            weight=weight,
            padding_idx=padding_idx,
            dtype=dtype,
            param_dtype=param_dtype,
            out_of_range=out_of_range,
            freeze=freeze,
        )

    def _rows(self, ids: Array) -> Array:
        """The rows looked up for `ids` (int32): negatives wrapped once; checked
        under "error"; clamped into `[0, V)` under "error" and "clip", so that the
        padding test below sees the row really looked up; left out of range (the
        fill) under "fill"."""
        V = self.num_embeddings
        rows = jnp.where(ids < 0, ids + V, ids)
        if self.out_of_range == "fill":
            return rows
        if self.out_of_range == "error":
            rows = error_if_any(
                rows,
                (rows < 0) | (rows >= V),
                f"eqx_seq.Embedding: an id is out of range for num_embeddings={V}: "
                f"valid ids are in [-{V}, {V}). Use out_of_range='clip' or 'fill' to "
                "accept such ids.",
            )
        return jnp.clip(rows, 0, V - 1)

    def _table(self) -> Array:
        return lax.stop_gradient(self.weight) if self.frozen else self.weight

    @jax.named_scope("eqx_seq.Embedding")
    def __call__(
        self, ids: Integer[ArrayLike, "*shape"], *, key: PRNGKeyArray | None = None
    ) -> Inexact[Array, "*shape embedding_size"]:
        """**Arguments:**

        - `ids`: integer ids of any shape, a scalar included.
        - `key`: ignored; for compatibility with the Equinox layer API.

        **Returns:**

        The rows, shape `(*ids.shape, embedding_size)`, in `dtype` (or the weight's).

        **Raises:**

        `ValueError` at trace time for non-integer ids; at run time, a
        `RuntimeError` (from `eqx.error_if`) for out-of-range ids under
        `out_of_range="error"`.
        """
        del key
        ids = _narrow(ids, self.num_embeddings)
        rows = self._rows(ids)
        if self.out_of_range == "fill":
            # `take` wraps negative ids itself and fills rows outside [0, V)
            out = jnp.take(self._table(), ids, axis=0, mode="fill", fill_value=jnp.nan)
        else:
            # already clamped: one gather, whose transpose scatter-adds into the
            # same rows
            out = jnp.take(self._table(), rows, axis=0, mode="clip")
        if self.padding_idx is not None:
            is_padding = (rows == self.padding_idx)[..., None]
            out = jnp.where(is_padding, lax.stop_gradient(out), out)
        return out if self.dtype is None else out.astype(self.dtype)

    @jax.named_scope("eqx_seq.Embedding.attend")
    def attend(
        self, x: Inexact[ArrayLike, "*batch embedding_size"]
    ) -> Inexact[Array, "*batch num_embeddings"]:
        """Tied read-out: logits `x @ weight.T` over the vocabulary.

        **Arguments:**

        - `x`: vectors of size `embedding_size`, any leading shape.

        **Returns:**

        Logits of shape `(*x.shape[:-1], num_embeddings)`, computed in `dtype` if
        set, else in the common dtype of `x` and the weight.

        **Raises:**

        `ValueError` at trace time if `x.shape[-1] != embedding_size`.
        """
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[-1] != self.embedding_size:
            raise ValueError(
                f"`attend` needs x of shape (..., {self.embedding_size}), "
                f"got {x.shape}."
            )
        weight = self._table()
        if self.padding_idx is not None:
            is_padding = (jnp.arange(self.num_embeddings) == self.padding_idx)[:, None]
            weight = jnp.where(is_padding, lax.stop_gradient(weight), weight)
        if self.dtype is not None:
            dtype = self.dtype
        else:
            with jax.numpy_dtype_promotion("standard"):
                dtype = jnp.result_type(x, weight)
        return jnp.matmul(x.astype(dtype), weight.astype(dtype).T)
