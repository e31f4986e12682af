"""S5 and LRU against a float64 NumPy loop built from the textbook formulas."""

import itertools as it

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import directional_derivative, directional_fd

import eqx_seq
from eqx_seq._ssm._s5 import hippo_normal_eigens


SCANS = [eqx_seq.SequentialScan(), eqx_seq.AssociativeScan()]
H, T = 3, 13


def pairs(x):
    x = np.asarray(x, np.float64)
    return x[..., 0] + 1j * x[..., 1]


def reference(layer, u, dt=None, h0=None):
    """Discretise with the textbook formulas and run the recurrence in a loop."""
    u = np.asarray(u, np.float64)
    steps = np.ones(len(u)) if dt is None else np.asarray(dt, np.float64)
    B, C, D = pairs(layer.B), pairs(layer.C), np.asarray(layer.D, np.float64)

    def coefficients(dt_t):
        if isinstance(layer, eqx_seq.LRU):
            lam = np.exp(-np.exp(layer.nu_log) + 1j * np.exp(layer.theta_log))
            return lam, np.exp(np.asarray(layer.gamma_log, np.float64))
        re = np.asarray(layer.lambda_re, np.float64)
        if layer.clip_eigs:
            re = np.minimum(re, -1e-4)
        lam = re + 1j * np.asarray(layer.lambda_im, np.float64)
        delta = np.exp(np.asarray(layer.log_step, np.float64)) * layer.step_rescale
        delta = delta * dt_t
        if layer.discretisation == "zoh":
            bar = np.exp(lam * delta)
            return bar, (bar - 1) / lam
        return (1 + lam * delta / 2) / (1 - lam * delta / 2), delta / (
            1 - lam * delta / 2
        )

    scale = 2.0 if getattr(layer, "conj_sym", False) else 1.0
    h = np.zeros(B.shape[0], complex) if h0 is None else np.asarray(h0, complex)
    y = np.zeros_like(u)
    for t in range(len(u)):
        bar, gain = coefficients(steps[t])
        h = bar * h + gain * (B @ u[t])
        y[t] = scale * (C @ h).real + D * u[t]
    if layer.C_backward is not None:
        Cb = pairs(layer.C_backward)
        g = np.zeros(B.shape[0], complex)
        for t in reversed(range(len(u))):
            # backwards, step t decays over the interval to step t + 1
            bar, gain = coefficients(steps[min(t + 1, len(u) - 1)])
            g = bar * g + gain * (B @ u[t])
            y[t] += scale * (Cb @ g).real
    return y


def make(kind, key, scan=eqx_seq.SequentialScan(), **kw):
    if kind == "lru":
        return eqx_seq.LRU(H, 4, r_min=0.5, scan=scan, key=key, dtype=jnp.float64, **kw)
    return eqx_seq.S5(H, 8, blocks=2, scan=scan, key=key, dtype=jnp.float64, **kw)


S5_OPTIONS = [
    {},
    {"discretisation": "bilinear"},
    {"conj_sym": False},
    {"clip_eigs": True},
    {"bidirectional": True},
    {"step_rescale": 2.5, "dt_min": 0.05, "dt_max": 0.5},
]


# Every option with the sequential backend but `conj_sym=False` (the full system,
# equal to the conjugate-symmetric one in test_conj_sym_equals_the_full_conjugate_
# system); the associative backend on the default and bidirectional layers (the
# other options change only the coefficients, which the backend never sees;
# `test_backends_agree_values_and_gradients` compares both). The rest run with
# `-m slow`.
LOOP_CASES = [
    pytest.param(
        options,
        scan,
        marks=[]
        if (isinstance(scan, eqx_seq.SequentialScan) and options != {"conj_sym": False})
        or options in ({}, {"bidirectional": True})
        else [pytest.mark.slow],
    )
    for options, scan in it.product(S5_OPTIONS, SCANS)
]


@pytest.mark.parametrize("options,scan", LOOP_CASES, ids=str)
def test_s5_matches_numpy_loop(options, scan, getkey):
    layer = make("s5", getkey(), scan, **options)
    if layer.clip_eigs:  # make the clip bite
        layer = eqx.tree_at(
            lambda l: l.lambda_re, layer, layer.lambda_re.at[0].set(0.3)
        )
    u = jr.normal(getkey(), (T, H), jnp.float64)
    np.testing.assert_allclose(
        eqx.filter_jit(layer)(u), reference(layer, u), atol=1e-10
    )
    dt = jr.uniform(getkey(), (T,), jnp.float64, minval=0.2, maxval=3.0)
    np.testing.assert_allclose(layer(u, dt=dt), reference(layer, u, dt), atol=1e-10)


