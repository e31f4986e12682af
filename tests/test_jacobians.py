"""`eqx_seq.recurrence_jacobians` against closed forms and `jax.jacfwd`."""

import itertools as it

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_seq


def closed_form(a, b, h0, reverse=False):
    """float64 closed forms for h_t = a h_{t-1} + b_t with time-invariant a:

    h_t = a^(t+1) h0 + sum_{k<=t} a^(t-k) b_k
    dh_t/da = (t+1) a^t h0 + sum_{k<t} (t-k) a^(t-k-1) b_k
    dh_t/dh0 = a^(t+1)
    """
    b = np.asarray(b, np.complex128)
    if reverse:
        h, s, p = closed_form(a, b[::-1], h0)
        return h[::-1], s[::-1], p[::-1]
    a, h0 = (
        np.broadcast_to(np.asarray(a, np.complex128), b.shape[1:]),
        np.asarray(h0, np.complex128),
    )
    T = len(b)
    h, s, p = (np.zeros_like(b) for _ in range(3))
    for t in range(T):
        p[t] = a ** (t + 1)
        h[t] = p[t] * h0 + sum(a ** (t - k) * b[k] for k in range(t + 1))
        s[t] = (t + 1) * a**t * h0 + sum(
            (t - k) * a ** (t - k - 1) * b[k] for k in range(t)
        )
    return h, s, p


CASES = list(
    it.product(["sequential", "associative"], [1, 9, 30], [False, True], [False, True])
)
SCANS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


# slow tier: the associative backend's longer sequences (T = 30), and at T = 9 the
# real reverse and complex forward rows; every row of the sequential backend, and of
# the associative one at T = 1, stays fast
_SLOW_CASES = [
    *(("associative", 30, c, r) for c in (False, True) for r in (False, True)),
    ("associative", 9, False, True),
    ("associative", 9, True, False),
]


@pytest.mark.parametrize(
    "backend,T,complex_,reverse",
    [
        pytest.param(*case, marks=[pytest.mark.slow] if case in _SLOW_CASES else [])
        for case in CASES
    ],
)
def test_against_closed_form(backend, T, complex_, reverse):
    rng = np.random.default_rng(T)
    S = (2, 3)
    a = rng.uniform(-0.9, 0.9, S)
    b = rng.normal(size=(T, *S))
    h0 = rng.normal(size=S)
    if complex_:
        a = a * np.exp(1j * rng.uniform(-3, 3, S))
        b = b + 1j * rng.normal(size=b.shape)
    jac = eqx_seq.recurrence_jacobians(a, b, h0, scan=SCANS[backend], reverse=reverse)
    assert isinstance(jac, eqx_seq.RecurrenceJacobians)
    h, s, p = closed_form(a, b, h0, reverse)
    if not complex_:
        h, s, p = h.real, s.real, p.real
    for got, expected in [(jac.states, h), (jac.wrt_a, s), (jac.wrt_h0, p)]:
        assert got.shape == (T, *S) and got.dtype == b.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


# slow tier: the real sequential and complex associative rows; each backend and each
# dtype runs once in the fast tier
@pytest.mark.parametrize(
    "backend,complex_",
    [
        pytest.param(
            *case,
            marks=[pytest.mark.slow]
            if case in [("sequential", False), ("associative", True)]
            else [],
        )
        for case in it.product(["sequential", "associative"], [False, True])
    ],
)
def test_diagonal_of_jacfwd(backend, complex_):
    rng = np.random.default_rng(0)
    T, N = 12, 4
    a = jnp.asarray(
        rng.uniform(-0.9, 0.9, N)
        * (np.exp(1j * rng.uniform(-3, 3, N)) if complex_ else 1)
    )
    b = jnp.asarray(
        rng.normal(size=(T, N)) + (1j * rng.normal(size=(T, N)) if complex_ else 0)
    )
    h0 = jnp.asarray(rng.normal(size=N), b.dtype)
    scan = SCANS[backend]
    jac = eqx_seq.recurrence_jacobians(a, b, h0, scan=scan)

    @jax.jit
    def dense(a, h0):
        f = lambda a, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan)
        return jax.jacfwd(f, argnums=(0, 1), holomorphic=complex_)(a, h0)

    da, dh0 = dense(a, h0)  # (T, N, N) each: diagonal in the last two axes
    for structured, full in [(jac.wrt_a, da), (jac.wrt_h0, dh0)]:
        np.testing.assert_allclose(
            structured, jnp.diagonal(full, axis1=1, axis2=2), rtol=1e-12, atol=1e-12
        )
        off_diagonal = jnp.where(jnp.eye(N, dtype=bool)[None], 0, full)
        assert jnp.all(off_diagonal == 0)


def test_shared_scalar_decay_and_float32():
    # a scalar decay shared by the whole state: dh_t[i]/da = s_t[i]
    rng = np.random.default_rng(1)
    b = jnp.asarray(rng.normal(size=(50, 3)), jnp.float32)
    a = jnp.float32(0.8)
    jac = eqx_seq.recurrence_jacobians(a, b)
    assert jac.wrt_a.dtype == jnp.float32
    full = jax.jacfwd(lambda a: eqx_seq.linear_recurrence(a, b))(a)
    np.testing.assert_allclose(jac.wrt_a, full, rtol=1e-5, atol=1e-5)


def test_scalar_state():
    # S = (): `b` of shape (T,), with a NumPy scalar decay and a Python float `h0`
    b = np.arange(1.0, 6.0)
    jac = eqx_seq.recurrence_jacobians(np.float32(0.5), b, 2.0)
    h, s, p = (x.real for x in closed_form(0.5, b, 2.0))
    for got, expected in [(jac.states, h), (jac.wrt_a, s), (jac.wrt_h0, p)]:
        assert got.shape == (5,) and got.dtype == jnp.float64
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_vmap_jit_and_differentiable():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.uniform(0.1, 0.9, (5, 3)))
    b = jnp.asarray(rng.normal(size=(5, 8, 3)))
    batched = jax.jit(jax.vmap(eqx_seq.recurrence_jacobians))(a, b)
    for i in range(5):
        single = eqx_seq.recurrence_jacobians(a[i], b[i])
        assert eqx.tree_equal(
            jax.tree.map(lambda x: x[i], batched), single, rtol=1e-12, atol=1e-12
        )
    # wrt_a is itself differentiable: its derivative w.r.t. a is the second derivative
    second = jax.grad(lambda a: eqx_seq.recurrence_jacobians(a, b[0]).wrt_a[-1].sum())(
        a[0]
    )
    expected = jnp.diagonal(
        jax.hessian(lambda a: eqx_seq.linear_recurrence(a, b[0])[-1].sum())(a[0])
    )
    np.testing.assert_allclose(second, expected, rtol=1e-10)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    b = jnp.ones((6, 3))
    with pytest.raises(ValueError, match="time-invariant.*jacfwd"):
        eqx_seq.recurrence_jacobians(jnp.ones((6, 3)), b)
    with pytest.raises(ValueError, match=r"a.shape=\(4,\)"):
        eqx_seq.recurrence_jacobians(jnp.ones(4), b)
    with pytest.raises(ValueError, match="must be an `eqx_seq.AbstractScan`"):
        eqx_seq.recurrence_jacobians(jnp.ones(3), b, scan="associative")
    with pytest.raises(ValueError, match="floating or complex"):
        eqx_seq.recurrence_jacobians(jnp.ones(3), jnp.ones((6, 3), jnp.int32))
