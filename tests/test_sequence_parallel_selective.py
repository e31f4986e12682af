"""The selective layers on one sequence split over devices along time
(`eqx_seq.ShardedScan` inside `jax.shard_map`): `selective_scan`, `Mamba`,
`MambaBlock`, `HawkBlock` and language models built on them, and `delta_rule_scan`,
give the values and gradients of the same layer on one device.

What crosses a block boundary: the `K - 1` inputs a causal convolution reads before
a block (`AbstractScan.halo`) and the recurrence's state (folded from the blocks'
maps: diagonal ones by `carry_into_block`, the delta rule's with a dense matrix part
by `carry_matrix_into_block`). On the CPU devices of `conftest.py`: two, and four
(blocks with neighbours on both sides) for the blocks' maps under resets, for the
layers and for the delta rule.
"""

import functools as ft
import itertools as it

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import slow_except
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs four devices (conftest.py asks for them)"
)

ONE = eqx_seq.SequentialScan()


def _mesh(devices: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("seq",))


def _shard_map(fn, in_specs, out_specs=P("seq"), devices: int = 2):
    return jax.shard_map(
        fn, mesh=_mesh(devices), in_specs=in_specs, out_specs=out_specs
    )


def _assert_close(x, y, rtol=1e-9, atol=1e-11, max_abs=None):
    """Leaf by leaf `allclose`, and with `max_abs` no absolute difference above it."""
    x_leaves, y_leaves = jax.tree.leaves(x), jax.tree.leaves(y)
    assert len(x_leaves) == len(y_leaves)
    for a, b in zip(x_leaves, y_leaves):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
        if max_abs is not None:
            assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) < max_abs


# ------------------------------------------------------------------------ halo


@pytest.mark.parametrize("reverse", [False, True])
def test_halo(reverse):
    """`ShardedScan.halo` gives the steps next to each block from its neighbour
    (`fill` at the sequence's end), and its gradient reaches the neighbour's
    steps; the base class gives `fill`."""
    T, C, width = 10, 3, 2
    x = jr.normal(jr.key(0), (T, C))
    fill = jr.normal(jr.key(1), (width, C))
    w = jr.normal(jr.key(2), (2 * width, C))
    scan = eqx_seq.ShardedScan("seq")
    split = _shard_map(
        lambda x, fill: scan.halo(x, width, fill, reverse=reverse), (P("seq"), P())
    )
    half = T // 2
    if reverse:  # the first steps of the next block; the last block gets `fill`
        expected = jnp.concatenate([x[half : half + width], fill])
    else:  # the last steps of the block before; the first block gets `fill`
        expected = jnp.concatenate([fill, x[half - width : half]])
    _assert_close(jax.jit(split)(x, fill), expected)

    def expected_fn(x, fill):
        if reverse:
            return jnp.concatenate([x[half : half + width], fill])
        return jnp.concatenate([fill, x[half - width : half]])

    loss = lambda f: lambda x, fill: jnp.sum(f(x, fill) * w)
    grads = jax.jit(jax.grad(loss(split), argnums=(0, 1)))(x, fill)
    _assert_close(grads, jax.grad(loss(expected_fn), argnums=(0, 1))(x, fill))
    # one device: nothing precedes the sequence but `fill` (zeros by default)
    _assert_close(ONE.halo(x, width, fill, reverse=reverse), fill)
    _assert_close(ONE.halo(x, width), jnp.zeros((width, C)))


@pytest.mark.usefixtures("unchecked_annotations")
def test_halo_bad_input():
    x = jnp.ones((4, 2))
    scan = eqx_seq.ShardedScan("seq")
    for width in (-1, 1.5, True):
        with pytest.raises(ValueError, match="`width` must be an int >= 0"):
            ONE.halo(x, width)
    short = _shard_map(lambda x: scan.halo(x, 3), (P("seq"),))
    with pytest.raises(ValueError, match="block of 2 steps is shorter than the 3"):
        short(x)
    with pytest.raises(ValueError, match="inside `jax.shard_map`"):
        scan.halo(x, 1)