# slow tier: the two rows that repeat a backend; each backend runs once, one of them
# bidirectional
@pytest.mark.parametrize(
    "bidirectional,scan",
    [
        pytest.param(*case, marks=[] if i in (0, 3) else [pytest.mark.slow])
        for i, case in enumerate(it.product([False, True], SCANS))
    ],
)
def test_lru_matches_numpy_loop(bidirectional, scan, getkey):
    layer = make("lru", getkey(), scan, bidirectional=bidirectional)
    u = jr.normal(getkey(), (T, H), jnp.float64)
    np.testing.assert_allclose(layer(u), reference(layer, u), atol=1e-10)


@pytest.mark.parametrize("kind", ["s5", "lru"])
def test_h0_matches_numpy_loop(kind, getkey):
    layer = make(kind, getkey())
    u = jr.normal(getkey(), (T, H), jnp.float64)
    h0 = jr.normal(getkey(), (layer.num_states,), jnp.complex128)
    np.testing.assert_allclose(layer(u, h0=h0), reference(layer, u, h0=h0), atol=1e-10)


def test_hippo_normal_eigens():
    n = 6
    k = np.arange(n)
    q = np.sqrt(2 * k + 1)
    legs = -(np.tril(np.outer(q, q)) - np.diag(k))  # HiPPO-LegS, written out
    p = np.sqrt(k + 0.5)
    normal = legs + np.outer(p, p)
    lam, V = hippo_normal_eigens(n)
    np.testing.assert_allclose(normal @ V, V * lam[None], atol=1e-12)
    np.testing.assert_allclose(V.conj().T @ V, np.eye(n), atol=1e-12)
    np.testing.assert_allclose(lam.real, -0.5, atol=1e-12)
    np.testing.assert_allclose(np.sort(lam.imag), np.sort(-lam.imag), atol=1e-12)


def test_s5_initialisation(getkey):
    layer = eqx_seq.S5(4, 12, blocks=3, dt_min=0.01, dt_max=0.2, key=getkey())
    lam, _ = hippo_normal_eigens(4)
    np.testing.assert_allclose(layer.eigenvalues, np.tile(lam[:2], 3), rtol=1e-6)
    assert layer.eigenvalues.shape == (6,) and layer.num_states == 6
    assert np.all(np.exp(layer.log_step) >= 0.01 * (1 - 1e-6))
    assert np.all(np.exp(layer.log_step) <= 0.2 * (1 + 1e-6))
    full = eqx_seq.S5(4, 12, blocks=3, conj_sym=False, key=getkey())
    assert full.eigenvalues.shape == (12,)


def test_lru_initialisation(getkey):
    layer = eqx_seq.LRU(4, 500, r_min=0.4, r_max=0.9, max_phase=0.5, key=getkey())
    r = np.abs(np.asarray(layer.eigenvalues))
    assert r.min() >= 0.4 - 1e-6 and r.max() <= 0.9 + 1e-6
    assert r.min() < 0.45 and r.max() > 0.85  # spread over the ring
    phase = np.angle(np.asarray(layer.eigenvalues))
    assert phase.min() >= 0 and phase.max() <= 0.5 + 1e-6
    np.testing.assert_allclose(np.exp(layer.gamma_log), np.sqrt(1 - r**2), rtol=1e-5)
    # stable by construction, whatever the parameters
    wild = eqx.tree_at(lambda l: l.nu_log, layer, layer.nu_log - 30.0)
    assert np.all(np.abs(np.asarray(wild.eigenvalues)) <= 1)


