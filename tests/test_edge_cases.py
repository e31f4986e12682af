"""Bad and edge-case input: a clear error or a correct result, never a silent number.

Each test here failed on the package before its fix (issue 18): silent wrong results,
obscure errors from deep inside JAX, and an initialisation that ran out of memory.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_seq


# ------------------------------------------------------------ tridiagonal solves
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
@pytest.mark.parametrize(
    "scan", [eqx_seq.SequentialScan(), eqx_seq.SequentialScan(unroll=2)]
)
def test_thomas_ignores_the_unused_corners(bad, scan):
    # `lower[0]` and `upper[-1]` are outside the matrix: documented as ignored
    n = 6
    lower = jnp.full(n, -1.0).at[0].set(bad)
    upper = jnp.full(n, -1.0).at[-1].set(bad)
    diag = jnp.full(n, 4.0)
    rhs = jnp.arange(1.0, n + 1)
    dense = np.diag(np.full(n, 4.0)) - np.eye(n, k=1) - np.eye(n, k=-1)
    expect = np.linalg.solve(dense, np.arange(1.0, n + 1))
    x = eqx_seq.tridiagonal_solve(lower, diag, upper, rhs, scan=scan)
    np.testing.assert_allclose(x, expect, rtol=1e-12)

    def loss(lower, diag, upper, rhs):
        return jnp.sum(
            eqx_seq.tridiagonal_solve(lower, diag, upper, rhs, scan=scan) ** 2
        )

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(lower, diag, upper, rhs)
    for g in grads:
        assert jnp.all(jnp.isfinite(g))
    # the ignored entries get no gradient; the others match the clean problem's
    clean = jax.grad(loss, argnums=(0, 1, 2, 3))(
        lower.at[0].set(0.0), diag, upper.at[-1].set(0.0), rhs
    )
    assert grads[0][0] == 0 and grads[2][-1] == 0
    for g, c in zip(grads, clean):
        np.testing.assert_allclose(g, c, rtol=1e-12, atol=1e-15)
    # forward mode too
    _, tangent = jax.jvp(loss, (lower, diag, upper, rhs), clean)
    assert jnp.isfinite(tangent)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_tridiagonal_pivoting_in_half_precision(dtype):
    # LAPACK has no half-precision gtsv: computed in float32, returned in `dtype`
    n = 5
    args = [jnp.full(n, v, dtype) for v in (0.3, 1.0, 2.0, 1.0)]
    lo, di, up = (float(np.asarray(a[0], np.float64)) for a in args[:3])
    dense = di * np.eye(n) + up * np.eye(n, k=1) + lo * np.eye(n, k=-1)
    expect = np.linalg.solve(dense, np.ones(n))  # not diagonally dominant
    x = eqx_seq.tridiagonal_solve(*args, pivoting=True)
    assert x.dtype == dtype
    np.testing.assert_allclose(np.asarray(x, np.float64), expect, rtol=2e-2)
    g = jax.grad(
        lambda r: jnp.sum(eqx_seq.tridiagonal_solve(*args[:3], r, pivoting=True))
    )
    assert g(args[3]).dtype == dtype


# -------------------------------------------------------------------- embedding
@pytest.mark.parametrize("padding_idx, bad_id", [(-1, 100), (0, -100)])
def test_embedding_clip_onto_padding_gives_it_no_gradient(padding_idx, bad_id):
    emb = eqx_seq.Embedding(
        7, 3, padding_idx=padding_idx, out_of_range="clip", key=jr.key(0)
    )
    ids = jnp.array([1, bad_id, 2])
    grad = eqx.filter_grad(lambda e: jnp.sum(e(ids) ** 2 + e(ids)))(emb)
    assert jnp.all(grad.weight[padding_idx % 7] == 0)
    # the row is still what is looked up: the padding row, zeros
    np.testing.assert_array_equal(emb(ids)[1], jnp.zeros(3))
    assert jnp.any(grad.weight[1] != 0)


def test_embedding_ids_beyond_32_bits_under_x64():
    emb = eqx_seq.Embedding(5, 2, key=jr.key(0))
    big = jnp.array([1, 2**32 + 3], jnp.int64)
    fill = eqx_seq.Embedding(weight=emb.weight, out_of_range="fill")
    out = fill(big)
    np.testing.assert_array_equal(out[0], emb.weight[1])
    assert jnp.all(jnp.isnan(out[1]))
    clip = eqx_seq.Embedding(weight=emb.weight, out_of_range="clip")
    np.testing.assert_array_equal(clip(big)[1], emb.weight[4])
    np.testing.assert_array_equal(clip(-big)[1], emb.weight[0])
    with pytest.raises(RuntimeError, match="out of range"):
        emb(big)
    with pytest.raises(RuntimeError, match="out of range"):
        emb(jnp.array([-(2**40)], jnp.int64))
    # unsigned ids past the int32 range
    np.testing.assert_array_equal(
        clip(jnp.array([2**32 - 1], jnp.uint32))[0], emb.weight[4]
    )
    with pytest.raises(RuntimeError, match="out of range"):
        emb(jnp.array([2**31], jnp.uint32))


def test_embedding_numpy_ids_beyond_32_bits_without_x64():
    emb = eqx_seq.Embedding(5, 2, key=jr.key(0))
    with jax.enable_x64(False):
        with pytest.raises(RuntimeError, match="out of range"):
            emb(np.array([2**32 + 1], np.int64))
        clip = eqx_seq.Embedding(weight=emb.weight, out_of_range="clip")
        np.testing.assert_array_equal(
            clip(np.array([2**32 + 1, -(2**40)], np.int64)),
            emb.weight[jnp.array([4, 0])],
        )
        fill = eqx_seq.Embedding(weight=emb.weight, out_of_range="fill")
        assert jnp.all(jnp.isnan(fill(np.array([2**32 + 1], np.int64))))
        with pytest.raises(RuntimeError, match="out of range"):
            emb(2**40)


# ----------------------------------------------------------------------- models
# slow tier: mean pooling; NaN padding under a mask, values and gradients, is checked
# on last pooling, and mean pooling under a mask by test_models.py's test_classifier_
# shapes_and_masked_pooling[mean-rglru]
@pytest.mark.parametrize(
    "pooling", [pytest.param("mean", marks=pytest.mark.slow), "last"]
)
def test_classifier_mask_hides_whatever_padded_steps_hold(pooling, getkey):
    model = eqx_seq.SequenceClassifier(
        2, 3, width=8, depth=1, state_size=4, pooling=pooling, key=getkey()
    )
    x = jr.normal(getkey(), (5, 2))
    padded = jnp.concatenate([x, jnp.full((3, 2), jnp.nan)])
    mask = jnp.arange(8) < 5
    np.testing.assert_allclose(model(padded, mask=mask), model(x), rtol=1e-12)
    grad = eqx.filter_grad(lambda m: jnp.sum(m(padded, mask=mask)))(model)
    expect = eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)
    leaves = jax.tree.leaves(eqx.filter(grad, eqx.is_inexact_array))
    for g, e in zip(leaves, jax.tree.leaves(eqx.filter(expect, eqx.is_inexact_array))):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


def test_classifier_all_false_mask_raises(getkey):
    model = eqx_seq.SequenceClassifier(2, 3, width=8, depth=1, key=getkey())
    x = jnp.ones((4, 2))
    with pytest.raises(RuntimeError, match="no valid step"):
        model(x, mask=jnp.zeros(4, bool))
    with pytest.raises(RuntimeError, match="no valid step"):
        jax.vmap(model)(jnp.ones((2, 4, 2)), mask=jnp.array([[True] * 4, [False] * 4]))


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0, np.float32(np.nan)])
def test_generate_rejects_bad_temperatures(temperature, getkey):
    lm = eqx_seq.LanguageModel(11, width=8, depth=1, state_size=4, key=getkey())
    with pytest.raises(ValueError, match="temperature"):
        lm.generate(jnp.array([1]), 2, key=getkey(), temperature=temperature)
    # traced (under the user's jit): a run-time error
    gen = eqx.filter_jit(
        lambda t: lm.generate(jnp.array([1]), 2, key=jr.key(0), temperature=t)
    )
    with pytest.raises(RuntimeError, match="temperature"):
        gen(jnp.asarray(temperature, jnp.float32))


# slow tier: a traced zero temperature gives the greedy tokens (the argmax of the
# parallel call's logits) in test_generate_tiny_temperatures_give_the_greedy_tokens,
# a Python zero in test_models.py's test_language_model_step_mode_equals_parallel
@pytest.mark.slow
def test_generate_zero_temperature_traced_is_greedy(getkey):
    lm = eqx_seq.LanguageModel(11, width=8, depth=1, state_size=4, key=getkey())
    prompt = jnp.array([1, 2])
    greedy = lm.generate(prompt, 4, key=jr.key(0), temperature=0.0)
    traced = eqx.filter_jit(
        lambda t: lm.generate(prompt, 4, key=jr.key(0), temperature=t)
    )(jnp.asarray(0.0))
    np.testing.assert_array_equal(greedy, traced)
    # and greedy is the argmax of the parallel call's logits, token by token
    ids = prompt
    for token in greedy:
        assert token == jnp.argmax(lm(ids)[-1])
        ids = jnp.concatenate([ids, token[None]])


def test_generate_eager_compiles_once(getkey):
    lm = eqx_seq.LanguageModel(11, width=8, depth=1, state_size=4, key=getkey())
    prompt = jnp.array([1, 2, 3])
    lm.generate(prompt, 3, key=jr.key(0))  # warm-up
    compiles = []

    def listen(event, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for seed in range(3):
            lm.generate(prompt, 3, key=jr.key(seed), temperature=0.5 + seed)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


# -------------------------------------------------------------------------- SSMs
@pytest.mark.parametrize("bad", [0.0, -0.5, jnp.nan, jnp.inf])
def test_s5_rejects_non_positive_dt(bad, getkey):
    layer = eqx_seq.S5(2, 4, key=getkey())
    u = jnp.ones((5, 2))
    dt = jnp.ones(5).at[2].set(bad)
    with pytest.raises(RuntimeError, match="dt"):
        layer(u, dt=dt)
    with pytest.raises(RuntimeError, match="dt"):
        eqx.filter_jit(layer)(u, dt=dt)
    with pytest.raises(RuntimeError, match="dt"):
        layer.step(layer.init_state(), u[0], dt=bad)
    with pytest.raises(RuntimeError, match="dt"):
        layer.final_state(u, dt=dt)


@pytest.mark.usefixtures("unchecked_annotations")
def test_s5_step_dt_shape_is_checked(getkey):
    layer = eqx_seq.S5(2, 4, key=getkey())
    with pytest.raises(ValueError, match="`dt` in `step` must be a scalar"):
        layer.step(layer.init_state(), jnp.ones(2), dt=jnp.ones(3))
    # a scalar of shape (1,) is not a scalar either
    with pytest.raises(ValueError, match="`dt` in `step` must be a scalar"):
        layer.step(layer.init_state(), jnp.ones(2), dt=jnp.ones(1))


@pytest.mark.parametrize(
    "build",
    [
        lambda k: eqx_seq.S5(2, 4, dt_max=math.inf, key=k),
        lambda k: eqx_seq.S5(2, 4, dt_min=math.inf, dt_max=math.inf, key=k),
        lambda k: eqx_seq.S5(2, 4, step_rescale=math.inf, key=k),
        lambda k: eqx_seq.S5(2, 4, step_rescale=math.nan, key=k),
        lambda k: eqx_seq.LRU(2, 4, max_phase=math.inf, key=k),
        lambda k: eqx_seq.LRU(2, 4, max_phase=math.nan, key=k),
        lambda k: eqx_seq.TridiagonalImplicit(2, coupling_range=(1, math.inf), key=k),
        lambda k: eqx_seq.TridiagonalImplicit(2, coupling_range=(0.1, math.nan), key=k),
        lambda k: eqx_seq.S5Block(eqx_seq.LRU(2, 4, key=k), dropout=math.nan, key=k),
    ],
)
def test_ranges_refuse_inf_and_nan(build, getkey):
    with pytest.raises(ValueError, match="finite|must be"):
        build(getkey())


def test_s5_ensemble_by_filter_vmap(getkey):
    keys = jr.split(getkey(), 3)
    ensemble = eqx.filter_vmap(lambda k: eqx_seq.S5(3, 8, blocks=2, key=k))(keys)
    u = jr.normal(getkey(), (10, 3))
    out = eqx.filter_vmap(lambda layer: layer(u))(ensemble)
    for i, k in enumerate(keys):
        one = eqx_seq.S5(3, 8, blocks=2, key=k)
        np.testing.assert_allclose(out[i], one(u), rtol=1e-10, atol=1e-12)
    # bidirectional, without conjugate symmetry, and the LRU too
    eqx.filter_vmap(
        lambda k: eqx_seq.S5(3, 8, conj_sym=False, bidirectional=True, key=k)
    )(keys)
    eqx.filter_vmap(
        lambda k: eqx_seq.SequenceClassifier(
            1, 2, width=4, depth=1, state_size=4, key=k
        )
    )(keys)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.int32])
def test_ssm_half_precision_is_refused_clearly(dtype, getkey):
    for cls in (eqx_seq.S5, eqx_seq.LRU):
        with pytest.raises(ValueError, match="float32 or float64"):
            cls(2, 4, dtype=dtype, key=getkey())


def test_ssm_half_precision_inputs_are_computed_in_the_parameters_dtype(getkey):
    layer = eqx_seq.S5(2, 4, dtype=jnp.float32, key=getkey())
    u = jr.normal(getkey(), (6, 2), jnp.float32)
    y = layer(u.astype(jnp.bfloat16))
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, layer(u.astype(jnp.bfloat16).astype(jnp.float32)))


def test_integer_input_is_cast_as_the_real_annotations_promise():
    """Integer sequences (pixel values, counts) are cast to the parameters' dtype
    in every sequence layer, model and step mode, as their `Real` annotations say
    (the shared input check refused them: "needs a real floating input, got
    int32"): the outputs equal the float calls', in one compiled program."""
    f32, H, T = jnp.float32, 4, 5
    k = iter(jr.split(jr.key(0), 16))
    s5 = eqx_seq.S5(H, 4, dtype=f32, key=next(k))
    mamba = eqx_seq.Mamba(H, state_size=2, dtype=f32, key=next(k))
    mamba2 = eqx_seq.Mamba2(H, state_size=2, head_dim=4, dtype=f32, key=next(k))
    gdn = eqx_seq.GatedDeltaNet(H, num_heads=1, head_dim=2, dtype=f32, key=next(k))
    recurrent = [
        s5,
        eqx_seq.LRU(H, 4, dtype=f32, key=next(k)),
        eqx_seq.S5Block(s5, key=next(k)),
        eqx_seq.RGLRU(H, dtype=f32, key=next(k)),
        eqx_seq.HawkBlock(H, dtype=f32, key=next(k)),
        mamba,
        eqx_seq.MambaBlock(mamba),
        mamba2,
        eqx_seq.Mamba2Block(mamba2),
        gdn,
        eqx_seq.GatedDeltaNetBlock(gdn),
    ]
    others = [
        eqx_seq.TridiagonalImplicit(H, dtype=f32, key=next(k)),
        eqx_seq.SequenceClassifier(
            H, 3, width=4, depth=1, state_size=2, dtype=f32, key=next(k)
        ),
        eqx_seq.DenoisingClassifier(
            H, 3, kalman_state_size=2, width=4, depth=1, state_size=2, dtype=f32,
            key=next(k),
        ),
    ]  # fmt: skip

    def calls(x):
        out = [layer(x) for layer in recurrent + others]
        out += [layer.step(layer.init_state(), x[0])[1] for layer in recurrent]
        return out + [s5(x, dt=x[:, 0] % 3 + 1)]  # integer steps too

    x = jr.randint(jr.key(1), (T, H), 0, 256, jnp.int32)
    ints, floats = jax.jit(lambda x: (calls(x), calls(x.astype(f32))))(x)
    for a, b in zip(ints, floats, strict=True):
        assert a.dtype == f32
        np.testing.assert_array_equal(a, b)


def test_s5_huge_hippo_block_is_refused_before_allocating(getkey):
    with pytest.raises(ValueError, match="blocks="):
        eqx_seq.S5(1, 2**15, key=getkey())
    # the same state size in blocks is fine (and cheap)
    layer = eqx_seq.S5(1, 2**12, blocks=2**6, key=getkey())
    assert layer.num_states == 2**11


# ----------------------------------------------------------------------- Kalman
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_kalman_half_precision_is_refused_clearly(dtype):
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.KalmanFilter(2, 1, dtype=dtype, key=jr.key(0))
    eye = jnp.eye(2, dtype=dtype)
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.KalmanFilter.from_matrices(
            eye, eye[:1], eye, eye[:1, :1], jnp.zeros(2, dtype), eye
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(learning_rate=math.nan),
        dict(learning_rate=-1e-3),
        dict(learning_rate=1e-3, ssm_learning_rate=math.inf),
        dict(learning_rate=1e-3, weight_decay=math.nan),
        dict(learning_rate=jnp.array([1e-3, 1e-3])),
    ],
)
@pytest.mark.usefixtures("unchecked_annotations")
def test_s5_optimizer_refuses_bad_rates(kwargs):
    with pytest.raises(ValueError, match="must be"):
        eqx_seq.s5_optimizer(**kwargs)


