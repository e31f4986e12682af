"""The composed models: shapes, a training step, backends, step mode, checkpoints."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import slow_except

import eqx_seq


SCANS = [eqx_seq.SequentialScan(), eqx_seq.AssociativeScan()]


def small(kw):
    """Small models' arguments; no `state_size` for the RG-LRU, which has none."""
    kw = {"width": 8, "depth": 2, "state_size": 8, "dtype": jnp.float64, **kw}
    if kw.get("mixer") == "rglru":
        del kw["state_size"]
    return kw


def classifier(key, scan=eqx_seq.AutoScan(), **kw):
    return eqx_seq.SequenceClassifier(2, 3, scan=scan, key=key, **small(kw))


def lm(key, scan=eqx_seq.AutoScan(), **kw):
    return eqx_seq.LanguageModel(11, scan=scan, key=key, **small(kw))


MIXERS = ["s5", "lru", "rglru", "mamba", "mamba2", "gated_deltanet"]
RECURRENT = (
    eqx_seq.AbstractDiagonalSSM,
    eqx_seq.RGLRU,
    eqx_seq.Mamba,
    eqx_seq.Mamba2,
    eqx_seq.GatedDeltaNet,
)


def every_layer_scan(model):
    def is_layer(x):
        return isinstance(x, RECURRENT)

    return [x.scan for x in jax.tree.leaves(model, is_leaf=is_layer) if is_layer(x)]


# slow tier: the other mixers, whose models hand `scan` to their blocks as the LRU's
# do (Mamba's models run on both backends in test_backends_agree[mamba])
@pytest.mark.parametrize("mixer", slow_except(MIXERS, ["lru"]))
def test_backend_reaches_every_layer(mixer, getkey):
    for scan in SCANS:
        for model in [
            classifier(getkey(), scan, mixer=mixer),
            lm(getkey(), scan, mixer=mixer),
        ]:
            scans = every_layer_scan(model)
            assert len(scans) == 2 and all(s == scan for s in scans)


# slow tier: the other mixers; both backends of each layer are compared in its own
# file (test_s5.py, test_rglru.py, test_mamba2.py), Mamba's here
@pytest.mark.parametrize("mixer", slow_except(MIXERS, ["mamba"]))
def test_backends_agree(mixer, getkey):
    key = getkey()
    x = jr.normal(getkey(), (3, 9, 2), jnp.float64)
    ids = jr.randint(getkey(), (9,), 0, 11)
    outs = [
        (jax.vmap(classifier(key, s, mixer=mixer))(x), lm(key, s, mixer=mixer)(ids))
        for s in SCANS
    ]
    np.testing.assert_allclose(outs[0][0], outs[1][0], atol=1e-10)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-10)


# slow tier: the denoiser with a gap runs in test_denoising_classifier_composes_the_
# layers, and the two backends agree through a model in test_backends_agree
@pytest.mark.slow
def test_denoising_classifier_backends_agree(getkey):
    key = getkey()
    x = jr.normal(getkey(), (12, 2), jnp.float64).at[3:5, 0].set(jnp.nan)
    outs = [eqx.filter_jit(lambda m, x: m(x))(denoiser(key, s), x) for s in SCANS]
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-9, atol=1e-10)


# slow tier: mean pooling of S5 and last pooling of Mamba; each pooling runs in the
# fast tier once (last-s5, mean-rglru)
@pytest.mark.parametrize(
    "pooling, mixer",
    [
        pytest.param("mean", "s5", marks=pytest.mark.slow),
        ("last", "s5"),
        ("mean", "rglru"),
        pytest.param("last", "mamba", marks=pytest.mark.slow),
    ],
)
def test_classifier_shapes_and_masked_pooling(pooling, mixer, getkey):
    model = classifier(getkey(), pooling=pooling, mixer=mixer)
    x = jr.normal(getkey(), (7, 2), jnp.float64)
    assert model(x).shape == (3,)
    # padding at the end + mask = the unpadded sequence (causal blocks)
    padded = jnp.concatenate([x, jr.normal(getkey(), (4, 2), jnp.float64)])
    mask = jnp.arange(11) < 7
    np.testing.assert_allclose(model(padded, mask=mask), model(x), atol=1e-10)