def test_conj_sym_equals_the_full_conjugate_system(getkey):
    half = make("s5", getkey())
    full = make("s5", getkey(), conj_sym=False)

    full = eqx.tree_at(
        lambda l: (l.lambda_re, l.lambda_im, l.log_step, l.B, l.C),
        full,
        (
            jnp.concatenate([half.lambda_re, half.lambda_re]),
            jnp.concatenate([half.lambda_im, -half.lambda_im]),
            jnp.concatenate([half.log_step, half.log_step]),
            jnp.concatenate([half.B, half.B.at[..., 1].multiply(-1)], axis=0),
            jnp.concatenate([half.C, half.C.at[..., 1].multiply(-1)], axis=1),
        ),
    )
    full = eqx.tree_at(lambda l: l.D, full, half.D)
    u = jr.normal(getkey(), (T, H), jnp.float64)
    y = half(u)
    assert jnp.isrealobj(y)
    np.testing.assert_allclose(full(u), y, atol=1e-12)


# slow tier: the layers equal the linear, time-invariant reference loop in
# test_s5_matches_numpy_loop and test_lru_matches_numpy_loop
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s5", "lru"])
def test_linear_and_time_invariant(kind, getkey):
    layer = make(kind, getkey())
    u1, u2 = jr.normal(getkey(), (2, T, H), jnp.float64)
    np.testing.assert_allclose(
        layer(2.0 * u1 - 3.0 * u2), 2.0 * layer(u1) - 3.0 * layer(u2), atol=1e-10
    )
    delayed = jnp.concatenate([jnp.zeros((4, H)), u1])
    np.testing.assert_allclose(layer(delayed)[4:], layer(u1), atol=1e-10)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_causality(bidirectional, getkey):
    layer = make("s5", getkey(), bidirectional=bidirectional)
    u = jr.normal(getkey(), (T, H), jnp.float64)
    changed = layer(u.at[7].add(1.0)) - layer(u)
    assert np.all(np.abs(changed[7:]).max(axis=1) > 0)
    if bidirectional:
        assert np.all(np.abs(changed[:7]).max(axis=1) > 1e-8)
    else:
        assert np.all(changed[:7] == 0)


# slow tier: S5 without steps `dt`, a special case of the row with them
@pytest.mark.parametrize(
    "kind,with_dt",
    [pytest.param("s5", False, marks=pytest.mark.slow), ("s5", True), ("lru", False)],
)
def test_step_mode_and_streaming_equal_the_parallel_call(kind, with_dt, getkey):
    layer = make(kind, getkey(), eqx_seq.AssociativeScan())
    u = jr.normal(getkey(), (T, H), jnp.float64)
    dt = (
        jr.uniform(getkey(), (T,), jnp.float64, minval=0.5, maxval=2)
        if with_dt
        else None
    )
    y = layer(u, dt=dt)

    def body(state, inputs):
        u_t, dt_t = inputs
        return layer.step(state, u_t, dt=None if dt is None else dt_t)

    dts = jnp.ones(T) if dt is None else dt
    final, ys = jax.lax.scan(body, layer.init_state(), (u, dts))
    np.testing.assert_allclose(ys, y, atol=1e-10)
    np.testing.assert_allclose(final, layer.final_state(u, dt=dt), atol=1e-10)
    # chunks with the state carried = one call
    state, outs = None, []
    for lo, hi in [(0, 5), (5, 6), (6, T)]:
        part = None if dt is None else dt[lo:hi]
        outs.append(layer(u[lo:hi], dt=part, h0=state))
        state = layer.final_state(u[lo:hi], dt=part, h0=state)
    np.testing.assert_allclose(jnp.concatenate(outs), y, atol=1e-10)


def test_constant_dt_equals_default_and_rescale(getkey):
    layer = make("s5", getkey())
    u = jr.normal(getkey(), (T, H), jnp.float64)
    np.testing.assert_allclose(layer(u, dt=jnp.ones(T)), layer(u), atol=1e-12)
    # step_rescale is a uniform dt
    faster = eqx.tree_at(lambda l: l.step_rescale, layer, 2.0)
    np.testing.assert_allclose(faster(u), layer(u, dt=jnp.full(T, 2.0)), atol=1e-12)


def loss(layer, u, h0):
    return jnp.sum(jnp.sin(layer(u, h0=h0)))


