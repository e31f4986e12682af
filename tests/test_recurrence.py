"""`eqx_seq.linear_recurrence` against a float64 NumPy loop, and its derivatives."""

import itertools as it

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import directional_derivative, directional_fd, slow_except
from hypothesis import given, settings, strategies as st

import eqx_seq


BACKENDS = {
    "sequential": eqx_seq.SequentialScan(),
    "sequential-unroll3": eqx_seq.SequentialScan(unroll=3),
    "associative": eqx_seq.AssociativeScan(),
    "auto": eqx_seq.AutoScan(),
}


def numpy_recurrence(a, b, h0=None, reverse=False):
    """Textbook loop in float64/complex128: h_t = a_t h_{t-1} + b_t."""
    b = np.asarray(
        b,
        dtype=np.complex128 if np.iscomplexobj(b) or np.iscomplexobj(a) else np.float64,
    )
    a = np.asarray(a, dtype=b.dtype)
    if a.ndim < b.ndim:
        a = np.broadcast_to(a, b.shape)
    h = np.zeros(b.shape[1:], b.dtype) if h0 is None else np.asarray(h0, b.dtype).copy()
    out = np.empty_like(b)
    steps = range(len(b) - 1, -1, -1) if reverse else range(len(b))
    for t in steps:
        h = a[t] * h + b[t]
        out[t] = h
    return out


def jax_loop(a, b, h0, reverse=False):
    """The same loop in unrolled jax.numpy; its autodiff is an independent reference."""
    a = jnp.broadcast_to(a, b.shape) if a.ndim < b.ndim else a
    h, out = h0, [None] * b.shape[0]
    steps = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
    for t in steps:
        h = a[t] * h + b[t]
        out[t] = h
    return jnp.stack(out)


def make_inputs(rng, T, S, *, time_invariant, complex_, dtype=np.float64):
    a_shape = S if time_invariant else (T, *S)
    a = rng.uniform(-0.95, 0.95, a_shape)
    b = rng.normal(size=(T, *S))
    h0 = rng.normal(size=S)
    if complex_:
        a = a * np.exp(1j * rng.uniform(-np.pi, np.pi, a_shape))
        b = b + 1j * rng.normal(size=b.shape)
        h0 = h0 + 1j * rng.normal(size=S)
        dtype = np.complex128 if dtype == np.float64 else np.complex64
    return a.astype(dtype), b.astype(dtype), h0.astype(dtype)


CASES = list(
    it.product(
        ["sequential", "associative"],  # unroll and auto: test_backends_agree
        [1, 7, 100],  # one step, odd, non-power-of-two, longer
        [(3,), (2, 3)],  # flat and batched state shapes
        [True, False],  # time-invariant / time-varying decay
        [False, True],  # real / complex
        [False, True],  # forward / reverse
    )
)
# slow tier: the associative backend's longer sequences but one (batched state,
# time-varying, complex, reverse); its every variant runs at T = 1 and 7, and the
# sequential backend's at every length
_LONG_ASSOCIATIVE_FAST = ("associative", 100, (2, 3), False, True, True)
LOOP_CASES = [
    pytest.param(
        *case,
        marks=[pytest.mark.slow]
        if case[:2] == ("associative", 100) and case != _LONG_ASSOCIATIVE_FAST
        else [],
    )
    for case in CASES
]


@pytest.mark.parametrize("backend,T,S,time_invariant,complex_,reverse", LOOP_CASES)
def test_values_match_numpy_loop(backend, T, S, time_invariant, complex_, reverse):
    rng = np.random.default_rng(T + len(S))
    a, b, h0 = make_inputs(rng, T, S, time_invariant=time_invariant, complex_=complex_)
    expected = numpy_recurrence(a, b, h0, reverse)
    got = eqx_seq.linear_recurrence(a, b, h0, scan=BACKENDS[backend], reverse=reverse)
    assert got.shape == b.shape and got.dtype == b.dtype
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["sequential", "associative"])
def test_long_float32(backend):
    rng = np.random.default_rng(0)
    a, b, h0 = make_inputs(
        rng, 1024, (16,), time_invariant=True, complex_=True, dtype=np.float32
    )
    a = (a / np.abs(a) * 0.999).astype(np.complex64)  # slow decay: long memory
    got = eqx_seq.linear_recurrence(a, b, h0, scan=BACKENDS[backend])
    assert got.dtype == jnp.complex64
    expected = numpy_recurrence(a, b, h0)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=1e-4 * scale)


