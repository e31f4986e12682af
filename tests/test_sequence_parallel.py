"""One sequence split over devices along time (`eqx_seq.ShardedScan` inside
`jax.shard_map`): the same values and gradients as on one device.

In process on the two CPU devices of `conftest.py`; on eight forced CPU devices in a
subprocess (its own JAX configuration), for the exchange between many blocks.
"""

import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import recurrence_inputs, run_forced_devices
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


pytestmark = pytest.mark.skipif(
    jax.device_count() < 2, reason="needs two devices (conftest.py asks for them)"
)

INNER = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


def _mesh(n: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("seq",))


def _sharded(fn, in_specs, out_specs=P("seq")):
    return jax.jit(
        jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs)
    )


def _loss(fn, w):
    def loss(*args):
        out = fn(*args)
        return jnp.sum(jnp.real(out) * w) + jnp.sum(jnp.imag(out) * w[::-1])

    return loss


def _assert_close(x, y, rtol=1e-10, atol=1e-12):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("decay", ["invariant, complex", "varying, real"])
def test_linear_recurrence(decay, reverse, inner):
    """Values and gradients with respect to `a`, `b` and `h0` equal the one-device
    ones, for both directions and both kinds of decay."""
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
    )
    _assert_close(split(a, b, h0), one(a, b, h0))
    grads = [
        jax.jit(jax.grad(_loss(f, w), argnums=(0, 1, 2)))(a, b, h0)
        for f in (one, split)
    ]
    _assert_close(grads[1], grads[0])


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


@pytest.mark.parametrize(
    "make",
    [
        lambda scan, key: eqx_seq.S5(3, 8, scan=scan, key=key),
        lambda scan, key: eqx_seq.S5(3, 8, bidirectional=True, scan=scan, key=key),
        lambda scan, key: eqx_seq.LRU(3, 8, scan=scan, key=key),
        lambda scan, key: eqx_seq.RGLRU(4, num_heads=2, scan=scan, key=key),
    ],
    ids=["s5", "s5-bidirectional", "lru", "rglru"],
)
def test_layers(make):
    """A layer on one sequence split over the devices: outputs and the gradients of
    its parameters (summed over the devices by JAX) equal one device's."""
    one = make(eqx_seq.SequentialScan(), jr.key(5))
    split_layer = make(eqx_seq.ShardedScan("seq"), jr.key(5))
    features = 4 if isinstance(one, eqx_seq.RGLRU) else 3
    x = jr.normal(jr.key(6), (30, features))
    w = jr.normal(jr.key(7), (30, features))
    params, static = eqx.partition(split_layer, eqx.is_inexact_array)
    run = jax.shard_map(
        lambda p, x: eqx.combine(p, static)(x),
        mesh=_mesh(),
        in_specs=(P(), P("seq")),
        out_specs=P("seq"),
    )
    _assert_close(jax.jit(run)(params, x), one(x))
    loss = lambda f: lambda p, x: jnp.sum(jnp.real(f(p, x)) * w)
    g_split = jax.jit(jax.grad(loss(run)))(params, x)
    p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
    g_one = jax.jit(jax.grad(loss(lambda p, x: eqx.combine(p, s_one)(x))))(p_one, x)
    _assert_close(g_split, g_one, rtol=1e-9)


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


_EIGHT_DEVICES = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, jax.random as jr, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqx_seq

    mesh = Mesh(np.array(jax.devices()), ("seq",))
    T, S = 64, (3,)
    k = jr.split(jr.key(0), 4)
    w = jr.normal(k[3], (T, *S))
    worst = 0.0
    for varying in (False, True):
        a = jr.uniform(k[0], (T, *S) if varying else S, minval=-0.99, maxval=0.99)
        b, h0 = jr.normal(k[1], (T, *S)), jr.normal(k[2], S)
        for reverse in (False, True):
            scan = eqx_seq.ShardedScan("seq")
            one = lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, reverse=reverse)
            split = jax.jit(jax.shard_map(
                lambda a, b, h0: eqx_seq.linear_recurrence(
                    a, b, h0, scan=scan, reverse=reverse),
                mesh=mesh, in_specs=(P("seq") if varying else P(), P("seq"), P()),
                out_specs=P("seq")))
            loss = lambda f: lambda *x: jnp.sum(f(*x) * w)
            pairs = [(one(a, b, h0), split(a, b, h0))] + list(zip(
                jax.grad(loss(one), argnums=(0, 1, 2))(a, b, h0),
                jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(a, b, h0)))
            for x, y in pairs:
                worst = max(worst, float(jnp.max(jnp.abs(x - y))))
    print("max abs difference", worst)
    assert worst < 1e-11, worst
    """
)


def test_eight_devices():
    """Eight blocks (eight forced CPU devices, in a subprocess): values and
    gradients of both kinds of decay, both directions, against one device."""
    run_forced_devices(_EIGHT_DEVICES, timeout=240)


_EIGHT_DEVICES_LAYERS = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import equinox as eqx, jax.numpy as jnp, jax.random as jr, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqx_seq

    mesh = Mesh(np.array(jax.devices()), ("seq",))
    makers = {
        "s5-bidirectional": lambda scan: eqx_seq.S5(
            3, 6, bidirectional=True, scan=scan, key=jr.key(0)),
        "lru": lambda scan: eqx_seq.LRU(3, 6, scan=scan, key=jr.key(0)),
        "hawk": lambda scan: eqx_seq.HawkBlock(3, scan=scan, key=jr.key(0)),
        "classifier": lambda scan: eqx_seq.SequenceClassifier(
            3, 2, width=4, depth=1, state_size=4, pooling="last", scan=scan,
            key=jr.key(0)),
    }
    x = jr.normal(jr.key(1), (40, 3))
    mask = jnp.arange(40) < 29  # the last valid step on the sixth device
    worst = {}
    for name, make in makers.items():
        one = make(eqx_seq.SequentialScan())
        split_layer = make(eqx_seq.ShardedScan("seq"))
        params, static = eqx.partition(split_layer, eqx.is_inexact_array)
        cls = name == "classifier"
        kw = lambda m: {"mask": m} if cls else {}
        run = lambda s: lambda p, x, m: eqx.combine(p, s)(x, **kw(m))
        split = jax.shard_map(run(static), mesh=mesh,
                              in_specs=(P(), P("seq"), P("seq")),
                              out_specs=P() if cls else P("seq"))
        p1, s1 = eqx.partition(one, eqx.is_inexact_array)
        loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x, mask)))
        pairs = [(jax.jit(split)(params, x, mask), run(s1)(p1, x, mask))]
        pairs += zip(jax.tree.leaves(jax.jit(jax.grad(loss(split)))(params, x)),
                     jax.tree.leaves(jax.grad(loss(run(s1)))(p1, x)))
        worst[name] = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    print("max abs difference", worst)
    assert max(worst.values()) < 1e-9, worst
    """
)


def test_eight_devices_layers():
    """The layers on eight blocks (eight forced CPU devices, in a subprocess): a
    bidirectional S5, an LRU, a Hawk block (its convolution's halo) and a
    classifier pooling the last valid step; outputs and parameter gradients
    against one device."""
    run_forced_devices(_EIGHT_DEVICES_LAYERS, timeout=400)
