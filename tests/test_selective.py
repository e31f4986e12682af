"""`eqx_seq.selective_scan`, `eqx_seq.Mamba` and `eqx_seq.MambaBlock` against a
float64 NumPy loop of the same equations, finite differences, and themselves
(step mode, streaming, backends, chunk sizes)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import directional_derivative, directional_fd, slow_except

import eqx_seq


SCANS = {
    "sequential": eqx_seq.SequentialScan(),
    "unrolled": eqx_seq.SequentialScan(unroll=3),
    "associative": eqx_seq.AssociativeScan(),
}


def softplus(x):
    return np.logaddexp(0.0, x)


def silu(x):
    return x / (1 + np.exp(-x))


def reference(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, softplus_=False, h0=None,
    negative=False,
):  # fmt: skip
    """The S6 recurrence step by step in float64 NumPy: `(y, h_last)`; decays
    `2 exp(delta A) - 1` with `negative`."""
    u, delta, A, B, C = (np.asarray(x, np.float64) for x in (u, delta, A, B, C))
    T, channels = u.shape
    h = np.zeros(A.shape) if h0 is None else np.array(h0, np.float64)
    ys = []
    for t in range(T):
        d = delta[t] + (0 if delta_bias is None else np.asarray(delta_bias))
        d = softplus(d) if softplus_ else d
        a = np.exp(d[:, None] * A)
        a = 2 * a - 1 if negative else a
        h = a * h + (d * u[t])[:, None] * B[t][None, :]
        y = h @ C[t]
        if D is not None:
            y = y + np.asarray(D) * u[t]
        if z is not None:
            y = y * silu(np.asarray(z)[t])
        ys.append(y)
    return np.stack(ys), h


def problem(key, T=29, channels=5, N=3):
    k = jr.split(key, 9)
    return dict(
        u=jr.normal(k[0], (T, channels)),
        delta=0.5 * jr.normal(k[1], (T, channels)),
        A=-jnp.exp(jr.normal(k[2], (channels, N))),
        B=jr.normal(k[3], (T, N)),
        C=jr.normal(k[4], (T, N)),
        D=jr.normal(k[5], (channels,)),
        z=jr.normal(k[6], (T, channels)),
        delta_bias=jr.normal(k[7], (channels,)),
        h0=jr.normal(k[8], (channels, N)),
    )


class _UserSequential(eqx_seq.AbstractLocalScan):
    """A user's sequential backend: the selective scan runs its fused loop, which
    never calls `recurrence`."""

    parallel = False
    unroll = 2

    def recurrence(self, a, b, h0=None, *, reverse=False):
        raise AssertionError("the fused loop does not call `recurrence`")


class _UserParallel(eqx_seq.AbstractLocalScan):
    """A user's parallel backend: chunked calls of its `recurrence`."""

    parallel = True
    unroll = 1

    def recurrence(self, a, b, h0=None, *, reverse=False):
        return eqx_seq.AssociativeScan().recurrence(a, b, h0, reverse=reverse)


def test_selective_scan_runs_what_a_user_backend_declares(getkey):
    """The declared `parallel` picks the algorithm for any backend, a user's too."""
    p = problem(getkey())
    y_ref, h_ref = reference(p["u"], p["delta"], p["A"], p["B"], p["C"], h0=p["h0"])
    for scan in (_UserSequential(), _UserParallel()):
        y, h = eqx_seq.selective_scan(
            p["u"], p["delta"], p["A"], p["B"], p["C"], h0=p["h0"],
            return_last_state=True, scan=scan, chunk_size=4,
        )  # fmt: skip
        np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(h, h_ref, rtol=1e-10, atol=1e-12)


# the chunks are the associative backend's: every chunk size for it in the fast
# tier, one each for the sequential backends (their fused loop takes no chunks).
# Slow tier: the sequential backends' other chunk sizes.
_LOOP_FAST = [
    "4-sequential",
    "7-unrolled",
    *(f"{chunk}-associative" for chunk in [1, 4, 7, 64]),
]


