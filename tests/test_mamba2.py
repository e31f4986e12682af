"""`Mamba2` and `Mamba2Block`: against the layer's equations in float64 NumPy (the
in-projection's split, the convolution, the SSD recurrence step by step, the gated
RMS norm per group), step mode, streaming, resets, backends and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.test_util import check_grads
from test_ssd import numpy_loop

import eqx_seq


def silu(x):
    return x / (1 + np.exp(-x))


def mamba2_reference(layer: eqx_seq.Mamba2, x, reset=None):
    """The Mamba-2 layer's equations in float64 NumPy, from its parameters; each
    segment of `reset` run on its own."""
    if reset is not None:
        starts = [*np.flatnonzero(reset), len(x)]
        if starts[0] != 0:
            starts = [0, *starts]
        return np.concatenate(
            [mamba2_reference(layer, x[a:b]) for a, b in zip(starts, starts[1:])]
        )
    w = {k: np.asarray(v, np.float64) for k, v in {
        "in": layer.in_proj, "conv_w": layer.conv.weight, "conv_b": layer.conv.bias,
        "dt_b": layer.dt_bias, "A_log": layer.A_log, "D": layer.D,
        "norm": layer.norm_weight, "out": layer.out_proj,
    }.items()}  # fmt: skip
    x = np.asarray(x, np.float64)
    T, E, K = len(x), layer.channels, layer.conv.kernel_size
    G, N, P, heads = layer.ngroups, layer.state_size, layer.head_dim, layer.heads
    proj = x @ w["in"].T
    z, xbc, dt = (
        proj[:, :E],
        proj[:, E : 2 * E + 2 * G * N],
        proj[:, 2 * E + 2 * G * N :],
    )
    padded = np.concatenate([np.zeros((K - 1, xbc.shape[1])), xbc])
    conv = np.stack(
        [w["conv_b"] + np.sum(w["conv_w"] * padded[t : t + K], 0) for t in range(T)]
    )
    xbc = silu(conv)
    xs = xbc[:, :E].reshape(T, heads, P)
    B = xbc[:, E : E + G * N].reshape(T, G, N)
    C = xbc[:, E + G * N :].reshape(T, G, N)
    y, _ = numpy_loop(
        xs, dt, -np.exp(w["A_log"]), B, C, w["D"], dt_bias=w["dt_b"][None],
        dt_softplus=True, negative_decays=layer.negative_decays,
    )  # fmt: skip
    g = (y.reshape(T, E) * silu(z)).reshape(T, G, E // G)
    g = g / np.sqrt(np.mean(g**2, axis=-1, keepdims=True) + layer.norm_eps)
    return (g.reshape(T, E) * w["norm"]) @ w["out"].T


def _layer(key, **kw):
    kw = {"state_size": 3, "head_dim": 4, "ngroups": 2, "chunk_size": 5, **kw}
    return eqx_seq.Mamba2(8, dtype=jnp.float64, key=key, **kw)


def test_matches_numpy_and_every_form_agrees(getkey):
    """The parallel call (with and without resets) against the NumPy equations;
    step mode from `init_state()`, streaming in two chunks through `final_state`,
    and the associative backend against it: one compiled program of each."""
    key = getkey()
    layer = _layer(key)
    T = 23
    x = jr.normal(getkey(), (T, 8), jnp.float64)
    reset = jnp.zeros(T, bool).at[jnp.array([7, 8, 15])].set(True)
    assoc = eqx.tree_at(lambda m: m.scan, layer, eqx_seq.AssociativeScan())

    @eqx.filter_jit
    def forms(layer, assoc, x, reset):
        y, y_reset = layer(x), layer(x, reset=reset)
        state = layer.final_state(x[:11], reset=reset[:11])
        streamed = layer(x[11:], reset=reset[11:], h0=state)

        def step(state, row):
            x_t, reset_t = row
            return layer.step(state, x_t, reset=reset_t)

        final, stepped = jax.lax.scan(step, layer.init_state(), (x, reset))
        whole = layer.final_state(x, reset=reset)
        return y, y_reset, streamed, stepped, final, whole, assoc(x, reset=reset)

    y, y_reset, streamed, stepped, final, whole, y_assoc = forms(layer, assoc, x, reset)
    tol = dict(rtol=1e-9, atol=1e-11)
    negative = _layer(key, negative_decays=True)  # the same parameters
    outputs = forms(negative, assoc, x, reset)
    y_negative, stepped_negative = outputs[0], outputs[3]
    np.testing.assert_allclose(y, mamba2_reference(layer, x), **tol)
    np.testing.assert_allclose(y_reset, mamba2_reference(layer, x, reset), **tol)
    np.testing.assert_allclose(streamed, y_reset[11:], **tol)
    np.testing.assert_allclose(stepped, y_reset, **tol)
    for a, b in zip(final, whole):
        np.testing.assert_allclose(a, b, **tol)
    np.testing.assert_allclose(y_assoc, y_reset, **tol)
    # decays in (-1, 1): the parallel call against NumPy, and step mode
    np.testing.assert_allclose(y_negative, mamba2_reference(negative, x), **tol)
    assert not np.allclose(y_negative, y)
    np.testing.assert_allclose(
        stepped_negative, mamba2_reference(negative, x, reset), **tol
    )


def test_gradients_match_finite_differences(getkey):
    layer = _layer(getkey(), chunk_size=4)
    x = jr.normal(getkey(), (9, 8), jnp.float64)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    loss = lambda p, x: jnp.sum(jnp.sin(eqx.combine(p, static)(x)))
    check_grads(
        jax.jit(loss), (params, x), order=1, modes=("rev",), eps=1e-6, atol=1e-6
    )


def test_initialisation(getkey):
    layer = eqx_seq.Mamba2(
        32, state_size=8, head_dim=16, A_init_range=(2, 4), dt_min=1e-3,
        dt_max=1e-1, key=getkey(),
    )  # fmt: skip
    assert layer.channels == 64 and layer.heads == 4
    A = np.exp(layer.A_log)
    assert np.all((A >= 2 * (1 - 1e-6)) & (A <= 4 * (1 + 1e-6)))
    dt = jax.nn.softplus(layer.dt_bias)
    assert jnp.all((dt >= 1e-3 * (1 - 1e-6)) & (dt <= 1e-1 * (1 + 1e-6)))
    np.testing.assert_array_equal(layer.D, 1.0)
    np.testing.assert_array_equal(layer.norm_weight, 1.0)
    assert layer.in_proj.shape == (2 * 64 + 2 * 8 + 4, 32)
    # the decay parameters are the recurrence's (no weight decay)
    labels = eqx_seq.ssm_param_labels(eqx_seq.Mamba2Block(layer))
    assert (labels.mamba.A_log, labels.mamba.D, labels.mamba.dt_bias) == ("ssm",) * 3
    assert labels.mamba.in_proj == "regular"


@pytest.mark.parametrize("layer_class", ["Mamba2", "GatedDeltaNet"])
def test_stratified_decays(layer_class):
    """`decay_init="stratified"` keeps the independent draw's `exp(A_log)` and puts
    the heads' decay rates `exp(A_log) softplus(dt_bias)` one in each equal slice
    of `[low dt_min, high dt_max]` on a log scale, in an order that varies with
    the key."""
    make = getattr(eqx_seq, layer_class)
    sizes = (
        {"state_size": 4, "head_dim": 4}  # 8 heads
        if layer_class == "Mamba2"
        else {"num_heads": 2, "num_v_heads": 8, "head_dim": 4}
    )
    ranges = {"A_init_range": (2.0, 5.0), "dt_min": 1e-3, "dt_max": 0.2}
    low, high = np.log(2.0 * 1e-3), np.log(5.0 * 0.2)
    slowest = set()
    for seed in range(4):
        layer, independent = (
            make(16, **sizes, **ranges, decay_init=init, key=jr.key(seed))
            for init in ("stratified", "independent")
        )
        np.testing.assert_array_equal(layer.A_log, independent.A_log)
        rate = np.exp(layer.A_log) * jax.nn.softplus(layer.dt_bias)
        where = (np.log(rate) - low) / (high - low) * 8
        assert np.all((where > -1e-9) & (where < 8 + 1e-9))
        np.testing.assert_array_equal(np.sort(np.floor(where)), np.arange(8))
        slowest.add(int(np.argmin(rate)))
    assert len(slowest) > 1


# slow tier: Mamba2Block's call and step run in test_packed.py (test_stacked_blocks_
# keep_documents_apart[Mamba2Block], test_step_mode_restarts_like_the_parallel_call
# [Mamba2Block]), a float32 Mamba-2 and its block in test_edge_cases.py's test_
# integer_input_is_cast_as_the_real_annotations_promise
@pytest.mark.slow
def test_block_and_half_precision(getkey):
    layer = _layer(getkey())
    assert eqx_seq.Mamba2Block(layer).norm.bias is None  # RMS: a scale, no bias
    block = eqx_seq.Mamba2Block(layer, norm="layer")
    x = jr.normal(getkey(), (8, 8), jnp.float64)
    norm = jax.vmap(block.norm)(x)
    np.testing.assert_allclose(block(x), x + layer(norm), rtol=1e-12)
    state, y_t = block.step(block.init_state(), x[0])
    np.testing.assert_allclose(y_t, block(x[:1])[0], rtol=1e-10)
    single = eqx_seq.Mamba2(
        8, state_size=3, head_dim=4, dtype=jnp.float32, key=getkey()
    )
    half = single(x.astype(jnp.bfloat16))
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(
        half, single(x.astype(jnp.bfloat16).astype(jnp.float32)), rtol=1e-6
    )


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input(getkey):
    with pytest.raises(ValueError, match="`head_dim` must divide the 12 channels"):
        eqx_seq.Mamba2(6, head_dim=5, key=getkey())
    with pytest.raises(ValueError, match="`ngroups` must divide the 3 heads"):
        eqx_seq.Mamba2(6, head_dim=4, ngroups=2, key=getkey())
    with pytest.raises(ValueError, match="0 <= low <= high"):
        eqx_seq.Mamba2(6, head_dim=4, dt_limit=(1.0, 0.5), key=getkey())
    with pytest.raises(ValueError, match="Need dt_min < dt_max"):
        eqx_seq.Mamba2(6, head_dim=4, dt_min=0.1, dt_max=0.01, key=getkey())
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.Mamba2(6, head_dim=4, dtype=jnp.float16, key=getkey())
    for bad in [(1.0,), 1.0, "12", (1.0, 2.0, 3.0, 4.0), ("a", 2.0), None]:
        with pytest.raises(ValueError, match=r"`A_init_range` must be a tuple \(low"):
            eqx_seq.Mamba2(6, head_dim=4, A_init_range=bad, key=getkey())
    with pytest.raises(ValueError, match=r"\(low = 0.0\)"):
        eqx_seq.Mamba2(6, head_dim=4, A_init_range=(0.0, 1.0), key=getkey())
    with pytest.raises(ValueError, match="low <= high"):
        eqx_seq.Mamba2(6, head_dim=4, A_init_range=(2.0, 1.0), key=getkey())
    for bad in ["uniform", None, True]:
        with pytest.raises(ValueError, match="`decay_init` must be one of"):
            eqx_seq.Mamba2(6, head_dim=4, decay_init=bad, key=getkey())
    layer = _layer(getkey())
    with pytest.raises(ValueError, match="use `jax.vmap` for a batch"):
        layer(jnp.ones((2, 5, 8)))
    with pytest.raises(ValueError, match=r"shape \(T, H\) = \(T, 8\)"):
        layer(jnp.ones((5, 4)))
    with pytest.raises(ValueError, match="`reset` marks segment starts"):
        layer(jnp.ones((5, 8)), reset=jnp.zeros(4, bool))
    with pytest.raises(ValueError, match=r"`Mamba2`: the state must be a pair"):
        layer(jnp.ones((5, 8)), h0=jnp.zeros(3))
    with pytest.raises(ValueError, match=r"got float64 of shape \(3,\)"):
        layer.step((jnp.zeros(3), jnp.zeros((4, 4, 3))), jnp.ones(8))
    with pytest.raises(ValueError, match=r"takes one real input of shape"):
        layer.step(layer.init_state(), jnp.ones(5))
    with pytest.raises(ValueError, match=r"`Mamba2.step` needs a real input"):
        layer.step(layer.init_state(), jnp.ones(8, jnp.complex64))
    with pytest.raises(ValueError, match="must be a bool scalar"):
        layer.step(layer.init_state(), jnp.ones(8), reset=1)
    with pytest.raises(ValueError, match="must be an `eqx_seq.Mamba2`"):
        eqx_seq.Mamba2Block(eqx_seq.Mamba(8, key=getkey()))
    block = eqx_seq.Mamba2Block(layer)
    with pytest.raises(ValueError, match=r"`Mamba2Block.step`: `state` must be"):
        block.step(jnp.zeros(3), jnp.ones(8))
