"""The level-loop associative scan against `lax.associative_scan` and a NumPy loop."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_seq._kalman._model import prepare
from eqx_seq._kalman._parallel import _combine_filter, _filter_elements
from eqx_seq._scan import level_scan


def affine(earlier, later):
    """Composition of affine maps x -> A x + b (not commutative)."""
    A1, b1 = earlier
    A2, b2 = later
    return A2 @ A1, jnp.einsum("tij,tj->ti", A2, b1) + b2


def numpy_affine_scan(A, b, reverse):
    idx = range(len(A) - 1, -1, -1) if reverse else range(len(A))
    outA, outb = np.zeros_like(A), np.zeros_like(b)
    accA, accb = None, None
    for t in idx:
        if accA is None:
            accA, accb = A[t], b[t]
        else:
            accA, accb = A[t] @ accA, A[t] @ accb + b[t]
        outA[t], outb[t] = accA, accb
    return outA, outb


# T: 1, a power of two, and lengths that need padding; K: doubling only, the
# default, one that does not divide T, and one longer than T (sequential)
@pytest.mark.parametrize(
    "T,block_size,reverse",
    [(1, None, False), (8, 1, False), (8, 3, True), (50, 50, True)]
    + [(13, k, r) for k in (1, None, 50) for r in (False, True)],
)
def test_matches_numpy_and_lax(T, block_size, reverse):
    rng = np.random.default_rng(T)
    A = rng.normal(size=(T, 2, 2)) / 2
    b = rng.normal(size=(T, 2))
    scan = jax.jit(
        level_scan, static_argnums=0, static_argnames=("reverse", "block_size")
    )
    out = scan(affine, (A, b), reverse=reverse, block_size=block_size)
    refA, refb = numpy_affine_scan(A, b, reverse)
    np.testing.assert_allclose(out[0], refA, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out[1], refb, rtol=1e-12, atol=1e-14)
    lax_scan = jax.jit(
        jax.lax.associative_scan, static_argnums=0, static_argnames="reverse"
    )
    laxA, laxb = lax_scan(affine, (A, b), reverse=reverse)
    np.testing.assert_allclose(out[0], laxA, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out[1], laxb, rtol=1e-12, atol=1e-14)


def test_gradient_matches_lax():
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.normal(size=(11, 2, 2)) / 2)
    b = jnp.asarray(rng.normal(size=(11, 2)))
    w = jnp.asarray(rng.normal(size=(11, 2)))

    def loss(scan, A, b):
        return jnp.sum(w * scan(affine, (A, b))[1])

    grad = lambda scan: jax.jit(jax.grad(lambda A, b: loss(scan, A, b), (0, 1)))
    ours = grad(level_scan)(A, b)
    ref = grad(jax.lax.associative_scan)(A, b)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, r, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("T,block_size", [(13, 3), (13, 1), (100, None)])
def test_operator_is_traced_once(T, block_size):
    """All stages are one loop: the program holds one copy of the operator."""
    calls = []

    def counted(earlier, later):
        calls.append(1)
        return affine(earlier, later)

    A, b = jnp.ones((T, 2, 2)) / 2, jnp.ones((T, 2))
    jax.jit(lambda A, b: level_scan(counted, (A, b), block_size=block_size)).lower(A, b)
    assert len(calls) == 1


def test_kalman_elements_match_lax():
    """The Kalman filter's combine (Cholesky solves inside) on its real elements."""
    import jax.random as jr

    import eqx_seq

    kf = eqx_seq.KalmanFilter(3, 2, key=jr.key(0))
    ys = jnp.asarray(np.random.default_rng(1).normal(size=(6, 2)))

    @eqx.filter_jit
    def both(kf, ys):
        elems = _filter_elements(prepare(kf._model(), ys, None, "missing"))
        combine = jax.vmap(_combine_filter)
        # K=2: all three phases (blocks, doubling over 3 totals, absorption)
        return (
            level_scan(combine, elems, block_size=2),
            jax.lax.associative_scan(combine, elems),
        )

    ours, ref = both(kf, ys)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, r, rtol=1e-9, atol=1e-11)


def test_bad_input():
    x = jnp.ones((4, 2))
    with pytest.raises(ValueError, match="same leading length"):
        level_scan(lambda a, b: a + b, (x, jnp.ones((3,))))
    with pytest.raises(ValueError, match="same leading length"):
        level_scan(lambda a, b: a + b, jnp.ones(()))
    with pytest.raises(ValueError, match="no arrays"):
        level_scan(lambda a, b: a, ())
    with pytest.raises(ValueError, match="block_size"):
        level_scan(lambda a, b: a + b, x, block_size=0)