@pytest.mark.parametrize(
    "chunk_size,scan",
    slow_except(
        [(chunk, scan) for chunk in [1, 4, 7, 64] for scan in SCANS.values()],
        _LOOP_FAST,
        ids=[f"{chunk}-{name}" for chunk in [1, 4, 7, 64] for name in SCANS],
    ),
)
def test_selective_scan_matches_numpy_loop(scan, chunk_size, getkey):
    p = problem(getkey())
    y, h = eqx_seq.selective_scan(
        p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], z=p["z"],
        delta_bias=p["delta_bias"], delta_softplus=True, h0=p["h0"],
        return_last_state=True, scan=scan, chunk_size=chunk_size,
    )  # fmt: skip
    y_ref, h_ref = reference(
        p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"],
        True, p["h0"],
    )  # fmt: skip
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, h_ref, rtol=1e-10, atol=1e-12)


def test_selective_scan_optional_arguments(getkey):
    p = problem(getkey())
    # only the required ones: no skip, no gate, no bias, no softplus, zero state
    y = eqx_seq.selective_scan(p["u"], jnp.abs(p["delta"]), p["A"], p["B"], p["C"])
    y_ref, _ = reference(p["u"], jnp.abs(p["delta"]), p["A"], p["B"], p["C"])
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)


def check_every_argument(loss, p, grads, getkey):
    """`grads` of `loss` at the arguments `p` against finite differences, every
    argument on its own, so that a wrong cotangent cannot hide in a sum."""
    for name in p:
        direction = {k: jnp.zeros_like(v) for k, v in p.items()}
        direction[name] = jr.normal(getkey(), p[name].shape)
        expected = directional_fd(loss, p, direction)
        got = directional_derivative(grads, direction)
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)


# slow tier: the sequential adjoint again, with another chunk size or unrolled; the
# two adjoints run in the fast tier (sequential-4, associative-4)
@pytest.mark.parametrize(
    "scan, chunk_size",
    [
        ("sequential", 4),
        pytest.param("sequential", 64, marks=pytest.mark.slow),
        pytest.param("unrolled", 4, marks=pytest.mark.slow),
        ("associative", 4),
    ],
)
def test_selective_scan_gradients_match_finite_differences(scan, chunk_size, getkey):
    # the sequential backends run the fused step loop, the others the chunks
    # through their recurrence: two hand-written adjoints
    p = problem(getkey(), T=17)

    def loss(p):
        y, h = eqx_seq.selective_scan(
            p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], z=p["z"],
            delta_bias=p["delta_bias"], delta_softplus=True, h0=p["h0"],
            return_last_state=True, chunk_size=chunk_size, scan=SCANS[scan],
        )  # fmt: skip
        return jnp.sum(jnp.sin(y)) + jnp.sum(h**2)

    check_every_argument(loss, p, jax.grad(loss)(p), getkey)


# slow tier: the fused loop's negative decays, checked through the Mamba layer (on
# the CPU's default sequential backend) by test_mamba_negative_decays
@pytest.mark.parametrize(
    "scan", [pytest.param("sequential", marks=pytest.mark.slow), "associative"]
)
def test_selective_scan_negative_decays(scan, getkey):
    """Decays `2 exp(delta A) - 1`, on both kernels (the fused loop, the chunks
    through `recurrence`): values against the loop, every argument's gradient
    against finite differences; the decays do reach below zero."""
    p = problem(getkey(), T=17)

    def run(p):
        return eqx_seq.selective_scan(
            p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], z=p["z"],
            delta_bias=p["delta_bias"], delta_softplus=True, h0=p["h0"],
            return_last_state=True, negative_decays=True, chunk_size=4,
            scan=SCANS[scan],
        )  # fmt: skip

    def loss(p):
        y, h = run(p)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h**2)

    (y, h), grads = jax.jit(lambda p: (run(p), jax.grad(loss)(p)))(p)
    delta = softplus(p["delta"] + p["delta_bias"][None])
    decays = 2 * np.exp(delta[:, :, None] * np.asarray(p["A"])[None]) - 1
    assert (decays < 0).any() and (decays > 0).any()
    y_ref, h_ref = reference(
        p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"],
        True, p["h0"], negative=True,
    )  # fmt: skip
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, h_ref, rtol=1e-10, atol=1e-12)
    check_every_argument(loss, p, grads, getkey)


