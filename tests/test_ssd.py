"""`ssd_scan` and `ssd_step` (Mamba-2's chunked scan) against the recurrent form: a
float64 NumPy loop for the values, the same loop in `jax.numpy` for the
derivatives (autodiff through the steps), and finite differences."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


# --- the references: the recurrent form, step by step ---


def numpy_loop(x, dt, A, B, C, D=None, z=None, h0=None, reset=None, **options):
    """The outputs and the final state, one step and one head at a time."""
    dt = dt + options.get("dt_bias", 0)
    if options.get("dt_softplus"):
        dt = np.log1p(np.exp(dt))
    dt = np.clip(dt, *options.get("dt_limit", (0, np.inf)))
    T, H, Pd = x.shape
    G, N = B.shape[1:]
    h = np.zeros((H, Pd, N)) if h0 is None else np.array(h0, dtype=np.float64)
    ys = np.zeros((T, H, Pd))
    for t in range(T):
        if reset is not None and reset[t]:
            h = np.zeros_like(h)
        for k in range(H):
            g = k // (H // G)
            a = np.exp(dt[t, k] * A[k])
            if options.get("negative_decays"):
                a = 2 * a - 1
            h[k] = a * h[k] + dt[t, k] * np.outer(x[t, k], B[t, g])
            ys[t, k] = h[k] @ C[t, g]
    if D is not None:
        ys = ys + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        ys = ys * z / (1 + np.exp(-z))
    return ys, h


def jax_loop(x, dt, A, B, C, D=None, z=None, h0=None, reset=None, **options):
    """`numpy_loop` in `jax.numpy` (a `lax.scan` over the steps), to differentiate."""
    if "dt_bias" in options:
        dt = dt + options["dt_bias"][None]
    if options.get("dt_softplus"):
        dt = jax.nn.softplus(dt)
    dt = jnp.clip(dt, *options.get("dt_limit", (0, jnp.inf)))
    T, H, Pd = x.shape
    G, N = B.shape[1:]
    heads = lambda v: jnp.repeat(v, H // G, axis=1)  # (T, G, N) -> (T, H, N)
    keep = jnp.ones(T) if reset is None else 1 - jnp.asarray(reset, x.dtype)

    def step(h, row):
        x_t, dt_t, B_t, C_t, keep_t = row
        decay = jnp.exp(dt_t * A)
        if options.get("negative_decays"):
            decay = 2 * decay - 1
            # `ssd_scan`'s convention: a decay of exactly zero forgets the state
            # as a reset does, its derivative included
            decay = jnp.where(decay == 0, jax.lax.stop_gradient(decay), decay)
        decay = keep_t * decay
        h = decay[:, None, None] * h + (dt_t[:, None] * x_t)[..., None] * B_t[:, None]
        return h, jnp.einsum("hpn,hn->hp", h, C_t)

    h = jnp.zeros((H, Pd, N), x.dtype) if h0 is None else h0
    h, ys = jax.lax.scan(step, h, (x, dt, heads(B), heads(C), keep))
    if D is not None:
        ys = ys + (D[None, :, None] if D.ndim == 1 else D[None]) * x
    if z is not None:
        ys = ys * jax.nn.silu(z)
    return ys, h


def draw(T, H, Pd, G, N, seed=0, D_shape=None):
    rng = np.random.default_rng(seed)
    arrays = dict(
        x=rng.normal(size=(T, H, Pd)),
        dt=rng.uniform(-1.5, 0.5, size=(T, H)),
        A=-rng.uniform(0.5, 2.0, size=H),
        B=rng.normal(size=(T, G, N)),
        C=rng.normal(size=(T, G, N)),
    )
    if D_shape is not None:
        arrays["D"] = rng.normal(size=D_shape)
    return arrays, rng


# every argument in some case; resets at a chunk boundary (8), inside chunks, on
# step 0 (which ignores h0) and two in one chunk
CASES = {
    "plain": dict(T=19, H=2, P=3, G=1, N=4, chunk=4, options={}),
    "groups, D, z, h0, bias, limit": dict(
        T=13, H=4, P=2, G=2, N=3, chunk=5, D=(4, 2), z=True, h0=True,
        options=dict(dt_bias=0.3, dt_softplus=True, dt_limit=(0.05, 0.9)),
    ),
    "resets, h0, D": dict(
        T=17, H=3, P=2, G=3, N=2, chunk=4, D=(3,), h0=True,
        reset=[0, 5, 6, 8, 13], options=dict(dt_softplus=True),
    ),
    # decays in (-1, 1), a reset, and one decay exactly zero (a forgetting step of
    # one head only, set in `_case`)
    "negative decays, zero decay, groups": dict(
        T=18, H=4, P=2, G=2, N=3, chunk=5, h0=True, reset=[9],
        options=dict(negative_decays=True),
    ),
}  # fmt: skip


def _case(name):
    c = CASES[name]
    arrays, rng = draw(c["T"], c["H"], c["P"], c["G"], c["N"], D_shape=c.get("D"))
    if c.get("z"):
        arrays["z"] = rng.normal(size=(c["T"], c["H"], c["P"]))
    if c.get("h0"):
        arrays["h0"] = rng.normal(size=(c["H"], c["P"], c["N"]))
    options = dict(c["options"])
    if "dt_bias" in options:
        options["dt_bias"] = np.full(c["H"], options["dt_bias"])
    if not options.get("dt_softplus"):
        arrays["dt"] = np.abs(arrays["dt"])
    if options.get("negative_decays"):
        # large steps give negative decays; dt A = -log 2 gives a decay of zero
        arrays["dt"] = arrays["dt"] * 3
        arrays["A"][1] = -1.0
        arrays["dt"][6, 1] = np.log(2.0)
    reset = None
    if "reset" in c:
        reset = np.zeros(c["T"], bool)
        reset[c["reset"]] = True
    return arrays, options, reset, c["chunk"]


# slow tier: all but the resets on the sequential backend; the associative backend's
# chunks with resets, negative decays, groups, `z`, `D` and `dt_bias` are checked
# against the NumPy loop by test_non_finite_inputs_reach_only_what_depends_on_them
# [associative-8-True]
@pytest.mark.parametrize(
    "name, backend",
    [
        pytest.param("plain", "sequential", marks=pytest.mark.slow),
        pytest.param(
            "groups, D, z, h0, bias, limit", "associative", marks=pytest.mark.slow
        ),
        ("resets, h0, D", "sequential"),
        pytest.param("resets, h0, D", "associative", marks=pytest.mark.slow),
        pytest.param(
            "negative decays, zero decay, groups", "sequential", marks=pytest.mark.slow
        ),
    ],
)
def test_matches_the_recurrent_form(name, backend):
    """Outputs and final state against the NumPy loop; the gradient of a weighted
    sum of both with respect to every array argument, and a forward-mode
    derivative, against autodiff through the JAX loop: one compiled program per
    side."""
    arrays, options, reset, chunk = _case(name)
    scan = {
        "sequential": eqx_seq.SequentialScan(),
        "associative": eqx_seq.AssociativeScan(),
    }[backend]
    y_ref, h_ref = numpy_loop(**arrays, reset=reset, **options)
    rng = np.random.default_rng(1)
    w_y, w_h = rng.normal(size=y_ref.shape), rng.normal(size=h_ref.shape)
    names = sorted(arrays)
    floats = {k: v for k, v in options.items() if k == "dt_bias"}
    static = {k: v for k, v in options.items() if k != "dt_bias"}
    names_f = sorted(floats)

    def ours(*values):
        kw = dict(zip(names + names_f, values))
        return eqx_seq.ssd_scan(
            **kw, reset=reset, **static, chunk_size=chunk, scan=scan,
            return_final_state=True,
        )  # fmt: skip

    def theirs(*values):
        return jax_loop(**dict(zip(names + names_f, values)), reset=reset, **static)

    def program(fn):
        def loss(*values):
            y, h = fn(*values)
            return jnp.sum(y * w_y) + jnp.sum(h * w_h)

        @jax.jit
        def run(*values):
            tangents = tuple(jnp.cos(v) for v in values)
            return (
                fn(*values),
                jax.grad(loss, range(len(values)))(*values),
                jax.jvp(loss, values, tangents)[1],
            )

        return run

    values = tuple(jnp.asarray(arrays[k]) for k in names) + tuple(
        jnp.asarray(floats[k]) for k in names_f
    )
    (y, h), grads, tangent = program(ours)(*values)
    _, grads_ref, tangent_ref = program(theirs)(*values)
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, h_ref, rtol=1e-10, atol=1e-12)
    for k, g, g_ref in zip(names + names_f, grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=1e-9, atol=1e-11, err_msg=k)
    np.testing.assert_allclose(tangent, tangent_ref, rtol=1e-10)


def test_lengths_chunks_and_the_step_form():
    """`T = 1`, a chunk longer than `T`, `T` a multiple of the chunk, and one chunk
    per step: the NumPy loop's outputs and final state; `ssd_step` from `h0` on each
    step in turn: the same (its own compiled step, reused)."""
    arrays, rng = draw(12, 4, 2, 2, 3, seed=3, D_shape=(4,))
    arrays["dt"] = np.abs(arrays["dt"])
    h0 = rng.normal(size=(4, 2, 3))
    z = rng.normal(size=(12, 4, 2))
    y_ref, h_ref = numpy_loop(**arrays, z=z, h0=h0)
    for T, chunk in [(12, 3), (12, 64), (12, 1), (7, 4), (1, 4)]:
        part = {k: v[:T] if v.shape[0] == 12 else v for k, v in arrays.items()}
        y, h = eqx_seq.ssd_scan(
            **part, z=z[:T], h0=h0, chunk_size=chunk, return_final_state=True
        )
        y_T, h_T = numpy_loop(**part, z=z[:T], h0=h0)
        np.testing.assert_allclose(y, y_T, rtol=1e-10, atol=1e-12, err_msg=str(T))
        np.testing.assert_allclose(h, h_T, rtol=1e-10, atol=1e-12, err_msg=str(T))
    step = jax.jit(eqx_seq.ssd_step)
    state, ys = h0, []
    for t in range(12):
        row = {k: v[t] for k, v in arrays.items() if k in ("x", "dt", "B", "C")}
        y_t, state = step(state, **row, A=arrays["A"], D=arrays["D"], z=z[t])
        ys.append(y_t)
    np.testing.assert_allclose(np.stack(ys), y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state, h_ref, rtol=1e-10, atol=1e-12)


def test_half_precision_is_computed_in_float32():
    arrays, _ = draw(10, 2, 2, 1, 3, seed=4)
    arrays["dt"] = np.abs(arrays["dt"])
    half = {k: jnp.asarray(v, jnp.bfloat16) for k, v in arrays.items()}
    single = {k: v.astype(jnp.float32) for k, v in half.items()}
    y = eqx_seq.ssd_scan(**half, chunk_size=4)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        y, eqx_seq.ssd_scan(**single, chunk_size=4).astype(jnp.bfloat16)
    )


# slow tier: `jax.vmap` of the scan's custom derivative; the scan's gradient is
# checked in the fast tier by test_matches_the_recurrent_form[resets, h0, D-
# sequential] and its split by test_split_over_devices_equals_one_device
@pytest.mark.slow
def test_batched_gradient_equals_each_example():
    """`jax.grad` of a loss summed over a `jax.vmap` of `ssd_scan` (as a model's
    batch is trained), with per-example or shared `h0` and resets and a shared `A`:
    the sums of the examples' gradients, each computed alone."""
    arrays, rng = draw(9, 2, 2, 1, 3, seed=6)
    arrays["dt"] = np.abs(arrays["dt"])
    A = jnp.asarray(arrays.pop("A"))
    batch = {
        k: jnp.asarray(np.stack([v, rng.normal(size=v.shape)]))
        for k, v in arrays.items()
    }
    batch["dt"] = jnp.abs(batch["dt"])
    batch["h0"] = jnp.asarray(rng.normal(size=(2, 2, 2, 3)))
    reset = jnp.asarray(np.array([[0, 0, 0, 1, 0, 0, 0, 0, 0], [0] * 9], bool))

    def loss(A, x, dt, B, C, h0, reset):
        y, h = eqx_seq.ssd_scan(
            x, dt, A, B, C, h0=h0, reset=reset, chunk_size=4,
            return_final_state=True,
        )  # fmt: skip
        return jnp.sum(jnp.sin(y)) + jnp.sum(h**2)

    args = [batch[k] for k in ("x", "dt", "B", "C", "h0")] + [reset]
    one = jax.jit(jax.grad(loss, range(6)))

    @ft.partial(jax.jit, static_argnums=0)
    def batched(axes, *args):
        total = lambda *a: jnp.sum(jax.vmap(loss, axes)(*a))
        return jax.grad(total, range(6))(*args)

    # per-example `h0` and resets, then one `h0` shared by the batch and no resets
    for axes, args in [
        ((None, 0, 0, 0, 0, 0, 0), args),
        ((None, 0, 0, 0, 0, None, None), args[:4] + [args[4][0], None]),
    ]:
        got = batched(axes, A, *args)
        each = [
            one(A, *(a if ax is None else a[i] for a, ax in zip(args, axes[1:])))
            for i in range(2)
        ]
        for k, axis in enumerate(axes[:6]):
            want = (
                sum(e[k] for e in each)
                if axis is None
                else jnp.stack([e[k] for e in each])
            )
            np.testing.assert_allclose(got[k], want, rtol=1e-12, atol=1e-14)