def test_s5_optimizer_takes_scalar_arrays_and_schedules():
    eqx_seq.s5_optimizer(jnp.asarray(1e-3), ssm_learning_rate=np.float32(1e-4))
    eqx_seq.s5_optimizer(lambda step: 1e-3, weight_decay=0)


# ------------------------------------------- models: arguments, states, tokens
# (argument, value) for which the argument is invalid, whatever the mixer
_BAD_BLOCK_ARGUMENTS = [
    ("dropout", 2.0),
    ("dropout", math.nan),
    ("norm", "batch"),
    ("activation", "no_such_activation"),
    ("ssm_blocks", 0),
    ("state_size", -1),
    ("prenorm", "no"),
]
_APPLIES = {
    "state_size": ("s5", "lru", "mamba", "mamba2"),
    "ssm_blocks": ("s5",),
    "activation": ("s5", "lru"),
    "norm": ("s5", "lru", "mamba", "mamba2"),
    "prenorm": ("s5", "lru"),
    "dropout": ("s5", "lru", "mamba", "mamba2"),
}


@pytest.mark.parametrize("mixer", ["s5", "lru", "rglru", "mamba", "mamba2"])
@pytest.mark.parametrize("name, value", _BAD_BLOCK_ARGUMENTS)
@pytest.mark.usefixtures("unchecked_annotations")
def test_classifier_refuses_block_arguments_bad_or_not_the_mixers(name, value, mixer):
    kwargs = {"width": 8, "depth": 1, "mixer": mixer, name: value}
    # an argument the mixer has no use for is named with the mixers it is for;
    # one it has is checked
    match = (
        f"`{name}`"
        if mixer in _APPLIES[name]
        else f"`{name}` applies to mixer=.*got `{name}=.*` with mixer='{mixer}'"
    )
    with pytest.raises(ValueError, match=match):
        eqx_seq.SequenceClassifier(2, 3, key=jr.key(0), **kwargs)


