"""`eqx_seq.tridiagonal_solve` against SciPy and dense float64 references."""

import itertools as it

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from jax.test_util import check_grads

import eqx_seq
from eqx_seq._tridiagonal._solve import _thomas_solve
from eqx_seq._tridiagonal._thomas import lu_solve, thomas


BACKENDS = {
    "thomas": dict(scan=eqx_seq.SequentialScan()),
    "pcr": dict(scan=eqx_seq.AssociativeScan()),
    "pivoting": dict(pivoting=True),
}
# also checked against the others in test_backends_agree_on_values_and_gradients
MORE_BACKENDS = {
    "thomas-unroll3": dict(scan=eqx_seq.SequentialScan(unroll=3)),
    "auto": dict(scan=eqx_seq.AutoScan()),
}


def scipy_solve(lower, diag, upper, rhs, axis):
    """Reference: one `scipy.linalg.solve_banded` per system, in float64/complex128."""
    full = np.broadcast_shapes(lower.shape, diag.shape, upper.shape, rhs.shape)
    dtype = np.result_type(lower, diag, upper, rhs, np.float64)
    move = lambda x: np.moveaxis(np.broadcast_to(x, full), axis, -1).astype(dtype)
    lower, diag, upper, rhs = map(move, (lower, diag, upper, rhs))
    out = np.empty(rhs.shape, dtype)
    for idx in np.ndindex(rhs.shape[:-1]):
        n = rhs.shape[-1]
        ab = np.zeros((3, n), dtype)
        ab[0, 1:] = upper[idx][:-1]
        ab[1] = diag[idx]
        ab[2, :-1] = lower[idx][1:]
        out[idx] = scipy.linalg.solve_banded((1, 1), ab, rhs[idx])
    return np.moveaxis(out, -1, axis)


def dense(lower, diag, upper):
    """The dense matrix of one system (1-D diagonals), written with jnp for autodiff."""
    return jnp.diag(diag) + jnp.diag(lower[1:], -1) + jnp.diag(upper[:-1], 1)


def dominant(rng, shape, *, complex_=False, dtype=np.float64):
    """Diagonally dominant systems with random values in the ignored corners."""
    lower = rng.uniform(-1, 1, shape)
    upper = rng.uniform(-1, 1, shape)
    if complex_:
        lower = lower + 1j * rng.uniform(-1, 1, shape)
        upper = upper + 1j * rng.uniform(-1, 1, shape)
    sign = rng.choice([-1.0, 1.0], shape)
    diag = sign * (np.abs(lower) + np.abs(upper) + rng.uniform(0.2, 1.0, shape))
    rhs = rng.normal(size=shape)
    if complex_:
        diag = diag * np.exp(1j * rng.uniform(-0.3, 0.3, shape))
        rhs = rhs + 1j * rng.normal(size=shape)
        dtype = np.complex128 if dtype == np.float64 else np.complex64
    return tuple(x.astype(dtype) for x in (lower, diag, upper, rhs))


LAYOUTS = [((None, 5), 0), ((4, None), 1), ((3, None, 2), 1), ((2, 3, None), -1)]
CASES = [
    (backend, n, layout)
    for backend, n in it.product(BACKENDS, [1, 2, 3, 7, 100])
    for layout in (LAYOUTS if n == 7 else LAYOUTS[:2])
]