# -------------------------------------------------------------- selective_scan


def _selective_inputs(T=24, D=3, N=2):
    k = jr.split(jr.key(3), 9)
    return {
        "u": jr.normal(k[0], (T, D)),
        "delta": jr.uniform(k[1], (T, D), minval=0.05, maxval=0.6),
        "A": -jr.uniform(k[2], (D, N), minval=0.2, maxval=2.0),
        "B": jr.normal(k[3], (T, N)),
        "C": jr.normal(k[4], (T, N)),
        "D": jr.normal(k[5], (D,)),
        "z": jr.normal(k[6], (T, D)),
        "delta_bias": jr.normal(k[7], (D,)) * 0.3,
        "h0": jr.normal(k[8], (D, N)),
    }


SELECTIVE_CASES = {
    "plain": ("u", "delta", "A", "B", "C"),
    "h0, D, z": ("u", "delta", "A", "B", "C", "D", "z", "h0"),
    "bias, softplus": ("u", "delta", "A", "B", "C", "D", "delta_bias"),
}
# which arguments are split along time (the rest are shared)
TIME_AXIS = ("u", "delta", "B", "C", "z")


# slow tier: all but `h0, D, z` with resets and the sequential inner backend; the
# associative inner backend under resets is checked by test_block_maps_respect_
# resets, a split without resets by test_selective_scan_h0_on_first_device, and the
# other options act on each block's steps alone
@pytest.mark.parametrize(
    "case,reset,inner",
    slow_except(
        it.product(SELECTIVE_CASES, [False, True], ["sequential", "associative"]),
        [("h0, D, z", True, "sequential")],
    ),
)
def test_selective_scan(case, reset, inner):
    """Values, final state and gradients with respect to every array argument equal
    one device's, with chunks that do not divide a block (padding), with resets in
    both blocks."""
    T = 24
    inputs = {
        k: v for k, v in _selective_inputs(T).items() if k in SELECTIVE_CASES[case]
    }
    names = list(inputs)
    softplus = "delta_bias" in inputs
    resets = jnp.zeros(T, bool).at[jnp.array([3, 19])].set(True) if reset else None
    w = jr.normal(jr.key(4), (T, 3))
    w_last = jr.normal(jr.key(5), (3, 2))
    inner_scan = {
        "sequential": eqx_seq.SequentialScan(),
        "associative": eqx_seq.AssociativeScan(),
    }[inner]

    def run(scan, reset, **arrays):
        return eqx_seq.selective_scan(
            **arrays,
            delta_softplus=softplus,
            reset=reset,
            return_last_state=True,
            scan=scan,
            chunk_size=5,
        )

    def one(*arrays):
        return run(ONE, resets, **dict(zip(names, arrays)))

    scan = eqx_seq.ShardedScan("seq", inner_scan)

    def per_device(reset, *arrays):
        y, h = run(scan, reset, **dict(zip(names, arrays)))
        return y, h[None]

    specs = tuple(P("seq") if k in TIME_AXIS else P() for k in names)
    split = _shard_map(per_device, (P("seq"), *specs), (P("seq"), P("seq")))
    if resets is None:
        split = _shard_map(
            lambda *arrays: per_device(None, *arrays), specs, (P("seq"), P("seq"))
        )
    else:
        split = ft.partial(split, resets)

    def two(*arrays):
        y, finals = split(*arrays)
        return y, finals[-1]  # the last device's: the whole sequence's

    args = tuple(inputs.values())
    _assert_close(jax.jit(two)(*args), one(*args))

    def loss(f):
        def value(*arrays):
            y, h = f(*arrays)
            return jnp.sum(y * w) + jnp.sum(h * w_last)

        return value

    argnums = tuple(range(len(args)))
    g_split = jax.jit(jax.grad(loss(two), argnums))(*args)
    g_one = jax.jit(jax.grad(loss(one), argnums))(*args)
    _assert_close(g_split, g_one)


