"""`eqx_seq.ShardedScan`'s two exchanges (`all_gather`, `ppermute`), and what else
runs on a time axis split over devices: `SequenceClassifier`'s pooling and the S5/LRU
`parameter_jacobians`. Each against one device.

In process on the two CPU devices of `conftest.py`; on eight and six forced CPU
devices in a subprocess (its own JAX configuration), where the `ppermute` scan takes
several rounds and, on six, a round in which some devices receive nothing.
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

EXCHANGES = ("all_gather", "ppermute")


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("seq",))


def _sharded(fn, in_specs, out_specs=P("seq")):
    return jax.jit(
        jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs)
    )


def _assert_close(x, y, rtol=1e-10, atol=1e-12):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def _loss(fn, w):
    def loss(*args):
        out = fn(*args)
        return jnp.sum(jnp.real(out) * w) + jnp.sum(jnp.imag(out) * w[::-1])

    return loss


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("decay", ["invariant, complex", "varying, real"])
def test_exchange(decay, reverse, exchange):
    """Values and gradients w.r.t. `a`, `b` and `h0` equal one device's, both of
    `linear_recurrence` (hand-written derivatives) and of the backend's
    `recurrence` differentiated by tracing (through the exchange itself)."""
    T, S = 24, (3, 2)
    varying = decay.startswith("varying")
    a, b, h0, w = recurrence_inputs(T, S, varying)
    scan = eqx_seq.ShardedScan("seq", exchange=exchange)
    specs = (P("seq") if varying else P(), P("seq"), P())
    one = lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, reverse=reverse)
    for fn in (
        lambda a, b, h0: eqx_seq.linear_recurrence(
            a, b, h0, scan=scan, reverse=reverse
        ),
        lambda a, b, h0: scan.recurrence(a, b, h0, reverse=reverse),
    ):
        split = _sharded(fn, specs)
        _assert_close(split(a, b, h0), one(a, b, h0))
        grads = [
            jax.jit(jax.grad(_loss(f, w), argnums=(0, 1, 2)))(a, b, h0)
            for f in (one, split)
        ]
        _assert_close(grads[1], grads[0])


def test_exchange_parallel_inner():
    """`ppermute` with a parallel inner backend, time-varying decay and `h0`."""
    T, S = 16, (4,)
    k = jr.split(jr.key(1), 3)
    a = jr.uniform(k[0], (T, *S), minval=0.5, maxval=0.99)
    b, h0 = jr.normal(k[1], (T, *S)), jr.normal(k[2], S)
    scan = eqx_seq.ShardedScan("seq", eqx_seq.AssociativeScan(), exchange="ppermute")
    split = _sharded(
        lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan),
        (P("seq"), P("seq"), P()),
    )
    _assert_close(split(a, b, h0), eqx_seq.linear_recurrence(a, b, h0))


def test_bad_exchange():
    for exchange in ("allgather", "psum", None):
        with pytest.raises(ValueError, match="`exchange` must be"):
            eqx_seq.ShardedScan("seq", exchange=exchange)


_MANY_DEVICES = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, jax.random as jr, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import eqx_seq

    T, S = 48, (3,)
    k = jr.split(jr.key(0), 4)
    w = jr.normal(k[3], (T, *S))
    loss = lambda f: lambda *x: jnp.sum(f(*x) * w)
    worst = 0.0
    for n in (8, 6):
        mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
        for varying in (False, True):
            a = jr.uniform(k[0], (T, *S) if varying else S, minval=-0.99, maxval=0.99)
            b, h0 = jr.normal(k[1], (T, *S)), jr.normal(k[2], S)
            specs = (P("seq") if varying else P(), P("seq"), P())
            for reverse in (False, True):
                one = lambda a, b, h0: eqx_seq.linear_recurrence(
                    a, b, h0, reverse=reverse)
                expected = [one(a, b, h0)] + list(
                    jax.grad(loss(one), argnums=(0, 1, 2))(a, b, h0))
                for exchange in ("all_gather", "ppermute"):
                    scan = eqx_seq.ShardedScan("seq", exchange=exchange)
                    fns = [lambda a, b, h0: eqx_seq.linear_recurrence(
                        a, b, h0, scan=scan, reverse=reverse)]
                    if exchange == "ppermute":  # through the exchange itself
                        fns.append(
                            lambda a, b, h0: scan.recurrence(a, b, h0, reverse=reverse))
                    for fn in fns:
                        split = jax.jit(jax.shard_map(
                            fn, mesh=mesh, in_specs=specs, out_specs=P("seq")))
                        got = [split(a, b, h0)] + list(jax.jit(
                            jax.grad(loss(split), argnums=(0, 1, 2)))(a, b, h0))
                        for x, y in zip(expected, got, strict=True):
                            worst = max(worst, float(jnp.max(jnp.abs(x - y))))
    print("max abs difference", worst)
    assert worst < 1e-11, worst
    """
)