# slow tier: S5, whose recurrence (and its derivatives) is the LRU's diagonal one;
# S5's values on both backends: test_s5_matches_numpy_loop
@pytest.mark.parametrize("kind", [pytest.param("s5", marks=pytest.mark.slow), "lru"])
def test_backends_agree_values_and_gradients(kind, getkey):
    key = getkey()
    u = jr.normal(getkey(), (T, H), jnp.float64)
    h0 = jr.normal(getkey(), (4,), jnp.complex128)
    results = []
    for scan in SCANS:
        layer = make(kind, key, scan)
        results.append((layer(u, h0=h0), eqx.filter_grad(loss)(layer, u, h0)))
    (y1, g1), (y2, g2) = results
    np.testing.assert_allclose(y1, y2, atol=1e-12)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(g1, eqx.is_array)),
        jax.tree.leaves(eqx.filter(g2, eqx.is_array)),
    ):
        np.testing.assert_allclose(a, b, atol=1e-10)


# slow tier: the bilinear discretisation (JAX's derivatives of its coefficients, whose
# values test_s5_matches_numpy_loop checks) and the bidirectional S5 (its reverse
# scan's derivatives: test_recurrence.py's test_gradients with `reverse`)
@pytest.mark.parametrize(
    "kind,options",
    [
        ("s5", {}),
        pytest.param("s5", {"discretisation": "bilinear"}, marks=pytest.mark.slow),
        pytest.param("s5", {"bidirectional": True}, marks=pytest.mark.slow),
        ("lru", {}),
    ],
)
def test_gradients_match_finite_differences(kind, options, getkey):
    layer = make(kind, getkey(), **options)
    u = jr.normal(getkey(), (T, H), jnp.float64)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    f = jax.jit(lambda p, u: loss(eqx.combine(p, static), u, None))
    grads = jax.grad(f)(params, u)
    leaves, treedef = jax.tree.flatten(params)
    for i, leaf in enumerate(leaves):
        # one leaf at a time: a random direction for it, zero for the others
        direction = jax.tree.unflatten(
            treedef,
            [
                jr.normal(getkey(), leaf.shape, leaf.dtype)
                if j == i
                else jnp.zeros_like(other)
                for j, other in enumerate(leaves)
            ],
        )
        fd = directional_fd(lambda p: f(p, u), params, direction)
        exact = directional_derivative(grads, direction)
        np.testing.assert_allclose(exact, fd, rtol=1e-6, atol=1e-7)
    # w.r.t. the input too
    du = jr.normal(getkey(), u.shape, u.dtype)
    fd = directional_fd(lambda u: f(params, u), u, du)
    np.testing.assert_allclose(
        directional_derivative(jax.grad(f, argnums=1)(params, u), du), fd, rtol=1e-6
    )


def test_gradient_wrt_h0_matches_finite_differences(getkey):
    layer = make("s5", getkey())
    u = jr.normal(getkey(), (T, H), jnp.float64)
    h0 = jr.normal(getkey(), (4,), jnp.complex128)
    f = jax.jit(lambda h0: loss(layer, u, h0))
    direction = jr.normal(getkey(), (4,), jnp.complex128)
    fd = directional_fd(f, h0, direction)
    # JAX's gradient of a real function of a complex input is the conjugate of the
    # direction of steepest ascent: the directional derivative is Re(vdot(g*, d)).
    g = jax.grad(f)(h0)
    np.testing.assert_allclose(directional_derivative(g, direction), fd, rtol=1e-6)