# slow tier: streaming with `h0` and the last state is checked through the layers by
# test_mamba_block (`final_state`, then `h0`) and test_selective_scan_reset_is_
# separate_calls (`h0`, the last state)
@pytest.mark.slow
def test_selective_scan_streams_in_chunks(getkey):
    p = problem(getkey(), T=30)
    args = ("u", "delta", "B", "C", "z")

    def run(sl, h0):
        part = {k: p[k][sl] if k in args else p[k] for k in p}
        return eqx_seq.selective_scan(
            part["u"], part["delta"], p["A"], part["B"], part["C"], p["D"],
            z=part["z"], h0=h0, return_last_state=True, chunk_size=8,
        )  # fmt: skip

    y, h = run(slice(None), None)
    y1, h1 = run(slice(0, 11), None)
    y2, h2 = run(slice(11, None), h1)
    np.testing.assert_allclose(jnp.concatenate([y1, y2]), y, rtol=1e-12)
    np.testing.assert_allclose(h2, h, rtol=1e-12)


# slow tier: the associative backend's chunks; the bound is checked in the fast tier
# on the CPU's default (sequential) backend
@pytest.mark.parametrize(
    "scan", ["sequential", pytest.param("associative", marks=pytest.mark.slow)]
)
def test_selective_scan_gradient_does_not_store_the_states(scan):
    # T * D * N float64 states would take 32 MiB; the gradient's working memory
    # must stay far below (chunk-boundary states and one chunk's worth)
    T, channels, N = 4096, 64, 16
    args = (
        jnp.ones((T, channels)),
        jnp.full((T, channels), 0.1),
        -jnp.ones((channels, N)),
        jnp.ones((T, N)),
        jnp.ones((T, N)),
    )

    def loss(*args):
        return jnp.sum(eqx_seq.selective_scan(*args, scan=SCANS[scan]))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    temp = grad.lower(*args).compile().memory_analysis().temp_size_in_bytes
    states = T * channels * N * 8
    assert temp < states / 4, (temp, states)


def test_selective_scan_half_precision(getkey):
    p = problem(getkey())
    half = {k: v.astype(jnp.float16) for k, v in p.items()}
    y = eqx_seq.selective_scan(
        half["u"], half["delta"], half["A"], half["B"], half["C"], half["D"]
    )
    assert y.dtype == jnp.float16
    as_float32 = {k: v.astype(jnp.float32) for k, v in half.items()}
    y32 = eqx_seq.selective_scan(
        as_float32["u"], as_float32["delta"], as_float32["A"], as_float32["B"],
        as_float32["C"], as_float32["D"],
    )  # fmt: skip
    np.testing.assert_allclose(y, y32.astype(jnp.float16), rtol=1e-2, atol=1e-2)


