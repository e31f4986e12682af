"""RGLRU and HawkBlock against a float64 NumPy loop of Griffin's equations."""

import math

import beartype
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import scipy.linalg
from helpers import directional_derivative, directional_fd
from jaxtyping import jaxtyped, TypeCheckError

import eqx_seq
from eqx_seq._ssm._rglru import sqrt_bounded_derivative


SCANS = [eqx_seq.SequentialScan(), eqx_seq.AssociativeScan()]
N, T = 6, 11
W, L = 4, 6  # HawkBlock width and lru_width


def f64(x):
    return np.asarray(x, np.float64)


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def gelu(z):  # tanh approximation, as `jax.nn.gelu`'s default
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


def rglru_reference(layer, x, reset=None, h0=None):
    """Griffin's RG-LRU, one step at a time, with dense block-diagonal gates."""
    x = f64(x)
    Wa = scipy.linalg.block_diag(*f64(layer.a_gate_weight))
    Wx = scipy.linalg.block_diag(*f64(layer.input_gate_weight))
    ba, bx = f64(layer.a_gate_bias).ravel(), f64(layer.input_gate_bias).ravel()
    softplus = np.log1p(np.exp(f64(layer.a_param)))
    h = np.zeros(x.shape[1]) if h0 is None else f64(h0)
    y = np.zeros_like(x)
    for t in range(len(x)):
        r, i = sigmoid(x[t] @ Wa + ba), sigmoid(x[t] @ Wx + bx)
        a = np.exp(-layer.c * r * softplus)
        if layer.negative_decays:
            a = 2 * a - 1
        if reset is not None and reset[t]:
            h = i * x[t]
        else:
            h = a * h + np.sqrt(1 - a**2) * (i * x[t])
        y[t] = h
    return y


def hawk_reference(block, x, reset=None, h0=None):
    """Griffin's residual block: the convolution as a loop over a window that a
    reset empties."""
    x = f64(x)

    def linear(layer, z):
        return z @ f64(layer.weight).T + f64(layer.bias)

    def rms(norm, z):
        return (
            z / np.sqrt(np.mean(z**2, -1, keepdims=True) + norm.eps) * f64(norm.weight)
        )

    z = rms(block.norm, x)
    gate, u = gelu(linear(block.gate_proj, z)), linear(block.in_proj, z)
    K = block.conv.kernel_size
    window = np.zeros((K - 1, L)) if h0 is None else f64(h0[0])
    v = np.zeros_like(u)
    for t in range(len(x)):
        if reset is not None and reset[t]:
            window = np.zeros_like(window)
        window = np.concatenate([window, u[t][None]])
        v[t] = f64(block.conv.bias) + np.sum(f64(block.conv.weight) * window, 0)
        window = window[1:]
    h = rglru_reference(block.rglru, v, reset, None if h0 is None else h0[1])
    x = x + linear(block.out_proj, gate * h)
    z = rms(block.mlp_norm, x)
    hidden = gelu(linear(block.mlp_gate, z)) * linear(block.mlp_up, z)
    return x + linear(block.mlp_down, hidden)


def make_rglru(key, scan=eqx_seq.SequentialScan(), **kw):
    return eqx_seq.RGLRU(N, num_heads=2, scan=scan, dtype=jnp.float64, key=key, **kw)


def make_hawk(key, scan=eqx_seq.SequentialScan(), **kw):
    return eqx_seq.HawkBlock(
        W,
        lru_width=L,
        num_heads=3,
        conv_size=3,
        mlp_expansion=2,
        scan=scan,
        dtype=jnp.float64,
        key=key,
        **kw,
    )


def random_gates(layer, key):
    """Non-zero gate biases, so that the tests see them."""
    k1, k2 = jr.split(key)
    return eqx.tree_at(
        lambda m: (m.a_gate_bias, m.input_gate_bias),
        layer,
        (
            jr.normal(k1, layer.a_gate_bias.shape, jnp.float64),
            jr.normal(k2, layer.input_gate_bias.shape, jnp.float64),
        ),
    )