def test_no_initial_state_means_zeros():
    rng = np.random.default_rng(1)
    a, b, _ = make_inputs(rng, 9, (4,), time_invariant=False, complex_=False)
    np.testing.assert_allclose(
        eqx_seq.linear_recurrence(a, b), numpy_recurrence(a, b), rtol=1e-12
    )


def test_broadcasting_and_promotion():
    # shared scalar decay, scalar h0, leading size-1 time axis, real a with complex b
    b = (np.arange(12.0).reshape(4, 3) + 1j).astype(np.complex64)
    for a in [
        np.float32(0.5),
        np.full((1, 3), 0.5, np.float32),
        np.full((3,), 0.5, np.float32),
    ]:
        got = eqx_seq.linear_recurrence(a, b, np.float32(2.0))
        assert got.dtype == jnp.complex64
        np.testing.assert_allclose(
            got, numpy_recurrence(np.full(3, 0.5), b, np.full(3, 2.0)), rtol=1e-6
        )
    # a per-step decay shared across the state: (T, 1)
    a = np.linspace(0.1, 0.9, 4)[:, None]
    np.testing.assert_allclose(
        eqx_seq.linear_recurrence(a, b.real.astype(np.float64)),
        numpy_recurrence(np.broadcast_to(a, (4, 3)), b.real),
        rtol=1e-12,
    )
    # a scalar state, S = (): `b` of shape (T,), `h0` a Python float
    b = np.arange(1.0, 6.0)
    np.testing.assert_allclose(
        eqx_seq.linear_recurrence(np.float32(0.5), b, 2.0),
        numpy_recurrence(0.5, b, 2.0),
        rtol=1e-12,
    )


# ----------------------------------------------------------------------------------
# Derivatives


def _loss_weights(shape, complex_):
    w = np.cos(np.arange(np.prod(shape))).reshape(shape)
    return w * (1 - 0.5j) if complex_ else w


def make_loss(fn, complex_, shape):
    w = jnp.asarray(_loss_weights(shape, complex_))

    def loss(a, b, h0):
        h = fn(a, b, h0)
        # nonlinear, real-valued, and touching every state
        return jnp.sum(jnp.real(w * h)) + 0.3 * jnp.sum(jnp.abs(h) ** 2)

    return loss


GRAD_CASES = list(
    it.product(
        ["sequential", "associative"], [True, False], [False, True], [False, True]
    )
)