# slow tier: S5 without steps and `h0`, a special case of the row with them
@pytest.mark.parametrize(
    "kind,with_dt,with_h0",
    [
        pytest.param("s5", False, False, marks=pytest.mark.slow),
        ("s5", True, True),
        ("lru", False, True),
    ],
)
def test_parameter_jacobians_match_dense_jacfwd(kind, with_dt, with_h0, getkey):
    layer = make(kind, getkey(), eqx_seq.AssociativeScan())
    u = jr.normal(getkey(), (T, H), jnp.float64)
    dt = (
        jr.uniform(getkey(), (T,), jnp.float64, minval=0.5, maxval=2)
        if with_dt
        else None
    )
    h0 = jr.normal(getkey(), (4,), jnp.complex128) if with_h0 else None
    jac = layer.parameter_jacobians(u, dt=dt, h0=h0)
    h0_ = jnp.zeros(4, jnp.complex128) if h0 is None else h0

    def states(fields, h0):
        new = eqx.tree_at(
            lambda l: [getattr(l, n) for n in fields], layer, list(fields.values())
        )
        return new._states(new._drive(u), dt, h0)

    fields = {n: getattr(layer, n) for n in (*layer.per_state_fields, "B")}
    dense = jax.jacfwd(states)(fields, h0_)  # (T, P, *param)
    dense = jax.tree.map(np.asarray, dense)
    eye = np.eye(4)
    for name in layer.per_state_fields:
        full = dense[name]  # (T, P, P): diagonal in the state
        np.testing.assert_allclose(full * (1 - eye), 0, atol=1e-12)
        np.testing.assert_allclose(
            jac.wrt[name], np.einsum("tpp->tp", full), atol=1e-10
        )
    full_B = dense["B"]  # (T, P, P, H, 2)
    np.testing.assert_allclose(
        full_B * (1 - eye)[None, :, :, None, None], 0, atol=1e-12
    )
    diag_B = np.einsum("tpphc->tphc", full_B)
    np.testing.assert_allclose(jac.wrt_B, diag_B[..., 0], atol=1e-10)
    np.testing.assert_allclose(1j * jac.wrt_B, diag_B[..., 1], atol=1e-10)
    dh0 = np.asarray(jax.jacfwd(lambda h: states(fields, h), holomorphic=True)(h0_))
    np.testing.assert_allclose(jac.wrt_h0, np.einsum("tpp->tp", dh0), atol=1e-10)
    np.testing.assert_allclose(jac.states, states(fields, h0_), atol=1e-12)
    # the final-step variant takes a cheaper route for B; same numbers
    last = layer.parameter_jacobians(u, dt=dt, h0=h0, final=True)
    np.testing.assert_allclose(last.wrt_B, jac.wrt_B[-1], atol=1e-10)
    for name in layer.per_state_fields:
        np.testing.assert_allclose(last.wrt[name], jac.wrt[name][-1], atol=1e-12)
    np.testing.assert_allclose(last.wrt_h0, jac.wrt_h0[-1], atol=1e-12)
    np.testing.assert_allclose(last.states, jac.states[-1], atol=1e-12)


def test_eigenvalue_jacobian_is_holomorphic(getkey):
    # d/d lambda_im = 1j * d/d lambda_re: the states are holomorphic in Λ
    layer = make("s5", getkey())
    jac = layer.parameter_jacobians(jr.normal(getkey(), (T, H), jnp.float64))
    np.testing.assert_allclose(
        jac.wrt["lambda_im"], 1j * jac.wrt["lambda_re"], atol=1e-12
    )


# slow tier: float32 S5 runs in test_edge_cases.py's test_ssm_half_precision_inputs_
# are_computed_in_the_parameters_dtype, and layers under `jax.vmap` and `jax.jit` in
# test_shard_map.py's test_ssm_layers[S5Block-sequential]
@pytest.mark.slow
def test_jit_vmap_and_dtypes(getkey):
    layer = eqx_seq.S5(H, 8, key=getkey(), dtype=jnp.float32)
    u = jr.normal(getkey(), (5, T, H), jnp.float32)
    y = eqx.filter_jit(jax.vmap(layer))(u)
    assert y.shape == (5, T, H) and y.dtype == jnp.float32
    np.testing.assert_allclose(y[2], layer(u[2]), rtol=1e-5, atol=1e-5)
    assert layer.init_state().dtype == jnp.complex64
    # float64 input to float32 parameters computes in float64 (standard promotion)
    assert layer(u[0].astype(jnp.float64)).dtype == jnp.float64


# ----------------------------------------------------------------------- S5Block


@pytest.mark.parametrize(
    "activation,prenorm,norm",
    [
        ("gelu", True, "layer"),
        ("full_glu", False, "rms"),
        ("half_glu1", True, "rms"),
        ("half_glu2", False, "layer"),
    ],
)
def test_block_matches_a_hand_written_block(activation, prenorm, norm, getkey):
    ssm = make("s5", getkey())
    block = eqx_seq.S5Block(
        ssm, activation=activation, prenorm=prenorm, norm=norm, key=getkey()
    )
    x = jr.normal(getkey(), (T, H), jnp.float64)

    def normalise(v):
        v = np.asarray(v)
        if norm == "layer":
            v = (v - v.mean(-1, keepdims=True)) / np.sqrt(
                v.var(-1, keepdims=True) + 1e-5
            )
        else:
            v = v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-5)
        return v  # weights start at one, biases at zero

    def dense(lin, v):
        return v @ np.asarray(lin.weight).T + np.asarray(lin.bias)

    def sigmoid(v):
        return 1 / (1 + np.exp(-v))

    z = normalise(x) if prenorm else np.asarray(x)
    y = reference(ssm, z)
    g = np.asarray(jax.nn.gelu(y))
    out = {
        "gelu": lambda: g,
        "full_glu": lambda: dense(block.gate_in, g) * sigmoid(dense(block.gate, g)),
        "half_glu1": lambda: g * sigmoid(dense(block.gate, g)),
        "half_glu2": lambda: y * sigmoid(dense(block.gate, g)),
    }[activation]()
    expected = np.asarray(x) + out
    expected = expected if prenorm else normalise(expected)
    np.testing.assert_allclose(block(x), expected, atol=1e-8)
    # step mode = the parallel call
    _, steps = jax.lax.scan(lambda s, x_t: block.step(s, x_t), block.init_state(), x)
    np.testing.assert_allclose(steps, block(x), atol=1e-10)