@pytest.mark.parametrize(
    "mixer, kwargs",
    [
        ("rglru", dict(state_size=8)),
        ("rglru", dict(dropout=0.1)),
        ("rglru", dict(norm="rms")),
        ("mamba", dict(activation="gelu")),
        ("mamba", dict(prenorm=False)),
        ("lru", dict(ssm_blocks=2)),
        ("mamba", dict(ssm_blocks=2)),
    ],
)
def test_models_refuse_valid_arguments_the_mixer_has_no_use_for(mixer, kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"`{name}` applies to mixer="):
        eqx_seq.SequenceClassifier(
            2, 3, width=8, depth=1, mixer=mixer, key=jr.key(0), **kwargs
        )
    if name not in ("norm", "prenorm"):  # the language model fixes these
        with pytest.raises(ValueError, match=f"`{name}` applies to mixer="):
            eqx_seq.LanguageModel(
                10, width=8, depth=1, mixer=mixer, key=jr.key(0), **kwargs
            )


def test_models_take_the_arguments_that_apply_and_the_defaults():
    model = eqx_seq.SequenceClassifier(
        2,
        3,
        width=8,
        depth=1,
        state_size=4,
        mixer="mamba",
        norm="rms",
        dropout=0.1,
        key=jr.key(0),
    )
    block = model.blocks[0]
    assert isinstance(block.norm, eqx.nn.RMSNorm) and block.dropout.p == 0.1
    assert block.mamba.state_size == 4
    # the defaults, spelled out, are not refused: nor an int for a float default
    eqx_seq.SequenceClassifier(
        2,
        3,
        width=8,
        depth=1,
        mixer="rglru",
        state_size=64,
        ssm_blocks=1,
        activation="half_glu1",
        norm="layer",
        prenorm=True,
        dropout=0,
        key=jr.key(0),
    )
    eqx_seq.LanguageModel(
        10, width=8, depth=1, mixer="rglru", dropout=0.0, key=jr.key(0)
    )