def denoiser(key, scan=eqx_seq.AutoScan()):
    kw = {"width": 8, "depth": 1, "state_size": 8, "dtype": jnp.float64}
    return eqx_seq.DenoisingClassifier(
        2, 3, kalman_state_size=3, scan=scan, key=key, **kw
    )


def tiny_task(kind, key):
    """A model, a batch and a loss for it."""
    mkey, xkey = jr.split(key)
    kind, _, mixer = kind.partition("-")
    mixer = mixer or "s5"
    if kind == "lm":
        ids = jr.randint(xkey, (4, 10), 0, 11)
        model = lm(mkey, mixer=mixer)

        def loss(model):
            logits = jax.vmap(model)(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, ids[:, 1:]
            ).mean()

        return model, loss
    x = jr.normal(xkey, (16, 10, 2), jnp.float64)
    y = (x[:, :, 0].mean(1) > 0).astype(jnp.int32)
    model = classifier(mkey, mixer=mixer) if kind == "classifier" else denoiser(mkey)

    def loss(model):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return model, loss


# slow tier: the other models; `s5_optimizer` and a gradient through a whole model
# are checked by the language model's row, the denoiser's gradient reaching every
# stage by test_denoising_classifier_composes_the_layers
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("classifier", marks=pytest.mark.slow),
        "lm",
        pytest.param("denoiser", marks=pytest.mark.slow),
        pytest.param("classifier-rglru", marks=pytest.mark.slow),
        pytest.param("lm-mamba", marks=pytest.mark.slow),
    ],
)
def test_training_step_reduces_the_loss(kind, getkey):
    model, loss = tiny_task(kind, getkey())
    optim = eqx_seq.s5_optimizer(1e-2, ssm_learning_rate=1e-3)
    with jax.numpy_dtype_promotion("standard"):  # optax is not strict-clean
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(model, opt_state):
            value, grads = eqx.filter_value_and_grad(loss)(model)
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, opt_state = optim.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, value

        model, opt_state, first = step(model, opt_state)
        for _ in range(10):
            model, opt_state, last = step(model, opt_state)
    assert last < 0.8 * first


# slow tier: the other mixers; each layer's step mode equals its call in its own
# file, and the model's `step` and `generate` over them are the same code (Gated
# DeltaNet kept fast: its blocks generate through `delta_rule_step`, not a scan)
@pytest.mark.parametrize("mixer", slow_except(MIXERS, ["mamba2", "gated_deltanet"]))
def test_language_model_step_mode_equals_parallel(mixer, getkey):
    model = lm(getkey(), mixer=mixer)
    ids = jr.randint(getkey(), (12,), 0, 11)
    call = eqx.filter_jit(lambda m, x: m(x))
    parallel = call(model, ids)
    assert parallel.shape == (12, 11)
    stepped = eqx.filter_jit(
        lambda m, x: jax.lax.scan(lambda s, t: m.step(s, t), m.init_state(), x)[1]
    )(model, ids)
    np.testing.assert_allclose(stepped, parallel, atol=1e-10)
    # greedy generation = the argmax of the parallel call at every new position
    generate = eqx.filter_jit(
        lambda m, p, k, temperature: m.generate(p, 4, key=k, temperature=temperature)
    )
    tokens = generate(model, ids[:3], getkey(), 0.0)
    logits = call(model, jnp.concatenate([ids[:3], tokens])[:-1])
    np.testing.assert_array_equal(tokens, jnp.argmax(logits[2:], axis=-1))
    sampled = generate(model, ids[:3], getkey(), 1.0)
    assert sampled.shape == (4,) and bool(jnp.all((sampled >= 0) & (sampled < 11)))
    assert not jnp.array_equal(sampled, tokens) or not jnp.array_equal(
        generate(model, ids[:3], getkey(), 1.0), tokens
    )  # sampling at temperature 1 is not the greedy path every time


