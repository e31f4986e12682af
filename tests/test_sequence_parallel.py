"""One sequence split over devices along time (`eqx_seq.ShardedScan` inside
`jax.shard_map`): the same values and gradients as on one device.

On the CPU devices of `conftest.py`: two, or four for the exchange between several
blocks (a device with blocks both before and after it). The Hawk block is on four
blocks in `test_sequence_parallel_selective.py`, the classifier's pooling in
`test_sequence_parallel_exchange.py`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import recurrence_inputs
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs four devices (conftest.py asks for them)"
)

INNER = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


def _mesh(n: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("seq",))


def _sharded(fn, in_specs, out_specs=P("seq"), devices: int = 2):
    return jax.jit(
        jax.shard_map(fn, mesh=_mesh(devices), in_specs=in_specs, out_specs=out_specs)
    )


def _outputs_and_grads(fn, w, args, argnums=0):
    """`fn(*args)` and the gradient of a weighted sum of its output (real and
    imaginary parts) with respect to `args[argnums]`, from one compiled program."""

    def loss(*args):
        out = fn(*args)
        value = jnp.sum(jnp.real(out) * w) + jnp.sum(jnp.imag(out) * w[::-1])
        return value, out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
    return out, grads


def _assert_close(x, y, rtol=1e-10, atol=1e-12, max_abs=None):
    """Leaf by leaf `allclose`, and with `max_abs` no absolute difference above it."""
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
        if max_abs is not None:
            assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) < max_abs


# slow tier: six of the eight; the fast tier splits each kind of decay once, forward
# on the sequential inner backend and in reverse on the associative one
@pytest.mark.parametrize(
    "decay,reverse,inner",
    [
        pytest.param(
            decay,
            reverse,
            inner,
            marks=[]
            if (decay, reverse, inner)
            in [
                ("invariant, complex", False, "sequential"),
                ("varying, real", True, "associative"),
            ]
            else [pytest.mark.slow],
        )
        for decay in ["invariant, complex", "varying, real"]
        for reverse in [False, True]
        for inner in INNER
    ],
)
def test_linear_recurrence(decay, reverse, inner):
    """Values and gradients with respect to `a`, `b` and `h0` equal the one-device
    ones, for both directions and both kinds of decay, on four blocks of 10 steps
    (within 1e-11 absolute too)."""
    T, S = 40, (3, 2)
    varying = decay.startswith("varying")
    a, b, h0, w = recurrence_inputs(T, S, varying)
    one = lambda a, b, h0: eqx_seq.linear_recurrence(
        a, b, h0, scan=INNER[inner], reverse=reverse
    )
    scan = eqx_seq.ShardedScan("seq", INNER[inner])
    split = _sharded(
        lambda a, b, h0: eqx_seq.linear_recurrence(
            a, b, h0, scan=scan, reverse=reverse
        ),
        (P("seq") if varying else P(), P("seq"), P()),
        devices=4,
    )
    got, want = (_outputs_and_grads(f, w, (a, b, h0), (0, 1, 2)) for f in (split, one))
    _assert_close(got, want, max_abs=1e-11)


def test_initial_and_final_state():
    """Only the first device's `h0` counts (the last's with `reverse`); the last
    device's last step is the final state."""
    T, S = 16, (4,)
    a = jnp.linspace(0.5, 0.9, 4)
    b = jr.normal(jr.key(1), (T, *S))
    h0s = jr.normal(jr.key(2), (2, *S))  # one per device
    scan = eqx_seq.ShardedScan("seq")
    for reverse, holder in ((False, 0), (True, 1)):
        split = _sharded(
            lambda b, h0: eqx_seq.linear_recurrence(
                a, b, h0[0], scan=scan, reverse=reverse
            ),
            (P("seq"), P("seq")),
        )
        expected = eqx_seq.linear_recurrence(a, b, h0s[holder], reverse=reverse)
        out = split(b, h0s)
        _assert_close(out, expected)
        final = out[0] if reverse else out[-1]
        _assert_close(final, expected[0] if reverse else expected[-1])


# slow tier: the last device's final state is checked by test_initial_and_final_state
# (the recurrence) and by test_sequence_parallel_selective.py's
# test_initial_and_final_state (a layer's `final_state`)
@pytest.mark.slow
def test_final_state():
    """`S5.final_state` on the last device is the whole sequence's."""
    one = eqx_seq.S5(3, 8, scan=eqx_seq.SequentialScan(), key=jr.key(0))
    split_layer = eqx_seq.S5(3, 8, scan=eqx_seq.ShardedScan("seq"), key=jr.key(0))
    x = jr.normal(jr.key(1), (20, 3))
    finals = _sharded(lambda x: split_layer.final_state(x)[None], (P("seq"),))(x)
    _assert_close(finals[-1], one.final_state(x))