def test_selective_scan_h0_on_first_device():
    """Only the first device's `h0` counts."""
    x = _selective_inputs(16)
    h0s = jnp.stack([x["h0"], 10 + x["h0"]])  # one per device
    scan = eqx_seq.ShardedScan("seq")
    split = _shard_map(
        lambda u, delta, B, C, h0: eqx_seq.selective_scan(
            u, delta, x["A"], B, C, h0=h0[0], scan=scan
        ),
        (P("seq"),) * 5,
    )
    expected = eqx_seq.selective_scan(
        x["u"], x["delta"], x["A"], x["B"], x["C"], h0=x["h0"], scan=ONE
    )
    _assert_close(jax.jit(split)(x["u"], x["delta"], x["B"], x["C"], h0s), expected)


# slow tier: the sequential inner backend, whose maps under resets test_selective_
# scan checks
@pytest.mark.parametrize(
    "inner", [pytest.param("sequential", marks=pytest.mark.slow), "associative"]
)
def test_block_maps_respect_resets(inner):
    """Growing decays (`A > 0`: a decay above one) with a segment starting every
    two steps: every state is finite on one device, and a block's map must be zero
    by selection where a segment starts in it, not the product of its decays (which
    overflows, and `inf * 0 = nan` reached every later block). The selective scan
    and the diagonal recurrence, with both inner backends, on four blocks."""
    T, D, N = 32, 2, 2
    k = jr.split(jr.key(9), 4)
    u, B, C = (jr.normal(key, (T, n)) for key, n in zip(k, (D, N, N)))
    delta = jnp.full((T, D), 0.5)
    A = jnp.full((D, N), 300.0)  # exp(150) a step: finite over a segment only
    resets = jnp.zeros(T, bool).at[::2].set(True)
    a = jnp.where(resets[:, None], 0.0, jnp.exp(150.0) * jnp.ones((T, D)))
    inner_scan = {"sequential": ONE, "associative": eqx_seq.AssociativeScan()}[inner]

    def run(scan, u, delta, B, C, reset, a):
        y = eqx_seq.selective_scan(u, delta, A, B, C, reset=reset, scan=scan)
        return y, eqx_seq.linear_recurrence(a, u, scan=scan)

    split = _shard_map(
        ft.partial(run, eqx_seq.ShardedScan("seq", inner_scan)), (P("seq"),) * 6,
        (P("seq"), P("seq")), devices=4,
    )  # fmt: skip
    expected = run(inner_scan, u, delta, B, C, resets, a)
    assert all(bool(jnp.isfinite(x).all()) for x in expected)
    _assert_close(jax.jit(split)(u, delta, B, C, resets, a), expected)


# ---------------------------------------------------------------------- layers