# slow tier: the other combinations; each backend runs a time-invariant and a
# time-varying decay, real and complex, forward and reverse in the fast tier
@pytest.mark.parametrize(
    "backend,time_invariant,complex_,reverse",
    slow_except(
        GRAD_CASES,
        [
            ("sequential", True, True, True),
            ("sequential", False, False, False),
            ("associative", True, False, False),
            ("associative", False, True, True),
        ],
    ),
)
def test_gradients(backend, time_invariant, complex_, reverse):
    T, S = 11, (2, 3)
    rng = np.random.default_rng(2)
    a, b, h0 = (
        jnp.asarray(x)
        for x in make_inputs(
            rng, T, S, time_invariant=time_invariant, complex_=complex_
        )
    )
    scan = BACKENDS[backend]
    ours = make_loss(
        lambda a, b, h0: eqx_seq.linear_recurrence(
            a, b, h0, scan=scan, reverse=reverse
        ),
        complex_,
        (T, *S),
    )
    ref = make_loss(lambda a, b, h0: jax_loop(a, b, h0, reverse), complex_, (T, *S))

    # reverse mode, all arguments together and each alone (each alone takes the
    # sensitivity path for a time-invariant decay), against autodiff of the loop
    @jax.jit
    def all_gradients(a, b, h0):
        together = jax.grad(ours, argnums=(0, 1, 2))(a, b, h0)
        alone = tuple(jax.grad(ours, argnums=i)(a, b, h0) for i in range(3))
        return together, alone, jax.grad(ref, argnums=(0, 1, 2))(a, b, h0)

    got, alone, expected = all_gradients(a, b, h0)
    assert eqx.tree_equal(got, expected, rtol=1e-10, atol=1e-10)
    assert eqx.tree_equal(alone, expected, rtol=1e-10, atol=1e-10)

    # against central finite differences along a random direction
    jitted = jax.jit(ours)
    args = (a, b, h0)
    for i, x in enumerate(args):
        v = rng.normal(size=x.shape) + (
            1j * rng.normal(size=x.shape) if complex_ else 0
        )
        v = jnp.asarray(v, x.dtype)
        fd = directional_fd(lambda x, i=i: jitted(*args[:i], x, *args[i + 1 :]), x, v)
        np.testing.assert_allclose(
            directional_derivative(got[i], v), fd, rtol=1e-6, atol=1e-7
        )


# slow tier: the other combinations; each backend's forward mode runs in the fast
# tier once, a time-varying decay on one and a time-invariant one on the other (both
# argument sets, so both derivative paths, in each), real and complex
@pytest.mark.parametrize(
    "backend,time_invariant,complex_,reverse",
    slow_except(
        GRAD_CASES,
        [("sequential", False, False, False), ("associative", True, False, True)],
    ),
)
def test_jacfwd_equals_jacrev(backend, time_invariant, complex_, reverse):
    T, S = 6, (3,)
    rng = np.random.default_rng(3)
    a, b, h0 = (
        jnp.asarray(x)
        for x in make_inputs(
            rng, T, S, time_invariant=time_invariant, complex_=complex_
        )
    )
    scan = BACKENDS[backend]
    f = lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan, reverse=reverse)
    # (0, 2): `b` unperturbed, the sensitivity path for a time-invariant decay;
    # (0, 1, 2): the adjoint-solve path.
    for argnums in [(0, 2), (0, 1, 2)]:

        @jax.jit
        def jacobians(a, b, h0):
            kw = dict(argnums=argnums, holomorphic=complex_)
            ref = jax.jacfwd(lambda *x: jax_loop(*x, reverse), **kw)(a, b, h0)
            return jax.jacfwd(f, **kw)(a, b, h0), jax.jacrev(f, **kw)(a, b, h0), ref

        fwd, rev, ref = jacobians(a, b, h0)
        assert eqx.tree_equal(fwd, rev, rtol=1e-12, atol=1e-12)
        assert eqx.tree_equal(fwd, ref, rtol=1e-12, atol=1e-12)


# slow tier: three of the four; second derivatives are of the same rules (first
# derivatives of both backends: test_gradients, test_jacfwd_equals_jacrev)
@pytest.mark.parametrize(
    "backend,time_invariant",
    slow_except(
        it.product(["sequential", "associative"], [True, False]),
        [("associative", False)],
    ),
)
def test_hessian(backend, time_invariant):
    T, S = 5, (2,)
    rng = np.random.default_rng(4)
    a, b, h0 = (
        jnp.asarray(x)
        for x in make_inputs(rng, T, S, time_invariant=time_invariant, complex_=False)
    )
    scan = BACKENDS[backend]
    ours = make_loss(
        lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan), False, (T, *S)
    )
    ref = make_loss(jax_loop, False, (T, *S))
    for argnums in [0, (0, 1, 2)]:
        got = jax.jit(jax.hessian(ours, argnums=argnums))(a, b, h0)
        expected = jax.jit(jax.hessian(ref, argnums=argnums))(a, b, h0)
        assert eqx.tree_equal(got, expected, rtol=1e-10, atol=1e-10)
    # and one Hessian-vector product against finite differences of the gradient
    v = jnp.asarray(rng.normal(size=a.shape))
    g = jax.jit(jax.grad(ours))
    fd = directional_fd(lambda a: g(a, b, h0), a, v)
    np.testing.assert_allclose(
        jax.jit(jax.hessian(ours))(a, b, h0).reshape(a.size, a.size) @ v.ravel(),
        fd.ravel(),
        rtol=1e-6,
        atol=1e-8,
    )


