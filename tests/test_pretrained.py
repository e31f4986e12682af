"""`LanguageModel.from_pretrained`: tiny random checkpoints in transformers' layout
(`MambaForCausalLM`, `Mamba2ForCausalLM`), written with safetensors' own writer,
against a float64 NumPy forward written here from the reference models' equations."""

import json
import re
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import eqx_seq


# ------------------------------------------------------------ the NumPy reference


def _silu(x):
    return x / (1 + np.exp(-x))


def _rms(x, weight, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * weight


def _conv(x, weight, bias):
    """PyTorch's depthwise `Conv1d(C, C, K, groups=C, padding=K - 1)`, its first T
    outputs: `out[t] = bias + sum_k weight[:, 0, k] * x[t - K + 1 + k]`."""
    T, K = x.shape[0], weight.shape[-1]
    padded = np.concatenate([np.zeros((K - 1, x.shape[1])), x])
    return bias + sum(weight[:, 0, k] * padded[k : k + T] for k in range(K))


def _mamba_mixer(x, p, cfg):
    E, N, R = (
        cfg["expand"] * cfg["hidden_size"],
        cfg["state_size"],
        cfg["time_step_rank"],
    )
    xz = x @ p["in_proj.weight"].T
    u, z = xz[:, :E], xz[:, E:]
    u = _silu(_conv(u, p["conv1d.weight"], p["conv1d.bias"]))
    dbc = u @ p["x_proj.weight"].T
    dt = np.logaddexp(0, dbc[:, :R] @ p["dt_proj.weight"].T + p["dt_proj.bias"])
    B, C = dbc[:, R : R + N], dbc[:, R + N :]
    A = -np.exp(p["A_log"])
    h, ys = np.zeros((E, N)), []
    for t in range(x.shape[0]):
        h = np.exp(dt[t][:, None] * A) * h + (dt[t] * u[t])[:, None] * B[t][None]
        ys.append(h @ C[t] + p["D"] * u[t])
    return (np.stack(ys) * _silu(z)) @ p["out_proj.weight"].T


def _mamba2_mixer(x, p, cfg):
    T = x.shape[0]
    E, N = cfg["expand"] * cfg["hidden_size"], cfg["state_size"]
    G, heads, P = cfg["n_groups"], cfg["num_heads"], cfg["head_dim"]
    proj = x @ p["in_proj.weight"].T
    z, xbc, dt = (
        proj[:, :E],
        proj[:, E : 2 * E + 2 * G * N],
        proj[:, 2 * E + 2 * G * N :],
    )
    xbc = _silu(_conv(xbc, p["conv1d.weight"], p["conv1d.bias"]))
    u = xbc[:, :E].reshape(T, heads, P)
    B = xbc[:, E : E + G * N].reshape(T, G, N)
    C = xbc[:, E + G * N :].reshape(T, G, N)
    dt = np.clip(np.logaddexp(0, dt + p["dt_bias"]), *cfg["time_step_limit"])
    A = -np.exp(p["A_log"])
    h, y = np.zeros((heads, P, N)), np.zeros((T, heads, P))
    for t in range(T):
        for j in range(heads):
            g = j // (heads // G)  # heads in a group are consecutive
            h[j] = np.exp(dt[t, j] * A[j]) * h[j] + dt[t, j] * np.outer(
                u[t, j], B[t, g]
            )
            y[t, j] = h[j] @ C[t, g] + p["D"][j] * u[t, j]
    gated = (y.reshape(T, E) * _silu(z)).reshape(T, G, E // G)
    normed = _rms(gated, 1.0, cfg["layer_norm_epsilon"]).reshape(T, E)
    return (normed * p["norm.weight"]) @ p["out_proj.weight"].T


def _reference_logits(ids, weights, cfg):
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    mixer = _mamba_mixer if cfg["model_type"] == "mamba" else _mamba2_mixer
    eps = cfg["layer_norm_epsilon"]
    h = w["backbone.embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"backbone.layers.{i}."
        mine = {k[len(pre + "mixer.") :]: v for k, v in w.items() if k.startswith(pre)}
        h = h + mixer(_rms(h, w[pre + "norm.weight"], eps), mine, cfg)
    return _rms(h, w["backbone.norm_f.weight"], eps) @ w["backbone.embeddings.weight"].T


# ---------------------------------------------------------- checkpoints to load


def _mamba_config():
    return dict(
        model_type="mamba",
        architectures=["MambaForCausalLM"],
        vocab_size=11,
        hidden_size=8,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=3,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )


def _mamba2_config():
    return dict(
        model_type="mamba2",
        architectures=["Mamba2ForCausalLM"],
        vocab_size=11,
        hidden_size=8,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        num_heads=4,
        head_dim=4,
        n_groups=2,
        conv_kernel=3,
        chunk_size=4,
        time_step_limit=[0.01, 0.8],
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-6,
        tie_word_embeddings=True,
    )


def _random_weights(cfg, dtype, seed=0):
    rng = np.random.default_rng(seed)
    H, V, N = cfg["hidden_size"], cfg["vocab_size"], cfg["state_size"]
    E, K = cfg["expand"] * H, cfg["conv_kernel"]

    def normal(*shape, scale=0.4):
        return rng.normal(0, scale, shape)

    w = {
        "backbone.embeddings.weight": normal(V, H),
        "backbone.norm_f.weight": 1 + normal(H),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"backbone.layers.{i}."
        w[p + "norm.weight"] = 1 + normal(H, scale=0.2)
        if cfg["model_type"] == "mamba":
            R = cfg["time_step_rank"]
            mixer = {
                "in_proj.weight": normal(2 * E, H),
                "conv1d.weight": normal(E, 1, K),
                "conv1d.bias": normal(E),
                "x_proj.weight": normal(R + 2 * N, E),
                "dt_proj.weight": normal(E, R),
                "dt_proj.bias": normal(E, scale=1.0) - 2,
                "A_log": np.log(rng.uniform(0.5, 4, (E, N))),
                "D": normal(E),
                "out_proj.weight": normal(H, E),
            }
        else:
            G, heads = cfg["n_groups"], cfg["num_heads"]
            mixer = {
                "in_proj.weight": normal(2 * E + 2 * G * N + heads, H),
                "conv1d.weight": normal(E + 2 * G * N, 1, K),
                "conv1d.bias": normal(E + 2 * G * N),
                "dt_bias": normal(heads, scale=1.0) - 1,
                "A_log": np.log(rng.uniform(0.5, 4, heads)),
                "D": normal(heads),
                "norm.weight": 1 + normal(E, scale=0.2),
                "out_proj.weight": normal(H, E),
            }
        w.update({p + "mixer." + k: v for k, v in mixer.items()})
    return {k: v.astype(dtype) for k, v in w.items()}


def _save(directory, cfg, weights, *, files=1):
    """`weights` as transformers saves them: one `model.safetensors`, or `files`
    shards and their index."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if files == 1:
        safetensors.numpy.save_file(
            weights, directory / "model.safetensors", metadata={"format": "pt"}
        )
        return directory
    names = sorted(weights)
    weight_map = {}
    for i in range(files):
        shard = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: weights[k] for k in names[i::files]}
        safetensors.numpy.save_file(part, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@eqx.filter_jit
def _logits_both_ways(model, ids):
    """The parallel call's logits and those of step mode, in one program."""
    _, stepped = jax.lax.scan(lambda s, t: model.step(s, t), model.init_state(), ids)
    return model(ids), stepped


IDS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])


@pytest.mark.parametrize(
    "architecture, dtype, files",
    # Mamba in bfloat16, one file; Mamba-2 in float16, two shards and an index,
    # its tied output layer saved (`lm_head.weight`, equal to the embedding)
    [("mamba", ml_dtypes.bfloat16, 1), ("mamba2", np.float16, 2)],
)
def test_logits_match_reference(architecture, dtype, files, tmp_path):
    cfg = _mamba_config() if architecture == "mamba" else _mamba2_config()
    weights = _random_weights(cfg, dtype)
    if architecture == "mamba2":
        weights["lm_head.weight"] = weights["backbone.embeddings.weight"]
    model = eqx_seq.LanguageModel.from_pretrained(
        _save(tmp_path / "ckpt", cfg, weights, files=files), dtype=jnp.float64
    )
    kind = eqx_seq.MambaBlock if architecture == "mamba" else eqx_seq.Mamba2Block
    assert len(model.blocks) == 2 and all(type(b) is kind for b in model.blocks)
    logits, stepped = _logits_both_ways(model, jnp.asarray(IDS))
    expected = _reference_logits(IDS, weights, cfg)
    np.testing.assert_allclose(logits, expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(stepped, expected, rtol=1e-10, atol=1e-10)


def test_chunk_size_and_dtype(tmp_path):
    cfg = _mamba2_config()
    path = _save(tmp_path / "ckpt", cfg, _random_weights(cfg, np.float32))
    model = eqx_seq.LanguageModel.from_pretrained(path, chunk_size=2)
    assert {b.mamba.chunk_size for b in model.blocks} == {2}
    assert model.embedding.weight.dtype == jnp.float64  # JAX's default (x64 here)
    default = eqx_seq.LanguageModel.from_pretrained(path, dtype=jnp.float32)
    arrays = jax.tree.leaves(eqx.filter(default, eqx.is_array))
    assert all(x.dtype == jnp.float32 for x in arrays)
    assert {b.mamba.chunk_size for b in default.blocks} == {4}  # the config's
    assert {b.mamba.norm_eps for b in default.blocks} == {1e-6}
    assert {b.norm.eps for b in default.blocks} | {default.norm.eps} == {1e-6}


def _broken(tmp_path, change):
    """A Mamba checkpoint with `change(cfg, weights)` applied."""
    cfg = _mamba_config()
    weights = _random_weights(cfg, np.float32)
    change(cfg, weights)
    return _save(tmp_path / "ckpt", cfg, weights)


def _set(**kw):
    return lambda cfg, weights: cfg.update(kw)


@pytest.mark.parametrize(
    "change, match",
    [
        (_set(model_type="llama", architectures=["LlamaForCausalLM"]), "'llama'"),
        (_set(use_bias=True), "use_bias"),
        (_set(state_size=5), "'layers.0.mixer.x_proj.weight' has shape"),
        (_set(num_hidden_layers=3), "no tensor 'layers.2.mixer.in_proj.weight'"),
        (_set(num_hidden_layers=1), "does not account for: 'layers.1"),
        (_set(hidden_size="8"), "`hidden_size` must be a positive integer"),
        (
            lambda cfg, w: w.update({"lm_head.weight": np.ones((11, 8), np.float32)}),
            "not its embedding table",
        ),
        (
            lambda cfg, w: w.pop("backbone.layers.1.mixer.D"),
            "no tensor 'layers.1.mixer.D'",
        ),
    ],
)
def test_bad_checkpoints(change, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        eqx_seq.LanguageModel.from_pretrained(_broken(tmp_path, change))


def test_bad_directories(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        eqx_seq.LanguageModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_mamba_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="only safetensors"):
        eqx_seq.LanguageModel.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        eqx_seq.LanguageModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="`chunk_size` is for Mamba-2"):
        eqx_seq.LanguageModel.from_pretrained(tmp_path, chunk_size=8)
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.LanguageModel.from_pretrained(tmp_path, dtype=jnp.float16)


# ------------------------------------------- checkpoints saved by transformers 5

# The config.json that transformers 5's `save_pretrained` writes for a small
# `Mamba2Config` with its default, infinite `time_step_limit`: its JSON encoder
# writes non-finite floats as `{"__float__": ...}` objects (strict JSON has no
# Infinity), and its config loader turns them back into floats.
TRANSFORMERS5_MAMBA2_CONFIG = """{
  "architectures": [
    "Mamba2ForCausalLM"
  ],
  "bos_token_id": 0,
  "chunk_size": 4,
  "conv_kernel": 3,
  "dtype": "float32",
  "eos_token_id": 2,
  "expand": 2,
  "head_dim": 4,
  "hidden_act": "silu",
  "hidden_size": 8,
  "initializer_range": 0.1,
  "layer_norm_epsilon": 1e-06,
  "model_type": "mamba2",
  "n_groups": 2,
  "num_heads": 4,
  "num_hidden_layers": 2,
  "pad_token_id": 1,
  "rescale_prenorm_residual": false,
  "residual_in_fp32": true,
  "rms_norm": true,
  "state_size": 4,
  "tie_word_embeddings": true,
  "time_step_floor": 0.0001,
  "time_step_limit": [
    0.0,
    {
      "__float__": "Infinity"
    }
  ],
  "time_step_max": 0.1,
  "time_step_min": 0.001,
  "time_step_rank": 1,
  "transformers_version": "5.0.0",
  "use_bias": false,
  "use_cache": true,
  "use_conv_bias": true,
  "vocab_size": 11
}
"""
# the same with the bare `Infinity` token that Python's json module (and so
# transformers 4) writes
_PLAIN = re.sub(
    r'\{\s*"__float__": "Infinity"\s*\}', "Infinity", TRANSFORMERS5_MAMBA2_CONFIG
)


@pytest.mark.parametrize(
    "text", [TRANSFORMERS5_MAMBA2_CONFIG, _PLAIN], ids=["transformers5", "Infinity"]
)
def test_infinite_time_step_limit(text, tmp_path):
    assert text.count("Infinity") == 1
    cfg = json.loads(_PLAIN)  # Python's json reads the bare token itself
    assert cfg["time_step_limit"] == [0.0, float("inf")]
    weights = _random_weights(cfg, np.float32)
    path = _save(tmp_path / "ckpt", cfg, weights)
    (path / "config.json").write_text(text)
    model = eqx_seq.LanguageModel.from_pretrained(path, dtype=jnp.float64)
    assert {b.mamba.dt_limit for b in model.blocks} == {(0.0, float("inf"))}
    logits, stepped = _logits_both_ways(model, jnp.asarray(IDS))
    expected = _reference_logits(IDS, weights, cfg)
    np.testing.assert_allclose(logits, expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(stepped, expected, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------- malformed input


def _checkpoint(directory, cfg=None, files=1):
    cfg = _mamba_config() if cfg is None else cfg
    return _save(directory, cfg, _random_weights(cfg, np.float32), files=files)


def _config(value=None, *, text=None, base=_mamba_config, **changes):
    """A checkpoint whose config.json is `text`, `value` as JSON, or `base()` with
    `changes` (a change to `None` removes the setting)."""

    def make(directory):
        _checkpoint(directory, base())
        if isinstance(text, bytes):  # not UTF-8
            (directory / "config.json").write_bytes(text)
            return
        if text is not None:
            written = text
        elif value is not None:
            written = json.dumps(value)
        else:
            cfg = {**base(), **changes}
            written = json.dumps({k: v for k, v in cfg.items() if v is not None})
        (directory / "config.json").write_text(written)

    return make


def _index(text):
    """A two-file checkpoint whose index is `text`."""

    def make(directory):
        _checkpoint(directory, files=2)
        (directory / "model.safetensors.index.json").write_text(text)

    return make


def _header(header, body=16):
    """A checkpoint whose `model.safetensors` has this JSON header and `body`
    zero bytes of data."""

    def make(directory):
        _checkpoint(directory)
        raw = json.dumps(header).encode()
        (directory / "model.safetensors").write_bytes(
            struct.pack("<Q", len(raw)) + raw + bytes(body)
        )

    return make


def _tensor(dtype="F32", shape=(2,), offsets=(0, 8), drop=None):
    """A header entry (tuples are written as JSON arrays)."""
    entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    entry.pop(drop, None)
    return entry


def _mamba_ssm(directory):
    """A checkpoint in `mamba_ssm`'s own format (as `MambaLMHeadModel` saves it)."""
    directory.mkdir()
    config = dict(
        d_model=8,
        n_layer=2,
        vocab_size=11,
        ssm_cfg={},
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        pad_vocab_size_multiple=8,
    )
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "pytorch_model.bin").write_bytes(b"PK\x03\x04")


_OFFSETS = "`data_offsets` must be two integers 0 <= begin <= end <= 16"
_LIMIT = r"`time_step_limit` must be a pair of numbers \[low, high\]"


@pytest.mark.parametrize(
    "make, match",
    [
        # config.json
        pytest.param(
            _config(text='{"model_type": "mamba",'),
            r"config\.json is not JSON",
            id="config-not-json",
        ),
        pytest.param(
            _config(text=b'{"a": "\xff"}'),
            r"config\.json is not JSON",
            id="config-not-utf8",
        ),
        pytest.param(
            _config([_mamba_config()]),
            r"config\.json must hold a JSON object.*an array",
            id="config-list",
        ),
        pytest.param(
            _config(model_type=None),
            r"config\.json has no `model_type`",
            id="config-no-model-type",
        ),
        pytest.param(
            _mamba_ssm,
            r"`mamba_ssm`'s own format.*safetensors.*save_pretrained",
            id="mamba-ssm-format",
        ),
        pytest.param(
            _config(layer_norm_epsilon="abc"),
            "`layer_norm_epsilon` must be a positive",
            id="eps-string",
        ),
        pytest.param(
            _config(layer_norm_epsilon=0),
            "`layer_norm_epsilon` must be a positive",
            id="eps-zero",
        ),
        pytest.param(
            _config(time_step_rank="3"),
            "`time_step_rank` must be a positive integer",
            id="rank-string",
        ),
        pytest.param(
            _config(expand=2.0),
            "`expand` must be a positive integer",
            id="expand-float",
        ),
        pytest.param(
            _config(num_hidden_layers=True),
            "`num_hidden_layers` must be a positive",
            id="layers-bool",
        ),
        pytest.param(
            _config(use_conv_bias="no"),
            "`use_conv_bias` must be true or false",
            id="conv-bias-string",
        ),
        pytest.param(
            _config(use_bias="false"),
            "`use_bias` must be true or false",
            id="bias-string",
        ),
        pytest.param(
            _config(architectures="Mamba", model_type="x"),
            "holds a 'x' checkpoint",
            id="other-architecture",
        ),
        pytest.param(
            _config(base=_mamba2_config, time_step_limit=[0.0]), _LIMIT, id="limit-one"
        ),
        pytest.param(
            _config(base=_mamba2_config, time_step_limit="abc"),
            _LIMIT,
            id="limit-string",
        ),
        pytest.param(
            _config(base=_mamba2_config, time_step_limit=[1.0, 0.5]),
            _LIMIT,
            id="limit-reversed",
        ),
        pytest.param(
            _config(base=_mamba2_config, time_step_limit=[-1.0, 1]),
            _LIMIT,
            id="limit-negative",
        ),
        pytest.param(
            _config(
                base=_mamba2_config,
                text=json.dumps(_mamba2_config()).replace(
                    "[0.01, 0.8]", '[0.0, {"__float__": "NaN"}]'
                ),
            ),
            _LIMIT + r".*\[0\.0, nan\]",
            id="limit-nan",
        ),
        pytest.param(
            _config(
                base=_mamba2_config,
                text=json.dumps({**_mamba2_config(), "time_step_limit": None}),
            ),
            _LIMIT + ".*None",
            id="limit-null",
        ),
        pytest.param(
            _config(base=_mamba2_config, n_groups=3),
            "`n_groups` = 3 must divide",
            id="groups-not-dividing",
        ),
        # activations other than SiLU
        pytest.param(
            _config(hidden_act="gelu"), "`hidden_act` is 'gelu'", id="act-gelu"
        ),
        pytest.param(
            _config(base=_mamba2_config, hidden_act="relu"),
            "`hidden_act` is 'relu'",
            id="act-relu-mamba2",
        ),
        pytest.param(_config(hidden_act=5), "`hidden_act` is 5", id="act-int"),
        # the index of a sharded checkpoint
        pytest.param(
            _index("{"),
            r"model\.safetensors\.index\.json is not JSON",
            id="index-not-json",
        ),
        pytest.param(
            _index("[]"), r"index\.json must hold a JSON object", id="index-list"
        ),
        pytest.param(
            _index('{"metadata": {}}'),
            r"index\.json: `weight_map` must be an object",
            id="index-no-weight-map",
        ),
        pytest.param(
            _index('{"weight_map": []}'),
            r"index\.json: `weight_map` must be an object",
            id="index-weight-map-list",
        ),
        pytest.param(
            _index('{"weight_map": {"a": 5}}'),
            r"index\.json: `weight_map` must be an",
            id="index-file-not-string",
        ),
        pytest.param(
            _index('{"weight_map": {"a": "missing.safetensors"}}'),
            r"index\.json lists 'missing\.safetensors', which is not a file",
            id="index-missing-file",
        ),
        # safetensors headers
        pytest.param(
            _header([]),
            r"model\.safetensors: its header must be a JSON object",
            id="header-list",
        ),
        pytest.param(
            _header({"a": 5}),
            "tensor 'a': its header entry must be an object",
            id="entry-not-object",
        ),
        pytest.param(
            _header({"a": _tensor(drop="dtype")}),
            "tensor 'a': its header entry lacks",
            id="entry-no-dtype",
        ),
        pytest.param(
            _header({"a": _tensor(drop="shape")}),
            "tensor 'a': its header entry lacks",
            id="entry-no-shape",
        ),
        pytest.param(
            _header({"a": _tensor(drop="data_offsets")}),
            "tensor 'a': its header entry lacks `data_offsets`",
            id="entry-no-offsets",
        ),
        pytest.param(
            _header({"a": _tensor(dtype="I64")}),
            "tensor 'a' has dtype I64",
            id="dtype-int",
        ),
        pytest.param(
            _header({"a": _tensor(shape=[-2])}),
            "`shape` must be a list of non-neg",
            id="shape-negative",
        ),
        pytest.param(
            _header({"a": _tensor(shape="2")}),
            "`shape` must be a list of non-neg",
            id="shape-string",
        ),
        pytest.param(
            _header({"a": _tensor(offsets=[-8, 0])}), _OFFSETS, id="offsets-negative"
        ),
        pytest.param(
            _header({"a": _tensor(offsets=[8, 0])}), _OFFSETS, id="offsets-reversed"
        ),
        pytest.param(
            _header({"a": _tensor(offsets=[8, 24])}), _OFFSETS, id="offsets-past-end"
        ),
        pytest.param(_header({"a": _tensor(offsets=[0])}), _OFFSETS, id="offsets-one"),
        pytest.param(
            _header({"a": _tensor(offsets=[0, 4])}),
            "hold 4 bytes; its dtype and shape",
            id="offsets-wrong-size",
        ),
        pytest.param(
            _header({"a": _tensor(), "b": _tensor(offsets=[4, 12])}),
            "tensors 'a' and 'b' overlap",
            id="offsets-overlap",
        ),
    ],
)
def test_malformed_input(make, match, tmp_path):
    """Each raises a `ValueError` naming the file and the problem, before any
    array is computed."""
    directory = tmp_path / "ckpt"
    make(directory)
    with pytest.raises(ValueError, match=match) as info:
        eqx_seq.LanguageModel.from_pretrained(directory)
    assert str(directory) in str(info.value)