def _reset(T):
    # on four blocks of `T // 4` steps, segments starting in every block: among the
    # last steps before a boundary (the convolution's halo is zero before it), at
    # a block's first steps (one after another), and inside blocks
    starts = [0, 5, T // 2 - 1, T // 2, T // 2 + 1, T // 2 + 2, T - 4]
    return jnp.zeros(T, bool).at[jnp.array(starts)].set(True)


LAYERS = {
    "mamba": lambda scan, key: eqx_seq.Mamba(
        4, state_size=3, conv_size=4, chunk_size=5, scan=scan, key=key
    ),
    # decays in (-1, 1), negative ones among them (steps dt up to 1.5, A to -3):
    # the blocks' maps multiply signed decays
    "mamba-block": lambda scan, key: eqx_seq.MambaBlock(
        eqx_seq.Mamba(
            4,
            state_size=3,
            dt_min=0.3,
            dt_max=1.5,
            negative_decays=True,
            scan=scan,
            key=key,
        ),
        norm="layer",
    ),
    "hawk": lambda scan, key: eqx_seq.HawkBlock(
        4, num_heads=2, conv_size=3, scan=scan, key=key
    ),
    # two heads in two groups; chunks of the SSD that do not divide a block
    "mamba2": lambda scan, key: eqx_seq.Mamba2(
        4, state_size=3, head_dim=4, ngroups=2, chunk_size=4, scan=scan, key=key
    ),
    # one key head over two value heads, chunks that do not divide a block
    "gated_deltanet": lambda scan, key: eqx_seq.GatedDeltaNet(
        4,
        num_heads=1,
        head_dim=2,
        num_v_heads=2,
        conv_size=3,
        chunk_size=4,
        scan=scan,
        key=key,
    ),  # fmt: skip
}


# slow tier: the layers without resets (a split without resets: test_selective_scan_
# h0_on_first_device, test_language_model), `Mamba` alone, which `MambaBlock` runs,
# and Gated DeltaNet, whose convolution crosses a split as Mamba-2's (kept fast) and
# whose recurrence does in test_delta_rule_scan
@pytest.mark.parametrize(
    "name,reset",
    slow_except(
        it.product(LAYERS, [False, True]),
        [(name, True) for name in LAYERS if name not in ("mamba", "gated_deltanet")],
    ),
)
def test_layers(name, reset):
    """A layer on one sequence split over four devices (blocks of 6 steps, chunks of
    the selective scan that do not divide them): outputs and the gradients with
    respect to its input and every parameter equal one device's (within 1e-10
    absolute too)."""
    T = 24
    one = LAYERS[name](ONE, jr.key(6))
    split_layer = LAYERS[name](eqx_seq.ShardedScan("seq"), jr.key(6))
    x = jr.normal(jr.key(7), (T, 4))
    w = jr.normal(jr.key(8), (T, 4))
    resets = _reset(T) if reset else None
    params, static = eqx.partition(split_layer, eqx.is_inexact_array)
    run = _shard_map(
        lambda p, x, reset: eqx.combine(p, static)(x, reset=reset),
        (P(), P("seq"), P("seq")),
        devices=4,
    )
    if resets is None:
        run = _shard_map(
            lambda p, x: eqx.combine(p, static)(x), (P(), P("seq")), devices=4
        )
    else:
        run = (lambda f: lambda p, x: f(p, x, resets))(run)
    p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
    run_one = lambda p, x: eqx.combine(p, s_one)(x, reset=resets)

    def outputs_and_grads(f, p):  # from one program
        loss = lambda p, x: (lambda y: (jnp.sum(y * w), y))(f(p, x))
        value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, y), grads = jax.jit(value_and_grad)(p, x)
        return y, grads

    (y, g_split), (y_one, g_one) = (
        outputs_and_grads(run, params),
        outputs_and_grads(run_one, p_one),
    )
    _assert_close(y, y_one, max_abs=1e-10)
    _assert_close(g_split, g_one, max_abs=1e-10)


# slow tier: Hawk, Mamba-2 and Gated DeltaNet, whose convolution and recurrence states
# cross a split as Mamba's do
@pytest.mark.parametrize(
    "name",
    [
        "mamba",
        pytest.param("hawk", marks=pytest.mark.slow),
        pytest.param("mamba2", marks=pytest.mark.slow),
        pytest.param("gated_deltanet", marks=pytest.mark.slow),
    ],
)
def test_initial_and_final_state(name):
    """Streaming across a split: `h0` (convolution and recurrence) is the first
    device's, and `final_state` on the last device is the whole sequence's."""
    T = 16
    one = LAYERS[name](ONE, jr.key(9))
    split_layer = LAYERS[name](eqx_seq.ShardedScan("seq"), jr.key(9))
    x = jr.normal(jr.key(10), (T, 4))
    h0 = jax.tree.map(
        lambda s: jr.normal(jr.key(11), s.shape, s.dtype), one.init_state()
    )
    h0 = tuple(h0)
    run = _shard_map(
        lambda x, h0: (
            split_layer(x, h0=h0),
            jax.tree.map(lambda s: s[None], split_layer.final_state(x, h0=h0)),
        ),
        (P("seq"), P()),
        (P("seq"), P("seq")),
    )
    y, finals = jax.jit(run)(x, h0)
    _assert_close(y, one(x, h0=h0))
    _assert_close(jax.tree.map(lambda s: s[-1], finals), one.final_state(x, h0=h0))