def test_batch_of_split_sequences():
    """`jax.vmap` over sequences inside the `shard_map`, each split over time (a
    mesh with a sequence axis, the batch on every device)."""
    x = jr.normal(jr.key(11), (3, 40, 3))
    one = eqx_seq.S5(3, 6, scan=eqx_seq.SequentialScan(), key=jr.key(0))
    layer = eqx_seq.S5(3, 6, scan=eqx_seq.ShardedScan("seq"), key=jr.key(0))
    split = jax.jit(
        jax.shard_map(
            jax.vmap(layer),
            mesh=_mesh(),
            in_specs=P(None, "seq"),
            out_specs=P(None, "seq"),
        )
    )
    _assert_close(split(x), jax.vmap(one)(x))


def test_recurrence_jacobians():
    T, S = 24, (3,)
    a = jnp.array([0.5, -0.8, 0.95])
    b = jr.normal(jr.key(3), (T, *S))
    h0 = jr.normal(jr.key(4), S)
    scan = eqx_seq.ShardedScan("seq")
    split = _sharded(
        lambda b, h0: eqx_seq.recurrence_jacobians(a, b, h0, scan=scan),
        (P("seq"), P()),
    )
    _assert_close(split(b, h0), eqx_seq.recurrence_jacobians(a, b, h0))


# slow tier: all but the bidirectional S5 (both directions of the exchange in one
# layer); the LRU's and S5's forward scans are the same diagonal recurrence, and the
# RG-LRU is split in test_sequence_parallel_selective.py's test_layers[hawk-True]
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda scan, key: eqx_seq.S5(3, 8, scan=scan, key=key),
            marks=pytest.mark.slow,
        ),
        lambda scan, key: eqx_seq.S5(3, 8, bidirectional=True, scan=scan, key=key),
        pytest.param(
            lambda scan, key: eqx_seq.LRU(3, 8, scan=scan, key=key),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            lambda scan, key: eqx_seq.RGLRU(4, num_heads=2, scan=scan, key=key),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["s5", "s5-bidirectional", "lru", "rglru"],
)
def test_layers(make):
    """A layer on one sequence split over four devices (blocks of 10 steps): outputs
    and the gradients of its parameters (summed over the devices by JAX) equal one
    device's, within 1e-9 absolute too."""
    one = make(eqx_seq.SequentialScan(), jr.key(5))
    split_layer = make(eqx_seq.ShardedScan("seq"), jr.key(5))
    features = 4 if isinstance(one, eqx_seq.RGLRU) else 3
    x = jr.normal(jr.key(6), (40, features))
    w = jr.normal(jr.key(7), (40, features))
    params, static = eqx.partition(split_layer, eqx.is_inexact_array)
    run = jax.shard_map(
        lambda p, x: eqx.combine(p, static)(x),
        mesh=_mesh(4),
        in_specs=(P(), P("seq")),
        out_specs=P("seq"),
    )
    p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
    y, g_split = _outputs_and_grads(run, w, (params, x))
    y_one, g_one = _outputs_and_grads(
        lambda p, x: eqx.combine(p, s_one)(x), w, (p_one, x)
    )
    _assert_close(y, y_one, max_abs=1e-9)
    _assert_close(g_split, g_one, rtol=1e-9, max_abs=1e-9)