RESET = np.zeros(T, bool)
RESET[[4, 5, 9]] = True  # segments of lengths 4, 1, 4, 2 (the first has no reset)
RESET_AT_0 = RESET.copy()
RESET_AT_0[0] = True

CASES = [
    (None, False),
    (None, True),
    (RESET, False),
    (RESET, True),
    (RESET_AT_0, True),  # h0 ignored
]


# slow tier: the associative backend, whose values and gradients with resets equal
# the sequential one's in test_backends_agree_values_and_gradients[rglru] (and the
# loop's with negative decays in test_negative_decays)
@pytest.mark.parametrize(
    "scan",
    [SCANS[0], pytest.param(SCANS[1], marks=pytest.mark.slow)],
    ids=["sequential", "associative"],
)
@pytest.mark.parametrize("reset,with_h0", CASES)
def test_rglru_matches_numpy_loop(scan, reset, with_h0, getkey):
    layer = random_gates(make_rglru(getkey(), scan), getkey())
    x = jr.normal(getkey(), (T, N), jnp.float64)
    h0 = jr.normal(getkey(), (N,), jnp.float64) if with_h0 else None
    reset_ = None if reset is None else jnp.asarray(reset)
    y = layer(x, reset=reset_, h0=h0)
    expected = rglru_reference(layer, x, reset, h0)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        layer.final_state(x, reset=reset_, h0=h0), expected[-1], rtol=1e-12, atol=1e-12
    )
    if reset is RESET_AT_0:
        np.testing.assert_allclose(y, layer(x, reset=reset_), rtol=1e-14)


# slow tier: three of the five; the block against the loop without resets, and with
# resets and `h0`, in the fast tier (`h0` forgotten at a reset on step 0: test_rglru_
# matches_numpy_loop[reset4-True-sequential])
@pytest.mark.parametrize(
    "reset,with_h0",
    [
        pytest.param(*case, marks=[] if i in (0, 3) else [pytest.mark.slow])
        for i, case in enumerate(CASES)
    ],
)
def test_hawk_matches_numpy_loop(reset, with_h0, getkey):
    block = make_hawk(getkey())
    block = eqx.tree_at(lambda b: b.rglru, block, random_gates(block.rglru, getkey()))
    x = jr.normal(getkey(), (T, W), jnp.float64)
    h0 = (
        (
            jr.normal(getkey(), (2, L), jnp.float64),
            jr.normal(getkey(), (L,), jnp.float64),
        )
        if with_h0
        else None
    )
    reset_ = None if reset is None else jnp.asarray(reset)
    np.testing.assert_allclose(
        block(x, reset=reset_, h0=h0),
        hawk_reference(block, x, reset, h0),
        rtol=1e-10,
        atol=1e-12,
    )


def test_initialisation(getkey):
    layer = eqx_seq.RGLRU(
        4096, num_heads=512, c=8.0, a_min=0.8, a_max=0.99, key=getkey()
    )
    decay = np.exp(-8.0 * np.log1p(np.exp(f64(layer.a_param))))
    assert decay.min() >= 0.8 - 1e-12 and decay.max() <= 0.99 + 1e-12
    # uniform: the quartiles of U[0.8, 0.99]
    np.testing.assert_allclose(
        np.quantile(decay, [0.25, 0.5, 0.75]),
        [0.8475, 0.895, 0.9425],
        atol=0.01,
    )
    heads = eqx_seq.RGLRU(8, num_heads=4, key=getkey())
    assert heads.a_gate_weight.shape == heads.input_gate_weight.shape == (4, 2, 2)
    assert heads.a_gate_bias.shape == (4, 2)


# ------------------------------------------------------------------ gradients


