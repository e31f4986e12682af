"""Reading Hugging Face transformers' Mamba and Mamba-2 causal-LM checkpoints: a
directory with `config.json` and the weights in safetensors files."""

import math
import os
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from .._misc import check_parameter_dtype
from .._scan import AbstractScan
from .._ssm._mamba import Mamba
from .._ssm._mamba2 import Mamba2
from .._ssm._mamba_block import Mamba2Block, MambaBlock
from ._files import decode_special_floats, is_int, read_json, read_weights


_ARCHITECTURES = ("mamba", "mamba2")


class _Config:
    """The settings of `config.json`, each checked as it is read: a `ValueError`
    that names the file and the setting for any of the wrong type or range."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.values = read_json(
            path,
            what="the model's settings by name",
            object_hook=decode_special_floats,
        )

    def get(self, name: str, default: object = None):
        return self.values.get(name, default)

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def integer(self, name: str, default: object = None) -> int:
        """A positive integer setting."""
        value = self.values.get(name, default)
        if not is_int(value) or value < 1:
            raise self.error(f"`{name}` must be a positive integer, got {value!r}.")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.values.get(name, default)
        if not isinstance(value, bool):
            raise self.error(f"`{name}` must be true or false, got {value!r}.")
        return value

    def positive(self, name: str, default: float) -> float:
        """A finite positive number."""
        value = self.values.get(name, default)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value < math.inf
        ):
            raise self.error(
                f"`{name}` must be a positive finite number, got {value!r}."
            )
        return float(value)

    def time_step_limit(self) -> tuple[float, float]:
        """Mamba-2's clamp of the step sizes: `[low, high]`, `high` possibly
        infinite (transformers' default)."""
        value = self.values.get("time_step_limit", [0.0, math.inf])
        numbers = (
            isinstance(value, list)
            and len(value) == 2
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
            )
        )
        # `not` of the comparisons, so that NaN fails them
        if not numbers or not (0 <= value[0] < math.inf and value[0] <= value[1]):
            raise self.error(
                "`time_step_limit` must be a pair of numbers [low, high] with "
                f"0 <= low <= high (high may be infinite), got {value!r}."
            )
        return float(value[0]), float(value[1])


class _Weights:
    """The checkpoint's tensors, handed out by name, each checked against the
    shape the layer needs and cast to the parameter dtype; `check_all_used`
    refuses tensors that were never asked for."""

    def __init__(self, directory: pathlib.Path, dtype):
        self.weights = read_weights(directory)
        self.where = f"The checkpoint in {directory}"
        self.dtype = dtype
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def __call__(self, name: str, like: jax.ShapeDtypeStruct | tuple[int, ...]):
        shape = like if isinstance(like, tuple) else like.shape
        if name not in self.weights:
            raise ValueError(
                f"{self.where} has no tensor {name!r} (shape {shape}), which its "
                "config.json implies."
            )
        array = self.weights[name]
        if array.shape != shape:
            raise ValueError(
                f"{self.where}: {name!r} has shape {array.shape}; its config.json "
                f"implies {shape}."
            )
        self.used.add(name)
        return jnp.asarray(np.asarray(array, np.float64), self.dtype)

    def check_all_used(self) -> None:
        unused = sorted(set(self.weights) - self.used)
        if unused:
            shown = ", ".join(map(repr, unused[:5]))
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise ValueError(
                f"{self.where} has tensors that its config.json does not account "
                f"for: {shown}{more}."
            )


def _conv(w: _Weights, prefix: str, conv, use_bias: bool):
    """A depthwise `Conv1d` of PyTorch, `(C, 1, K)`, as a `CausalConv`, `(K, C)`."""
    K, C = conv.weight.shape
    weight = w(f"{prefix}.weight", (C, 1, K))[:, 0, :].T
    bias = w(f"{prefix}.bias", (C,)) if use_bias else jnp.zeros(C, w.dtype)
    return eqx.tree_at(lambda c: (c.weight, c.bias), conv, (weight, bias))