# slow tier: Mamba blocks, split on four devices by test_layers[mamba-block-True]
@pytest.mark.parametrize(
    "mixer", [pytest.param("mamba", marks=pytest.mark.slow), "rglru"]
)
def test_language_model(mixer):
    """`LanguageModel` with Mamba or Hawk blocks on one token stream split over the
    devices: the logits and the gradient of a next-token loss equal one device's."""
    ids = jr.randint(jr.key(12), (32,), 0, 20)
    size = {} if mixer == "rglru" else {"state_size": 4}
    make = lambda scan: eqx_seq.LanguageModel(
        20, width=8, depth=2, mixer=mixer, scan=scan, key=jr.key(13), **size
    )
    one, split_lm = make(ONE), make(eqx_seq.ShardedScan("seq"))
    params, static = eqx.partition(split_lm, eqx.is_inexact_array)

    def nll(lm, ids):
        logp = jax.nn.log_softmax(lm(ids)[:-1])
        return -jnp.sum(jnp.take_along_axis(logp, ids[1:, None], axis=1))

    logits = _shard_map(lambda p, ids: eqx.combine(p, static)(ids), (P(), P("seq")))
    p_one, s_one = eqx.partition(one, eqx.is_inexact_array)
    _assert_close(jax.jit(logits)(params, ids), one(ids))
    g_split = jax.jit(jax.grad(lambda p: nll(lambda ids: logits(p, ids), ids)))(params)
    g_one = jax.jit(jax.grad(lambda p: nll(eqx.combine(p, s_one), ids)))(p_one)
    _assert_close(g_split, g_one)


def test_convolution_longer_than_a_block():
    """A block shorter than the `K - 1` steps the convolution reads before it is a
    clear error (only the device before holds them)."""
    layer = eqx_seq.Mamba(
        4, conv_size=4, scan=eqx_seq.ShardedScan("seq"), key=jr.key(0)
    )
    run = _shard_map(layer, (P("seq"),))
    with pytest.raises(ValueError, match="block of 2 steps is shorter than the 3"):
        run(jnp.ones((4, 4)))
    run(jnp.ones((6, 4)))  # blocks of 3: enough


# ------------------------------------------------------------------ delta rule


def test_carry_matrix_into_block():
    """The contract for maps with a dense matrix part, `S -> M @ S + N` (a batch
    axis of `3 x 2` states): on four devices, by `all_gather` in run order and by
    `ppermute` in reverse, each device enters with the maps of the blocks before it
    composed, the first block's from `h0` (the others' `h0` is never read), from
    one program; on one device the carry is `h0`, and the block's map is not
    called."""
    D, B, d, e = 4, 2, 3, 2
    rng = np.random.default_rng(17)
    M, N, h0s = (rng.normal(size=(D, B, d, n)) for n in (d, e, e))  # h0: one a device
    cases = [("all_gather", False), ("ppermute", True)]

    def per_device(M, N, h0s):
        block_map = lambda start: (M[0], M[0] @ start + N[0])
        return [
            eqx_seq.ShardedScan("seq", exchange=exchange).carry_matrix_into_block(
                block_map, h0s[0], reverse=reverse
            )[None]
            for exchange, reverse in cases
        ]

    got = jax.jit(_shard_map(per_device, (P("seq"),) * 3, devices=D))(M, N, h0s)
    for (exchange, reverse), value in zip(cases, got):
        order = range(D - 1, -1, -1) if reverse else range(D)
        S, expected = h0s[order[0]], [None] * D
        for j in order:
            expected[j], S = S, M[j] @ S + N[j]
        _assert_close(value, np.stack(expected), rtol=1e-12, atol=1e-12)

    def never(start):
        raise AssertionError("one block: no map is needed")

    h0 = jnp.asarray(h0s[0])
    for scan in (ONE, eqx_seq.AssociativeScan(), eqx_seq.AutoScan()):
        assert scan.carry_matrix_into_block(never, h0) is h0


