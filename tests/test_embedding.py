"""`eqx_seq.Embedding` against plain indexing, at the edges of every policy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqx_seq


V, D = 7, 3
WEIGHT = np.arange(V * D, dtype=np.float32).reshape(V, D) + 1.0  # row r = 3r+1..3r+3
EDGES = np.array([0, V - 1, V, V + 5, -1, -V, -V - 1, -V - 9], np.int32)


def make(**kw):
    return eqx_seq.Embedding.from_pretrained(WEIGHT, **kw)


def grad_counts(emb, ids):
    """How many lookups each row gets gradient from (column 0 of d sum(out)/dW)."""
    g = jax.grad(lambda e: jnp.sum(jnp.nan_to_num(e(ids))))(emb)
    return np.asarray(g.weight[:, 0])


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 1, 4)])
def test_values_any_shape(getkey, shape):
    emb = eqx_seq.Embedding(V, D, key=getkey())
    ids = jr.randint(getkey(), shape, -V, V)
    out = emb(ids)
    # the weight's dtype: JAX's default floating dtype (float64 in this suite)
    assert out.shape == (*shape, D) and out.dtype == emb.weight.dtype == jnp.float64
    np.testing.assert_array_equal(
        out, np.asarray(emb.weight)[np.asarray(ids)]
    )  # numpy wraps negatives too


@pytest.mark.parametrize(
    "dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.uint32, jnp.int64]
)
def test_narrow_and_unsigned_ids(dtype):
    weight = np.arange(300 * 2, dtype=np.float32).reshape(
        300, 2
    )  # V larger than int8 holds
    emb = eqx_seq.Embedding.from_pretrained(weight)
    ids = np.array([0, 5, 100, 120], np.int64)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        ids = np.concatenate([ids, [-1, -3]])
    np.testing.assert_array_equal(emb(jnp.asarray(ids, dtype)), weight[ids])


def test_policy_clip_edges():
    emb = make(out_of_range="clip")
    expected_rows = [0, V - 1, V - 1, V - 1, V - 1, 0, 0, 0]
    np.testing.assert_array_equal(emb(EDGES), WEIGHT[expected_rows])
    # the clamped forward keeps its gradient: each looked-up row gets one count
    np.testing.assert_array_equal(
        grad_counts(emb, EDGES), np.bincount(expected_rows, minlength=V)
    )


def test_policy_fill_edges():
    emb = make(out_of_range="fill")
    out = np.asarray(emb(EDGES))
    valid = [0, 1, 4, 5]  # ids 0, V-1, -1, -V
    np.testing.assert_array_equal(out[valid], WEIGHT[[0, V - 1, V - 1, 0]])
    assert np.isnan(out[[2, 3, 6, 7]]).all()
    # NaN rows do not depend on the weight: no gradient from them
    np.testing.assert_array_equal(
        grad_counts(emb, EDGES), np.bincount([0, V - 1, V - 1, 0], minlength=V)
    )


def test_policy_error():
    emb = make()  # "error" is the default
    assert emb.out_of_range == "error"
    inside = np.array([0, V - 1, -1, -V], np.int32)
    np.testing.assert_array_equal(emb(inside), WEIGHT[[0, V - 1, V - 1, 0]])
    f = jax.jit(lambda e, i: e(i))
    for bad in [V, -V - 1, V + 100]:
        with pytest.raises(RuntimeError, match="out of range for num_embeddings=7"):
            jax.block_until_ready(f(emb, jnp.array([0, bad])))
    # and under vmap
    with pytest.raises(RuntimeError, match="out of range"):
        jax.block_until_ready(jax.vmap(emb)(jnp.array([[0], [V]])))


def test_padding(getkey):
    emb = eqx_seq.Embedding(V, D, padding_idx=-2, key=getkey())
    assert emb.padding_idx == V - 2
    np.testing.assert_array_equal(emb.weight[V - 2], 0)
    ids = jnp.array([[V - 2, 1], [-2, 3]])
    x = jr.normal(getkey(), (4, D), jnp.float32)

    def loss(e):
        return jnp.sum(e(ids) ** 2 + 1.0 * e(ids)) + jnp.sum(e.attend(x) ** 2)

    g = jax.grad(loss)(emb)
    np.testing.assert_array_equal(g.weight[V - 2], 0)  # neither lookups nor attend
    assert np.all(np.asarray(g.weight[1]) != 0) and np.all(np.asarray(g.weight[3]) != 0)
    # the padding row's logit still passes gradient to the read-out input: give the
    # row a value (as a loaded checkpoint could) so that this can be seen
    loaded = eqx.tree_at(lambda e: e.weight, emb, emb.weight.at[V - 2].set(5.0))
    gx = jax.grad(lambda x: jnp.sum(loaded.attend(x)))(x)
    expected = np.broadcast_to(np.asarray(loaded.weight).sum(0), x.shape)
    np.testing.assert_allclose(gx, expected, rtol=1e-6)


def test_attend_tied_logits(getkey):
    emb = eqx_seq.Embedding(V, D, key=getkey())
    x = jr.normal(getkey(), (2, 5, D), jnp.float32)
    logits = emb.attend(x)
    assert logits.shape == (2, 5, V)
    np.testing.assert_allclose(
        logits, np.asarray(x) @ np.asarray(emb.weight).T, rtol=1e-5, atol=1e-5
    )


def test_dtypes(getkey):
    emb = eqx_seq.Embedding(
        V, D, dtype=jnp.bfloat16, param_dtype=jnp.float32, key=getkey()
    )
    assert emb.weight.dtype == jnp.float32  # storage
    ids = jnp.array([1, 2])
    out = emb(ids)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, emb.weight[ids].astype(jnp.bfloat16))
    assert emb.attend(jnp.ones((4, D), jnp.float32)).dtype == jnp.bfloat16
    g = jax.grad(lambda e: jnp.sum(e(ids).astype(jnp.float32)))(emb)
    assert g.weight.dtype == jnp.float32
    half = eqx_seq.Embedding(V, D, param_dtype=jnp.float16, key=getkey())
    assert half.weight.dtype == jnp.float16 and half(ids).dtype == jnp.float16
    assert make(param_dtype=jnp.float64).weight.dtype == jnp.float64
    # attend without a compute dtype: common dtype of x and weight
    assert make().attend(jnp.ones(D, jnp.float64)).dtype == jnp.float64


def test_jit_vmap_grad(getkey):
    emb = eqx_seq.Embedding(V, D, key=getkey())
    ids = jr.randint(getkey(), (4, 6), 0, V)
    direct = emb(ids)
    np.testing.assert_array_equal(jax.jit(lambda e, i: e(i))(emb, ids), direct)
    np.testing.assert_array_equal(jax.vmap(emb)(ids), direct)
    np.testing.assert_array_equal(jax.vmap(jax.vmap(emb))(ids), direct)
    ct = jr.normal(getkey(), direct.shape, direct.dtype)
    g = jax.jit(jax.grad(lambda e: jnp.sum(e(ids) * ct)))(emb).weight
    expected = np.zeros((V, D), direct.dtype)
    np.add.at(expected, np.asarray(ids), np.asarray(ct))  # scatter-add reference
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-6)


def test_serialise_round_trip(getkey, tmp_path):
    emb = eqx_seq.Embedding(V, D, padding_idx=0, out_of_range="clip", key=getkey())
    eqx.tree_serialise_leaves(tmp_path / "emb.eqx", emb)
    like = eqx_seq.Embedding(V, D, padding_idx=0, out_of_range="clip", key=getkey())
    loaded = eqx.tree_deserialise_leaves(tmp_path / "emb.eqx", like)
    assert eqx.tree_equal(loaded, emb)
    np.testing.assert_array_equal(loaded(jnp.arange(V)), emb(jnp.arange(V)))


def test_freeze_with_optax():
    frozen = make(freeze=True)
    ids = jnp.array([0, 3, 3])

    def loss(e):
        return jnp.sum(e(ids) ** 2) + jnp.sum(e.attend(jnp.ones((2, D), jnp.float32)))

    grads = eqx.filter_grad(loss)(frozen)
    np.testing.assert_array_equal(grads.weight, 0)
    opt = optax.adam(0.1)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int counts and floats
        state = opt.init(eqx.filter(frozen, eqx.is_inexact_array))
        updates, state = opt.update(grads, state)
        stepped = eqx.apply_updates(frozen, updates)
        np.testing.assert_array_equal(stepped.weight, WEIGHT)
        # not frozen: the same step moves it
        live = make()
        live_state = opt.init(eqx.filter(live, eqx.is_inexact_array))
        updates, _ = opt.update(eqx.filter_grad(loss)(live), live_state)
        assert not np.array_equal(eqx.apply_updates(live, updates).weight, WEIGHT)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input(getkey):
    emb = eqx_seq.Embedding(V, D, key=getkey())
    with pytest.raises(ValueError, match="integer ids.*float32"):
        emb(jnp.array([1.0, 2.0], jnp.float32))
    with pytest.raises(ValueError, match="integer ids.*bool"):
        emb(jnp.array([True]))
    with pytest.raises(ValueError, match=r"\(\.\.\., 3\).*\(2, 4\)"):
        emb.attend(jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="out_of_range"):
        eqx_seq.Embedding(V, D, out_of_range="wrap", key=getkey())
    with pytest.raises(ValueError, match="padding_idx"):
        eqx_seq.Embedding(V, D, padding_idx=V, key=getkey())
    with pytest.raises(ValueError, match="key"):
        eqx_seq.Embedding(V, D)
    with pytest.raises(ValueError, match="positive int"):
        eqx_seq.Embedding(0, D, key=getkey())
    with pytest.raises(ValueError, match="2-D"):
        eqx_seq.Embedding.from_pretrained(jnp.ones(5))
    with pytest.raises(ValueError, match="floating"):
        eqx_seq.Embedding.from_pretrained(jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="shape"):
        eqx_seq.Embedding(3, D, weight=WEIGHT)


def _gathers(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "gather":
            found.append(eqn)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                found += _gathers(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("policy", ["error", "clip", "fill"])
def test_one_canonical_gather(policy):
    # one gather for the whole index array, with one index column and the row
    # dimension collapsed: the form accelerators fuse (equinox issue 920)
    emb = make(out_of_range=policy)
    ids = jnp.zeros((4, 6), jnp.int32)
    (gather,) = _gathers(jax.make_jaxpr(lambda e, i: e(i))(emb, ids).jaxpr)
    numbers = gather.params["dimension_numbers"]
    assert gather.invars[1].aval.shape == (4, 6, 1)
    assert numbers.start_index_map == (0,) and numbers.collapsed_slice_dims == (0,)
