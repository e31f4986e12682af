"""Reading Hugging Face transformers' Mamba and Mamba-2 causal-LM checkpoints: a
directory with `config.json` and the weights in safetensors files."""

import json
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


# safetensors' dtype names; bfloat16, which NumPy lacks, is widened to float32
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_ARCHITECTURES = ("mamba", "mamba2")


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The floating tensors of one safetensors file, as NumPy arrays (mapped, not
    read, until used). The format: an 8-byte little-endian header size, a JSON
    header of `name: {dtype, shape, data_offsets}`, then the bytes."""
    if path.stat().st_size < 8:
        raise ValueError(f"{path} is not a safetensors file.")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    size = int(data[:8].view("<u8")[0])
    if not 0 < size <= data.size - 8:
        raise ValueError(f"{path} is not a safetensors file.")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except ValueError:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not a safetensors file.") from None
    body = data[8 + size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}; a Mamba "
                f"checkpoint's weights are one of {sorted(_DTYPES)}."
            )
        dtype = np.dtype(_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if end - begin != count * dtype.itemsize or end > body.size:
            raise ValueError(f"{path}: tensor {name!r} does not fit its header.")
        array = body[begin:end].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":  # the high half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array
    return tensors


def _read_weights(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint: `model.safetensors`, or the files that
    `model.safetensors.index.json` lists; names without the `backbone.` prefix."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        raise ValueError(
            f"{directory} has no `model.safetensors` (nor an index of safetensors "
            "files); only safetensors checkpoints are read (transformers saves them "
            "by default)."
        )
    weights = {}
    for file in files:
        weights.update(read_safetensors(file))
    return {name.removeprefix("backbone."): w for name, w in weights.items()}


def _setting(config: dict, name: str, default: object = None) -> int:
    """A positive integer setting of the config."""
    value = config.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"config.json: `{name}` must be a positive integer, got {value!r}."
        )
    return value


class _Weights:
    """The checkpoint's tensors, handed out by name, each checked against the
    shape the layer needs and cast to the parameter dtype; `check_all_used`
    refuses tensors that were never asked for."""

    def __init__(self, weights: dict[str, np.ndarray], dtype):
        self.weights = weights
        self.dtype = dtype
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def __call__(self, name: str, like: jax.ShapeDtypeStruct | tuple[int, ...]):
        shape = like if isinstance(like, tuple) else like.shape
        if name not in self.weights:
            raise ValueError(
                f"The checkpoint has no tensor {name!r} (shape {shape}), which its "
                "config.json implies."
            )
        array = self.weights[name]
        if array.shape != shape:
            raise ValueError(
                f"The checkpoint's {name!r} has shape {array.shape}; its config.json "
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
                f"The checkpoint has tensors that its config.json does not account "
                f"for: {shown}{more}."
            )


def _conv(w: _Weights, prefix: str, conv, use_bias: bool):
    """A depthwise `Conv1d` of PyTorch, `(C, 1, K)`, as a `CausalConv`, `(K, C)`."""
    K, C = conv.weight.shape
    weight = w(f"{prefix}.weight", (C, 1, K))[:, 0, :].T
    bias = w(f"{prefix}.bias", (C,)) if use_bias else jnp.zeros(C, w.dtype)
    return eqx.tree_at(lambda c: (c.weight, c.bias), conv, (weight, bias))


def _mamba_block(config: dict, w: _Weights, i: int, scan: AbstractScan) -> MambaBlock:
    H = config["hidden_size"]
    rank = config.get("time_step_rank", "auto")
    rank = math.ceil(H / 16) if rank == "auto" else _setting(config, "time_step_rank")
    layer = eqx.filter_eval_shape(
        Mamba,
        H,
        state_size=_setting(config, "state_size"),
        expand=_setting(config, "expand"),
        conv_size=_setting(config, "conv_kernel"),
        dt_rank=rank,
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
            _conv(w, f"{p}.conv1d", layer.conv, config.get("use_conv_bias", True)),
            w(f"{p}.out_proj.weight", layer.out_proj),
        ),
    )
    return _with_norm(MambaBlock, layer, config, w, i)


def _mamba2_block(
    config: dict, w: _Weights, i: int, scan: AbstractScan, chunk_size: int | None
) -> Mamba2Block:
    H = config["hidden_size"]
    E = _setting(config, "expand") * H
    heads = _setting(config, "num_heads")
    head_dim = _setting(config, "head_dim")
    if heads * head_dim != E:
        raise ValueError(
            f"config.json: num_heads * head_dim = {heads} * {head_dim} must equal "
            f"expand * hidden_size = {E}."
        )
    limit = config.get("time_step_limit", (0.0, float("inf")))
    layer = eqx.filter_eval_shape(
        Mamba2,
        H,
        state_size=_setting(config, "state_size"),
        head_dim=head_dim,
        expand=config["expand"],
        ngroups=_setting(config, "n_groups", 1),
        conv_size=_setting(config, "conv_kernel"),
        dt_limit=(float(limit[0]), float(limit[1])),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        chunk_size=_setting(config, "chunk_size", 256)
        if chunk_size is None
        else chunk_size,
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
    conv = _conv(w, f"{p}.conv1d", layer.conv, config.get("use_conv_bias", True))
    layer = eqx.tree_at(lambda m: m.conv, layer, conv)
    return _with_norm(Mamba2Block, layer, config, w, i)


def _with_norm(kind: type, layer, config: dict, w: _Weights, i: int):
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    block = kind(layer, norm="rms", norm_eps=eps)
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
    config = json.loads((directory / "config.json").read_text())
    kind = config.get("model_type")
    if kind not in _ARCHITECTURES:
        raise ValueError(
            f"{directory} holds a {kind!r} checkpoint "
            f"({', '.join(config.get('architectures', [])) or 'no architectures'}); "
            "`LanguageModel.from_pretrained` reads transformers' Mamba and Mamba-2 "
            f"causal language models (model_type one of {_ARCHITECTURES})."
        )
    for name in ("use_bias",):
        if config.get(name, False):
            raise ValueError(
                f"config.json: `{name}=true` (biases on the in- and out-projections) "
                "is not a layout `eqx_seq.Mamba` and `eqx_seq.Mamba2` have."
            )
    if kind == "mamba" and chunk_size is not None:
        raise ValueError("`chunk_size` is for Mamba-2 checkpoints (`ssd_scan`).")
    dtype = check_parameter_dtype("LanguageModel", dtype)
    w = _Weights(_read_weights(directory), dtype)
    H = _setting(config, "hidden_size")
    vocab = _setting(config, "vocab_size")
    table = w("embeddings.weight", (vocab, H))
    blocks = tuple(
        _mamba_block(config, w, i, scan)
        if kind == "mamba"
        else _mamba2_block(config, w, i, scan, chunk_size)
        for i in range(_setting(config, "num_hidden_layers"))
    )
    norm = eqx.nn.RMSNorm(
        H,
        eps=float(config.get("layer_norm_epsilon", 1e-5)),
        use_bias=False,
        dtype=dtype,
    )
    norm = eqx.tree_at(lambda n: n.weight, norm, w("norm_f.weight", (H,)))
    if "lm_head.weight" in w:
        head = w("lm_head.weight", (vocab, H))
        if not jnp.array_equal(head, table):
            raise ValueError(
                "The checkpoint's output layer (`lm_head.weight`) is not its "
                "embedding table; `eqx_seq.LanguageModel` ties the two."
            )
    w.check_all_used()
    return table, blocks, norm