def test_block_dropout_one_mask_over_time(getkey):
    block = eqx_seq.S5Block(make("s5", getkey()), dropout=0.5, key=getkey())
    x = jr.normal(getkey(), (T, H), jnp.float64)
    with pytest.raises(RuntimeError):
        block(x)  # training mode needs a key
    dropped = block(x, key=getkey()) - x
    # every feature is either dropped at all steps or at none, and some are dropped
    zero = np.asarray(dropped) == 0
    assert np.all(zero.all(axis=0) | (~zero).all(axis=0))
    masks = [np.asarray(block(x, key=jr.key(i)) - x)[0] == 0 for i in range(20)]
    assert 0 < np.mean(masks) < 1
    inference = eqx.nn.inference_mode(block)
    np.testing.assert_allclose(
        inference(x) - x, jax.vmap(block._activate)(block.ssm(jax.vmap(block.norm)(x)))
    )


# slow tier: the block's state is its layer's, whose streaming test_step_mode_and_
# streaming_equal_the_parallel_call checks (the block's step mode: test_block_
# matches_a_hand_written_block)
@pytest.mark.slow
def test_block_chunks_equal_one_call(getkey):
    block = eqx_seq.S5Block(
        eqx_seq.LRU(H, 4, key=getkey(), dtype=jnp.float64), key=getkey()
    )
    x = jr.normal(getkey(), (T, H), jnp.float64)
    state = block.final_state(x[:6])
    np.testing.assert_allclose(
        jnp.concatenate([block(x[:6]), block(x[6:], h0=state)]), block(x), atol=1e-10
    )


# slow tier: `s5_optimizer` (the labels driving `optax.multi_transform`) trains a
# model of S5 blocks in test_models.py's test_training_step_reduces_the_loss[lm]; the
# labels of every layer are read in test_selective.py's test_recurrent_layers_
# declare_the_contract
@pytest.mark.slow
def test_ssm_param_labels_drive_multi_transform(getkey):
    import optax

    model = [
        eqx_seq.S5Block(make("s5", getkey()), key=getkey()),
        eqx_seq.S5Block(make("lru", getkey()), key=getkey()),
    ]
    labels = eqx_seq.ssm_param_labels(model)
    assert labels[0].ssm.lambda_re == labels[0].ssm.B == labels[1].ssm.nu_log == "ssm"
    assert labels[1].ssm.gamma_log == "ssm" and labels[0].ssm.C == "regular"
    assert labels[0].ssm.C_backward is None and labels[0].gate.weight == "regular"
    params = eqx.filter(model, eqx.is_inexact_array)
    assert jax.tree.structure(labels) == jax.tree.structure(params)
    # the SSM group gets no weight decay and its own (here: zero) learning rate
    optim = optax.multi_transform(
        {"ssm": optax.sgd(0.0), "regular": optax.adamw(1e-2, weight_decay=0.1)},
        eqx_seq.ssm_param_labels,
    )
    x = jr.normal(getkey(), (T, H), jnp.float64)

    def f(model):
        return jnp.sum(model[1](model[0](x)) ** 2)

    with jax.numpy_dtype_promotion("standard"):  # optax is not strict-clean
        state = optim.init(params)
        grads = eqx.filter_jit(eqx.filter_grad(f))(model)
        updates, _ = eqx.filter_jit(optim.update)(grads, state, params)
    new = eqx.apply_updates(model, updates)
    assert np.all(new[0].ssm.lambda_re == model[0].ssm.lambda_re)
    assert np.all(new[1].ssm.B == model[1].ssm.B)
    assert np.any(new[0].gate.weight != model[0].gate.weight)
    assert np.any(new[1].ssm.C != model[1].ssm.C)