# slow tier: a bound on memory, not on numbers (the selective scan's counterpart,
# test_selective.py's test_selective_scan_gradient_does_not_store_the_states, is fast)
@pytest.mark.slow
def test_gradient_keeps_chunk_states_not_step_states():
    """The residuals of the gradient: nothing of the size of the `(T, H, P, N)`
    states, and in all at most the inputs plus a few arrays of chunk states
    (`T / chunk_size` of them)."""
    T, H, Pd, G, N, chunk = 256, 2, 4, 1, 8, 32
    arrays, _ = draw(T, H, Pd, G, N, seed=5)
    values = [jnp.asarray(arrays[k]) for k in ("x", "dt", "A", "B", "C")]
    fn = lambda *v: eqx_seq.ssd_scan(*v, dt_softplus=True, chunk_size=chunk)
    _, pullback = jax.vjp(fn, *values)
    sizes = [r.size for r in jax.tree.leaves(pullback) if hasattr(r, "size")]
    states = T * H * Pd * N
    inputs = sum(v.size for v in values)
    assert max(sizes) < states
    assert sum(sizes) <= 4 * inputs + 4 * (T // chunk) * H * Pd * N


def test_split_over_devices_equals_one_device():
    """Inside `jax.shard_map` with `eqx_seq.ShardedScan` on four devices (resets in
    some blocks, chunks that do not divide a block, a NaN in a document that spans
    three devices and one in the last): outputs, the last device's final state and
    the gradient of a loss on the finite outputs with respect to every argument
    equal one device's, from one compiled program per side."""
    T, H, Pd, G, N = 36, 2, 2, 1, 3
    arrays, rng = draw(T, H, Pd, G, N, seed=6, D_shape=(H,))
    arrays["h0"] = rng.normal(size=(H, Pd, N))
    arrays["x"][6, 1, 0] = np.nan
    arrays["B"][30, 0, 2] = np.inf
    reset = np.zeros(T, bool)
    reset[[4, 20, 27]] = True
    names = ("x", "dt", "A", "B", "C", "D", "h0")
    values = tuple(jnp.asarray(arrays[k]) for k in names)
    timed = {"x", "dt", "B", "C"}
    w = jnp.asarray(rng.normal(size=(T, H, Pd)))

    def call(scan, *v, reset):
        kw = dict(zip(names, v))
        return eqx_seq.ssd_scan(
            **kw, dt_softplus=True, reset=reset, chunk_size=4, scan=scan,
            return_final_state=True,
        )  # fmt: skip

    mesh = Mesh(np.array(jax.devices()[:4]), ("t",))
    specs = tuple(P("t") if k in timed else P() for k in names)
    split = jax.shard_map(
        lambda *v: call(eqx_seq.ShardedScan("t"), *v[:-1], reset=v[-1]),
        mesh=mesh,
        in_specs=(*specs, P("t")),
        out_specs=(P("t"), P("t")),
    )
    split_y = lambda *v: split(*v)
    one = lambda *v: call(eqx_seq.SequentialScan(), *v[:-1], reset=v[-1])

    def program(fn, last):
        def loss(*v):
            y, h = fn(*v, jnp.asarray(reset))
            finite = lambda u: jnp.where(jnp.isfinite(u), u, 0)
            return jnp.sum(finite(y) * w) + jnp.sum(finite(last(h)))

        return jax.jit(
            lambda *v: (fn(*v, jnp.asarray(reset)), jax.grad(loss, range(7))(*v))
        )

    # the split program's final states come back stacked per device: the last one's
    (y, h), grads = program(split_y, lambda h: h.reshape(4, H, Pd, N)[-1])(*values)
    (y1, h1), grads1 = program(one, lambda h: h)(*values)
    assert np.isnan(y1[6:20, 1, 0]).all() and np.isfinite(y1[:6]).all()
    assert np.isnan(h1[:, :, 2]).all() and np.isfinite(h1[:, :, :2]).all()
    np.testing.assert_allclose(y, y1, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h.reshape(4, H, Pd, N)[-1], h1, rtol=1e-10, atol=1e-12)
    for k, g, g1 in zip(names, grads, grads1):
        assert np.all(np.isfinite(g1)), k
        np.testing.assert_allclose(g, g1, rtol=1e-9, atol=1e-11, err_msg=k)


# slow tier: the sequential backend, whose resets test_matches_the_recurrent_form
# [resets, h0, D-sequential] checks, and its packing with a NaN in a document
# test_packed.py's test_stacked_blocks_keep_documents_apart[Mamba2Block]
@pytest.mark.parametrize(
    "backend, chunk, negative",
    [
        pytest.param("sequential", 4, False, marks=pytest.mark.slow),
        ("associative", 8, True),
    ],
)
def test_non_finite_inputs_reach_only_what_depends_on_them(backend, chunk, negative):
    """Two packed documents: NaN and inf in `x`, `dt`, `B`, `C` and `z` of the
    first, an `h0` of NaNs forgotten at the reset on step 0, and a NaN late in the
    second. The outputs and the final state are not finite exactly where the NumPy
    loop's are (later steps of the bad entry's document: never an earlier step of
    its chunk, nor another document) and equal it elsewhere. The gradient of a loss
    on the second document's finite outputs, with respect to its steps and to the
    shared `A`, `D` and `dt_bias`, is finite and equals that of a separate call on
    the second document alone: one compiled program."""
    T, H, Pd, G, N, start = 13, 4, 2, 2, 3, 6
    arrays, rng = draw(T, H, Pd, G, N, seed=7, D_shape=(H, Pd))
    arrays["z"] = rng.normal(size=(T, H, Pd))
    bias = rng.normal(size=H) * 0.1
    arrays["x"][2, 1, 0] = np.nan
    arrays["dt"][4, 2] = np.inf
    arrays["B"][3, 0, 1] = np.nan
    arrays["C"][1, 1, 2] = -np.inf
    arrays["z"][5, 0, 1] = np.nan
    arrays["x"][10, 3, 1] = np.nan  # in the second document
    h0 = np.full((H, Pd, N), np.nan)
    reset = np.zeros(T, bool)
    reset[[0, start]] = True
    options = dict(dt_softplus=True, negative_decays=negative)
    with np.errstate(invalid="ignore", over="ignore"):
        y_ref, h_ref = numpy_loop(**arrays, h0=h0, reset=reset, dt_bias=bias, **options)
    scan = {
        "sequential": eqx_seq.SequentialScan(),
        "associative": eqx_seq.AssociativeScan(),
    }[backend]
    timed = ("x", "dt", "B", "C", "z")
    names = (*timed, "A", "D", "dt_bias")
    values = tuple(jnp.asarray(arrays.get(k, bias)) for k in names)
    finite = np.isfinite(y_ref[start:])
    w = rng.normal(size=finite.shape)

    def call(*v, h0=None, reset=None):
        return eqx_seq.ssd_scan(
            **dict(zip(names, v)), h0=h0, reset=reset, chunk_size=chunk, scan=scan,
            return_final_state=True, **options,
        )  # fmt: skip

    def later(*v):
        return jnp.sum(
            jnp.where(finite, call(*v, h0=h0, reset=reset)[0][start:], 0) * w
        )

    def alone(*v):
        return jnp.sum(jnp.where(finite, call(*v)[0], 0) * w)

    @jax.jit
    def program(*v):
        second = tuple(u[start:] if k in timed else u for k, u in zip(names, v))
        grads = jax.grad(later, range(len(v)))(*v)
        grads = tuple(g[start:] if k in timed else g for k, g in zip(names, grads))
        return (
            call(*v, h0=h0, reset=reset),
            grads,
            jax.grad(alone, range(len(v)))(*second),
        )

    (y, h), grads, grads_alone = program(*values)
    for ours, ref in [(y, y_ref), (h, h_ref)]:
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
        ok = np.isfinite(ref)
        np.testing.assert_allclose(
            np.asarray(ours)[ok], ref[ok], rtol=1e-10, atol=1e-12
        )
    for k, g, g_alone in zip(names, grads, grads_alone):
        assert np.all(np.isfinite(g)), k
        np.testing.assert_allclose(g, g_alone, rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    arrays, _ = draw(8, 4, 2, 2, 3)
    ok = dict(arrays)
    with pytest.raises(ValueError, match="use `jax.vmap` for a batch"):
        eqx_seq.ssd_scan(**{**ok, "x": np.zeros((2, 8, 4, 2))})
    with pytest.raises(ValueError, match="3 groups of `B` and `C` must divide the 4"):
        eqx_seq.ssd_scan(**{**ok, "B": np.zeros((8, 3, 3)), "C": np.zeros((8, 3, 3))})
    with pytest.raises(ValueError, match=r"`dt` must have shape \(8, 4\)"):
        eqx_seq.ssd_scan(**{**ok, "dt": np.zeros((8, 2))})
    with pytest.raises(ValueError, match=r"`D` must have shape \(H,\) or \(H, P\)"):
        eqx_seq.ssd_scan(**ok, D=np.zeros(3))
    with pytest.raises(ValueError, match=r"`h0` must have shape \(4, 2, 3\)"):
        eqx_seq.ssd_scan(**ok, h0=np.zeros((4, 3)))
    with pytest.raises(ValueError, match="real floating"):
        eqx_seq.ssd_scan(**{**ok, "x": np.zeros((8, 4, 2), int)})
    with pytest.raises(ValueError, match="`reset` marks segment starts"):
        eqx_seq.ssd_scan(**ok, reset=np.zeros(7, bool))
    with pytest.raises(ValueError, match="0 <= low <= high"):
        eqx_seq.ssd_scan(**ok, dt_limit=(0.5, 0.1))
    with pytest.raises(ValueError, match="pair of numbers"):
        eqx_seq.ssd_scan(**ok, dt_limit=0.5)
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        eqx_seq.ssd_scan(**ok, chunk_size=0)
    with pytest.raises(ValueError, match="AbstractScan"):
        eqx_seq.ssd_scan(**ok, scan="sequential")
    for key in ("x", "B", "A"):
        with pytest.raises(ValueError, match=f"`{key}` is required, got None"):
            eqx_seq.ssd_scan(**{**ok, key: None})
    with pytest.raises(ValueError, match="G = 0 groups"):
        eqx_seq.ssd_scan(**{**ok, "B": np.zeros((8, 0, 3)), "C": np.zeros((8, 0, 3))})
    with pytest.raises(ValueError, match="N = 0 states"):
        eqx_seq.ssd_scan(**{**ok, "B": np.zeros((8, 2, 0)), "C": np.zeros((8, 2, 0))})
    for flag in ("dt_softplus", "negative_decays", "return_final_state"):
        with pytest.raises(ValueError, match=f"`{flag}` must be a bool, got 'no'"):
            eqx_seq.ssd_scan(**ok, **{flag: "no"})
    row = {k: v[0] for k, v in arrays.items() if k != "A"}
    state = np.zeros((4, 2, 3))
    with pytest.raises(ValueError, match=r"`state` must have shape \(4, 2, 3\)"):
        eqx_seq.ssd_step(np.zeros((4, 2)), **row, A=arrays["A"])
    with pytest.raises(ValueError, match=r"`x` must have shape \(H, P\)"):
        eqx_seq.ssd_step(state, **{**row, "x": arrays["x"]}, A=arrays["A"])
    with pytest.raises(ValueError, match="`state` is required, got None"):
        eqx_seq.ssd_step(None, **row, A=arrays["A"])
    with pytest.raises(ValueError, match="`C` is required, got None"):
        eqx_seq.ssd_step(state, **{**row, "C": None}, A=arrays["A"])
    with pytest.raises(ValueError, match="`dt_softplus` must be a bool, got 1"):
        eqx_seq.ssd_step(state, **row, A=arrays["A"], dt_softplus=1)
