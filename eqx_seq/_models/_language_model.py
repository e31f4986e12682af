"""A causal language model: Embedding, recurrent blocks, tied output, generation."""

import math
import os
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import (
    Array,
    ArrayLike,
    DTypeLike,
    Float,
    Int,
    PRNGKeyArray,
    PyTree,
    Real,
)

from .._embedding import Embedding
from .._misc import check_positive_int, error_if_any
from .._scan import AbstractScan, AutoScan
from .._ssm._recurrent import AbstractRecurrentLayer
from ._blocks import make_blocks, Mixer, run_blocks
from ._pretrained import load_pretrained


class LanguageModel(eqx.Module):
    """A causal language model: `Embedding` → recurrent blocks → norm → tied logits.

    The blocks are [`eqx_seq.S5Block`][]s around S5 or LRU layers,
    [`eqx_seq.HawkBlock`][]s (`mixer="rglru"`), [`eqx_seq.MambaBlock`][]s
    (`mixer="mamba"`), [`eqx_seq.Mamba2Block`][]s (`mixer="mamba2"`) or
    [`eqx_seq.GatedDeltaNetBlock`][]s (`mixer="gated_deltanet"`).

    The output layer is the embedding itself ([`eqx_seq.Embedding.attend`][]), so
    the model has one `(vocab_size, width)` table. Generation runs the blocks in
    step mode, one token at a time with their states carried, and gives the same
    logits as the parallel call on the whole sequence.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, jax.random as jr
        import eqx_seq

        lm = eqx_seq.LanguageModel(50, width=32, depth=2, key=jr.key(0))
        logits = lm(jnp.array([1, 2, 3]))                       # (3, 50)
        text = lm.generate(jnp.array([1, 2]), 5, key=jr.key(1))  # 5 new tokens
        ```
    """

    embedding: Embedding
    blocks: tuple[AbstractRecurrentLayer, ...]
    norm: eqx.nn.LayerNorm | eqx.nn.RMSNorm

    def __init__(
        self,
        vocab_size: int,
        *,
        width: int = 128,
        depth: int = 4,
        state_size: int = 64,
        mixer: Mixer = "s5",
        ssm_blocks: int = 1,
        activation: str = "half_glu1",
        dropout: float = 0.0,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `vocab_size`: the number of tokens.
        - `width`, `depth`, `state_size`, `mixer`, `ssm_blocks`, `activation`,
            `dropout`: as for [`eqx_seq.SequenceClassifier`][] (always causal,
            with pre-norm LayerNorms). `state_size` is not for `mixer="rglru"`,
            `ssm_blocks` is for `"s5"` only, `activation` for `"s5"` and `"lru"`,
            and `dropout` not for `"rglru"`: one of them given a value other than
            its default with a mixer that has no such argument is refused. A
            mixer of your own generates through its blocks' `init_state` and
            `step`.
        - `scan`: the recurrence backend of every layer.
        - `dtype`: the parameter dtype.
        - `key`: a `jax.random` key. (Keyword only.)
        """
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("width", width)
        ekey, bkey = jr.split(key)
        emb = Embedding(vocab_size, width, param_dtype=dtype, key=ekey)
        # N(0, 1/width) rows: unit-scale logits through the tied output
        self.embedding = eqx.tree_at(lambda e: e.weight, emb, emb.weight / width**0.5)
        self.blocks = make_blocks(
            width,
            depth,
            state_size,
            mixer=mixer,
            ssm_blocks=ssm_blocks,
            bidirectional=False,
            activation=activation,
            norm="layer",
            prenorm=True,
            dropout=dropout,
            scan=scan,
            dtype=dtype,
            key=bkey,
        )
        self.norm = eqx.nn.LayerNorm(width, dtype=dtype)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        *,
        dtype: DTypeLike | None = None,
        scan: AbstractScan = AutoScan(),
        chunk_size: int | None = None,
    ) -> "LanguageModel":
        """A Mamba or Mamba-2 language model from a checkpoint of Hugging Face
        transformers (`MambaForCausalLM`, `Mamba2ForCausalLM`) in a local
        directory: its `config.json` and its weights in `model.safetensors` (or
        the files that `model.safetensors.index.json` lists). Nothing is
        downloaded.

        The model has the checkpoint's blocks, [`eqx_seq.MambaBlock`][]s or
        [`eqx_seq.Mamba2Block`][]s with RMS norms of its epsilon, an RMS final
        norm and the output tied to the embedding, and gives the logits of the
        checkpoint's own model. `config.json` is read as transformers reads it:
        the non-finite numbers that transformers 5 writes as objects
        (`{"__float__": "Infinity"}`, `"-Infinity"`, `"NaN"`) and the bare
        `Infinity` token of older versions are numbers.

        A Mamba-2 checkpoint's `time_step_limit` (`[low, high]`; transformers'
        default `[0, inf]` clamps nothing) clamps the step sizes in step mode
        too, as in the parallel call, so `step` and `generate` give the logits
        of the checkpoint's whole-sequence forward pass. `mamba_ssm`'s cached
        one-token step skips that clamp, and so does transformers' cached
        decoding on `mamba_ssm`'s CUDA kernels: with a finite limit, the tokens
        that `generate` picks here can differ from those of transformers'
        `generate`, while every step's logits equal those of its forward pass
        over the whole sequence.

        **Arguments:**

        - `directory`: the checkpoint's directory.
        - `dtype`: the parameter dtype, float32 or float64 (default: JAX's
            default float); half-precision weights are widened.
        - `scan`: the recurrence backend of every layer.
        - `chunk_size`: the steps per chunk of [`eqx_seq.ssd_scan`][] in a
            Mamba-2 model (default: the checkpoint's `chunk_size`); the logits do
            not depend on it.

        **Returns:**

        The `LanguageModel`.

        **Raises:**

        `ValueError`, naming the file and the problem, for a directory without
        `config.json` or safetensors weights; for a file that is not what it
        should be (a `config.json` or index that is not JSON or not an object,
        an index without a `weight_map` of tensor names to files, a safetensors
        header entry without `dtype`, `shape` or `data_offsets`, or with offsets
        outside the data, of the wrong size or overlapping another's); for a
        setting of the wrong type or range (`time_step_limit` must be
        `[low, high]` with `0 <= low <= high`); for another architecture
        (`model_type` other than `"mamba"` or `"mamba2"`; a checkpoint in
        `mamba_ssm`'s own format, `pytorch_model.bin`, is told apart, with how
        to convert it); for a layout the layers do not have (biases on the
        projections, a `hidden_act` other than `"silu"`/`"swish"`, an output
        layer not tied to the embedding); and for tensors missing, left over or
        of the wrong shape.
        """
        table, blocks, norm = load_pretrained(
            directory, dtype=dtype, scan=scan, chunk_size=chunk_size
        )
        vocab, width = table.shape
        # the model's structure without its parameters, which the checkpoint gives
        model = eqx.filter_eval_shape(
            cls,
            vocab,
            width=width,
            depth=1,
            mixer="rglru",
            dtype=table.dtype,
            key=jr.key(0),
        )
        return eqx.tree_at(
            lambda m: (m.embedding.weight, m.blocks, m.norm),
            model,
            (table, blocks, norm),
        )

    @jax.named_scope("eqx_seq.LanguageModel")
    def __call__(
        self, ids: Int[ArrayLike, " T"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " T V"]:
        """**Arguments:**

        - `ids`: token ids, shape `(T,)`.
        - `key`: for dropout.

        **Returns:**

        Next-token logits for every position, shape `(T, vocab_size)`.
        """
        ids = jnp.asarray(ids)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise ValueError(
                f"`LanguageModel` takes one sequence of token ids, shape (T,) with "
                f"T >= 1, got shape {ids.shape}; use `jax.vmap` for a batch."
            )
        z = run_blocks(self.blocks, self.embedding(ids), key)
        return self.embedding.attend(jax.vmap(self.norm)(z))

    def init_state(self) -> tuple[PyTree[Array], ...]:
        """The zero state of every block, for step mode."""
        return tuple(block.init_state() for block in self.blocks)

    def _check_state(self, state: object) -> tuple[PyTree[Array], ...]:
        """`state` (lists read as tuples) if it has the structure of `init_state()`:
        one state per block, each with its leaves' shapes, floating (complex where
        the block's is). Blocks are paired with states in order, so a state that
        is short would skip blocks."""
        expected = tuple(jax.eval_shape(block.init_state) for block in self.blocks)
        state = _as_tuples(state)
        if not isinstance(state, tuple) or len(state) != len(expected):
            raise ValueError(
                "`LanguageModel.step`: `state` must be a tuple of one state per block "
                f"({len(expected)} blocks), as `init_state()` returns, got "
                f"{_describe(state)}."
            )
        for i, (block, want, got) in enumerate(zip(self.blocks, expected, state)):
            leaves = jax.tree.leaves(got)
            if jax.tree.structure(got) != jax.tree.structure(want) or not all(
                _fits(leaf, spec) for leaf, spec in zip(leaves, jax.tree.leaves(want))
            ):
                raise ValueError(
                    f"`LanguageModel.step`: `state[{i}]`, the state of block {i} (a "
                    f"`{type(block).__name__}`), must be {_describe(want)} as in "
                    f"`init_state()`, got {_describe(got)}."
                )
        return state

    def step(
        self, state: Sequence[PyTree[Array]], token: Int[ArrayLike, ""]
    ) -> tuple[tuple[PyTree[Array], ...], Float[Array, " V"]]:
        """Feed one token (RNN mode): stepping through a sequence from
        `init_state()` gives the logits of the parallel call.

        **Arguments:**

        - `state`: the state of every block, with the structure and shapes of
            `init_state()` (as the previous `step` returns it); lists are taken for
            its tuples.
        - `token`: one token id, an integer scalar.

        **Returns:**

        `(state, logits)`: the new states and the next-token logits `(vocab_size,)`.
        """
        state = self._check_state(state)
        token = jnp.asarray(token)
        if token.shape != () or not jnp.issubdtype(token.dtype, jnp.integer):
            raise ValueError(
                "`LanguageModel.step` takes one token id, an integer scalar, got "
                f"{token.dtype} of shape {token.shape}; `jax.lax.scan` over a "
                "sequence, `jax.vmap` over a batch."
            )
        z = self.embedding(token)
        new = []
        for block, s in zip(self.blocks, state, strict=True):
            s, z = block.step(s, z)
            new.append(s)
        return tuple(new), self.embedding.attend(self.norm(z))

    def generate(
        self,
        prompt: Int[ArrayLike, " T"],
        num_tokens: int,
        *,
        key: PRNGKeyArray,
        temperature: Real[ArrayLike, ""] = 1.0,
    ) -> Int[Array, " N"]:
        """Sample `num_tokens` tokens after `prompt` in step mode.

        **Arguments:**

        - `prompt`: token ids, shape `(T,)`, `T >= 1`.
        - `num_tokens`: how many tokens to sample.
        - `key`: a `jax.random` key.
        - `temperature`: tokens are drawn from `softmax(logits / temperature)`;
            `0` picks the most likely token. A real, finite number `>= 0`, which
            may be traced (no recompilation per value).

        The draw is the Gumbel-max trick, `argmax(logits + temperature * g)` with
        `g` standard Gumbel noise (`argmax(logits / temperature + g)` when
        `temperature >= 1`, the same token): exactly a draw from the softmax at
        every `temperature > 0`, without dividing by a small temperature, which
        overflows. So the tokens tend to the greedy ones as `temperature → 0`
        (a float32 model gives them at `1e-37`) and are the greedy ones at `0`.

        **Returns:**

        The sampled ids, shape `(num_tokens,)`.
        """
        prompt = jnp.asarray(prompt)
        check_positive_int("num_tokens", num_tokens)
        if (
            prompt.ndim != 1
            or prompt.shape[0] == 0
            or not jnp.issubdtype(prompt.dtype, jnp.integer)
        ):
            raise ValueError(
                "`prompt` must be token ids, integers of shape (T,) with T >= 1, got "
                f"{prompt.dtype} of shape {prompt.shape}."
            )
        return _generate(self, prompt, num_tokens, key, _temperature(temperature))


def _as_tuples(tree: object) -> object:
    """`tree` with its lists and tuples as tuples."""
    if isinstance(tree, (list, tuple)):
        return tuple(_as_tuples(x) for x in tree)
    return tree


def _describe(tree: object) -> str:
    """`tree` in words: its structure with `dtype[shape]` for every array."""
    if isinstance(tree, tuple):
        inner = ", ".join(_describe(x) for x in tree)
        return f"({inner},)" if len(tree) == 1 else f"({inner})"
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return f"{tree.dtype}{list(tree.shape)}"
    return repr(tree) if tree is None else type(tree).__name__


def _fits(leaf: object, spec: jax.ShapeDtypeStruct) -> bool:
    """Whether `leaf` can stand for an array like `spec`: the same shape, floating,
    complex only where `spec` is."""
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        return False
    if jnp.issubdtype(spec.dtype, jnp.complexfloating):
        kind = jnp.inexact
    else:
        kind = jnp.floating
    return tuple(leaf.shape) == spec.shape and jnp.issubdtype(leaf.dtype, kind)


_BAD_TEMPERATURE = (
    "`temperature` must be a real number, finite and >= 0 (0 picks the likeliest token)"
)


def _temperature(temperature: Real[ArrayLike, ""]) -> Real[Array, ""]:
    """`temperature` as an array (one compilation for every value), checked: at once
    when it is concrete, at run time (`eqx.error_if`) when it is traced."""
    try:
        t = jnp.asarray(temperature)
    except (TypeError, ValueError):  # not an array: a string, None, an object
        raise ValueError(f"{_BAD_TEMPERATURE}; got {temperature!r}.") from None
    real = jnp.issubdtype(t.dtype, jnp.floating) or jnp.issubdtype(t.dtype, jnp.integer)
    if t.shape != () or not real:
        raise ValueError(f"{_BAD_TEMPERATURE}; got {temperature!r}.")
    try:
        value = float(t)
    except jax.errors.ConcretizationTypeError:
        good = jnp.isfinite(t) & (t >= 0)
        return error_if_any(t, ~good, f"eqx_seq.LanguageModel: {_BAD_TEMPERATURE}.")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{_BAD_TEMPERATURE}; got {temperature!r}.")
    return t


@eqx.filter_jit
def _generate(model: LanguageModel, prompt, num_tokens: int, key, temperature):
    state, logits = jax.lax.scan(
        lambda s, t: model.step(s, t), model.init_state(), prompt
    )
    # Gumbel-max: argmax(logits / T + g) is a draw from softmax(logits / T), and
    # so is argmax(logits / s + (T / s) g) for any s > 0. s = max(T, 1) divides by
    # nothing below 1 (logits / T overflowed for a tiny T) and multiplies the
    # noise by nothing above 1; at T = 0 it is the argmax of the logits. For
    # T >= 1 it is `jr.categorical(key, logits / T)`, with the same draws.
    temperature = temperature.astype(logits.dtype)
    scale = jnp.maximum(temperature, jnp.ones((), logits.dtype))
    noise = temperature / scale

    def sample(carry, key):
        state, logits = carry
        gumbel = jr.gumbel(key, logits.shape, logits.dtype)
        token = jnp.argmax(logits / scale + noise * gumbel)
        state, logits = model.step(state, token)
        return (state, logits), token

    _, tokens = jax.lax.scan(sample, (state, logits[-1]), jr.split(key, num_tokens))
    return tokens
