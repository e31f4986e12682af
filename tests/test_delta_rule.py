"""`delta_rule_scan` and `delta_rule_step` (the gated delta rule, chunked) against
the recurrent form: a float64 NumPy loop for the values, the same loop in
`jax.numpy` for the derivatives (autodiff through the steps), and finite
differences; the `GatedDeltaNet` layer against its equations in NumPy (the
projections, the convolution, the NumPy loop, the gated norm), its forms, its
block and bad input. Packing through the layer and its block is in
`test_packed.py` with the other layers'."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import directional_derivative, directional_fd

import eqx_seq


def numpy_loop(q, k, v, beta, g=None, h0=None, reset=None, scale=None, unit=False):
    """The outputs and the final state, one step and one head at a time."""
    T, G, dk = q.shape
    H, dv = v.shape[1:]
    if unit:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    scale = dk**-0.5 if scale is None else scale
    S = np.zeros((H, dk, dv)) if h0 is None else np.array(h0, dtype=np.float64)
    out = np.zeros((T, H, dv))
    for t in range(T):
        if reset is not None and reset[t]:
            S = np.zeros_like(S)
        for h in range(H):
            q_t, k_t = q[t, h // (H // G)], k[t, h // (H // G)]
            S[h] = S[h] * (1.0 if g is None else np.exp(g[t, h]))
            u = beta[t, h] * (v[t, h] - k_t @ S[h])
            S[h] = S[h] + np.outer(k_t, u)
            out[t, h] = scale * (S[h].T @ q_t)
    return out, S


def jax_loop(q, k, v, beta, g, h0, reset, scale):
    """`numpy_loop` in `jax.numpy` (a `lax.scan` over the steps, keys and queries
    already unit), to differentiate."""
    T, G, dk = q.shape
    H = v.shape[1]
    heads = lambda a: jnp.repeat(a, H // G, axis=1)
    keep = 1 - jnp.asarray(reset, q.dtype)

    def step(S, row):
        q_t, k_t, v_t, b_t, g_t, keep_t = row
        S = (keep_t * jnp.exp(g_t))[:, None, None] * S
        u = b_t[:, None] * (v_t - jnp.einsum("hde,hd->he", S, k_t))
        S = S + k_t[:, :, None] * u[:, None, :]
        return S, scale * jnp.einsum("hde,hd->he", S, q_t)

    S, out = jax.lax.scan(step, h0, (heads(q), heads(k), v, beta, g, keep))
    return out, S


def draw(T, G, H, dk, dv, seed=0):
    """Unit keys, `beta` in (0, 2), gates near zero on some heads and near -30 on
    the others."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(T, G, dk))
    g = -rng.uniform(0, 0.1, size=(T, H))
    g[:, 1::2] = -rng.uniform(25, 35, size=(T, H // 2))
    arrays = dict(
        q=rng.normal(size=(T, G, dk)),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=rng.normal(size=(T, H, dv)),
        beta=rng.uniform(0.05, 1.95, size=(T, H)),
        g=g,
        h0=rng.normal(size=(H, dk, dv)),
    )
    return arrays, rng


# resets on step 0 (which ignores h0), at a chunk boundary of both chunk sizes (64),
# inside chunks and two in one chunk; T = 100 a multiple of neither chunk size
RESETS = [0, 23, 29, 64, 70]


@pytest.mark.parametrize("chunk", [16, 64])
def test_matches_the_recurrent_form(chunk):
    """Values and final states to 1e-12 of the NumPy loop: grouped heads, gates,
    `beta` in (0, 2), `h0`, resets, normalised queries and keys and a scale given;
    and without gates, resets nor `h0` (DeltaNet, unit keys given). One program."""
    T, G, H, dk, dv = 100, 2, 4, 5, 3
    a, _ = draw(T, G, H, dk, dv)
    reset = np.zeros(T, bool)
    reset[RESETS] = True
    raw_k = a["k"] * np.linspace(0.5, 2.0, T)[:, None, None]

    @jax.jit
    def program(q, k, raw_k, v, beta, g, h0, reset):
        options = dict(chunk_size=chunk, return_final_state=True)
        gated = eqx_seq.delta_rule_scan(
            q, raw_k, v, beta, g=g, h0=h0, reset=reset, scale=0.7,
            normalize_qk=True, **options,
        )  # fmt: skip
        return gated, eqx_seq.delta_rule_scan(q, k, v, beta, **options)

    gated, plain = program(
        a["q"], a["k"], raw_k, a["v"], a["beta"], a["g"], a["h0"], reset
    )
    refs = [
        numpy_loop(a["q"], raw_k, a["v"], a["beta"], a["g"], a["h0"], reset, 0.7, True),
        numpy_loop(a["q"], a["k"], a["v"], a["beta"]),
    ]
    for ours, ref in zip([gated, plain], refs):
        for x, r in zip(ours, ref):
            assert x.dtype == jnp.float64
            np.testing.assert_allclose(x, r, rtol=0, atol=1e-12 * np.abs(r).max())


def test_derivatives_match_the_recurrent_form_and_finite_differences():
    """Reverse and forward mode with respect to every array, `h0` and the final
    state's cotangent included, equal autodiff through the `jax.numpy` loop; one
    directional derivative equals finite differences. One program for the
    derivatives, one for the values."""
    T, G, H, dk, dv, chunk = 21, 1, 2, 4, 3, 8
    a, rng = draw(T, G, H, dk, dv, seed=1)
    reset = np.zeros(T, bool)
    reset[[5, 16]] = True
    names = ("q", "k", "v", "beta", "g", "h0")
    args = tuple(jnp.asarray(a[n]) for n in names)
    w_out, w_state = rng.normal(size=(T, H, dv)), rng.normal(size=(H, dk, dv))
    direction = tuple(jnp.asarray(rng.normal(size=x.shape)) for x in args)

    def loss(fn, *x):
        out, S = fn(*x)
        return jnp.sum(out * w_out) + jnp.sum(S * w_state)

    def ours(q, k, v, beta, g, h0):
        return eqx_seq.delta_rule_scan(
            q, k, v, beta, g=g, h0=h0, reset=reset, chunk_size=chunk,
            return_final_state=True,
        )  # fmt: skip

    def ref(q, k, v, beta, g, h0):
        return jax_loop(q, k, v, beta, g, h0, reset, dk**-0.5)

    @jax.jit
    def derivatives(*x):
        out = []
        for fn in (ours, ref):
            grad = jax.grad(lambda *y: loss(fn, *y), range(len(x)))(*x)
            out.append((grad, jax.jvp(fn, x, direction)[1]))
        return out

    (grad, tangent), (grad_ref, tangent_ref) = derivatives(*args)
    for n, d, d_ref in zip(names, grad, grad_ref):
        np.testing.assert_allclose(d, d_ref, rtol=1e-10, atol=1e-12, err_msg=n)
    for d, d_ref in zip(tangent, tangent_ref):
        np.testing.assert_allclose(d, d_ref, rtol=1e-10, atol=1e-12)
    value = jax.jit(lambda x: loss(ours, *x))
    fd = directional_fd(value, args, direction)
    np.testing.assert_allclose(directional_derivative(grad, direction), fd, rtol=1e-6)


def test_step_equals_call():
    """`delta_rule_step` called on each step from `h0` gives the scan's outputs and
    final state (grouped heads, gates, `beta` in (0, 2), normalised keys)."""
    T, G, H, dk, dv = 11, 2, 4, 3, 2
    a, _ = draw(T, G, H, dk, dv, seed=2)

    @jax.jit
    def program(q, k, v, beta, g, h0):
        def step(S, row):
            q_t, k_t, v_t, b_t, g_t = row
            out, S = eqx_seq.delta_rule_step(
                S, q_t, k_t, v_t, b_t, g=g_t, scale=0.5, normalize_qk=True
            )
            return S, out

        S, out = jax.lax.scan(step, h0, (q, k, v, beta, g))
        call = eqx_seq.delta_rule_scan(
            q, k, v, beta, g=g, h0=h0, scale=0.5, normalize_qk=True, chunk_size=4,
            return_final_state=True,
        )  # fmt: skip
        return (out, S), call

    stepped, call = program(*(a[n] for n in ("q", "k", "v", "beta", "g", "h0")))
    for x, y in zip(stepped, call):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


def test_non_finite_inputs_reach_only_what_depends_on_them():
    """Two packed documents: NaN and inf in `q`, `k`, `v`, `beta` and `g` of the
    first, an `h0` of NaNs forgotten at the reset on step 0, and a NaN late in the
    second's `v`. The outputs and the final state are not finite exactly where the
    NumPy loop's are (a `v` entry reaches only its value channel, a `q` row only
    its step, a key, `beta` or gate the whole head; never an earlier step of its
    chunk, nor another document) and equal it elsewhere. The gradient of a loss on
    the second document's finite outputs is finite and equals that of a separate
    call on the second document alone: one compiled program."""
    T, G, H, dk, dv, start, chunk = 15, 1, 2, 3, 2, 6, 4
    a, rng = draw(T, G, H, dk, dv, seed=3)
    a["q"][1, 0, 2] = np.nan
    a["k"][3, 0, 0] = np.inf
    a["v"][2, 1, 0] = np.nan
    a["beta"][4, 0] = np.nan
    a["g"][5, 1] = np.inf
    a["v"][11, 0, 1] = np.nan  # in the second document
    h0 = np.full((H, dk, dv), np.nan)
    reset = np.zeros(T, bool)
    reset[[0, start]] = True
    names = ("q", "k", "v", "beta", "g")
    with np.errstate(invalid="ignore", over="ignore"):
        out_ref, S_ref = numpy_loop(*(a[n] for n in names), h0, reset, unit=True)
    finite = np.isfinite(out_ref[start:])
    w = rng.normal(size=finite.shape)

    def call(*x, h0=None, reset=None):
        return eqx_seq.delta_rule_scan(
            *x[:4], g=x[4], h0=h0, reset=reset, chunk_size=chunk, normalize_qk=True,
            return_final_state=True,
        )  # fmt: skip

    def later(*x):
        out = call(*x, h0=h0, reset=reset)[0][start:]
        return jnp.sum(jnp.where(finite, out, 0) * w)

    def alone(*x):
        return jnp.sum(jnp.where(finite, call(*x)[0], 0) * w)

    @jax.jit
    def program(*x):
        grads = jax.grad(later, range(len(x)))(*x)
        second = tuple(u[start:] for u in x)
        return (
            call(*x, h0=h0, reset=reset),
            tuple(d[start:] for d in grads),
            jax.grad(alone, range(len(x)))(*second),
        )

    (out, S), grads, grads_alone = program(*(jnp.asarray(a[n]) for n in names))
    for ours, ref in [(out, out_ref), (S, S_ref)]:
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
        ok = np.isfinite(ref)
        np.testing.assert_allclose(
            np.asarray(ours)[ok], ref[ok], rtol=1e-10, atol=1e-12
        )
    for n, d, d_alone in zip(names, grads, grads_alone):
        assert np.all(np.isfinite(d)), n
        np.testing.assert_allclose(d, d_alone, rtol=1e-10, atol=1e-12, err_msg=n)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input_and_half_precision():
    a, _ = draw(6, 2, 4, 3, 2)
    ok = {n: a[n] for n in ("q", "k", "v", "beta")}
    scan = eqx_seq.delta_rule_scan
    with pytest.raises(ValueError, match="use `jax.vmap` for a batch"):
        scan(**{**ok, "q": np.zeros((2, 6, 2, 3))})
    with pytest.raises(ValueError, match="3 heads of `q` and `k` must divide the 4"):
        scan(**{**ok, "q": np.zeros((6, 3, 3)), "k": np.zeros((6, 3, 3))})
    with pytest.raises(ValueError, match=r"`k` must have shape \(6, 2, 3\)"):
        scan(**{**ok, "k": np.zeros((6, 2, 4))})
    with pytest.raises(ValueError, match=r"`beta` must have shape \(6, 4\)"):
        scan(**{**ok, "beta": np.zeros((6, 2))})
    with pytest.raises(ValueError, match=r"`g` must have shape \(6, 4\)"):
        scan(**ok, g=np.zeros(6))
    with pytest.raises(ValueError, match=r"`h0` must have shape \(4, 3, 2\)"):
        scan(**ok, h0=np.zeros((4, 2, 3)))
    with pytest.raises(ValueError, match="real floating"):
        scan(**{**ok, "v": np.zeros((6, 4, 2), int)})
    with pytest.raises(ValueError, match="`reset` marks segment starts"):
        scan(**ok, reset=np.zeros(5, bool))
    with pytest.raises(ValueError, match="`scale` must be a finite positive"):
        scan(**ok, scale=0.0)
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        scan(**ok, chunk_size=0)
    with pytest.raises(ValueError, match="`beta` is required, got None"):
        scan(**{**ok, "beta": None})
    with pytest.raises(ValueError, match="dv = 0"):
        scan(**{**ok, "v": np.zeros((6, 4, 0))})
    for flag in ("normalize_qk", "return_final_state"):
        with pytest.raises(ValueError, match=f"`{flag}` must be a bool, got 'no'"):
            scan(**ok, **{flag: "no"})
    row = {n: x[0] for n, x in ok.items()}
    step = eqx_seq.delta_rule_step
    with pytest.raises(ValueError, match=r"`state` must have shape \(4, 3, 2\)"):
        step(np.zeros((4, 3)), **row)
    with pytest.raises(ValueError, match=r"`q` must have shape \(G, dk\)"):
        step(np.zeros((4, 3, 2)), **{**row, "q": ok["q"]})
    with pytest.raises(ValueError, match="`state` is required, got None"):
        step(None, **row)
    # half precision is computed in float32 and cast back
    half = {n: jnp.asarray(x, jnp.bfloat16) for n, x in ok.items()}
    out = scan(**half, chunk_size=4)
    assert out.dtype == jnp.bfloat16
    ref = scan(**{n: x.astype(jnp.float32) for n, x in half.items()}, chunk_size=4)
    np.testing.assert_allclose(
        out.astype(jnp.float32), ref.astype(jnp.bfloat16).astype(jnp.float32)
    )


# ------------------------------------------------------------------ the layer


def silu(x):
    return x / (1 + np.exp(-x))


def layer_reference(layer: eqx_seq.GatedDeltaNet, x, reset=None):
    """The Gated DeltaNet layer's equations in float64 NumPy, from its parameters:
    each segment of `reset` on its own (a fresh convolution and state)."""
    if reset is not None:
        starts = [*np.flatnonzero(reset), len(x)]
        starts = starts if starts[0] == 0 else [0, *starts]
        return np.concatenate(
            [layer_reference(layer, x[a:b]) for a, b in zip(starts, starts[1:])]
        )
    w = {
        name: np.asarray(getattr(layer, name), np.float64)
        for name in ("in_proj", "A_log", "dt_bias", "norm_weight", "out_proj")
    }
    conv_w = np.asarray(layer.conv.weight, np.float64)
    x = np.asarray(x, np.float64)
    T, K = len(x), layer.conv.kernel_size
    G, Hv, dk, dv = layer.num_heads, layer.num_v_heads, layer.head_dim, layer.value_dim
    proj = x @ w["in_proj"].T
    C = 2 * G * dk + Hv * dv
    qkv, z = proj[:, :C], proj[:, C : C + Hv * dv]
    b, a = proj[:, C + Hv * dv : C + Hv * dv + Hv], proj[:, C + Hv * dv + Hv :]
    padded = np.concatenate([np.zeros((K - 1, C)), qkv])
    qkv = silu(np.stack([np.sum(conv_w * padded[t : t + K], 0) for t in range(T)]))
    q = qkv[:, : G * dk].reshape(T, G, dk)
    k = qkv[:, G * dk : 2 * G * dk].reshape(T, G, dk)
    v = qkv[:, 2 * G * dk :].reshape(T, Hv, dv)
    beta = (2 if layer.negative_eigenvalues else 1) / (1 + np.exp(-b))
    g = -np.exp(w["A_log"]) * np.log1p(np.exp(a + w["dt_bias"]))
    o, _ = numpy_loop(q, k, v, beta, g, unit=True)
    o = o / np.sqrt(np.mean(o**2, axis=-1, keepdims=True) + layer.norm_eps)
    o = o * w["norm_weight"] * silu(z.reshape(T, Hv, dv))
    return o.reshape(T, Hv * dv) @ w["out_proj"].T


def _layer(key, **kw):
    kw = dict(num_heads=2, head_dim=3, num_v_heads=4, conv_size=3, chunk_size=4) | kw
    return eqx_seq.GatedDeltaNet(6, dtype=jnp.float64, key=key, **kw)


def test_layer_matches_numpy_and_every_form_agrees():
    """`GatedDeltaNet` (grouped value heads, chunks that do not divide T) against
    its equations in NumPy, with and without resets, with `beta` in (0, 1) and in
    (0, 2); step mode from `init_state()` and streaming in two parts through
    `final_state` equal the call; `GatedDeltaNetBlock` is `x + layer(norm(x))`
    and steps as it calls. One compiled program per layer."""
    layer = _layer(jr.key(0))
    negative = _layer(jr.key(0), negative_eigenvalues=True)  # the same parameters
    block = eqx_seq.GatedDeltaNetBlock(layer, norm="layer")
    T = 15
    x = jr.normal(jr.key(1), (T, 6), jnp.float64)
    reset = jnp.zeros(T, bool).at[jnp.array([6, 7, 12])].set(True)

    @eqx.filter_jit
    def forms(layer, negative, block, x, reset):
        def stepped(module):
            def step(state, row):
                return module.step(state, row[0], reset=row[1])

            return jax.lax.scan(step, module.init_state(), (x, reset))

        state = layer.final_state(x[:9], reset=reset[:9])
        final, steps = stepped(layer)
        return dict(
            y=layer(x), y_reset=layer(x, reset=reset),
            y_negative=negative(x, reset=reset),
            streamed=layer(x[9:], reset=reset[9:], h0=state), stepped=steps,
            final=final, whole=layer.final_state(x, reset=reset),
            block=block(x, reset=reset),
            block_ref=x + layer(jax.vmap(block.norm)(x), reset=reset),
            block_stepped=stepped(block)[1],
        )  # fmt: skip

    out = forms(layer, negative, block, x, reset)
    y_negative = out["y_negative"]
    tol = dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(out["y"], layer_reference(layer, x), **tol)
    np.testing.assert_allclose(out["y_reset"], layer_reference(layer, x, reset), **tol)
    np.testing.assert_allclose(y_negative, layer_reference(negative, x, reset), **tol)
    assert not np.allclose(y_negative, out["y_reset"])
    np.testing.assert_allclose(out["streamed"], out["y_reset"][9:], **tol)
    np.testing.assert_allclose(out["stepped"], out["y_reset"], **tol)
    for a, b in zip(out["final"], out["whole"], strict=True):
        np.testing.assert_allclose(a, b, **tol)
    np.testing.assert_allclose(out["block"], out["block_ref"], **tol)
    np.testing.assert_allclose(out["block_stepped"], out["block"], **tol)


def test_layer_gradients_and_initialisation():
    """The layer's gradient with respect to its input and every parameter against
    finite differences (along a random direction); the initialisation's ranges
    and the parameters labelled as the recurrence's."""
    layer = _layer(jr.key(2), num_v_heads=2, A_init_range=(2.0, 4.0))
    x = jr.normal(jr.key(3), (7, 6), jnp.float64)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    loss = jax.jit(lambda p, x: jnp.sum(jnp.sin(eqx.combine(p, static)(x))))
    args = (params, x)
    leaves, tree = jax.tree.flatten(args)
    keys = jr.split(jr.key(4), len(leaves))
    direction = jax.tree.unflatten(
        tree, [jr.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
    )
    grad = jax.jit(jax.grad(loss, (0, 1)))(*args)
    fd = directional_fd(lambda a: loss(*a), args, direction)
    np.testing.assert_allclose(directional_derivative(grad, direction), fd, rtol=1e-6)
    A = np.exp(layer.A_log)
    assert np.all((A >= 2 * (1 - 1e-9)) & (A <= 4 * (1 + 1e-9)))
    dt = jax.nn.softplus(layer.dt_bias)
    assert np.all((dt >= 1e-3 * (1 - 1e-9)) & (dt <= 1e-1 * (1 + 1e-9)))
    assert layer.conv.bias is None and layer.value_dim == 6
    assert layer.in_proj.shape == (2 * 2 * 3 + 2 * 6 + 2 * 6 + 2 * 2, 6)
    labels = eqx_seq.ssm_param_labels(eqx_seq.GatedDeltaNetBlock(layer))
    assert (labels.layer.A_log, labels.layer.dt_bias) == ("ssm", "ssm")
    assert labels.layer.in_proj == "regular"


@pytest.mark.usefixtures("unchecked_annotations")
def test_layer_bad_input():
    key = jr.key(0)
    with pytest.raises(ValueError, match="`num_v_heads` must be a multiple of"):
        eqx_seq.GatedDeltaNet(6, num_heads=2, num_v_heads=3, key=key)
    with pytest.raises(ValueError, match="`head_dim` must be a positive int"):
        eqx_seq.GatedDeltaNet(6, head_dim=0, key=key)
    with pytest.raises(ValueError, match="low <= high"):
        eqx_seq.GatedDeltaNet(6, A_init_range=(2.0, 1.0), key=key)
    with pytest.raises(ValueError, match="Need dt_min < dt_max"):
        eqx_seq.GatedDeltaNet(6, dt_min=0.1, dt_max=0.01, key=key)
    with pytest.raises(ValueError, match="`decay_init` must be one of"):
        eqx_seq.GatedDeltaNet(6, decay_init="uniform", key=key)
    with pytest.raises(ValueError, match="float32 or float64"):
        eqx_seq.GatedDeltaNet(6, dtype=jnp.float16, key=key)
    with pytest.raises(ValueError, match="`negative_eigenvalues` must be a bool"):
        eqx_seq.GatedDeltaNet(6, negative_eigenvalues=1, key=key)
    with pytest.raises(ValueError, match="`scan` must be an `eqx_seq.AbstractScan`"):
        eqx_seq.GatedDeltaNet(6, scan="sequential", key=key)
    with pytest.raises(ValueError, match="`layer` must be an `eqx_seq.GatedDelta"):
        eqx_seq.GatedDeltaNetBlock(eqx_seq.Mamba2(8, head_dim=4, key=key))
    layer = _layer(key)
    block = eqx_seq.GatedDeltaNetBlock(layer)
    with pytest.raises(ValueError, match="use `jax.vmap` for a batch"):
        layer(jnp.ones((2, 5, 6)))
    with pytest.raises(ValueError, match=r"shape \(T, H\) = \(T, 6\)"):
        block(jnp.ones((5, 4)))
    with pytest.raises(ValueError, match="`reset` marks segment starts"):
        layer(jnp.ones((5, 6)), reset=jnp.zeros(4, bool))
    with pytest.raises(ValueError, match=r"`GatedDeltaNet`: `state` must be a pair"):
        layer(jnp.ones((5, 6)), h0=jnp.zeros(3))
    conv, state = layer.init_state()
    with pytest.raises(ValueError, match=r"`state\[1\]` \(state\) must be a real"):
        layer.step((conv, state[:1]), jnp.ones(6))
    with pytest.raises(ValueError, match=r"`state\[0\]` \(conv_state\) must be a"):
        block.step((conv.astype(jnp.int32), state), jnp.ones(6))
    with pytest.raises(ValueError, match=r"takes one real input of shape \(6,\)"):
        layer.step(layer.init_state(), jnp.ones(5))
    with pytest.raises(ValueError, match=r"`GatedDeltaNet.step` needs a real input"):
        layer.step(layer.init_state(), jnp.ones(6, jnp.complex64))
    with pytest.raises(ValueError, match="must be a bool scalar"):
        layer.step(layer.init_state(), jnp.ones(6), reset=1)
