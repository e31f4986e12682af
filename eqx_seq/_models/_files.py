"""Reading a checkpoint's files: JSON as transformers writes it, and the tensors of
safetensors files, each malformed entry a `ValueError` that names the file."""

import json
import math
import pathlib

import numpy as np


# safetensors' dtype names; bfloat16, which NumPy lacks, is widened to float32
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The floating tensors of one safetensors file, as NumPy arrays (mapped, not
    read, until used). The format: an 8-byte little-endian header size, a JSON
    header of `name: {dtype, shape, data_offsets}`, then the bytes; the offsets
    count from the end of the header."""
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
    if not isinstance(header, dict):
        raise ValueError(
            f"{path}: its header must be a JSON object of tensors by name, got "
            f"{json_type(header)}."
        )
    body = data[8 + size :]
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = _check_entry(path, name, info, body.size)
        spans.append((begin, end, name))
        dtype = np.dtype(_DTYPES[info["dtype"]])
        array = body[begin:end].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":  # the high half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array
    # tensors that share bytes are a corrupt file (safetensors' own reader refuses
    # them too), and would alias each other's weights here
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(
                f"{path}: tensors {first!r} and {second!r} overlap (their "
                "`data_offsets` share bytes)."
            )
    return tensors


def _check_entry(path: pathlib.Path, name: str, info, size: int) -> tuple[int, int]:
    """`(begin, end)` of the tensor `name` if its header entry is well formed and
    within the `size` bytes of data, else a `ValueError` that says what is wrong."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ValueError(
            f"{where}: its header entry must be an object with `dtype`, `shape` and "
            f"`data_offsets`, got {info!r}."
        )
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise ValueError(f"{where}: its header entry lacks `{key}`.")
    if not isinstance(info["dtype"], str) or info["dtype"] not in _DTYPES:
        raise ValueError(
            f"{where} has dtype {info['dtype']}; a Mamba checkpoint's weights are "
            f"one of {sorted(_DTYPES)}."
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
        raise ValueError(
            f"{where}: `shape` must be a list of non-negative integers, got {shape!r}."
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(map(is_int, offsets))
        and 0 <= offsets[0] <= offsets[1] <= size
    ):
        raise ValueError(
            f"{where}: `data_offsets` must be two integers 0 <= begin <= end <= "
            f"{size} (the bytes of data after the header), got {offsets!r}."
        )
    begin, end = offsets
    expected = math.prod(shape) * np.dtype(_DTYPES[info["dtype"]]).itemsize
    if end - begin != expected:
        raise ValueError(
            f"{where}: its `data_offsets` {offsets} hold {end - begin} bytes; its "
            f"dtype and shape ({info['dtype']}, {shape}) need {expected}."
        )
    return begin, end


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_type(value) -> str:
    """What JSON calls the type of a parsed value, for messages."""
    if isinstance(value, bool):
        return str(value).lower()
    names = {dict: "an object", list: "an array", str: "a string", type(None): "null"}
    return names.get(type(value), "a number")


# transformers' JSON encoder writes the floats that JSON lacks as these objects,
# and its config loader turns them back into floats; it leaves other `__float__`
# objects as they are, and so does this (they then fail the setting's check)
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_special_floats(obj: dict):
    tag = obj.get("__float__")
    if len(obj) == 1 and isinstance(tag, str) and tag in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[tag]
    return obj


def read_json(path: pathlib.Path, *, what: str, object_hook=None) -> dict:
    """The JSON object in the file `path`, which holds `what`."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"), object_hook=object_hook)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not JSON ({error}).") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{path} must hold a JSON object ({what}), got {json_type(value)}."
        )
    return value


def read_weights(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint: `model.safetensors`, or the files that
    `model.safetensors.index.json` lists; names without the `backbone.` prefix."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index, what="the index of the weight files").get(
            "weight_map"
        )
        if not isinstance(weight_map, dict) or not all(
            isinstance(file, str) for file in weight_map.values()
        ):
            raise ValueError(
                f"{index}: `weight_map` must be an object of tensor names to the "
                f"names of the files that hold them, got {weight_map!r}."
            )
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(
                    f"{index} lists {file.name!r}, which is not a file in {directory}."
                )
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