def _delta_inputs(T, G=1, H=2, dk=3, dv=3):
    rng = np.random.default_rng(14)
    return {
        "q": rng.normal(size=(T, G, dk)),
        "k": rng.normal(size=(T, G, dk)),
        "v": rng.normal(size=(T, H, dv)),
        "beta": rng.uniform(0.05, 1.95, size=(T, H)),
        "g": np.log(rng.uniform(0.3, 1.0, size=(T, H))),
        "h0": rng.normal(size=(H, dk, dv)),
    }


# slow tier: the `ppermute` exchange, whose maps test_carry_matrix_into_block checks
@pytest.mark.parametrize(
    "exchange", slow_except(["all_gather", "ppermute"], ["all_gather"])
)
def test_delta_rule_scan(exchange):
    """`delta_rule_scan` on four devices (blocks of 6 steps, chunks of 4 that do not
    divide them; beta in (0, 2), gates; a segment starting at a block's first step
    and one inside a block; a NaN in `v` in the first document, which spans two
    blocks): the outputs (NaN exactly where one device's are: that value channel
    of the first document's later steps), the last device's final state and the
    gradient of a loss on the finite outputs and the final state with respect to
    every array equal one device's, from one compiled program per side. Only the
    first device's `h0` counts: the others get a zero gradient."""
    T, D = 24, 4
    x = _delta_inputs(T)
    x["v"][3, 1, 0] = np.nan
    reset = np.zeros(T, bool)
    reset[[12, 15]] = True
    rng = np.random.default_rng(15)
    w, w_last = rng.normal(size=x["v"].shape), rng.normal(size=x["h0"].shape)

    def call(scan, q, k, v, beta, g, h0, reset):
        return eqx_seq.delta_rule_scan(
            q, k, v, beta, g=g, h0=h0, reset=reset, chunk_size=4, scan=scan,
            return_final_state=True,
        )  # fmt: skip

    scan = eqx_seq.ShardedScan("seq", exchange=exchange)

    def per_device(*arrays):
        *arrays, h0s, reset = arrays
        y, final = call(scan, *arrays, h0s[0], reset)
        return y, final[None]

    split = _shard_map(per_device, (P("seq"),) * 7, (P("seq"), P("seq")), devices=D)

    def program(fn):
        def loss(*arrays):
            y, final = fn(*arrays, reset)
            value = jnp.sum(jnp.where(jnp.isnan(y), 0, y) * w) + jnp.sum(final * w_last)
            return value, (y, final)

        return jax.jit(jax.value_and_grad(loss, range(6), has_aux=True))

    # one `h0` per device, the first the sequence's
    h0s = x["h0"][None] + np.arange(D)[:, None, None, None]
    last = lambda *a: (lambda y, finals: (y, finals[-1]))(*split(*a))
    args = (x["q"], x["k"], x["v"], x["beta"], x["g"])
    (_, (y, final)), grads = program(last)(*args, h0s)
    (_, (y1, final1)), grads1 = program(ft.partial(call, ONE))(*args, x["h0"])
    nan = np.zeros(y1.shape, bool)
    nan[3:12, 1, 0] = True
    np.testing.assert_array_equal(np.isnan(y1), nan)
    _assert_close((y, final), (y1, final1))
    for g, g1 in zip(grads[:5], grads1[:5]):
        assert np.isfinite(g1).all()
        _assert_close(g, g1)
    _assert_close(grads[5][0], grads1[5])
    _assert_close(grads[5][1:], np.zeros((D - 1, *x["h0"].shape)))


@pytest.mark.usefixtures("unchecked_annotations")
def test_delta_rule_scan_bad_scan():
    q, v, beta = np.ones((4, 1, 2)), np.ones((4, 1, 2)), np.ones((4, 1))
    for scan in ("sequential", eqx_seq.SequentialScan):
        with pytest.raises(ValueError, match="must be an `eqx_seq.AbstractScan`"):
            eqx_seq.delta_rule_scan(q, q, v, beta, scan=scan)