# slow tier: the tied output layer is `Embedding.attend`, checked by test_embedding.py's
# test_attend_tied_logits
@pytest.mark.slow
def test_language_model_ties_input_and_output(getkey):
    model = lm(getkey())
    ids = jr.randint(getkey(), (5,), 0, 11)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(ids)[:, 0]))(model)
    # the output layer is the embedding table: row 0 gets gradient as an output
    # even though token 0 may not be in the input
    assert jnp.any(grads.embedding.weight[0] != 0)
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert sum(x.size for x in leaves if x.shape == (11, 8)) == 11 * 8


# slow tier: the language model and the denoiser, serialised by the same Equinox
# functions as the classifier's row
@pytest.mark.parametrize(
    "kind",
    [
        "classifier",
        pytest.param("lm", marks=pytest.mark.slow),
        pytest.param("denoiser", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_round_trip(kind, getkey, tmp_path):
    make = {"classifier": classifier, "lm": lm, "denoiser": denoiser}[kind]
    model = make(getkey())
    arg = jnp.array([1, 2, 3]) if kind == "lm" else jr.normal(getkey(), (6, 2))
    path = tmp_path / "m.eqx"
    eqx.tree_serialise_leaves(path, model)
    loaded = eqx.tree_deserialise_leaves(path, make(getkey()))  # other weights
    assert not np.array_equal(make(getkey())(arg), model(arg))
    np.testing.assert_array_equal(loaded(arg), model(arg))


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input(getkey):
    model = classifier(getkey())
    with pytest.raises(ValueError, match="in_features"):
        model(jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="mask"):
        model(jnp.ones((5, 2)), mask=jnp.ones(4, bool))
    with pytest.raises(ValueError, match="mask"):
        model(jnp.ones((5, 2)), mask=jnp.ones(5))
    with pytest.raises(ValueError, match="pooling"):
        classifier(getkey(), pooling="max")
    with pytest.raises(ValueError, match="mixer"):
        classifier(getkey(), mixer="lstm")
    with pytest.raises(ValueError, match="causal"):
        classifier(getkey(), mixer="mamba", bidirectional=True)
    with pytest.raises(ValueError, match="positive int"):
        classifier(getkey(), depth=0)
    language = lm(getkey())
    with pytest.raises(ValueError, match="token ids"):
        language(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="prompt"):
        language.generate(jnp.zeros((0,), jnp.int32), 3, key=getkey())
    with pytest.raises(ValueError, match="temperature"):
        language.generate(jnp.array([1]), 3, key=getkey(), temperature=-1.0)


def test_denoising_classifier_composes_the_layers(getkey):
    model = eqx_seq.DenoisingClassifier(
        2, 3, kalman_state_size=3, width=8, depth=1, state_size=8, key=getkey()
    )
    x = jr.normal(getkey(), (20, 2), jnp.float32).at[5:8].set(jnp.nan)  # a gap
    features = model.features(x)
    assert features.shape == (20, 3) and bool(jnp.all(jnp.isfinite(features)))
    np.testing.assert_allclose(features, model.smoother(model.kalman(x)), rtol=1e-6)
    logits = eqx.filter_jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(logits, model.classifier(features), rtol=1e-5, atol=1e-6)
    # trained end to end: every stage gets a finite, non-zero gradient
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)))(model, x)
    for stage in (grads.kalman, grads.smoother, grads.classifier):
        leaves = jax.tree.leaves(eqx.filter(stage, eqx.is_inexact_array))
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
        assert any(bool(jnp.any(g != 0)) for g in leaves)
    # one backend for every stage
    seq = eqx_seq.DenoisingClassifier(
        2, 3, width=8, depth=1, scan=eqx_seq.SequentialScan(), key=getkey()
    )
    assert seq.kalman.scan == seq.smoother.scan == eqx_seq.SequentialScan()
    assert every_layer_scan(seq) == [eqx_seq.SequentialScan()]
    with pytest.raises(ValueError):
        model(jnp.ones((20, 3)))  # wrong number of features