@pytest.mark.parametrize("backend,n,layout", CASES)
def test_values_match_scipy(backend, n, layout):
    template, axis = layout
    shape = tuple(n if s is None else s for s in template)
    rng = np.random.default_rng(n + len(shape))
    args = dominant(rng, shape)
    x = eqx_seq.tridiagonal_solve(*args, axis=axis, **BACKENDS[backend])
    assert x.shape == shape and x.dtype == jnp.float64
    np.testing.assert_allclose(x, scipy_solve(*args, axis), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_and_float32(backend):
    rng = np.random.default_rng(1)
    args = dominant(rng, (9, 3), complex_=True)
    x = eqx_seq.tridiagonal_solve(*args, **BACKENDS[backend])
    assert x.dtype == jnp.complex128
    np.testing.assert_allclose(x, scipy_solve(*args, 0), rtol=1e-11, atol=1e-12)
    args32 = dominant(rng, (3, 50), dtype=np.float32)
    x32 = eqx_seq.tridiagonal_solve(*args32, axis=1, **BACKENDS[backend])
    assert x32.dtype == jnp.float32
    np.testing.assert_allclose(x32, scipy_solve(*args32, 1), rtol=2e-5, atol=2e-6)


# slow tier: the first case (time-major blocks with a remainder) and the last (tiles
# on both sides, every input broadcast) run fast; the others are more layouts of
# the same blocking
_SLOW = dict(marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "shapes,axis",
    [
        # (lower, diag, upper, rhs) shapes; the solve runs along `axis`
        ([(6, 23)] * 4, 0),  # time-major, 23 = 4 blocks of 5 + 3
        pytest.param([(6, 1), (6, 1), (6, 1), (6, 23)], 0, **_SLOW),  # shared
        pytest.param([(6, 23), (6, 23), (6, 1), (6, 23)], 0, **_SLOW),
        # systems along the leading axis: tiles of 5 rows
        pytest.param([(17, 6)] * 4, 1, **_SLOW),
        pytest.param([(1, 6), (17, 6), (1, 6), (17, 6)], 1, **_SLOW),
        # both sides: tiles of 2 x 2 systems
        pytest.param([(7, 6, 2)] * 4, 1, **_SLOW),
        pytest.param([(7, 6, 1), (1, 6, 2), (7, 6, 2), (7, 6, 2)], 1, **_SLOW),
        ([(1, 3, 6, 2), (4, 1, 6, 2), (4, 3, 6, 1), (4, 3, 6, 2)], 2),
    ],
)
def test_blocked_sweeps_match_scipy(shapes, axis):
    # Thomas with its factors, and the factored solves with A and A^T, in blocks of
    # 5 systems so that every path of the blocking runs, remainders included
    rng = np.random.default_rng(len(shapes[0]))
    full = np.broadcast_shapes(*shapes)
    args = [
        a[tuple(slice(0, s) for s in shp)]
        for a, shp in zip(dominant(rng, full), shapes)
    ]
    rhs2 = rng.normal(size=full)
    opts = dict(block_bytes=5 * 8)

    def run(*a):
        x, factors = thomas(*a, axis=axis, factors=True, **opts)
        plain = thomas(*a, axis=axis, **opts)
        # a JAX array, as the package's solves give it
        solve = lambda b, t: lu_solve(factors, jnp.asarray(b), transpose=t)
        return x, plain, solve(rhs2, False), solve(rhs2, True)

    x, plain, y, yt = jax.jit(run)(*args)
    lower, diag, upper, rhs = (np.broadcast_to(a, full) for a in args)
    tol = dict(rtol=1e-11, atol=1e-12)
    expected = scipy_solve(lower, diag, upper, rhs, axis)
    np.testing.assert_allclose(x, expected, **tol)
    np.testing.assert_array_equal(plain, x)
    np.testing.assert_allclose(y, scipy_solve(lower, diag, upper, rhs2, axis), **tol)
    # A^T: sub-diagonal upper[i-1], super-diagonal lower[i+1]
    lower_t, upper_t = np.roll(upper, 1, axis), np.roll(lower, -1, axis)
    np.testing.assert_allclose(
        yt, scipy_solve(lower_t, diag, upper_t, rhs2, axis), **tol
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcasting(backend):
    rng = np.random.default_rng(2)
    n, B = 12, 4
    lower, diag, upper, _ = dominant(rng, (n, 1))
    rhs = rng.normal(size=(n, B))
    kw = BACKENDS[backend]
    x = eqx_seq.tridiagonal_solve(lower, diag, upper, rhs, **kw)
    full = lambda a: np.broadcast_to(a, (n, B))
    np.testing.assert_allclose(
        x, scipy_solve(full(lower), full(diag), full(upper), rhs, 0), rtol=1e-11
    )
    # 1-D diagonals align with the trailing axis (NumPy): solve along axis -1
    y = eqx_seq.tridiagonal_solve(lower[:, 0], diag[:, 0], upper[:, 0], rhs.T, axis=-1)
    np.testing.assert_allclose(y, x.T, rtol=1e-11)
    # one right-hand side shared by per-system diagonals
    lo, di, up, _ = dominant(rng, (n, B))
    r1 = rng.normal(size=(n, 1))
    z = eqx_seq.tridiagonal_solve(lo, di, up, r1, **kw)
    np.testing.assert_allclose(z, scipy_solve(lo, di, up, full(r1), 0), rtol=1e-11)


def test_non_dominant_needs_pivoting():
    rng = np.random.default_rng(3)
    shape = (60, 40)
    lower, diag, upper, rhs = (rng.normal(size=shape) for _ in range(4))
    expected = scipy_solve(lower, diag, upper, rhs, 0)
    x = eqx_seq.tridiagonal_solve(lower, diag, upper, rhs, pivoting=True)
    np.testing.assert_allclose(x, expected, rtol=1e-8, atol=1e-8)
    # a tiny leading pivot: float32 Thomas loses most digits, pivoting does not
    lower, diag, upper, rhs = dominant(rng, (50, 200))
    diag[0] = 1e-7
    expected = scipy_solve(lower, diag, upper, rhs, 0)
    args32 = [a.astype(np.float32) for a in (lower, diag, upper, rhs)]
    scale = np.abs(expected).max()
    err = lambda **kw: (
        np.abs(np.asarray(eqx_seq.tridiagonal_solve(*args32, **kw)) - expected).max()
        / scale
    )
    assert err(pivoting=True) < 1e-5
    assert err(scan=eqx_seq.AssociativeScan()) < 1e-5  # PCR copes with this one
    assert err(scan=eqx_seq.SequentialScan()) > 1e-4  # documented failure mode
    with pytest.raises(RuntimeError, match="not diagonally dominant"):
        eqx_seq.tridiagonal_solve(*args32, check=True)


@pytest.mark.parametrize("backend", ["thomas", "pcr", "pivoting"])
def test_check_mode(backend):
    kw = BACKENDS[backend]
    # weakly dominant but singular: [[1, 1], [1, 1]]
    ones = jnp.ones(2)
    singular = (ones, ones, ones, jnp.array([1.0, 2.0]))
    assert not jnp.all(jnp.isfinite(eqx_seq.tridiagonal_solve(*singular, **kw)))
    with pytest.raises(RuntimeError, match="not finite"):
        eqx_seq.tridiagonal_solve(*singular, check=True, **kw)
    # dominant by columns only (row 0 is not: |1| < |2|) is accepted
    cols = tuple(
        jnp.array(v) for v in ([9.0, 0.5, 0.5], [1.0, 5.0, 1.0], [2.0, 0.5, 9.0])
    ) + (jnp.ones(3),)
    x = jax.jit(lambda *a: eqx_seq.tridiagonal_solve(*a, check=True, **kw))(*cols)
    np.testing.assert_allclose(x, scipy_solve(*map(np.asarray, cols), 0), rtol=1e-12)
    # dominant by neither
    if "pivoting" not in kw:
        bad = (jnp.array([0.0, 2.0]), ones, jnp.array([0.5, 0.0]), ones)
        with pytest.raises(RuntimeError, match="not diagonally dominant"):
            eqx_seq.tridiagonal_solve(*bad, check=True, **kw)


# ------------------------------------------------------------------- derivatives
def loss_dense(lower, diag, upper, rhs, weights):
    """Sum over systems (last axis) of a weighted quadratic of dense solves."""
    xs = [
        jnp.linalg.solve(dense(lower[:, j], diag[:, j], upper[:, j]), rhs[:, j])
        for j in range(rhs.shape[1])
    ]
    return jnp.sum(weights * jnp.stack(xs, 1) ** 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 9])
def test_grad_matches_dense_solve(backend, n):
    rng = np.random.default_rng(n)
    args = tuple(jnp.asarray(a) for a in dominant(rng, (n, 3)))
    weights = jnp.asarray(rng.normal(size=(n, 3)))
    kw = BACKENDS[backend]
    loss = lambda *a: jnp.sum(weights * eqx_seq.tridiagonal_solve(*a, **kw) ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    expected = jax.jit(jax.grad(loss_dense, argnums=(0, 1, 2, 3)))(*args, weights)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)
    assert grads[0][0].tolist() == [0.0] * 3  # lower[0] is ignored
    assert grads[2][-1].tolist() == [0.0] * 3  # upper[-1] is ignored


@pytest.mark.parametrize("backend", ["thomas", "pcr", "pivoting"])
def test_grad_of_shared_diagonals(backend):
    # broadcast inputs get the summed gradient; along axis 1 for the shift logic
    rng = np.random.default_rng(4)
    lower, diag, upper, _ = dominant(rng, (1, 8))
    rhs = rng.normal(size=(3, 8))
    kw = BACKENDS[backend]
    loss = lambda *a: jnp.sum(jnp.sin(eqx_seq.tridiagonal_solve(*a, axis=1, **kw)))

    def loss_ref(lower, diag, upper, rhs):
        A = dense(lower[0], diag[0], upper[0])
        return jnp.sum(jnp.sin(jnp.linalg.solve(A, rhs.T)))

    args = tuple(map(jnp.asarray, (lower, diag, upper, rhs)))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2, 3)))(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "backend,complex_,order",
    [
        ("thomas", False, 2),
        ("thomas", True, 1),
        # slow tier: PCR's derivatives run fast against dense solves in
        # test_grad_matches_dense_solve and test_grad_of_shared_diagonals
        pytest.param("pcr", False, 1, marks=pytest.mark.slow),
        pytest.param("pcr", True, 1, marks=pytest.mark.slow),
        ("pivoting", False, 1),
    ],
)
def test_derivatives_vs_finite_differences(backend, complex_, order):
    rng = np.random.default_rng(5)
    args = tuple(jnp.asarray(a) for a in dominant(rng, (5, 2), complex_=complex_))
    kw = BACKENDS[backend]
    f = jax.jit(lambda *a: eqx_seq.tridiagonal_solve(*a, axis=0, **kw))
    check_grads(f, args, order=order, modes=["fwd", "rev"], atol=1e-6, rtol=1e-6)


