"""`eqx_seq.ShardedScan`'s two exchanges (`all_gather`, `ppermute`), and what else
runs on a time axis split over devices: `SequenceClassifier`'s pooling and the S5/LRU
`parameter_jacobians`. Each against one device.

In process on the two CPU devices of `conftest.py`; on eight and six forced CPU
devices in a subprocess (its own JAX configuration), where the `ppermute` scan takes
several rounds and, on six, a round in which some devices receive nothing.
"""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
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
    k = jr.split(jr.key(0), 5)
    varying = decay.startswith("varying")
    a = jr.uniform(k[0], (T, *S) if varying else S, minval=-0.99, maxval=0.99)
    b = jr.normal(k[1], (T, *S))
    h0 = jr.normal(k[2], S)
    if not varying:  # complex: a rotation and decay, complex inputs
        a = a.astype(jnp.complex128) * jnp.exp(0.4j)
        b = jax.lax.complex(b, jr.normal(k[3], (T, *S)))
        h0 = h0.astype(jnp.complex128) - 0.5j
    w = jr.normal(k[4], (T, *S))
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _MANY_DEVICES],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "max abs difference" in out.stdout