# slow tier: all but the most general case (time-varying, complex, reverse); each
# backend's variants are checked against the loop by test_values_match_numpy_loop
@pytest.mark.parametrize(
    "time_invariant,complex_,reverse",
    slow_except(
        it.product([True, False], [False, True], [False, True]),
        [(False, True, True)],
    ),
)
def test_backends_agree(time_invariant, complex_, reverse):
    T, S = 33, (4,)
    rng = np.random.default_rng(5)
    a, b, h0 = (
        jnp.asarray(x)
        for x in make_inputs(
            rng, T, S, time_invariant=time_invariant, complex_=complex_
        )
    )
    results = []
    for scan in BACKENDS.values():
        loss = make_loss(
            lambda a, b, h0: eqx_seq.linear_recurrence(
                a, b, h0, scan=scan, reverse=reverse
            ),
            complex_,
            (T, *S),
        )
        results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(a, b, h0))
    for r in results[1:]:
        assert eqx.tree_equal(r, results[0], rtol=1e-10, atol=1e-10)


def test_vmap_and_jit():
    rng = np.random.default_rng(6)
    batch = [
        make_inputs(rng, 10, (3,), time_invariant=True, complex_=False)
        for _ in range(4)
    ]
    a, b, h0 = (jnp.stack(x) for x in zip(*batch))
    for scan in [eqx_seq.SequentialScan(), eqx_seq.AssociativeScan()]:
        f = jax.jit(
            jax.vmap(lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan))
        )
        got = f(a, b, h0)
        for i in range(4):
            np.testing.assert_allclose(got[i], numpy_recurrence(*batch[i]), rtol=1e-12)
        loss = lambda a, b, h0: jnp.sum(
            eqx_seq.linear_recurrence(a, b, h0, scan=scan) ** 2
        )
        grad_single = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(a, b, h0)
        for i in range(4):
            single = grad_single(a[i], b[i], h0[i])
            assert eqx.tree_equal(
                jax.tree.map(lambda x: x[i], per_example),
                single,
                rtol=1e-12,
                atol=1e-12,
            )
        # the batch dimension may also sit inside the state: one call, same numbers
        batched_state = eqx_seq.linear_recurrence(
            a, jnp.moveaxis(b, 0, 1), h0, scan=scan
        )
        np.testing.assert_allclose(jnp.moveaxis(batched_state, 1, 0), got, rtol=1e-12)


