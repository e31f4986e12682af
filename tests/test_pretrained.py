"""`LanguageModel.from_pretrained`: tiny random checkpoints in transformers' layout
(`MambaForCausalLM`, `Mamba2ForCausalLM`), written with safetensors' own writer,
against a float64 NumPy forward written here from the reference models' equations."""

import json

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