# slow tier: the other backends, whose forward and reverse mode
# test_derivatives_vs_finite_differences checks
@pytest.mark.parametrize(
    "backend",
    ["thomas", *(pytest.param(b, marks=pytest.mark.slow) for b in ("pcr", "pivoting"))],
)
def test_jacfwd_jacrev_vmap(backend):
    rng = np.random.default_rng(6)
    kw = BACKENDS[backend]
    args = tuple(jnp.asarray(a) for a in dominant(rng, (6, 2)))
    f = lambda *a: eqx_seq.tridiagonal_solve(*a, **kw)
    every = (0, 1, 2, 3)
    jf = jax.jit(jax.jacfwd(f, argnums=every))(*args)
    jr = jax.jit(jax.jacrev(f, argnums=every))(*args)
    for a, b in zip(jf, jr):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # the Jacobian w.r.t. rhs is the inverse of each system
    for j in range(2):
        inverse = np.linalg.inv(dense(args[0][:, j], args[1][:, j], args[2][:, j]))
        np.testing.assert_allclose(jf[3][:, j, :, j], inverse, rtol=1e-10, atol=1e-12)
    # vmap (over a leading batch, and with unbatched diagonals) matches a loop
    batch = tuple(jnp.asarray(a) for a in dominant(rng, (3, 6, 2)))
    loss = lambda *a: jnp.sum(f(*a) ** 2)
    vm, vg = jax.jit(jax.vmap(lambda *a: (f(*a), jax.grad(loss, argnums=every)(*a))))(
        *batch
    )
    vr = jax.jit(jax.vmap(f, in_axes=(None, None, None, 0)))(*args[:3], batch[3])
    one = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=every)(*a)))
    for k in range(3):
        value, grads = one(*(a[k] for a in batch))
        np.testing.assert_allclose(vm[k], value, rtol=1e-12)
        for a, b in zip(vg, grads):
            np.testing.assert_allclose(a[k], b, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(vr[k], one(*args[:3], batch[3][k])[0], rtol=1e-12)


def dense_solve(lower, diag, upper, rhs, axis):
    """Reference for derivatives: `jnp.linalg.solve` on the dense matrices, any
    layout and broadcasting; differentiated by JAX through the dense LU."""
    full = jnp.broadcast_shapes(lower.shape, diag.shape, upper.shape, rhs.shape)
    move = lambda x: jnp.moveaxis(jnp.broadcast_to(x, full), axis, -1)
    lower, diag, upper, rhs = map(move, (lower, diag, upper, rhs))
    n = full[axis]
    eye = lambda k: jnp.eye(n, k=k, dtype=diag.dtype).reshape(
        (1,) * (len(full) - 1) + (n, n)
    )
    A = (
        diag[..., :, None] * eye(0)
        + lower[..., :, None] * eye(-1)  # row i: lower[i] at column i-1
        + upper[..., :, None] * eye(1)
    )
    return jnp.moveaxis(jnp.linalg.solve(A, rhs[..., None])[..., 0], -1, axis)


# slow tier: test_derivatives_vs_finite_differences checks the Thomas path's jvp
# rule (to second order, complex too) against finite differences, and
# test_blocked_sweeps_match_scipy the blocked sweeps and factored solves; this adds
# the rule in blocks
@pytest.mark.slow
@pytest.mark.parametrize(
    "shapes,axis,complex_,second_order",
    [
        ([(6, 7)] * 4, 0, False, True),  # time-major, blocks of 3 systems + 1
        # shared diagonals (also in test_blocked_sweeps_match_scipy)
        ([(6, 1), (6, 1), (6, 1), (6, 7)], 0, False, False),
        ([(7, 6)] * 4, 1, True, False),  # systems on the leading axis: tiles
        ([(3, 6, 1), (1, 6, 2), (3, 6, 2), (3, 6, 2)], 1, False, False),
        # second order on tiles with broadcast diagonals
        ([(3, 6, 1), (1, 6, 2), (3, 6, 2), (3, 6, 2)], 1, False, True),
    ],
)
def test_factored_derivatives_in_blocks(shapes, axis, complex_, second_order):
    # the Thomas path's jvp rule (factors kept, division-free tangent and adjoint
    # sweeps) in blocks of 3 complex or 6 real systems (its static block size, 48
    # bytes of a row), against autodiff through dense solves
    rng = np.random.default_rng(11)
    full = np.broadcast_shapes(*shapes)
    draw = dominant(rng, full, complex_=complex_)
    args = tuple(
        jnp.asarray(a[tuple(slice(0, s) for s in shp)]) for a, shp in zip(draw, shapes)
    )
    tangents = tuple(
        jnp.asarray(rng.normal(size=a.shape)).astype(a.dtype) for a in args
    )
    ours = lambda *a: _thomas_solve(*a, axis, 1, 3 * 16)
    ref = lambda *a: dense_solve(*a, axis)
    tol = dict(rtol=1e-10, atol=1e-12)
    every = (0, 1, 2, 3)
    for f in (ours, ref):
        f.jvp = jax.jit(lambda *a, f=f: jax.jvp(f, a, tangents))(*args)
        x, pullback = jax.vjp(f, *args)
        f.vjp = jax.jit(pullback)(jnp.cos(x))
        f.jacfwd = jax.jit(jax.jacfwd(f, every, holomorphic=complex_))(*args)
        f.jacrev = jax.jit(jax.jacrev(f, every, holomorphic=complex_))(*args)
    for name in ("jvp", "vjp", "jacfwd", "jacrev"):
        for a, b in zip(getattr(ours, name), getattr(ref, name)):
            np.testing.assert_allclose(a, b, **tol)
    if not second_order:
        return
    # second order (forward over reverse and reverse over reverse), vmap of grad
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for f in (ours, ref):
        grad = jax.grad(loss(f), argnums=every)
        f.fwd_rev = jax.jit(lambda *a, g=grad: jax.jvp(g, a, tangents))(*args)
        f.hvp = jax.jit(
            lambda *a, f=f: jax.grad(
                lambda *b: jnp.vdot(jax.grad(loss(f), argnums=0)(*b), tangents[0]),
                argnums=every,
            )(*a)
        )(*args)
        batch = tuple(jnp.stack([a, 2 * a]) for a in args)
        f.vgrad = jax.jit(jax.vmap(jax.grad(loss(f), argnums=every)))(*batch)
    for name in ("fwd_rev", "hvp", "vgrad"):
        leaves = zip(
            jax.tree.leaves(getattr(ours, name)), jax.tree.leaves(getattr(ref, name))
        )
        for a, b in leaves:
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


# slow tier: test_values_match_scipy and test_grad_matches_dense_solve check every
# backend's values and gradients against references; this adds `AutoScan` and an
# unrolled Thomas
@pytest.mark.slow
def test_backends_agree_on_values_and_gradients():
    rng = np.random.default_rng(7)
    args = tuple(jnp.asarray(a) for a in dominant(rng, (4, 33, 5)))
    loss = lambda *a, kw: jnp.sum(jnp.cos(eqx_seq.tridiagonal_solve(*a, axis=1, **kw)))
    results = {
        name: jax.value_and_grad(
            lambda *a, kw=kw: loss(*a, kw=kw), argnums=(0, 1, 2, 3)
        )(*args)
        for name, kw in {**BACKENDS, **MORE_BACKENDS}.items()
    }
    base_value, base_grads = results["pivoting"]
    for value, grads in results.values():
        np.testing.assert_allclose(value, base_value, rtol=1e-12)
        for g, b in zip(grads, base_grads):
            np.testing.assert_allclose(g, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------- bad input
@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    ones = jnp.ones((5, 3))
    solve = eqx_seq.tridiagonal_solve
    with pytest.raises(ValueError, match="axis"):
        solve(ones, ones, ones, ones, axis=2)
    with pytest.raises(ValueError, match="axis"):
        solve(ones, ones, ones, ones, axis=-3)
    with pytest.raises(ValueError, match="axis"):
        solve(ones, ones, ones, ones, axis=True)
    with pytest.raises(ValueError, match="same non-zero size along axis=0"):
        solve(jnp.ones((4, 3)), ones, ones, ones)
    with pytest.raises(ValueError, match="same non-zero size along axis=0"):
        solve(jnp.ones((1, 3)), ones, ones, ones)  # size 1 on axis: not a broadcast
    with pytest.raises(ValueError, match="same non-zero size"):
        z = jnp.ones((0, 3))
        solve(z, z, z, z)
    with pytest.raises(ValueError, match="broadcast"):
        solve(jnp.ones((5, 2)), ones, ones, ones)
    with pytest.raises(ValueError, match="floating or complex"):
        solve(ones, ones, ones, jnp.ones((5, 3), jnp.int32))
    with pytest.raises(ValueError, match="at least one axis"):
        solve(1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="AbstractScan"):
        solve(ones, ones, ones, ones, scan="sequential")

    class Other(eqx_seq.AbstractLocalScan):
        unroll = 1

        def recurrence(self, a, b, h0=None, *, reverse=False):
            return b

    # `parallel` picks the method: a backend cannot be made without it
    with pytest.raises(TypeError, match="abstract class attributes {'parallel'}"):
        solve(ones, ones, ones, ones, scan=Other())


def test_user_backends():
    """A user's backend runs the algorithm of the kind it declares (`parallel`):
    Thomas for a sequential one (with its declared `unroll`), PCR for a parallel
    one, the same numbers as the library's backend of that kind; `select()` is what
    the solve reads. One that does not declare `parallel` is refused (in
    `test_bad_input`)."""

    class UserSequential(eqx_seq.AbstractLocalScan):
        parallel = False
        unroll = 1

        def recurrence(self, a, b, h0=None, *, reverse=False):
            raise AssertionError("not called")

    class UserParallel(UserSequential):
        parallel = True

    class PicksParallel(eqx_seq.AutoScan):
        def select(self):
            return eqx_seq.AssociativeScan()

    rng = np.random.default_rng(0)
    n = 9
    lower, upper = rng.normal(size=(2, n, 3))
    diag = 4 + rng.uniform(size=(n, 3))
    rhs = rng.normal(size=(n, 3))

    def solve(scan):
        return eqx_seq.tridiagonal_solve(lower, diag, upper, rhs, scan=scan)

    seq = solve(scan=eqx_seq.SequentialScan())
    par = solve(scan=eqx_seq.AssociativeScan())
    np.testing.assert_array_equal(solve(scan=UserSequential()), seq)
    np.testing.assert_array_equal(solve(scan=UserParallel()), par)
    np.testing.assert_array_equal(solve(scan=PicksParallel()), par)