@pytest.mark.usefixtures("unchecked_annotations")
def test_mamba_block_names_its_own_bad_input():
    block = eqx_seq.MambaBlock(eqx_seq.Mamba(8, state_size=2, key=jr.key(0)))
    for x in [jnp.ones((5, 9)), jnp.ones(5)]:
        with pytest.raises(ValueError, match=r"MambaBlock.*\(T, 8\)"):
            block(x)
        with pytest.raises(ValueError, match=r"MambaBlock.*\(T, 8\)"):
            block.final_state(x)
    for x_t in [jnp.ones((1, 8)), jnp.ones(9)]:
        with pytest.raises(ValueError, match=r"MambaBlock.step.*\(8,\)"):
            block.step(block.init_state(), x_t)
    with pytest.raises(ValueError, match=r"MambaBlock.step.*real input.*complex"):
        block.step(block.init_state(), jnp.ones(8, jnp.complex64))
    with pytest.raises(ValueError, match=r"`state` must be a pair.*got NoneType"):
        block.step(None, jnp.ones(8))


@pytest.mark.parametrize("block", ["hawk", "mamba"])
@pytest.mark.usefixtures("unchecked_annotations")
def test_block_step_refuses_a_state_of_another_structure(block):
    if block == "hawk":
        b = eqx_seq.HawkBlock(8, key=jr.key(0))
    else:
        b = eqx_seq.MambaBlock(eqx_seq.Mamba(8, state_size=2, key=jr.key(0)))
    conv, inner = b.init_state()
    x = jnp.ones(8)
    for state in [
        None,
        (),
        (conv,),
        (conv, inner, inner),
        (None, inner),
        ("abc", inner),
        (conv.astype(jnp.complex128), inner),
        (conv, jnp.zeros(inner.shape, jnp.int32)),
        (conv, jnp.zeros(inner.shape, bool)),
        (conv[None], inner),
        (conv, inner[..., None]),
    ]:
        with pytest.raises(ValueError, match=r"`state(\[\d\])?`"):
            b.step(state, x)


