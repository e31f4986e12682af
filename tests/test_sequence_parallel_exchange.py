"""`eqx_seq.ShardedScan`'s two exchanges (`all_gather`, `ppermute`), and what else
runs on a time axis split over devices: `SequenceClassifier`'s pooling and the S5/LRU
`parameter_jacobians`. Each against one device.

On four of the CPU devices of `conftest.py`, where the `ppermute` scan takes two
rounds and a device has blocks both before and after it, and on three, a count that
is not a power of two.
"""

import itertools as it

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import recurrence_inputs, slow_except
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs four devices (conftest.py asks for them)"
)

EXCHANGES = ("all_gather", "ppermute")


def _mesh(devices: int = 4) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("seq",))


def _sharded(fn, in_specs, out_specs=P("seq"), devices: int = 4):
    return jax.jit(
        jax.shard_map(fn, mesh=_mesh(devices), in_specs=in_specs, out_specs=out_specs)
    )


def _assert_close(x, y, rtol=1e-10, atol=1e-12, max_abs=None):
    """Leaf by leaf `allclose`, and with `max_abs` no absolute difference above it."""
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
        if max_abs is not None:
            assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) < max_abs


def _outputs_and_grads(fn, w, args, argnums=0):
    """`fn(*args)` and the gradient of a weighted sum of its output (real and
    imaginary parts) with respect to `args[argnums]`, from one compiled program."""

    def loss(*args):
        out = fn(*args)
        value = jnp.sum(jnp.real(out) * w) + jnp.sum(jnp.imag(out) * w[::-1])
        return value, out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
    return out, grads


# slow tier: 14 of the 16; the fast tier runs `all_gather` forward on four devices
# with a shared decay and `ppermute` in reverse on three (its last round reaching
# some devices only) with a split one; `ppermute`'s two full rounds on four devices
# give the values of one device in test_exchange_parallel_inner
_DEVICE_IDS = {4: "four", 3: "three"}
DECAYS = ["invariant, complex", "varying, real"]


def _exchange_id(decay, reverse, exchange, devices):
    return f"{decay}-{reverse}-{exchange}-{_DEVICE_IDS[devices]}"


_EXCHANGE_CASES = list(it.product(DECAYS, [False, True], EXCHANGES, [4, 3]))
_EXCHANGE_FAST = [
    ("invariant, complex", False, "all_gather", 4),
    ("varying, real", True, "ppermute", 3),
]


@pytest.mark.parametrize(
    "decay,reverse,exchange,devices",
    slow_except(
        _EXCHANGE_CASES,
        [_exchange_id(*case) for case in _EXCHANGE_FAST],
        ids=[_exchange_id(*case) for case in _EXCHANGE_CASES],
    ),
)
def test_exchange(decay, reverse, exchange, devices):
    """Values and gradients w.r.t. `a`, `b` and `h0` equal one device's (within
    1e-11 absolute too), both of `linear_recurrence` (hand-written derivatives) and
    of the backend's `recurrence` differentiated by tracing (through the exchange
    itself). On four devices (two rounds of `ppermute`, a device with blocks before
    and after it) and on three: a count that is not a power of two, whose last
    round of `ppermute` reaches some devices only (three stand in for six)."""
    T, S = 24, (3, 2)
    varying = decay.startswith("varying")
    a, b, h0, w = recurrence_inputs(T, S, varying)
    scan = eqx_seq.ShardedScan("seq", exchange=exchange)
    specs = (P("seq") if varying else P(), P("seq"), P())
    one = lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, reverse=reverse)
    expected = _outputs_and_grads(one, w, (a, b, h0), (0, 1, 2))
    for fn in (
        lambda a, b, h0: eqx_seq.linear_recurrence(
            a, b, h0, scan=scan, reverse=reverse
        ),
        lambda a, b, h0: scan.recurrence(a, b, h0, reverse=reverse),
    ):
        split = _sharded(fn, specs, devices=devices)
        got = _outputs_and_grads(split, w, (a, b, h0), (0, 1, 2))
        _assert_close(got, expected, max_abs=1e-11)


def test_exchange_parallel_inner():
    """`ppermute` with a parallel inner backend, time-varying decay and `h0`, on four
    devices."""
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


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_exchange():
    for exchange in ("allgather", "psum", None):
        with pytest.raises(ValueError, match="`exchange` must be"):
            eqx_seq.ShardedScan("seq", exchange=exchange)


# slow tier: mean pooling (a sum over the devices); last pooling, kept fast, runs the
# same masks and takes its step from the device that holds the last valid one
@pytest.mark.parametrize(
    "pooling", [pytest.param("mean", marks=pytest.mark.slow), "last"]
)
def test_classifier(pooling):
    """`SequenceClassifier` on one sequence split over four devices (blocks of 5
    steps): every device returns the whole sequence's logits, and they and the
    parameters' gradients equal one device's (within 1e-9 absolute too); without a
    mask, and with masks whose last valid step is on the last device, on a middle
    one or on the first (the devices after it then have none)."""
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

    def check(mixer, valids):
        """One program per side for the masks `arange(T) < valid` (`None`: no
        mask), each device's logits (a row each) and the gradient of a loss of the
        logits as replicated."""
        one = make(eqx_seq.SequentialScan(), mixer)
        split_model = make(eqx_seq.ShardedScan("seq", exchange="ppermute"), mixer)
        params, static = eqx.partition(split_model, eqx.is_inexact_array)
        p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
        given = lambda mask: None if valids[0] is None else mask
        run = lambda p, x, mask: eqx.combine(p, static)(x, mask=given(mask))
        per_device, split = (
            jax.shard_map(
                f, mesh=_mesh(), in_specs=(P(), P("seq"), P("seq")), out_specs=spec
            )
            for f, spec in (
                (lambda *args: run(*args)[None], P("seq")),
                (run, P()),
            )
        )

        @jax.jit
        def sharded(p, mask):
            loss = lambda p: jnp.sum(split(p, x, mask) * w)
            return per_device(p, x, mask), jax.grad(loss)(p)

        @jax.jit
        def single(p, mask):
            logits = lambda p: eqx.combine(p, s_one)(x, mask=given(mask))
            loss = lambda p: (lambda y: (jnp.sum(y * w), y))(logits(p))
            (_, y), grads = jax.value_and_grad(loss, has_aux=True)(p)
            return y, grads

        for valid in valids:
            mask = jnp.ones(T, bool) if valid is None else jnp.arange(T) < valid
            logits, g_split = sharded(params, mask)
            expected, g_one = single(p_one, mask)
            _assert_close(logits, jnp.stack([expected] * 4), rtol=1e-9, max_abs=1e-9)
            _assert_close(g_split, g_one, rtol=1e-9, max_abs=1e-9)

    # the last valid step on the last device, the third, the first
    for mixer, valids in (("s5", (None,)), ("s5", (18, 14)), ("lru", (4,))):
        check(mixer, valids)


# slow tier: S5 without steps and the LRU, whose Jacobians cross the split by the
# same exchange as S5's with steps
@pytest.mark.parametrize(
    "kind,with_dt",
    [
        pytest.param("s5", False, marks=pytest.mark.slow),
        ("s5", True),
        pytest.param("lru", False, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_parameter_jacobians(kind, with_dt):
    """S5/LRU `parameter_jacobians` on one sequence split over four devices, with
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