def _mamba_ssm_format(directory: pathlib.Path, config: _Config) -> ValueError:
    """The error for a checkpoint that `mamba_ssm` saved itself (its
    `MambaLMHeadModel`): what it is, what is read instead, how to convert."""
    ssm_cfg = config.get("ssm_cfg")
    mamba2 = isinstance(ssm_cfg, dict) and ssm_cfg.get("layer") == "Mamba2"
    model, folder = (
        ("Mamba2ForCausalLM", "mamba2") if mamba2 else ("MambaForCausalLM", "mamba")
    )
    return ValueError(
        f"{directory} holds a checkpoint in `mamba_ssm`'s own format (config.json "
        "with `d_model` and `ssm_cfg`, weights in `pytorch_model.bin`), not "
        "transformers'. `LanguageModel.from_pretrained` reads Hugging Face "
        'transformers\' checkpoints: config.json with `model_type` "mamba" or '
        '"mamba2", weights in safetensors files. Convert it with transformers: the '
        f"conversion script in its `models/{folder}` folder loads it into a "
        f"`{model}`, or load its weights into one yourself; that model's "
        "`save_pretrained(directory)` writes the checkpoint to read."
    )


# what transformers' Mamba and Mamba-2 mixers apply through `ACT2FN[hidden_act]`
# (after the convolution, and Mamba's to the gate too) is SiLU in the layers here
_SILU = ("silu", "swish")


def _settings(directory: pathlib.Path, chunk_size: int | None) -> dict:
    """The checked settings of the checkpoint's config.json, all read before any
    weight, so that a bad config is named as such."""
    config = _Config(directory / "config.json")
    kind = config.get("model_type")
    if kind is None and ("d_model" in config.values or "ssm_cfg" in config.values):
        raise _mamba_ssm_format(directory, config)
    if kind is None:
        raise ValueError(
            f"{config.path} has no `model_type`; `LanguageModel.from_pretrained` "
            "reads transformers' Mamba and Mamba-2 causal language models "
            f"(model_type one of {_ARCHITECTURES})."
        )
    if kind not in _ARCHITECTURES:
        names = config.get("architectures")
        names = ", ".join(map(str, names)) if isinstance(names, list) else names
        raise ValueError(
            f"{directory} holds a {kind!r} checkpoint ({names or 'no architectures'}"
            "); `LanguageModel.from_pretrained` reads transformers' Mamba and Mamba-2 "
            f"causal language models (model_type one of {_ARCHITECTURES})."
        )
    if config.flag("use_bias", False):
        raise config.error(
            "`use_bias=true` (biases on the in- and out-projections) is not a layout "
            "`eqx_seq.Mamba` and `eqx_seq.Mamba2` have."
        )
    act = config.get("hidden_act", "silu")
    if act not in _SILU:
        raise config.error(
            f"`hidden_act` is {act!r}; `eqx_seq.Mamba` and `eqx_seq.Mamba2` apply "
            f"SiLU where transformers' mixers apply `hidden_act` (one of {_SILU}), "
            "and have no other activation."
        )
    if kind == "mamba" and chunk_size is not None:
        raise ValueError("`chunk_size` is for Mamba-2 checkpoints (`ssd_scan`).")
    H = config.integer("hidden_size")
    s = dict(
        kind=kind,
        hidden_size=H,
        vocab_size=config.integer("vocab_size"),
        layers=config.integer("num_hidden_layers"),
        state_size=config.integer("state_size"),
        expand=config.integer("expand"),
        conv_size=config.integer("conv_kernel"),
        conv_bias=config.flag("use_conv_bias", True),
        eps=config.positive("layer_norm_epsilon", 1e-5),
    )
    if kind == "mamba":
        rank = config.get("time_step_rank", "auto")
        s["dt_rank"] = (
            math.ceil(H / 16) if rank == "auto" else config.integer("time_step_rank")
        )
        return s
    heads, head_dim = config.integer("num_heads"), config.integer("head_dim")
    if heads * head_dim != s["expand"] * H:
        raise config.error(
            f"num_heads * head_dim = {heads} * {head_dim} must equal expand * "
            f"hidden_size = {s['expand']} * {H}."
        )
    groups = config.integer("n_groups", 1)
    if heads % groups:
        raise config.error(
            f"`n_groups` = {groups} must divide the {heads} heads (`num_heads`)."
        )
    s.update(
        heads=heads,
        head_dim=head_dim,
        groups=groups,
        chunk_size=config.integer("chunk_size", 256)
        if chunk_size is None
        else chunk_size,
        dt_limit=config.time_step_limit(),
    )
    return s


