"""`eqx_seq.TridiagonalImplicit`: its system, its dominance, and its derivatives."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import tree_allclose
from jax.test_util import check_grads

import eqx_seq


SCANS = {"thomas": eqx_seq.SequentialScan(), "pcr": eqx_seq.AssociativeScan()}


def randomised(layer, key, scale=3.0):
    """The layer with every parameter replaced by random values (float64)."""
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jr.split(key, len(leaves))
    leaves = [scale * jr.normal(k, p.shape, jnp.float64) for k, p in zip(keys, leaves)]
    return eqx.combine(jax.tree_util.tree_unflatten(tree, leaves), static)


def whittaker(x, kappa):
    """Dense float64 reference: argmin_y |y - x|^2 + sum_t kappa_t (y_{t+1} - y_t)^2,
    i.e. (I + D^T K D) y = x per channel, D the first difference."""
    T, C = x.shape
    out = np.empty((T, C))
    D = np.diff(np.eye(T), axis=0)  # (T-1, T)
    for c in range(C):
        A = np.eye(T) + D.T @ np.diag(kappa[:, c]) @ D
        out[:, c] = np.linalg.solve(A, x[:, c])
    return out


# slow tier: each length, each backend and each kind of coupling run fast once
# (thomas-False-1, thomas-True-2, thomas-False-37, pcr-True-37); the other
# combinations repeat them
FAST_SYSTEMS = {
    ("thomas", False, 1),
    ("thomas", True, 2),
    ("thomas", False, 37),
    ("pcr", True, 37),
}


@pytest.mark.parametrize(
    "scan,input_dependent,T",
    [
        c if c in FAST_SYSTEMS else pytest.param(*c, marks=pytest.mark.slow)
        for c in [("thomas", i, T) for i in (False, True) for T in (1, 2, 37)]
        + [("pcr", i, 37) for i in (False, True)]
    ],
)
def test_output_solves_its_system(scan, input_dependent, T, getkey):
    layer = eqx_seq.TridiagonalImplicit(
        5, input_dependent=input_dependent, scan=SCANS[scan], key=getkey()
    )
    layer = randomised(layer, getkey())
    x = 4 * jr.normal(getkey(), (T, 5), jnp.float64)
    y = eqx.filter_jit(layer)(x)
    lower, diag, upper = eqx.filter_jit(layer.diagonals)(x)
    kappa = np.asarray(eqx.filter_jit(layer.couplings)(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    # residual of its own system
    y_np, l, d, u = map(np.asarray, (y, lower, diag, upper))
    Ay = d * y_np
    Ay[1:] += l[1:] * y_np[:-1]
    Ay[:-1] += u[:-1] * y_np[1:]
    np.testing.assert_allclose(Ay, x, rtol=1e-10, atol=1e-10)
    # dominant with margin 1, symmetric, zero corners, non-negative couplings
    assert np.all(kappa >= 0)
    np.testing.assert_allclose(d - np.abs(l) - np.abs(u), 1.0, rtol=1e-12)
    assert np.all(l[0] == 0) and np.all(u[-1] == 0)
    np.testing.assert_array_equal(u[:-1], l[1:])
    # and it is the Whittaker smoother with these couplings
    np.testing.assert_allclose(y, whittaker(np.asarray(x), kappa), rtol=1e-9, atol=1e-9)
    # a contraction: eigenvalues of A are >= 1
    assert np.linalg.norm(y_np) <= np.linalg.norm(np.asarray(x)) * (1 + 1e-12)


def test_single_step_is_identity_and_static_couplings(getkey):
    layer = eqx_seq.TridiagonalImplicit(3, coupling_range=(2.0, 2.0), key=getkey())
    x = jr.normal(getkey(), (1, 3))
    np.testing.assert_allclose(layer(x), x, rtol=1e-6)
    kappa = layer.couplings(jnp.ones((4, 3), jnp.float32))
    assert kappa.shape == (3, 3) and kappa.dtype == jnp.float32
    np.testing.assert_allclose(kappa, 2.0, rtol=1e-5)  # softplus^{-1} round trip
    wide = eqx_seq.TridiagonalImplicit(64, coupling_range=(0.1, 100.0), key=getkey())
    k = np.asarray(wide.couplings(jnp.ones((2, 64), jnp.float32)))[0]
    assert 0.1 * (1 - 1e-5) <= k.min() and k.max() <= 100.0 * (1 + 1e-5)
    assert k.max() / k.min() > 10  # spread over the range


@pytest.mark.parametrize(
    "input_dependent",
    [
        # slow tier: the input-dependent couplings (fast) run the same solve with
        # gradients through the gate as well
        pytest.param(False, marks=pytest.mark.slow),
        True,
    ],
)
def test_gradients(input_dependent, getkey):
    layer = eqx_seq.TridiagonalImplicit(
        3, input_dependent=input_dependent, key=getkey()
    )
    layer = randomised(layer, getkey(), scale=0.5)
    x = jr.normal(getkey(), (6, 3), jnp.float64)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    leaves, tree = jax.tree_util.tree_flatten(params)

    def f(x, *leaves):
        model = eqx.combine(jax.tree_util.tree_unflatten(tree, leaves), static)
        return model(x)

    # first order here; second order of the solve is in test_tridiagonal.py
    check_grads(
        jax.jit(f), (x, *leaves), order=1, modes=["fwd", "rev"], atol=1e-6, rtol=1e-6
    )
    # both backends give the same gradients
    grads = [
        eqx.filter_jit(jax.grad(lambda m, x: jnp.sum(jnp.sin(m(x))), argnums=(0, 1)))(
            eqx.tree_at(lambda m: m.scan, layer, scan), x
        )
        for scan in SCANS.values()
    ]
    # (the leaves: the two models differ in their `scan` field)
    leaves_0, leaves_1 = (jax.tree.leaves(g) for g in grads)
    assert tree_allclose(leaves_0, leaves_1, rtol=1e-10, atol=1e-12)


def test_vmap_jit_and_dtypes(getkey):
    layer = eqx_seq.TridiagonalImplicit(
        4, input_dependent=True, dtype=jnp.float32, key=getkey()
    )
    layer = eqx.tree_at(
        lambda m: m.gate_weight, layer, 0.1 * jr.normal(getkey(), (4, 8))
    )
    x = jr.normal(getkey(), (3, 20, 4), jnp.float32)
    y = eqx.filter_jit(jax.vmap(layer))(x)
    assert y.dtype == jnp.float32
    for k in range(3):
        np.testing.assert_allclose(y[k], layer(x[k]), rtol=1e-5, atol=1e-6)
    # float32 parameters with float64 inputs: computed in float64
    y64 = layer(x[0].astype(jnp.float64))
    assert y64.dtype == jnp.float64
    np.testing.assert_allclose(y64, y[0], rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input(getkey):
    layer = eqx_seq.TridiagonalImplicit(4, key=getkey())
    for bad in [
        jnp.ones((5, 3)),
        jnp.ones((4,)),
        jnp.ones((2, 5, 4)),
        jnp.ones((0, 4)),
    ]:
        with pytest.raises(ValueError, match=r"shape \(T, channels\) = \(T, 4\)"):
            layer(bad)
    with pytest.raises(ValueError, match="real input"):
        layer(jnp.ones((5, 4), jnp.complex64))
    with pytest.raises(ValueError, match="channels"):
        eqx_seq.TridiagonalImplicit(0, key=getkey())
    with pytest.raises(ValueError, match="coupling_range"):
        eqx_seq.TridiagonalImplicit(4, coupling_range=(0.0, 1.0), key=getkey())
    with pytest.raises(ValueError, match="coupling_range"):
        eqx_seq.TridiagonalImplicit(4, coupling_range=(2.0, 1.0), key=getkey())
    with pytest.raises(ValueError, match="AbstractScan"):
        eqx_seq.TridiagonalImplicit(4, scan="thomas", key=getkey())