def tiny_lm(mixer="s5", dtype=jnp.float64, depth=2, seed=0):
    size = {} if mixer == "rglru" else {"state_size": 2}
    return eqx_seq.LanguageModel(
        10, width=8, depth=depth, mixer=mixer, dtype=dtype, key=jr.key(seed), **size
    )


@pytest.mark.usefixtures("unchecked_annotations")
def test_language_model_step_refuses_what_is_not_one_token_id():
    lm = tiny_lm("mamba", depth=1)
    for token in [jnp.array([1]), jnp.array(1.0), jnp.array(True)]:
        with pytest.raises(ValueError, match="one token id, an integer scalar"):
            lm.step(lm.init_state(), token)


@pytest.mark.parametrize("mixer", ["s5", "rglru", "mamba"])
@pytest.mark.usefixtures("unchecked_annotations")
def test_language_model_step_refuses_a_state_of_another_structure(mixer):
    lm = tiny_lm(mixer)
    state = lm.init_state()
    token = jnp.array(1)
    first = state[0]
    leaves, treedef = jax.tree.flatten(first)
    complex_ = jax.tree.unflatten(treedef, [x.astype(jnp.complex128) for x in leaves])
    wider = jax.tree.unflatten(treedef, [jnp.zeros(x.shape + (1,)) for x in leaves])
    integer = jax.tree.unflatten(treedef, [jnp.zeros(x.shape, int) for x in leaves])
    bad = {
        "one block's state": state[:1],
        "empty": (),
        "None": None,
        "three": state + state[:1],
        "None for a block": (None, state[1]),
        "wider": (wider, state[1]),
        "integer": (integer, state[1]),
        "nested once more": ((first,), state[1]),
    }
    if mixer != "s5":  # the S5 block's state is complex itself
        bad["complex"] = (complex_, state[1])
    else:
        bad["a pair for one array"] = ((first, first), state[1])
    for s in bad.values():
        with pytest.raises(ValueError, match=r"LanguageModel.step.*`state"):
            lm.step(s, token)