def check_gradients(f, tree, key):
    """Every inexact leaf of `tree`, one at a time, along a random direction:
    `jax.grad` against central finite differences."""
    params, static = eqx.partition(tree, eqx.is_inexact_array)
    g = jax.jit(lambda p: f(eqx.combine(p, static)))
    grads = jax.grad(g)(params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jr.split(key, len(leaves))
    for i, leaf in enumerate(leaves):
        direction = jax.tree.unflatten(
            treedef,
            [
                jr.normal(keys[i], leaf.shape, leaf.dtype)
                if j == i
                else jnp.zeros_like(other)
                for j, other in enumerate(leaves)
            ],
        )
        fd = directional_fd(g, params, direction)
        exact = directional_derivative(grads, direction)
        np.testing.assert_allclose(exact, fd, rtol=1e-6, atol=1e-8)


def loss(layer, x, reset, h0):
    return jnp.sum(jnp.sin(3 * layer(x, reset=reset, h0=h0)))


# slow tier: without resets; the row with resets runs the same derivatives and the
# reset's
@pytest.mark.parametrize(
    "with_reset", [pytest.param(False, marks=pytest.mark.slow), True]
)
def test_rglru_gradients_match_finite_differences(with_reset, getkey):
    layer = random_gates(make_rglru(getkey()), getkey())
    x = jr.normal(getkey(), (T, N), jnp.float64)
    h0 = jr.normal(getkey(), (N,), jnp.float64)
    reset = jnp.asarray(RESET) if with_reset else None
    check_gradients(lambda t: loss(t[0], t[1], reset, t[2]), (layer, x, h0), getkey())


def test_negative_decays(getkey):
    """Decays `2a - 1`: values against the loop, step mode, both backends, and the
    gradients against finite differences; the decays do reach below zero."""
    kw = dict(negative_decays=True, a_min=1e-4, a_max=0.5)
    layer = random_gates(make_rglru(getkey(), **kw), getkey())
    x = jr.normal(getkey(), (T, N), jnp.float64)
    h0 = jr.normal(getkey(), (N,), jnp.float64)
    reset = jnp.asarray(RESET)
    a, _ = layer._coefficients(x)
    assert (a < 0).any() and (a > 0).any()
    expected = rglru_reference(layer, x, RESET, h0)
    assoc = eqx.tree_at(lambda m: m.scan, layer, eqx_seq.AssociativeScan())
    for model in (layer, assoc):
        np.testing.assert_allclose(
            model(x, reset=reset, h0=h0), expected, rtol=1e-12, atol=1e-12
        )
    np.testing.assert_allclose(
        run_steps(layer, x, RESET, h0)[1], expected, rtol=1e-12, atol=1e-12
    )
    check_gradients(lambda t: loss(t[0], t[1], reset, t[2]), (layer, x, h0), getkey())


# slow tier: the RG-LRU's gradients are checked against finite differences by
# test_rglru_gradients_match_finite_differences[True] (with resets and `h0`); the
# block's are of the same layer inside JAX-differentiated projections and
# convolution, and agree between the backends in test_backends_agree_values_and_
# gradients (slow for the block)
@pytest.mark.slow
def test_hawk_gradients_match_finite_differences(getkey):
    block = make_hawk(getkey())
    x = jr.normal(getkey(), (T, W), jnp.float64)
    h0 = (
        jr.normal(getkey(), (2, L), jnp.float64),
        jr.normal(getkey(), (L,), jnp.float64),
    )
    reset = jnp.asarray(RESET)
    check_gradients(lambda t: loss(t[0], t[1], reset, t[2]), (block, x, h0), getkey())


def test_sqrt_derivative_is_capped_near_zero():
    grad = jax.vmap(jax.grad(sqrt_bounded_derivative))
    x = jnp.array([0.25, 1e-4, 2.5e-7, 1e-12, 0.0])
    np.testing.assert_allclose(grad(x), [1.0, 50.0, 1000.0, 1000.0, 1000.0], rtol=1e-12)
    np.testing.assert_allclose(sqrt_bounded_derivative(x), jnp.sqrt(x), rtol=1e-15)


@pytest.mark.parametrize("where", ["softplus", "gate"])
def test_gradients_stay_finite_as_the_decay_reaches_one(where, getkey):
    layer = make_rglru(getkey())
    if where == "softplus":  # softplus(a_param) -> 0
        layer = eqx.tree_at(lambda m: m.a_param, layer, jnp.full(N, -800.0))
    else:  # r_t -> 0
        layer = eqx.tree_at(lambda m: m.a_gate_bias, layer, jnp.full((2, 3), -800.0))
    x = jr.normal(getkey(), (T, N), jnp.float64)
    h0 = jr.normal(getkey(), (N,), jnp.float64)
    for reset in [None, jnp.asarray(RESET)]:
        y = layer(x, reset=reset, h0=h0)
        # a_t = 1 and no input: the state is held
        if reset is None:
            np.testing.assert_allclose(y, jnp.broadcast_to(h0, (T, N)), rtol=1e-14)
        grads = eqx.filter_grad(loss)(layer, x, reset, h0)
        for leaf in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)):
            assert jnp.all(jnp.isfinite(leaf))
        gx = jax.grad(loss, argnums=1)(layer, x, reset, h0)
        assert jnp.all(jnp.isfinite(gx))