def test_many_devices():
    """Eight and six blocks (forced CPU devices, in a subprocess): both exchanges,
    both kinds of decay, both directions, values and gradients against one device."""
    run_forced_devices(_MANY_DEVICES, timeout=400)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_classifier(pooling):
    """`SequenceClassifier` on one sequence split over the devices: every device
    returns the whole sequence's logits, and they and the parameters' gradients
    equal one device's; without a mask, and with masks whose last valid step is
    on the last device or the first (the last device then has none)."""
    make = lambda scan, mixer: eqx_seq.SequenceClassifier(
        3,
        4,
        width=8,
        depth=2,
        state_size=4,
        mixer=mixer,
        pooling=pooling,
        scan=scan,
        key=jr.key(10),
    )
    T = 20
    x = jr.normal(jr.key(11), (T, 3))
    w = jr.normal(jr.key(12), (4,))
    for mixer, valid in (("s5", None), ("s5", 14), ("lru", 7)):
        one = make(eqx_seq.SequentialScan(), mixer)
        split_model = make(eqx_seq.ShardedScan("seq", exchange="ppermute"), mixer)
        mask = jnp.ones(T, bool) if valid is None else jnp.arange(T) < valid
        params, static = eqx.partition(split_model, eqx.is_inexact_array)

        def run(p, x, mask, valid=valid, static=static):
            model = eqx.combine(p, static)
            return model(x, mask=None if valid is None else mask)

        # each device's logits (a row each), and the logits as replicated
        per_device, split = (
            jax.shard_map(
                f, mesh=_mesh(), in_specs=(P(), P("seq"), P("seq")), out_specs=spec
            )
            for f, spec in (
                (lambda *args: run(*args)[None], P("seq")),
                (run, P()),
            )
        )
        expected = one(x, mask=None if valid is None else mask)
        logits = jax.jit(per_device)(params, x, mask)
        _assert_close(logits, jnp.stack([expected, expected]), rtol=1e-9)
        loss = lambda p: jnp.sum(split(p, x, mask) * w)
        p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
        loss_one = lambda p: jnp.sum(
            eqx.combine(p, s_one)(x, mask=None if valid is None else mask) * w
        )
        g_split = jax.jit(jax.grad(loss))(params)
        _assert_close(g_split, jax.jit(jax.grad(loss_one))(p_one), rtol=1e-9)


@pytest.mark.parametrize(
    "kind,with_dt", [("s5", False), ("s5", True), ("lru", False)], ids=str
)
def test_parameter_jacobians(kind, with_dt):
    """S5/LRU `parameter_jacobians` on one sequence split over the devices, with
    `h0`: every step's Jacobians equal one device's, and with `final=True` the last
    device's equal one device's (`wrt_B`, summed over time, on every device)."""
    T, H = 16, 3
    make = eqx_seq.S5 if kind == "s5" else eqx_seq.LRU
    one = make(H, 4, scan=eqx_seq.SequentialScan(), key=jr.key(13))
    split_layer = make(H, 4, scan=eqx_seq.ShardedScan("seq"), key=jr.key(13))
    k = jr.split(jr.key(14), 3)
    u = jr.normal(k[0], (T, H))
    dt = jr.uniform(k[1], (T,), minval=0.5, maxval=2) if with_dt else None
    h0 = jax.lax.complex(*jr.normal(k[2], (2, one.num_states)))
    dt_spec = P("seq") if with_dt else None
    jac = _sharded(
        lambda u, dt, h0: split_layer.parameter_jacobians(u, dt=dt, h0=h0),
        (P("seq"), dt_spec, P()),
    )(u, dt, h0)
    _assert_close(jac, one.parameter_jacobians(u, dt=dt, h0=h0))
    finals = _sharded(
        lambda u, dt, h0: jax.tree.map(
            lambda x: x[None],
            split_layer.parameter_jacobians(u, dt=dt, h0=h0, final=True),
        ),
        (P("seq"), dt_spec, P()),
    )(u, dt, h0)
    expected = one.parameter_jacobians(u, dt=dt, h0=h0, final=True)
    _assert_close(jax.tree.map(lambda x: x[-1], finals), expected)
    _assert_close(finals.wrt_B[0], expected.wrt_B)