@pytest.mark.parametrize("mixer", ["s5", "rglru", "mamba"])
def test_language_model_step_takes_lists_for_tuples(mixer):
    # the structure of `init_state()`, with lists for tuples, is taken: traced only
    lm = tiny_lm(mixer)
    state = lm.init_state()
    as_lists = [list(s) if isinstance(s, tuple) else s for s in state]
    out_state, logits = jax.eval_shape(lm.step, as_lists, jnp.array(1))
    assert logits.shape == (10,)
    assert jax.tree.structure(out_state) == jax.tree.structure(state)


@pytest.mark.parametrize("temperature", ["hot", 1j, np.complex64(1), None, [1.0]])
@pytest.mark.usefixtures("unchecked_annotations")
def test_generate_refuses_temperatures_that_are_not_real_numbers(temperature):
    lm = tiny_lm(depth=1)
    with pytest.raises(ValueError, match="`temperature` must be a real number"):
        lm.generate(jnp.array([1]), 2, key=jr.key(0), temperature=temperature)


def test_generate_tiny_temperatures_give_the_greedy_tokens():
    # float32, with confident logits (|logit| ~ 100), as a trained model's: the
    # logits divided by 1e-37 overflowed, and 1e-37 gave token 0 after token 0
    lm = tiny_lm("s5", dtype=jnp.float32, depth=1, seed=1)
    lm = eqx.tree_at(lambda m: m.norm.weight, lm, lm.norm.weight * 100)
    prompt = jnp.array([1, 2, 3])
    generate = eqx.filter_jit(
        lambda m, t: m.generate(prompt, 5, key=jr.key(0), temperature=t)
    )
    call = eqx.filter_jit(lambda m, ids: m(ids))
    # the greedy tokens, independently: the argmax of the parallel call's logits
    # at every new position, given the tokens before it
    for temperature in [1e-37, 1e-30, 0.0]:
        tokens = generate(lm, jnp.asarray(temperature, jnp.float32))
        logits = call(lm, jnp.concatenate([prompt, tokens])[:-1])[len(prompt) - 1 :]
        assert jnp.all(jnp.max(jnp.abs(logits), axis=-1) > 30)
        np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))