# ------------------------------------------------- step, chunks, backends, resets


# the kinds, the block's row in the slow tier (the reason is given at each use)
KINDS_HAWK_SLOW = ["rglru", pytest.param("hawk", marks=pytest.mark.slow)]


def run_steps(layer, x, reset, state):
    outs = []
    for t in range(len(x)):
        state, y = layer.step(state, x[t], reset=bool(reset[t]))
        outs.append(y)
    return state, jnp.stack(outs)


# slow tier: without resets; the rows with a reset on step 0 step the same layers
@pytest.mark.parametrize("kind", ["rglru", "hawk"])
@pytest.mark.parametrize(
    "reset", [pytest.param(None, marks=pytest.mark.slow), RESET_AT_0]
)
def test_step_equals_the_parallel_call(kind, reset, getkey):
    layer = make_rglru(getkey()) if kind == "rglru" else make_hawk(getkey())
    size = N if kind == "rglru" else W
    x = jr.normal(getkey(), (T, size), jnp.float64)
    reset_ = None if reset is None else jnp.asarray(reset)
    state, ys = run_steps(
        layer, x, np.zeros(T, bool) if reset is None else reset, layer.init_state()
    )
    np.testing.assert_allclose(ys, layer(x, reset=reset_), rtol=1e-10, atol=1e-12)
    for a, b in zip(
        jax.tree.leaves(state), jax.tree.leaves(layer.final_state(x, reset=reset_))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# slow tier: all but the RG-LRU split at a segment start (4); the block's state
# (`final_state`, and `h0`) is checked by test_step_equals_the_parallel_call
# [reset1-hawk] and test_hawk_matches_numpy_loop[reset3-True]
@pytest.mark.parametrize("kind", KINDS_HAWK_SLOW)
@pytest.mark.parametrize(
    "split",
    [
        pytest.param(2, marks=pytest.mark.slow),
        4,
        pytest.param(5, marks=pytest.mark.slow),
        pytest.param(7, marks=pytest.mark.slow),
    ],
)  # 4, 5 at a segment start
def test_chunks_with_the_state_carried_equal_one_call(kind, split, getkey):
    layer = make_rglru(getkey()) if kind == "rglru" else make_hawk(getkey())
    size = N if kind == "rglru" else W
    x = jr.normal(getkey(), (T, size), jnp.float64)
    for reset in [None, jnp.asarray(RESET)]:
        r1, r2 = (None, None) if reset is None else (reset[:split], reset[split:])
        state = layer.final_state(x[:split], reset=r1)
        y = jnp.concatenate(
            [layer(x[:split], reset=r1), layer(x[split:], reset=r2, h0=state)]
        )
        np.testing.assert_allclose(y, layer(x, reset=reset), rtol=1e-10, atol=1e-12)
        final = layer.final_state(x[split:], reset=r2, h0=state)
        for a, b in zip(
            jax.tree.leaves(final), jax.tree.leaves(layer.final_state(x, reset=reset))
        ):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# slow tier: the block, whose recurrence is the RG-LRU's (the rest runs no scan)
@pytest.mark.parametrize("kind", KINDS_HAWK_SLOW)
def test_backends_agree_values_and_gradients(kind, getkey):
    key = getkey()
    size = N if kind == "rglru" else W
    x = jr.normal(getkey(), (T, size), jnp.float64)
    reset = jnp.asarray(RESET)
    results = []
    for scan in SCANS:
        layer = make_rglru(key, scan) if kind == "rglru" else make_hawk(key, scan)
        results.append(
            (layer(x, reset=reset), eqx.filter_grad(loss)(layer, x, reset, None))
        )
    (y1, g1), (y2, g2) = results
    np.testing.assert_allclose(y1, y2, rtol=1e-12, atol=1e-13)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(g1, eqx.is_array)),
        jax.tree.leaves(eqx.filter(g2, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# slow tier: the block, whose resets (convolution included) are checked against the
# loop by test_hawk_matches_numpy_loop[reset3-True] and with a NaN in a document by
# test_packed.py's test_step_mode_restarts_like_the_parallel_call[HawkBlock]
@pytest.mark.parametrize("kind", KINDS_HAWK_SLOW)
def test_reset_equals_separate_calls_on_each_segment(kind, getkey):
    layer = make_rglru(getkey()) if kind == "rglru" else make_hawk(getkey())
    size = N if kind == "rglru" else W
    x = jr.normal(getkey(), (T, size), jnp.float64)
    h0 = layer.final_state(jr.normal(getkey(), (5, size), jnp.float64))
    packed = layer(x, reset=jnp.asarray(RESET), h0=h0)
    starts = [0, *np.flatnonzero(RESET), T]
    for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        # each segment on its own, from its own start (the first from h0)
        alone = layer(x[s:e], reset=jnp.asarray(RESET[s:e]), h0=h0 if i == 0 else None)
        np.testing.assert_allclose(packed[s:e], alone, rtol=1e-12, atol=1e-13)
    # and a segment start differs from no reset: the mask is not ignored
    assert not np.allclose(packed, layer(x, h0=h0))


# ------------------------------------------------------------- transformations


# slow tier: the block, whose float32 parameters, half-precision input, `vmap` and
# `jit` are those of the RG-LRU inside it (the fast row); its step mode is checked by
# test_step_equals_the_parallel_call[reset1-hawk]
@pytest.mark.parametrize("kind", KINDS_HAWK_SLOW)
def test_vmap_jit_and_dtypes(kind, getkey):
    size = N if kind == "rglru" else W
    build = (
        (lambda k: eqx_seq.RGLRU(N, num_heads=3, dtype=jnp.float32, key=k))
        if kind == "rglru"
        else (lambda k: eqx_seq.HawkBlock(W, dtype=jnp.float32, key=k))
    )
    layer = build(getkey())
    x = jr.normal(getkey(), (3, T, size), jnp.float32)
    resets = jr.bernoulli(getkey(), 0.3, (3, T))
    y = eqx.filter_jit(jax.vmap(lambda x, r: layer(x, reset=r)))(x, resets)
    assert y.shape == (3, T, size) and y.dtype == jnp.float32
    np.testing.assert_allclose(y[1], layer(x[1], reset=resets[1]), rtol=1e-5, atol=1e-6)
    # half-precision inputs compute in float32, float64 inputs in float64
    assert layer(x[0].astype(jnp.float16)).dtype == jnp.float32
    assert layer(x[0].astype(jnp.float64)).dtype == jnp.float64
    # step mode under `lax.scan` (generation): the state keeps its dtypes
    state, ys = jax.lax.scan(
        lambda s, x_t: layer.step(s, x_t), layer.init_state(), x[0]
    )
    np.testing.assert_allclose(ys, layer(x[0]), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------- bad input


@pytest.mark.usefixtures("unchecked_annotations")
def test_rglru_bad_input(getkey):
    layer = make_rglru(getkey())
    x = jnp.ones((T, N))
    with pytest.raises(ValueError, match=r"\(T, 6\)"):
        layer(jnp.ones((T, N + 1)))
    with pytest.raises(ValueError, match="vmap"):
        layer(jnp.ones((2, T, N)))
    with pytest.raises(ValueError, match="T >= 1"):
        layer(jnp.ones((0, N)))
    for dtype in (jnp.complex64, jnp.bool_):  # integers are cast (test_edge_cases)
        with pytest.raises(ValueError, match="real input"):
            layer(jnp.ones((T, N), dtype))
    with pytest.raises(ValueError, match="reset"):
        layer(x, reset=jnp.zeros(T - 1, bool))
    with pytest.raises(ValueError, match="reset"):
        layer(x, reset=jnp.zeros(T))  # not bool
    with pytest.raises(ValueError, match="h0"):
        layer(x, h0=jnp.zeros(N + 1))
    with pytest.raises(ValueError, match="negative_decays"):
        make_rglru(getkey(), negative_decays=1)
    with pytest.raises(ValueError, match="h0"):
        layer.final_state(x, h0=jnp.zeros(N, jnp.complex128))
    with pytest.raises(ValueError, match="step"):
        layer.step(layer.init_state(), jnp.ones(N + 1))
    with pytest.raises(ValueError, match="reset"):
        layer.step(layer.init_state(), jnp.ones(N), reset=jnp.zeros(2, bool))
    with pytest.raises(ValueError, match="`state` must be a real array"):
        layer.step(jnp.zeros(N + 1), jnp.ones(N))
    for state in [None, (jnp.zeros(N),)]:
        with pytest.raises(ValueError, match="`state` must be a real array"):
            layer.step(state, jnp.ones(N))
    with pytest.raises(ValueError, match="divide"):
        eqx_seq.RGLRU(6, num_heads=4, key=getkey())
    with pytest.raises(ValueError, match="positive int"):
        eqx_seq.RGLRU(0, key=getkey())
    with pytest.raises(ValueError, match="positive int"):
        eqx_seq.RGLRU(6, num_heads=0, key=getkey())
    for a_min, a_max in [(0.0, 0.5), (0.9, 0.9), (0.5, 1.0), (0.99, 0.9)]:
        with pytest.raises(ValueError, match="a_min"):
            eqx_seq.RGLRU(6, a_min=a_min, a_max=a_max, key=getkey())
    for bad in [math.nan, math.inf]:
        with pytest.raises(ValueError, match="finite"):
            eqx_seq.RGLRU(6, a_max=bad, key=getkey())
        with pytest.raises(ValueError, match="finite"):
            eqx_seq.RGLRU(6, c=bad, key=getkey())
    with pytest.raises(ValueError, match="positive"):
        eqx_seq.RGLRU(6, c=0.0, key=getkey())
    with pytest.raises(ValueError, match="scan"):
        eqx_seq.RGLRU(6, scan="sequential", key=getkey())
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.RGLRU(6, dtype=jnp.float16, key=getkey())


@pytest.mark.usefixtures("unchecked_annotations")
def test_hawk_bad_input(getkey):
    block = make_hawk(getkey())
    # Griffin's norms: epsilon 1e-6 unless asked otherwise
    assert block.norm.eps == block.mlp_norm.eps == 1e-6
    assert eqx_seq.HawkBlock(W, norm_eps=1e-5, key=getkey()).norm.eps == 1e-5
    with pytest.raises(ValueError, match="`norm_eps` must be a finite positive"):
        eqx_seq.HawkBlock(W, norm_eps=0.0, key=getkey())
    x = jnp.ones((T, W))
    with pytest.raises(ValueError, match=r"\(T, 4\)"):
        block(jnp.ones((T, W + 1)))
    with pytest.raises(ValueError, match="vmap"):
        block(jnp.ones(W))
    with pytest.raises(ValueError, match="real input"):
        block(jnp.ones((T, W), jnp.complex64))
    with pytest.raises(ValueError, match="reset"):
        block(x, reset=jnp.zeros(T + 1, bool))
    with pytest.raises(ValueError, match="tuple"):
        block(x, h0=jnp.zeros(L))
    with pytest.raises(ValueError, match=r"h0\[0\]"):
        block(x, h0=(jnp.zeros((3, L)), jnp.zeros(L)))
    with pytest.raises(ValueError, match=r"h0\[1\]"):
        block.final_state(x, h0=(jnp.zeros((2, L)), jnp.zeros(L + 1)))
    with pytest.raises(ValueError, match="step"):
        block.step(block.init_state(), jnp.ones(W + 1))
    with pytest.raises(ValueError, match="reset"):
        block.step(block.init_state(), jnp.ones(W), reset=1)
    with pytest.raises(ValueError, match=r"state\[1\]"):
        block.step((jnp.zeros((2, L)), jnp.zeros(W)), jnp.ones(W))
    with pytest.raises(ValueError, match="divide"):
        eqx_seq.HawkBlock(4, num_heads=3, key=getkey())
    for name in ["width", "lru_width", "conv_size", "mlp_expansion"]:
        kwargs = {"width": 4, name: 0}
        with pytest.raises(ValueError, match=name):
            eqx_seq.HawkBlock(**kwargs, key=getkey())
    with pytest.raises(ValueError, match="scan"):
        eqx_seq.HawkBlock(4, scan=None, key=getkey())
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.HawkBlock(4, dtype=jnp.bfloat16, key=getkey())


def test_annotations_hold(getkey):
    def checked(fn):
        return jaxtyped(typechecker=beartype.beartype)(fn)

    reset = jnp.zeros(T, bool).at[3].set(True)
    layer = make_rglru(getkey())
    x = jnp.ones((T, N))
    assert checked(type(layer).__call__)(layer, x, reset=reset, h0=jnp.ones(N)).shape
    assert checked(type(layer).final_state)(layer, x, reset=reset).shape == (N,)
    state = checked(type(layer).init_state)(layer)
    assert checked(type(layer).step)(layer, state, x[0], reset=True)[1].shape == (N,)
    block = make_hawk(getkey())
    x = jnp.ones((T, W))
    state = checked(type(block).init_state)(block)
    assert checked(type(block).__call__)(block, x, reset=reset, h0=state).shape
    assert jax.tree.map(jnp.shape, checked(type(block).final_state)(block, x)) == (
        (2, L),
        (L,),
    )
    assert checked(type(block).step)(block, state, x[0])[1].shape == (W,)
    with pytest.raises(TypeCheckError):  # the checker is live
        checked(type(block).step)(block, (state[1], state[0]), x[0])


# slow tier: width 2; the degenerate width 1 (no state carried) stays fast
@pytest.mark.parametrize("conv_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_hawk_short_convolutions(conv_size, getkey):
    block = eqx_seq.HawkBlock(
        W, lru_width=L, conv_size=conv_size, dtype=jnp.float64, key=getkey()
    )
    x = jr.normal(getkey(), (T, W), jnp.float64)
    reset = jnp.asarray(RESET_AT_0)
    np.testing.assert_allclose(
        block(x, reset=reset), hawk_reference(block, x, RESET_AT_0), rtol=1e-10
    )
    _, ys = run_steps(block, x, RESET_AT_0, block.init_state())
    np.testing.assert_allclose(ys, block(x, reset=reset), rtol=1e-10, atol=1e-12)