def test_selective_scan_under_vmap_and_jit(getkey):
    ps = [problem(getkey(), T=12) for _ in range(3)]
    stacked = {k: jnp.stack([p[k] for p in ps]) for k in ps[0]}

    @jax.jit
    def run(u, delta, B, C):
        return eqx_seq.selective_scan(u, delta, ps[0]["A"], B, C)

    y = jax.vmap(run)(stacked["u"], stacked["delta"], stacked["B"], stacked["C"])
    for i, p in enumerate(ps):
        expected, _ = reference(p["u"], p["delta"], ps[0]["A"], p["B"], p["C"])
        np.testing.assert_allclose(y[i], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures("unchecked_annotations")
def test_selective_scan_rejects_bad_input(getkey):
    p = problem(getkey())
    u, delta, A, B, C = p["u"], p["delta"], p["A"], p["B"], p["C"]
    with pytest.raises(ValueError, match="`B` must have shape"):
        eqx_seq.selective_scan(u, delta, A, B[:-1], C)
    with pytest.raises(ValueError, match="`delta` must have shape"):
        eqx_seq.selective_scan(u, delta[:, :-1], A, B, C)
    with pytest.raises(ValueError, match="`D` must have shape"):
        eqx_seq.selective_scan(u, delta, A, B, C, jnp.ones(2))
    with pytest.raises(ValueError, match="`h0` must have shape"):
        eqx_seq.selective_scan(u, delta, A, B, C, h0=jnp.ones(5))
    with pytest.raises(ValueError, match="one unbatched sequence"):
        eqx_seq.selective_scan(u[None], delta, A, B, C)
    with pytest.raises(ValueError, match="T >= 1"):
        eqx_seq.selective_scan(u[:0], delta[:0], A, B[:0], C[:0])
    with pytest.raises(ValueError, match="real floating"):
        eqx_seq.selective_scan(u.astype(jnp.int32), delta, A, B, C)
    with pytest.raises(ValueError, match="real floating"):
        eqx_seq.selective_scan(u, delta, A.astype(jnp.complex128), B, C)
    with pytest.raises(ValueError, match="chunk_size"):
        eqx_seq.selective_scan(u, delta, A, B, C, chunk_size=0)
    with pytest.raises(ValueError, match="AbstractScan"):
        eqx_seq.selective_scan(u, delta, A, B, C, scan="sequential")


# ----------------------------------------------------------------------- Mamba


def mamba_reference(layer: eqx_seq.Mamba, x):
    """The Mamba layer's equations in float64 NumPy, from its parameters."""
    w = {k: np.asarray(v, np.float64) for k, v in {
        "in": layer.in_proj, "conv_w": layer.conv.weight, "conv_b": layer.conv.bias,
        "x": layer.x_proj, "dt": layer.dt_proj, "dt_b": layer.dt_bias,
        "A_log": layer.A_log, "D": layer.D, "out": layer.out_proj,
    }.items()}  # fmt: skip
    x = np.asarray(x, np.float64)
    E, K = layer.channels, layer.conv.kernel_size
    R, N = layer.dt_rank, layer.state_size
    vz = x @ w["in"].T
    v, z = vz[:, :E], vz[:, E:]
    padded = np.concatenate([np.zeros((K - 1, E)), v])
    conv = np.stack(
        [
            w["conv_b"] + np.sum(w["conv_w"] * padded[t : t + K], 0)
            for t in range(len(x))
        ]
    )
    u = silu(conv)
    dbc = u @ w["x"].T
    delta = dbc[:, :R] @ w["dt"].T
    y, _ = reference(
        u, delta, -np.exp(w["A_log"]), dbc[:, R : R + N], dbc[:, R + N :], w["D"], z,
        w["dt_b"], True, negative=layer.negative_decays,
    )  # fmt: skip
    return y @ w["out"].T


# slow tier: test_mamba_negative_decays checks the layer against the same NumPy
# equations (with decays below zero, and its step mode and gradients)
@pytest.mark.slow
def test_mamba_matches_numpy(getkey):
    layer = eqx_seq.Mamba(6, state_size=4, expand=2, dt_rank=2, key=getkey())
    x = jr.normal(getkey(), (21, 6))
    np.testing.assert_allclose(
        layer(x), mamba_reference(layer, x), rtol=1e-9, atol=1e-12
    )


def test_mamba_negative_decays(getkey):
    """`negative_decays=True`: the numbers of the equations, step mode, gradients."""
    layer = eqx_seq.Mamba(
        4, state_size=3, dt_rank=2, chunk_size=4, negative_decays=True, key=getkey()
    )
    layer = eqx.tree_at(lambda m: m.dt_bias, layer, layer.dt_bias + 2.0)  # dt ~ 2
    x = jr.normal(getkey(), (11, 4))
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(params, x):
        return jnp.sum(jnp.tanh(eqx.combine(params, static)(x)))

    @jax.jit
    def everything(params, x):
        model = eqx.combine(params, static)
        _, stepped = jax.lax.scan(lambda s, t: model.step(s, t), model.init_state(), x)
        return model(x), stepped, jax.grad(loss, argnums=(0, 1))(params, x)

    y, stepped, grads = everything(params, x)
    expected = mamba_reference(layer, x)
    np.testing.assert_allclose(y, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(stepped, expected, rtol=1e-9, atol=1e-12)
    direction = jax.tree.map(lambda a: jr.normal(getkey(), a.shape), (params, x))
    fd = directional_fd(lambda p: loss(*p), (params, x), direction)
    np.testing.assert_allclose(directional_derivative(grads, direction), fd, rtol=1e-6)


def test_mamba_initialisation(getkey):
    layer = eqx_seq.Mamba(32, state_size=8, dt_min=1e-3, dt_max=1e-1, key=getkey())
    assert layer.channels == 64 and layer.dt_rank == 2  # ceil(32 / 16)
    # S4D-real: A[e, n] = -(n + 1)
    np.testing.assert_allclose(-jnp.exp(layer.A_log[3]), -jnp.arange(1.0, 9.0))
    dt = jax.nn.softplus(layer.dt_bias)
    assert jnp.all((dt >= 1e-3 * (1 - 1e-9)) & (dt <= 1e-1 * (1 + 1e-9)))
    np.testing.assert_array_equal(layer.D, 1.0)


# slow tier: Mamba's step mode is checked by test_mamba_negative_decays, streaming
# through `final_state` and `h0` by test_mamba_block, and the backends agree on the
# selective scan itself (test_selective_scan_matches_numpy_loop)
@pytest.mark.slow
@pytest.mark.parametrize("scan", SCANS.values(), ids=SCANS.keys())
def test_mamba_step_streaming_and_backends(scan, getkey):
    key = getkey()
    layer = eqx_seq.Mamba(5, state_size=3, chunk_size=4, scan=scan, key=key)
    x = jr.normal(getkey(), (19, 5))
    y = layer(x)
    # every backend gives the sequential one's numbers
    other = eqx_seq.Mamba(5, state_size=3, scan=eqx_seq.SequentialScan(), key=key)
    np.testing.assert_allclose(y, other(x), rtol=1e-10, atol=1e-12)
    # step mode
    state, outs = layer.init_state(), []
    for t in range(len(x)):
        state, out = layer.step(state, x[t])
        outs.append(out)
    np.testing.assert_allclose(jnp.stack(outs), y, rtol=1e-10, atol=1e-12)
    # streaming in chunks; the final state is the stepped one
    first = layer.final_state(x[:7])
    y2 = jnp.concatenate([layer(x[:7]), layer(x[7:], h0=first)])
    np.testing.assert_allclose(y2, y, rtol=1e-10, atol=1e-12)
    for a, b in zip(layer.final_state(x[7:], h0=first), state):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# slow tier: test_mamba_negative_decays checks the layer's gradients against finite
# differences (the selective scan's own: test_selective_scan_gradients_match_finite_
# differences)
@pytest.mark.slow
def test_mamba_gradients_match_finite_differences(getkey):
    layer = eqx_seq.Mamba(4, state_size=3, chunk_size=4, key=getkey())
    x = jr.normal(getkey(), (11, 4))
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def loss(params, x):
        return jnp.sum(jnp.tanh(eqx.combine(params, static)(x)))

    grads = jax.grad(loss, argnums=(0, 1))(params, x)
    direction = jax.tree.map(lambda a: jr.normal(getkey(), a.shape), (params, x))
    expected = directional_fd(lambda p: loss(*p), (params, x), direction)
    np.testing.assert_allclose(
        directional_derivative(grads, direction), expected, rtol=1e-6
    )


def test_mamba_half_precision_input(getkey):
    layer = eqx_seq.Mamba(4, state_size=3, dtype=jnp.float32, key=getkey())
    x = jr.normal(getkey(), (9, 4), jnp.float16)
    y = layer(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, layer(x.astype(jnp.float32)), rtol=1e-6)


@pytest.mark.usefixtures("unchecked_annotations")
def test_mamba_rejects_bad_input(getkey):
    layer = eqx_seq.Mamba(4, state_size=3, key=getkey())
    with pytest.raises(ValueError, match="`negative_decays` must be a bool"):
        eqx_seq.Mamba(4, negative_decays="yes", key=getkey())
    with pytest.raises(ValueError, match="one unbatched sequence"):
        layer(jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="one unbatched sequence"):
        layer(jnp.ones((2, 5, 4)))
    with pytest.raises(ValueError, match="real input"):
        layer(jnp.ones((5, 4), jnp.complex64))
    with pytest.raises(ValueError, match="conv_state, ssm_state"):
        layer(jnp.ones((5, 4)), h0=jnp.zeros((8, 3)))
    with pytest.raises(ValueError, match="real floating arrays of shapes"):
        layer(jnp.ones((5, 4)), h0=(jnp.zeros((3, 8)), jnp.zeros((8, 4))))
    # a complex state, in either part, would lose its imaginary part
    conv, ssm = layer.init_state()
    for h0 in [(conv.astype(complex), ssm), (conv, ssm.astype(complex))]:
        with pytest.raises(ValueError, match="real floating arrays.*complex"):
            layer(jnp.ones((5, 4)), h0=h0)
        with pytest.raises(ValueError, match="real floating arrays.*complex"):
            layer.step(h0, jnp.ones(4))
    with pytest.raises(ValueError, match="one input of shape"):
        layer.step(layer.init_state(), jnp.ones(3))
    with pytest.raises(ValueError, match="conv_state, ssm_state"):
        layer.step(None, jnp.ones(4))
    for kwargs, match in [
        (dict(state_size=0), "state_size"),
        (dict(expand=1.5), "expand"),
        (dict(dt_rank=0), "dt_rank"),
        (dict(dt_min=0.1, dt_max=0.01), "dt_min"),
        (dict(dt_min=float("nan")), "dt_min"),
        (dict(scan=None), "AbstractScan"),
        (dict(dtype=jnp.float16), "float32 or float64"),
    ]:
        with pytest.raises(ValueError, match=match):
            eqx_seq.Mamba(4, key=getkey(), **kwargs)


def test_mamba_block(getkey):
    layer = eqx_seq.Mamba(5, state_size=3, key=getkey())
    block = eqx_seq.MambaBlock(layer, dropout=0.5)
    # the reference models' RMS norm: a scale, no bias
    assert block.norm.bias is None and block.norm.weight.shape == (5,)
    x = jr.normal(getkey(), (13, 5))
    inference = eqx.nn.inference_mode(block)
    y = inference(x)
    norm = jax.vmap(block.norm)(x)
    np.testing.assert_allclose(y, x + layer(norm), rtol=1e-12)
    state, outs = block.init_state(), []
    for t in range(len(x)):
        state, out = block.step(state, x[t])
        outs.append(out)
    np.testing.assert_allclose(jnp.stack(outs), y, rtol=1e-10, atol=1e-12)
    first = block.final_state(x[:6])
    np.testing.assert_allclose(
        jnp.concatenate([inference(x[:6]), inference(x[6:], h0=first)]), y, rtol=1e-10
    )
    # dropout: one mask over features for all steps, from the key
    dropped = block(x, key=getkey()) - x
    kept = jnp.any(dropped != 0, axis=0)
    assert 0 < int(jnp.sum(kept)) < 5


@pytest.mark.usefixtures("unchecked_annotations")
def test_mamba_block_rejects_bad_input(getkey):
    layer = eqx_seq.Mamba(5, state_size=3, key=getkey())
    with pytest.raises(ValueError, match="eqx_seq.Mamba"):
        eqx_seq.MambaBlock(eqx_seq.LRU(5, 4, key=getkey()))
    with pytest.raises(ValueError, match="norm"):
        eqx_seq.MambaBlock(layer, norm="batch")
    with pytest.raises(ValueError, match="dropout"):
        eqx_seq.MambaBlock(layer, dropout=1.0)
    with pytest.raises(ValueError, match=r"\(T, H\)"):
        eqx_seq.MambaBlock(layer)(jnp.ones(5))


def test_ssm_param_labels_mark_mamba_recurrence(getkey):
    model = eqx_seq.SequenceClassifier(
        2, 3, width=4, depth=2, state_size=3, mixer="mamba", key=getkey()
    )
    labels = eqx_seq.ssm_param_labels(model)
    for block in labels.blocks:
        assert block.mamba.A_log == block.mamba.D == block.mamba.dt_bias == "ssm"
        assert block.mamba.in_proj == block.mamba.x_proj == "regular"
        assert block.mamba.conv.weight == block.norm.weight == "regular"
    params = eqx.filter(model, eqx.is_inexact_array)
    assert jax.tree.structure(labels) == jax.tree.structure(params)


def test_ssm_param_labels_mark_rglru_decay(getkey):
    model = eqx_seq.SequenceClassifier(
        2, 3, width=4, depth=1, mixer="rglru", key=getkey()
    )
    labels = eqx_seq.ssm_param_labels(model)
    block = labels.blocks[0]
    assert block.rglru.a_param == "ssm"
    assert block.rglru.a_gate_weight == block.in_proj.weight == "regular"


def test_recurrent_layers_declare_the_contract(getkey):
    """Every layer with a state is an `AbstractRecurrentLayer` that names its
    recurrence parameters, and `ssm_param_labels` reads those names, a user's
    layer's included (nested in a list of layers, and inside another one); a layer
    that does not declare them cannot be made."""
    layers = [
        eqx_seq.S5(3, 4, key=getkey()),
        eqx_seq.LRU(3, 4, key=getkey()),
        eqx_seq.RGLRU(3, key=getkey()),
        eqx_seq.Mamba(3, state_size=2, key=getkey()),
    ]
    layers += [
        eqx_seq.S5Block(layers[0], key=getkey()),
        eqx_seq.HawkBlock(3, key=getkey()),
        eqx_seq.MambaBlock(layers[3]),
    ]
    for layer in layers:
        assert isinstance(layer, eqx_seq.AbstractRecurrentLayer)
        assert all(hasattr(layer, name) for name in layer.recurrence_fields)

    class Decay(eqx_seq.AbstractRecurrentLayer):
        a: jax.Array
        inner: eqx_seq.RGLRU
        recurrence_fields = ("a",)

        def __call__(self, x, *, h0=None, key=None):
            return self.inner(x * self.a, h0=h0)

        def final_state(self, x, *, h0=None):
            return self.inner.final_state(x * self.a, h0=h0)

        def init_state(self):
            return self.inner.init_state()

        def step(self, state, x_t):
            return self.inner.step(state, x_t * self.a)

    labels = eqx_seq.ssm_param_labels([Decay(jnp.ones(3), layers[2]), 1.0])
    assert labels[0].a == labels[0].inner.a_param == "ssm"
    assert labels[0].inner.a_gate_weight == "regular" and labels[1] is None

    class Bare(eqx_seq.AbstractRecurrentLayer):
        def __call__(self, x, *, h0=None, key=None):
            return x

        def final_state(self, x, *, h0=None):
            return x[-1]

        def init_state(self):
            return jnp.zeros(())

        def step(self, state, x_t):
            return state, x_t

    with pytest.raises(TypeError, match="recurrence_fields"):
        Bare()


# ------------------------------------------------------------- packed sequences


# slow tier: the fused loop's resets, checked with a NaN in a document by
# test_packed.py's test_a_bad_segment_stays_in_its_segment[selective_scan-sequential]
@pytest.mark.parametrize(
    "scan", [pytest.param("sequential", marks=pytest.mark.slow), "associative"]
)
def test_selective_scan_reset_is_separate_calls(scan, getkey):
    p = problem(getkey(), T=23)
    starts = [0, 6, 7, 15]  # a one-step segment too
    reset = jnp.zeros(23, bool).at[jnp.array(starts)].set(True)

    def run(sl, reset=None, h0=None):
        return eqx_seq.selective_scan(
            p["u"][sl], p["delta"][sl], p["A"], p["B"][sl], p["C"][sl], p["D"],
            z=p["z"][sl], delta_bias=p["delta_bias"], delta_softplus=True, h0=h0,
            reset=reset, return_last_state=True, chunk_size=4, scan=SCANS[scan],
        )  # fmt: skip

    # `h0` is forgotten at a reset on step 0
    y, h = run(slice(None), reset, p["h0"])
    bounds = starts + [23]
    for a, b in zip(bounds[:-1], bounds[1:]):
        y_seg, h_seg = run(slice(a, b))
        np.testing.assert_allclose(y[a:b], y_seg, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, h_seg, rtol=1e-10, atol=1e-12)

    # gradients through a packed sequence against finite differences
    def loss(p):
        y, h = eqx_seq.selective_scan(
            p["u"], p["delta"], p["A"], p["B"], p["C"], delta_softplus=True,
            h0=p["h0"], reset=reset.at[0].set(False), return_last_state=True,
            chunk_size=4, scan=SCANS[scan],
        )  # fmt: skip
        return jnp.sum(jnp.sin(y)) + jnp.sum(h**2)

    keys = ("u", "delta", "A", "B", "C", "h0")
    sub = {k: p[k] for k in keys}
    grads = jax.grad(loss)(sub)
    direction = {k: jr.normal(getkey(), v.shape) for k, v in sub.items()}
    np.testing.assert_allclose(
        directional_derivative(grads, direction),
        directional_fd(loss, sub, direction),
        rtol=1e-6,
    )


# slow tier: test_packed.py checks Mamba's resets (test_a_bad_segment_stays_in_its_
# segment[MambaBlock-associative]) and its step mode across them (test_step_mode_
# restarts_like_the_parallel_call[MambaBlock])
@pytest.mark.slow
def test_mamba_reset_is_separate_calls(getkey):
    layer = eqx_seq.Mamba(4, state_size=3, chunk_size=4, key=getkey())
    block = eqx_seq.MambaBlock(layer)
    x = jr.normal(getkey(), (17, 4))
    reset = jnp.zeros(17, bool).at[jnp.array([5, 6, 12])].set(True)
    for module in (layer, block):
        y = module(x, reset=reset)
        for a, b in [(0, 5), (5, 6), (6, 12), (12, 17)]:
            np.testing.assert_allclose(y[a:b], module(x[a:b]), rtol=1e-10, atol=1e-12)
        # step mode with resets, and streaming across a segment start
        state, outs = module.init_state(), []
        for t in range(17):
            state, out = module.step(state, x[t], reset=reset[t])
            outs.append(out)
        np.testing.assert_allclose(jnp.stack(outs), y, rtol=1e-10, atol=1e-12)
        first = module.final_state(x[:9], reset=reset[:9])
        rest = module(x[9:], reset=reset[9:], h0=first)
        np.testing.assert_allclose(rest, y[9:], rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures("unchecked_annotations")
def test_mamba_reset_rejects_bad_input(getkey):
    layer = eqx_seq.Mamba(4, state_size=3, chunk_size=4, key=getkey())
    x = jnp.ones((17, 4))
    reset = jnp.zeros(17, bool).at[jnp.array([5, 6, 12])].set(True)
    with pytest.raises(ValueError, match="reset"):
        layer(x, reset=reset[:-1])
    with pytest.raises(ValueError, match="reset"):
        layer(x, reset=reset.astype(jnp.int32))
    with pytest.raises(ValueError, match="reset"):
        layer.step(layer.init_state(), x[0], reset=jnp.array([True]))
    with pytest.raises(ValueError, match="reset"):
        eqx_seq.selective_scan(
            x, x, -jnp.ones((4, 2)), x[:, :2], x[:, :2], reset=jnp.ones(17)
        )
