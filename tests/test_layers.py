"""Conventions every layer shares: the default parameter dtype and the named scope."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_seq


def s5(key):
    return eqx_seq.S5(3, 4, key=key)


def gdn(key):
    return eqx_seq.GatedDeltaNet(3, num_heads=1, head_dim=2, key=key)


# name -> (build from a key, an input for `__call__`)
LAYERS = {
    "S5": (s5, jnp.ones((6, 3))),
    "LRU": (lambda key: eqx_seq.LRU(3, 4, key=key), jnp.ones((6, 3))),
    "S5Block": (lambda key: eqx_seq.S5Block(s5(key), key=key), jnp.ones((6, 3))),
    "Mamba": (lambda key: eqx_seq.Mamba(3, state_size=2, key=key), jnp.ones((6, 3))),
    "MambaBlock": (
        lambda key: eqx_seq.MambaBlock(eqx_seq.Mamba(3, state_size=2, key=key)),
        jnp.ones((6, 3)),
    ),
    "RGLRU": (lambda key: eqx_seq.RGLRU(4, num_heads=2, key=key), jnp.ones((6, 4))),
    "HawkBlock": (lambda key: eqx_seq.HawkBlock(3, key=key), jnp.ones((6, 3))),
    "GatedDeltaNet": (lambda key: gdn(key), jnp.ones((6, 3))),
    "GatedDeltaNetBlock": (
        lambda key: eqx_seq.GatedDeltaNetBlock(gdn(key)),
        jnp.ones((6, 3)),
    ),
    "Embedding": (lambda key: eqx_seq.Embedding(5, 3, key=key), jnp.arange(4)),
    "TridiagonalImplicit": (
        lambda key: eqx_seq.TridiagonalImplicit(3, input_dependent=True, key=key),
        jnp.ones((6, 3)),
    ),
    "KalmanFilter": (lambda key: eqx_seq.KalmanFilter(2, 3, key=key), jnp.ones((6, 3))),
    "SequenceClassifier": (
        lambda key: eqx_seq.SequenceClassifier(
            2, 3, width=4, depth=1, state_size=4, key=key
        ),
        jnp.ones((6, 2)),
    ),
    "LanguageModel": (
        lambda key: eqx_seq.LanguageModel(7, width=4, depth=1, state_size=4, key=key),
        jnp.arange(4),
    ),
    "DenoisingClassifier": (
        lambda key: eqx_seq.DenoisingClassifier(
            2, 3, width=4, depth=1, state_size=4, key=key
        ),
        jnp.ones((6, 2)),
    ),
}


def parameter_dtypes(layer) -> set:
    return {x.dtype for x in jax.tree.leaves(eqx.filter(layer, eqx.is_inexact_array))}


@pytest.mark.parametrize("name", LAYERS)
def test_default_dtype_is_jax_default(name, getkey):
    build, _ = LAYERS[name]
    # the suite runs under x64 (conftest.py): every layer agrees on float64
    assert parameter_dtypes(build(getkey())) == {jnp.dtype(jnp.float64)}
    with jax.enable_x64(False):
        assert parameter_dtypes(build(getkey())) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("name", LAYERS)
def test_named_scope(name, getkey):
    build, x = LAYERS[name]
    layer = build(getkey())
    text = jax.jit(lambda x: layer(x)).lower(x).as_text(debug_info=True)
    assert f"/eqx_seq.{name}/" in text