def _mamba_block(s: dict, w: _Weights, i: int, scan: AbstractScan) -> MambaBlock:
    layer = eqx.filter_eval_shape(
        Mamba,
        s["hidden_size"],
        state_size=s["state_size"],
        expand=s["expand"],
        conv_size=s["conv_size"],
        dt_rank=s["dt_rank"],
        scan=scan,
        dtype=w.dtype,
        key=jr.key(0),
    )
    p = f"layers.{i}.mixer"
    layer = eqx.tree_at(
        lambda m: (m.in_proj, m.x_proj, m.dt_proj, m.dt_bias, m.A_log, m.D),
        layer,
        (
            w(f"{p}.in_proj.weight", layer.in_proj),
            w(f"{p}.x_proj.weight", layer.x_proj),
            w(f"{p}.dt_proj.weight", layer.dt_proj),
            w(f"{p}.dt_proj.bias", layer.dt_bias),
            w(f"{p}.A_log", layer.A_log),
            w(f"{p}.D", layer.D),
        ),
    )
    layer = eqx.tree_at(
        lambda m: (m.conv, m.out_proj),
        layer,
        (
            _conv(w, f"{p}.conv1d", layer.conv, s["conv_bias"]),
            w(f"{p}.out_proj.weight", layer.out_proj),
        ),
    )
    return _with_norm(MambaBlock, layer, s, w, i)


def _mamba2_block(s: dict, w: _Weights, i: int, scan: AbstractScan) -> Mamba2Block:
    layer = eqx.filter_eval_shape(
        Mamba2,
        s["hidden_size"],
        state_size=s["state_size"],
        head_dim=s["head_dim"],
        expand=s["expand"],
        ngroups=s["groups"],
        conv_size=s["conv_size"],
        dt_limit=s["dt_limit"],
        norm_eps=s["eps"],
        chunk_size=s["chunk_size"],
        scan=scan,
        dtype=w.dtype,
        key=jr.key(0),
    )
    p = f"layers.{i}.mixer"
    layer = eqx.tree_at(
        lambda m: (m.in_proj, m.dt_bias, m.A_log, m.D, m.norm_weight, m.out_proj),
        layer,
        (
            w(f"{p}.in_proj.weight", layer.in_proj),
            w(f"{p}.dt_bias", layer.dt_bias),
            w(f"{p}.A_log", layer.A_log),
            w(f"{p}.D", layer.D),
            w(f"{p}.norm.weight", layer.norm_weight),
            w(f"{p}.out_proj.weight", layer.out_proj),
        ),
    )
    conv = _conv(w, f"{p}.conv1d", layer.conv, s["conv_bias"])
    layer = eqx.tree_at(lambda m: m.conv, layer, conv)
    return _with_norm(Mamba2Block, layer, s, w, i)


def _with_norm(kind: type, layer, s: dict, w: _Weights, i: int):
    block = kind(layer, norm="rms", norm_eps=s["eps"])
    weight = w(f"layers.{i}.norm.weight", block.norm.weight.shape)
    return eqx.tree_at(lambda b: b.norm.weight, block, weight)


def load_pretrained(
    directory: str | os.PathLike,
    *,
    dtype,
    scan: AbstractScan,
    chunk_size: int | None,
) -> tuple[Float[Array, "V H"], tuple[MambaBlock | Mamba2Block, ...], eqx.nn.RMSNorm]:
    """The embedding table, the blocks and the final norm of the checkpoint in
    `directory`, checked against its config."""
    directory = pathlib.Path(directory)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json: not a checkpoint directory.")
    s = _settings(directory, chunk_size)
    dtype = check_parameter_dtype("LanguageModel", dtype)
    w = _Weights(directory, dtype)
    H, vocab = s["hidden_size"], s["vocab_size"]
    table = w("embeddings.weight", (vocab, H))
    blocks = tuple(
        _mamba_block(s, w, i, scan)
        if s["kind"] == "mamba"
        else _mamba2_block(s, w, i, scan)
        for i in range(s["layers"])
    )
    norm = eqx.nn.RMSNorm(H, eps=s["eps"], use_bias=False, dtype=dtype)
    norm = eqx.tree_at(lambda n: n.weight, norm, w("norm_f.weight", (H,)))
    if "lm_head.weight" in w:
        head = w("lm_head.weight", (vocab, H))
        if not jnp.array_equal(head, table):
            raise ValueError(
                f"{w.where}: its output layer (`lm_head.weight`) is not its "
                "embedding table; `eqx_seq.LanguageModel` ties the two."
            )
    w.check_all_used()
    return table, blocks, norm