# slow tier: a language model on a split token stream is checked by
# test_sequence_parallel_selective.py's test_language_model[rglru]
@pytest.mark.slow
def test_language_model():
    """`LanguageModel` (S5 blocks) on one token stream split over the devices: the
    logits and the gradient of a next-token loss equal one device's."""
    ids = jr.randint(jr.key(8), (32,), 0, 20)
    make = lambda scan: eqx_seq.LanguageModel(
        20, width=8, depth=2, state_size=4, scan=scan, key=jr.key(9)
    )
    one, split_lm = make(eqx_seq.SequentialScan()), make(eqx_seq.ShardedScan("seq"))
    params, static = eqx.partition(split_lm, eqx.is_inexact_array)

    def nll(lm, ids):  # summed over this device's tokens
        logp = jax.nn.log_softmax(lm(ids)[:-1])
        return -jnp.sum(jnp.take_along_axis(logp, ids[1:, None], axis=1))

    logits = jax.shard_map(
        lambda p, ids: eqx.combine(p, static)(ids),
        mesh=_mesh(),
        in_specs=(P(), P("seq")),
        out_specs=P("seq"),
    )
    _assert_close(jax.jit(logits)(params, ids), one(ids), rtol=1e-9)
    # the loss of the whole stream from the sharded logits
    loss = lambda p: nll(lambda ids: logits(p, ids), ids)
    g_split = jax.jit(jax.grad(loss))(params)
    p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
    g_one = jax.jit(jax.grad(lambda p: nll(eqx.combine(p, s_one), ids)))(p_one)
    _assert_close(g_split, g_one, rtol=1e-9)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    b = jnp.ones((8, 2))
    with pytest.raises(ValueError, match="inside `jax.shard_map`"):
        eqx_seq.linear_recurrence(0.5, b, scan=eqx_seq.ShardedScan("seq"))
    wrong = _sharded(
        lambda b: eqx_seq.linear_recurrence(0.5, b, scan=eqx_seq.ShardedScan("time")),
        (P("seq"),),
    )
    with pytest.raises(ValueError, match="axis named 'time'"):
        wrong(b)
    for axis_name in ("", 3):
        with pytest.raises(ValueError, match="`axis_name` must be"):
            eqx_seq.ShardedScan(axis_name)
    with pytest.raises(ValueError, match="cannot be another ShardedScan"):
        eqx_seq.ShardedScan("seq", inner=eqx_seq.ShardedScan("seq"))
    with pytest.raises(ValueError, match="must be an `eqx_seq.AbstractScan`"):
        eqx_seq.ShardedScan("seq", inner="sequential")
    # the tridiagonal solve needs more than a state across a boundary: it refuses
    scan = eqx_seq.ShardedScan("seq")
    with pytest.raises(ValueError, match="does not run on a time axis split"):
        eqx_seq.tridiagonal_solve(b, b, b, b, scan=scan)
    # an uneven split is shard_map's error
    uneven = _sharded(
        lambda b: eqx_seq.linear_recurrence(0.5, b, scan=scan), (P("seq"),)
    )
    with pytest.raises(ValueError, match="divisible"):
        uneven(jnp.ones((7, 2)))


def _matrix_product(earlier, later):
    """A non-commutative associative operator on batches of 2 x 2 matrices."""
    return jnp.einsum("bij,bjk->bik", later, earlier)


def test_pytree_scan_on_a_split_time_axis():
    """`ShardedScan.associative_scan` on four blocks is the inclusive scan of the
    whole sequence (products of 2 x 2 matrices, in order), both directions, with
    either inner backend's pytree scan (the one-element-after-another one of
    `AbstractLocalScan` for `SequentialScan`)."""
    elems = jr.normal(jr.key(0), (12, 2, 2)) / 2 + jnp.eye(2)[None]
    expected = {
        reverse: jax.lax.associative_scan(_matrix_product, elems, reverse=reverse)
        for reverse in (False, True)
    }

    def scans(x):
        return {
            (name, reverse): eqx_seq.ShardedScan("seq", inner).associative_scan(
                _matrix_product, x, reverse=reverse
            )
            for name, inner in INNER.items()
            for reverse in (False, True)
        }

    got = _sharded(scans, P("seq"), devices=4)(elems)
    for (name, reverse), value in got.items():
        _assert_close(value, expected[reverse], rtol=1e-12, atol=1e-12)
        local = INNER[name].associative_scan(_matrix_product, elems, reverse=reverse)
        _assert_close(local, expected[reverse], rtol=1e-12, atol=1e-12)


def test_the_block_backend_declares_the_contract():
    """What a layer reads of a backend is declared: the block's backend and its
    `unroll` (an `AutoScan` forwards to its choice), `splits_time`, and the carry
    into a one-device block is `h0` without calling the block's map."""
    sharded = eqx_seq.ShardedScan("seq", eqx_seq.SequentialScan(unroll=3))
    assert sharded.splits_time and not sharded.parallel
    assert sharded.block_scan() == eqx_seq.SequentialScan(unroll=3)
    assert sharded.unroll == 3
    auto = eqx_seq.AutoScan()
    assert auto.block_scan() == auto.select() and auto.unroll == auto.select().unroll
    assert not auto.splits_time and auto.parallel == auto.select().parallel

    def never(start):
        raise AssertionError("one block: no map is needed")

    h0 = jnp.arange(3.0)
    for scan in (eqx_seq.SequentialScan(), eqx_seq.AssociativeScan(), auto):
        assert scan.carry_into_block(never, h0) is h0
        assert not scan.splits_time