# slow tier: the associative backend (its `recurrence` is JAX's associative scan,
# differentiated by JAX alone; its derivatives through `linear_recurrence` are
# checked by test_gradients and test_jacfwd_equals_jacrev) and the other
# sequential rows; `SequentialScan`'s own JVP runs forward with a time-invariant
# decay and, unrolled, in reverse with a time-varying one
@pytest.mark.parametrize(
    "reverse,time_invariant,backend",
    slow_except(
        it.product(
            [False, True],
            [True, False],
            ["sequential", "sequential-unroll3", "associative"],
        ),
        [(False, True, "sequential"), (True, False, "sequential-unroll3")],
    ),
)
def test_backend_recurrence_differentiated_directly(backend, time_invariant, reverse):
    """`AbstractScan.recurrence`, the low-level primal, differentiated by tracing
    (not through `linear_recurrence`'s rules): both modes match the autodiff of an
    unrolled loop, also under `vmap` (`SequentialScan`'s loop has its own JVP)."""
    rng = np.random.default_rng(9)
    a, b, h0 = make_inputs(rng, 9, (2,), time_invariant=time_invariant, complex_=True)
    scan = BACKENDS[backend]
    ours = lambda a, b, h0: scan.recurrence(a, b, h0, reverse=reverse)
    ref = lambda a, b, h0: jax_loop(a, b, h0, reverse=reverse)
    tangents = tuple(
        x + 1j * y
        for x, y in zip(
            (rng.normal(size=a.shape), rng.normal(size=b.shape), rng.normal(size=2)),
            (rng.normal(size=a.shape), rng.normal(size=b.shape), rng.normal(size=2)),
        )
    )
    out, tan = jax.jvp(ours, (a, b, h0), tangents)
    out_ref, tan_ref = jax.jvp(ref, (a, b, h0), tangents)
    np.testing.assert_allclose(out, out_ref, rtol=1e-12)
    np.testing.assert_allclose(tan, tan_ref, rtol=1e-12)
    ct = rng.normal(size=b.shape) + 1j * rng.normal(size=b.shape)
    got = jax.vjp(ours, a, b, h0)[1](ct)
    want = jax.vjp(ref, a, b, h0)[1](ct)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    # per-example gradients under vmap
    stack = lambda x: jnp.stack([x, 2 * x])
    batched = jax.vmap(jax.grad(lambda *x: jnp.sum(jnp.abs(ours(*x)) ** 2), (0, 1, 2)))
    single = jax.grad(lambda *x: jnp.sum(jnp.abs(ref(*x)) ** 2), (0, 1, 2))
    per_example = batched(stack(a), stack(b), stack(h0))
    for i, scale in enumerate((1, 2)):
        want = single(scale * a, scale * b, scale * h0)
        for g, w in zip(per_example, want):
            np.testing.assert_allclose(g[i], w, rtol=1e-12)