def test_generate_samples_the_softmax_at_every_temperature(getkey):
    """The Gumbel-max draw `argmax(logits + T g)` is a draw from softmax(logits / T),
    below a temperature of 1 (where the noise is scaled) and above (the logits)."""
    model = lm(getkey(), depth=1)
    prompt = jnp.array([1, 2, 3])
    keys = jr.split(getkey(), 4000)
    draw = eqx.filter_jit(
        lambda m, t: jax.vmap(lambda k: m.generate(prompt, 1, key=k, temperature=t))(
            keys
        )[:, 0]
    )
    logits = model(prompt)[-1]
    for temperature in [0.5, 2.0]:
        counts = jnp.bincount(draw(model, jnp.asarray(temperature)), length=11)
        p = jax.nn.softmax(logits / temperature)
        sigma = jnp.sqrt(p * (1 - p) / len(keys))
        assert jnp.all(jnp.abs(counts / len(keys) - p) < 5 * sigma + 1e-3)


class _OwnBlock(eqx_seq.AbstractRecurrentLayer):
    """A user's block: `x + W rglru(x)`."""

    rglru: eqx_seq.RGLRU
    out: eqx.nn.Linear
    recurrence_fields = ()

    def __init__(self, width, key):
        k1, k2 = jr.split(key)
        self.rglru = eqx_seq.RGLRU(width, dtype=jnp.float64, key=k1)
        self.out = eqx.nn.Linear(width, width, dtype=jnp.float64, key=k2)

    def __call__(self, x, *, h0=None, key=None):
        return x + jax.vmap(self.out)(self.rglru(x, h0=h0))

    def final_state(self, x, *, h0=None):
        return self.rglru.final_state(x, h0=h0)

    def init_state(self):
        return self.rglru.init_state()

    def step(self, state, x_t):
        state, y_t = self.rglru.step(state, x_t)
        return state, x_t + self.out(y_t)


class _Halves(_OwnBlock):
    def __call__(self, x, *, h0=None, key=None):
        return x[:, ::2]


def test_models_take_a_mixer_of_ones_own(getkey):
    """A function that makes an `AbstractRecurrentLayer` is a mixer: the language
    model's step mode equals its parallel call through the user's `step`, the
    classifier runs, and the optimiser labels find the layer inside."""
    make = lambda key: _OwnBlock(8, key)  # noqa: E731
    model = eqx_seq.LanguageModel(11, width=8, depth=2, mixer=make, key=getkey())
    ids = jr.randint(getkey(), (6,), 0, 11)
    parallel = model(ids)
    stepped = jax.lax.scan(lambda s, t: model.step(s, t), model.init_state(), ids)[1]
    np.testing.assert_allclose(stepped, parallel, atol=1e-10)
    labels = eqx_seq.ssm_param_labels(model)
    assert all(block.rglru.a_param == "ssm" for block in labels.blocks)
    classifier = eqx_seq.SequenceClassifier(
        2, 3, width=8, depth=1, mixer=make, dtype=jnp.float64, key=getkey()
    )
    assert classifier(jnp.ones((5, 2))).shape == (3,)


@pytest.mark.usefixtures("unchecked_annotations")
def test_models_refuse_mixers_that_are_not_one(getkey):
    """A mixer that makes something else, or the wrong width, and a block argument
    of the library's blocks, are refused."""
    make = lambda key: _OwnBlock(8, key)  # noqa: E731
    with pytest.raises(ValueError, match="must return an `eqx_seq.AbstractRecurrent"):
        eqx_seq.LanguageModel(
            11, width=8, mixer=lambda key: eqx.nn.Identity(), key=getkey()
        )
    with pytest.raises(ValueError, match=r"\(T, width\) = \(T, 8\).*gives \(2, 4\)"):
        eqx_seq.LanguageModel(11, width=8, mixer=lambda k: _Halves(8, k), key=getkey())
    with pytest.raises(ValueError, match="`dropout` is an argument of the library"):
        eqx_seq.LanguageModel(11, width=8, mixer=make, dropout=0.1, key=getkey())
    with pytest.raises(ValueError, match="or a function `key ->"):
        eqx_seq.LanguageModel(11, width=8, mixer="gru", key=getkey())