# --------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input(getkey):
    layer = make("s5", getkey())
    with pytest.raises(ValueError, match="input_size"):
        layer(jnp.ones((T, H + 1)))
    with pytest.raises(ValueError, match="input_size"):
        layer(jnp.ones((2, T, H)))  # a batch without vmap
    with pytest.raises(ValueError, match="at least|T >= 1"):
        layer(jnp.ones((0, H)))
    for dtype in (jnp.complex64, jnp.bool_):  # integers are cast (test_edge_cases)
        with pytest.raises(ValueError, match="real input"):
            layer(jnp.ones((T, H), dtype))
    with pytest.raises(ValueError, match="real `dt`"):
        layer(jnp.ones((T, H)), dt=jnp.ones(T, bool))
    with pytest.raises(ValueError, match=r"\(T,\)"):
        layer(jnp.ones((T, H)), dt=jnp.ones(T - 1))
    with pytest.raises(ValueError, match="h0"):
        layer(jnp.ones((T, H)), h0=jnp.zeros(5, jnp.complex128))
    with pytest.raises(ValueError, match="step"):
        layer.step(layer.init_state(), jnp.ones(H + 1))
    with pytest.raises(ValueError, match="needs the previous state"):
        layer.step(None, jnp.ones(H))
    # the block checks its input before its norm (whose error named no argument)
    block = eqx_seq.S5Block(layer, key=getkey())
    for x in [jnp.ones((T, H + 1)), jnp.ones((2, T, H))]:
        for call in [block, block.final_state]:
            with pytest.raises(ValueError, match=rf"`S5Block` takes .*\(T, {H}\)"):
                call(x)
    for x_t in [jnp.ones(H + 1), jnp.ones((1, H))]:
        with pytest.raises(ValueError, match="`S5Block.step` takes one input"):
            block.step(block.init_state(), x_t)
    with pytest.raises(ValueError, match="even"):
        eqx_seq.S5(H, 6, blocks=2, key=getkey())
    with pytest.raises(ValueError, match="divide"):
        eqx_seq.S5(H, 8, blocks=3, key=getkey())
    with pytest.raises(ValueError, match="discretisation"):
        eqx_seq.S5(H, 8, discretisation="euler", key=getkey())
    with pytest.raises(ValueError, match="dt_min"):
        eqx_seq.S5(H, 8, dt_min=0.1, dt_max=0.01, key=getkey())
    with pytest.raises(ValueError, match="scan"):
        eqx_seq.S5(H, 8, scan="sequential", key=getkey())
    with pytest.raises(ValueError, match="positive int"):
        eqx_seq.S5(H, 0, key=getkey())
    bidirectional = make("s5", getkey(), bidirectional=True)
    for call in [
        bidirectional.init_state,
        lambda: bidirectional.final_state(jnp.ones((T, H))),
        lambda: bidirectional.parameter_jacobians(jnp.ones((T, H))),
        lambda: bidirectional(jnp.ones((T, H)), h0=jnp.zeros(4, jnp.complex128)),
    ]:
        with pytest.raises(ValueError, match="bidirectional"):
            call()
    lru = make("lru", getkey())
    with pytest.raises(ValueError, match="discrete-time"):
        lru(jnp.ones((T, H)), dt=jnp.ones(T))
    with pytest.raises(ValueError, match="r_min"):
        eqx_seq.LRU(H, 4, r_min=0.9, r_max=0.5, key=getkey())
    with pytest.raises(ValueError, match="ssm"):
        eqx_seq.S5Block(eqx.nn.Linear(3, 3, key=getkey()), key=getkey())
    with pytest.raises(ValueError, match="activation"):
        eqx_seq.S5Block(layer, activation="relu", key=getkey())
    with pytest.raises(ValueError, match="norm"):
        eqx_seq.S5Block(layer, norm="batch", key=getkey())
    with pytest.raises(ValueError, match=rf"one unbatched sequence .*\(T, {H}\)"):
        eqx_seq.S5Block(layer, key=getkey())(jnp.ones(H))