@settings(max_examples=12, deadline=None)
@given(
    T=st.integers(1, 40),
    S=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    time_invariant=st.booleans(),
    reverse=st.booleans(),
    backend=st.sampled_from(["sequential", "associative"]),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape(T, S, time_invariant, reverse, backend, seed):
    rng = np.random.default_rng(seed)
    a, b, h0 = make_inputs(rng, T, S, time_invariant=time_invariant, complex_=False)
    got = eqx_seq.linear_recurrence(a, b, h0, scan=BACKENDS[backend], reverse=reverse)
    np.testing.assert_allclose(
        got, numpy_recurrence(a, b, h0, reverse), rtol=1e-12, atol=1e-12
    )


# ----------------------------------------------------------------------------------
# Bad input


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_shapes():
    b = jnp.ones((5, 3))
    with pytest.raises(
        ValueError, match=r"\(T, \*S\) = \(5, 3\).*S = \(3,\).*a.shape=\(4, 3\)"
    ):
        eqx_seq.linear_recurrence(jnp.ones((4, 3)), b)
    with pytest.raises(ValueError, match=r"a.shape=\(4,\)"):
        eqx_seq.linear_recurrence(jnp.ones(4), b)
    with pytest.raises(ValueError, match=r"a.shape=\(5, 3, 1\)"):
        eqx_seq.linear_recurrence(jnp.ones((5, 3, 1)), b)
    with pytest.raises(ValueError, match=r"h0.*S = \(3,\).*h0.shape=\(2,\)"):
        eqx_seq.linear_recurrence(jnp.ones(3), b, jnp.ones(2))
    with pytest.raises(ValueError, match=r"time step.*b.shape=\(\)"):
        eqx_seq.linear_recurrence(jnp.ones(()), jnp.ones(()))
    with pytest.raises(ValueError, match=r"time step.*b.shape=\(0, 3\)"):
        eqx_seq.linear_recurrence(jnp.ones(3), jnp.ones((0, 3)))


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_dtypes_and_types():
    with pytest.raises(ValueError, match="floating or complex.*int32.*`b`"):
        eqx_seq.linear_recurrence(jnp.ones(3), jnp.ones((5, 3), jnp.int32))
    with pytest.raises(ValueError, match="floating or complex.*bool.*`a`"):
        eqx_seq.linear_recurrence(jnp.ones(3, bool), jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="needs arrays"):
        eqx_seq.linear_recurrence("0.5", jnp.ones((5, 3)))


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_scan():
    for scan in ["sequential", eqx_seq.SequentialScan, jax.lax.scan]:
        with pytest.raises(ValueError, match="must be an `eqx_seq.AbstractScan`"):
            eqx_seq.linear_recurrence(jnp.ones(3), jnp.ones((5, 3)), scan=scan)
    for unroll in [0, -1, 1.5, True]:
        with pytest.raises(ValueError, match="positive int"):
            eqx_seq.SequentialScan(unroll=unroll)


def test_annotations_are_checked_by_the_import_hook(monkeypatch):
    """The suite runs under jaxtyping's import hook (`--jaxtyping-packages` in
    pyproject.toml), which checks the package's annotations on every call, eagerly
    and under `jax.jit` (on tracers): a recurrence that returned one step too few
    contradicts `linear_recurrence`'s return annotation, `(T, *S)` as `b`'s."""
    monkeypatch.setattr(
        "eqx_seq._recurrence._compiled_recurrence",
        lambda scan, reverse, a, b, h0: b[1:],
    )
    a, b = jnp.full(2, 0.5), jnp.ones((3, 2))
    for run in (eqx_seq.linear_recurrence, jax.jit(eqx_seq.linear_recurrence)):
        with pytest.raises(jaxtyping.TypeCheckError, match="return value"):
            run(a, b)


def test_errors_under_jit_and_vmap():
    # shape checks happen at trace time, so they fire inside transformations too
    f = jax.jit(jax.vmap(lambda a, b: eqx_seq.linear_recurrence(a, b)))
    with pytest.raises(ValueError, match="a.shape=\\(4,\\)"):
        f(jnp.ones((2, 4)), jnp.ones((2, 5, 3)))


def test_auto_scan_rule():
    expected = (
        eqx_seq.SequentialScan
        if jax.default_backend() == "cpu"
        else eqx_seq.AssociativeScan
    )
    assert type(eqx_seq.AutoScan().select()) is expected


# slow tier: the associative backend; the promotion and the gradient's cast back to
# the real decay happen in `linear_recurrence`, before and after any backend
@pytest.mark.parametrize(
    "backend", ["sequential", pytest.param("associative", marks=pytest.mark.slow)]
)
def test_gradient_real_decay_complex_inputs(backend):
    # a real decay driving complex inputs: promoted inside, gradient back on the reals
    rng = np.random.default_rng(7)
    T, N = 9, 3
    a = jnp.asarray(rng.uniform(-0.9, 0.9, N))
    b = jnp.asarray(rng.normal(size=(T, N)) + 1j * rng.normal(size=(T, N)))
    h0 = jnp.asarray(rng.normal(size=N))
    ours = make_loss(
        lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=BACKENDS[backend]),
        True,
        (T, N),
    )
    ref = make_loss(
        lambda a, b, h0: jax_loop(a.astype(b.dtype), b, h0.astype(b.dtype)),
        True,
        (T, N),
    )
    got = jax.jit(jax.grad(ours, argnums=(0, 2)))(a, b, h0)
    expected = jax.jit(jax.grad(ref, argnums=(0, 2)))(a, b, h0)
    assert got[0].dtype == a.dtype and got[1].dtype == h0.dtype
    assert eqx.tree_equal(got, expected, rtol=1e-10, atol=1e-10)
