"""Packed sequences whatever a segment holds: a segment start replaces the state.

One segment with a NaN or an inf in it, or an `h0` of NaNs forgotten at a reset on
step 0, must not reach any other segment: values, step mode and gradients equal
those of a separate call on each clean segment. A reset is a zero decay, and a zero
decay forgets the state by selection, not by a product (`0 * nan = nan`), in every
algorithm of the recurrence and of the selective scan.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import slow_except

import eqx_seq


T, START = 12, 5  # the second segment starts at step 5
RESET = jnp.zeros(T, bool).at[jnp.array([0, START])].set(True)
SCANS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


def _poisoned(x):
    """`x` with a NaN and an inf inside the first segment."""
    return x.at[1, 0].set(jnp.nan).at[3].set(jnp.inf)


def _close(x, y):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# -------------------------------------------------------------- the recurrence


@pytest.mark.parametrize("scan", SCANS.values(), ids=SCANS.keys())
def test_zero_decay_forgets_the_state(scan):
    """`linear_recurrence`: where `a_t = 0` the state is `b_t`, whatever came
    before; values, reverse-mode and forward-mode derivatives of the later part
    equal a separate run's, and the derivative at a zero decay of a finite state is
    kept (`h_{t-1}`), also by autodiff through the backend's `recurrence`."""
    k1, k2 = jr.split(jr.key(0))
    a = jr.uniform(k1, (T, 3), minval=0.5, maxval=1.5).at[START].set(0.0)
    b = jr.normal(k2, (T, 3))
    h0 = jnp.full(3, jnp.nan)

    @jax.jit
    def program(a, b):
        def later(a, b):
            return jnp.sum(
                jnp.sin(eqx_seq.linear_recurrence(a, b, h0, scan=scan)[START:])
            )

        def alone(a, b):
            return jnp.sum(jnp.sin(eqx_seq.linear_recurrence(a, b, scan=scan)))

        bad = _poisoned(b)
        grads = jax.grad(later, (0, 1))(a, bad)
        grads_alone = jax.grad(alone, (0, 1))(a[START:], b[START:])
        tangent = jax.jvp(later, (a, bad), (jnp.ones_like(a).at[START].set(0), b))[1]
        tangent_alone = jax.jvp(
            alone,
            (a[START:], b[START:]),
            (jnp.ones_like(a[START:]).at[0].set(0), b[START:]),
        )[1]
        # a finite state before a zero decay: d h_t / d a_t = h_{t-1}
        finite = jax.grad(
            lambda a: jnp.sum(eqx_seq.linear_recurrence(a, b, scan=scan)[START])
        )(a)
        # the same by autodiff through the backend's primal `recurrence`
        traced = jax.grad(lambda a: jnp.sum(scan.recurrence(a, b)[START]))(a)
        h = eqx_seq.linear_recurrence(a, b, scan=scan)
        return (
            later(a, bad), alone(a[START:], b[START:]),
            tuple(g[START + 1 :] for g in grads[:1]) + (grads[1][START:],),
            (grads_alone[0][1:], grads_alone[1]),
            tangent, tangent_alone, (finite[START], traced[START]),
            (h[START - 1], h[START - 1]),
        )  # fmt: skip

    value, value_alone, grads, grads_alone, jvp, jvp_alone, da, h_prev = program(a, b)
    _close(value, value_alone)
    _close(grads, grads_alone)
    _close(jvp, jvp_alone)
    _close(da, h_prev)


# ------------------------------------------------------------------ the layers


def _selective(key, scan):
    """`selective_scan` as a layer of its arrays, `x` its input `u`."""
    k = jr.split(key, 5)
    params = {
        "delta": jr.normal(k[0], (T, 3)),
        "A": -jr.uniform(k[1], (3, 2), minval=0.5, maxval=2.0),
        "B": jr.normal(k[2], (T, 2)),
        "C": jr.normal(k[3], (T, 2)),
        "D": jr.normal(k[4], (3,)),
    }

    def call(params, x, reset, h0=None):
        n = x.shape[0]
        return eqx_seq.selective_scan(
            x, params["delta"][-n:], params["A"], params["B"][-n:],
            params["C"][-n:], params["D"], delta_softplus=True, h0=h0,
            reset=reset, chunk_size=4, scan=scan,
        )  # fmt: skip

    return params, call, 3, jnp.full((3, 2), jnp.nan)


def _ssd(key, scan):
    """`ssd_scan` as a layer of its arrays, `x` its input `(T, H * P)`: two heads in
    two groups, every optional array."""
    k = jr.split(key, 6)
    params = {
        "dt": jr.normal(k[0], (T, 2)),
        "A": -jr.uniform(k[1], (2,), minval=0.5, maxval=2.0),
        "B": jr.normal(k[2], (T, 2, 2)),
        "C": jr.normal(k[3], (T, 2, 2)),
        "D": jr.normal(k[4], (2, 2)),
        "z": jr.normal(k[5], (T, 2, 2)),
        "dt_bias": jnp.full(2, 0.3),
    }

    def call(params, x, reset, h0=None):
        n = x.shape[0]
        p = {k: v[-n:] if v.shape[0] == T else v for k, v in params.items()}
        y = eqx_seq.ssd_scan(
            x.reshape(n, 2, 2), **p, dt_softplus=True, h0=h0, reset=reset,
            chunk_size=4, scan=scan,
        )  # fmt: skip
        return y.reshape(n, 4)

    return params, call, 4, jnp.full((2, 2, 2), jnp.nan)


def _module(make, size):
    def build(key, scan):
        layer = make(key, scan)
        params, static = eqx.partition(layer, eqx.is_inexact_array)

        def call(params, x, reset, h0=None):
            return eqx.combine(params, static)(x, reset=reset, h0=h0)

        nan = jax.tree.map(lambda s: jnp.full_like(s, jnp.nan), layer.init_state())
        return params, call, size, nan

    return build


def _mamba(key, scan):
    return eqx_seq.Mamba(3, state_size=2, conv_size=3, chunk_size=4, scan=scan, key=key)


def _mamba2(key, scan):
    return eqx_seq.Mamba2(
        3, state_size=2, head_dim=2, conv_size=3, chunk_size=4, scan=scan, key=key
    )


def _gdn(key, scan):
    return eqx_seq.GatedDeltaNet(
        3, num_heads=1, head_dim=2, num_v_heads=2, conv_size=3, chunk_size=4,
        scan=scan, key=key,
    )  # fmt: skip


LAYERS = {
    "selective_scan": _selective,
    "RGLRU": _module(lambda k, s: eqx_seq.RGLRU(4, num_heads=2, scan=s, key=k), 4),
    "HawkBlock": _module(
        lambda k, s: eqx_seq.HawkBlock(
            4, lru_width=4, num_heads=2, conv_size=3, scan=s, key=k
        ),
        4,
    ),
    "Mamba": _module(_mamba, 3),
    "MambaBlock": _module(lambda k, s: eqx_seq.MambaBlock(_mamba(k, s)), 3),
    "ssd_scan": _ssd,
    "Mamba2": _module(_mamba2, 3),
    "Mamba2Block": _module(lambda k, s: eqx_seq.Mamba2Block(_mamba2(k, s)), 3),
    "GatedDeltaNet": _module(_gdn, 3),
    "GatedDeltaNetBlock": _module(
        lambda k, s: eqx_seq.GatedDeltaNetBlock(_gdn(k, s)), 3
    ),
}


# in the fast tier, each algorithm once: the selective scan's fused loop
# (sequential) and chunks (associative, in MambaBlock), the SSD's chunks
# (associative; its sequential form is test_stacked_blocks_keep_documents_apart
# [Mamba2Block]), the recurrence's sequential form (RGLRU; the associative one is
# test_zero_decay_forgets_the_state[associative]), the delta rule's chunks and
# short convolution (GatedDeltaNetBlock). Slow tier: the other rows, the same
# algorithms inside other layers and blocks.
_BAD_SEGMENT_FAST = [
    "selective_scan-sequential",
    "RGLRU-sequential",
    "MambaBlock-associative",
    "ssd_scan-associative",
    "GatedDeltaNetBlock-sequential",
]


@pytest.mark.parametrize(
    "name,scan",
    slow_except(
        [(name, scan) for name in LAYERS for scan in SCANS.values()],
        _BAD_SEGMENT_FAST,
        ids=[f"{name}-{scan_id}" for name in LAYERS for scan_id in SCANS],
    ),
)
def test_a_bad_segment_stays_in_its_segment(name, scan):
    """A NaN and an inf in the first segment: the second segment's outputs, and
    the gradient with respect to its inputs, are a separate call's; an `h0` of NaNs
    with `reset[0]` is forgotten, in the values and in every parameter's
    gradient."""
    params, call, size, nan_state = LAYERS[name](jr.key(1), scan)
    x = jr.normal(jr.key(2), (T, size))
    w = jr.normal(jr.key(3), (T, size))

    @jax.jit
    def program(params, x):
        def packed(x):
            return jnp.sum(w[START:] * call(params, x, RESET)[START:])

        def alone(x):
            return jnp.sum(w[START:] * call(params, x, RESET[START:]))

        def with_h0(params, h0):
            return jnp.sum(w * call(params, x, RESET, h0))

        bad = _poisoned(x)
        return (
            (call(params, bad, RESET)[START:], jax.grad(packed)(bad)[START:]),
            (call(params, x[START:], RESET[START:]), jax.grad(alone)(x[START:])),
            jax.value_and_grad(with_h0)(params, nan_state),
            jax.value_and_grad(with_h0)(params, None),
        )

    packed, alone, with_nan_h0, without_h0 = program(params, x)
    _close(packed, alone)
    _close(with_nan_h0, without_h0)


# slow tier: MambaBlock and GatedDeltaNetBlock, whose convolution's backward across a
# reset is that of Mamba2Block (kept fast); their packing is checked by test_a_bad_
# segment_stays_in_its_segment[MambaBlock-associative, GatedDeltaNetBlock-sequential]
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("MambaBlock", marks=pytest.mark.slow),
        "Mamba2Block",
        pytest.param("GatedDeltaNetBlock", marks=pytest.mark.slow),
    ],
)
def test_stacked_blocks_keep_documents_apart(name):
    """Two blocks in a row, the second document starting inside a chunk: with a NaN
    late in the first document, the gradient of a loss on the second with respect
    to its inputs is a separate call's; with a NaN on the second's first step, that
    of a loss on the first. The second block's backward gives finite outputs of
    the first NaN cotangents (its convolution reaches back over the bad step): they
    must not cross the reset, either way."""
    make = {
        "MambaBlock": eqx_seq.MambaBlock,
        "Mamba2Block": eqx_seq.Mamba2Block,
        "GatedDeltaNetBlock": eqx_seq.GatedDeltaNetBlock,
    }[name]
    base = {"MambaBlock": _mamba, "Mamba2Block": _mamba2, "GatedDeltaNetBlock": _gdn}
    base = base[name]
    keys = jr.split(jr.key(8), 2)
    first, second = (make(base(k, eqx_seq.SequentialScan())) for k in keys)
    start = 7
    reset = jnp.zeros(T, bool).at[jnp.array([0, start])].set(True)
    x = jr.normal(jr.key(9), (T, 3))
    w = jr.normal(jr.key(10), (T, 3))

    @eqx.filter_jit
    def program(first, second, x):
        model = lambda x, reset: second(first(x, reset=reset), reset=reset)
        loss = lambda x, reset, w: jnp.sum(w * model(x, reset))
        zero = jnp.zeros_like(w)
        late = x.at[start - 2, 0].set(jnp.nan)
        early = x.at[start, 1].set(jnp.nan)
        return (
            jax.grad(loss)(late, reset, zero.at[start:].set(w[start:]))[start:],
            jax.grad(loss)(x[start:], reset[start:], w[start:]),
            jax.grad(loss)(early, reset, zero.at[:start].set(w[:start]))[:start],
            jax.grad(loss)(x[:start], reset[:start], w[:start]),
        )

    later, later_alone, earlier, earlier_alone = program(first, second, x)
    _close(later, later_alone)
    _close(earlier, earlier_alone)


# slow tier: the layers whose blocks (kept fast) run their `step` inside
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Mamba", marks=pytest.mark.slow),
        "MambaBlock",
        pytest.param("Mamba2", marks=pytest.mark.slow),
        "Mamba2Block",
        pytest.param("RGLRU", marks=pytest.mark.slow),
        "HawkBlock",
        pytest.param("GatedDeltaNet", marks=pytest.mark.slow),
        "GatedDeltaNetBlock",
    ],
)
def test_step_mode_restarts_like_the_parallel_call(name):
    """Step mode through a bad segment, then a reset: the outputs after it equal
    the parallel call's, both finite."""
    module = {
        "Mamba": lambda: _mamba(jr.key(4), eqx_seq.SequentialScan()),
        "MambaBlock": lambda: eqx_seq.MambaBlock(
            _mamba(jr.key(4), eqx_seq.SequentialScan())
        ),
        "Mamba2": lambda: _mamba2(jr.key(4), eqx_seq.SequentialScan()),
        "Mamba2Block": lambda: eqx_seq.Mamba2Block(
            _mamba2(jr.key(4), eqx_seq.SequentialScan())
        ),
        "RGLRU": lambda: eqx_seq.RGLRU(4, num_heads=2, key=jr.key(4)),
        "HawkBlock": lambda: eqx_seq.HawkBlock(
            4, lru_width=4, num_heads=2, conv_size=3, key=jr.key(4)
        ),
        "GatedDeltaNet": lambda: _gdn(jr.key(4), eqx_seq.SequentialScan()),
        "GatedDeltaNetBlock": lambda: eqx_seq.GatedDeltaNetBlock(
            _gdn(jr.key(4), eqx_seq.SequentialScan())
        ),
    }[name]()
    size = 4 if name in ("RGLRU", "HawkBlock") else 3
    x = _poisoned(jr.normal(jr.key(5), (T, size)))

    @eqx.filter_jit
    def program(module, x):
        def step(state, x_reset):
            x_t, reset = x_reset
            return module.step(state, x_t, reset=reset)

        _, stepped = jax.lax.scan(step, module.init_state(), (x, RESET))
        return stepped[START:], module(x, reset=RESET)[START:]

    stepped, parallel = program(module, x)
    _close(stepped, parallel)


# slow tier: all but a function (`selective_scan`) and a module (MambaBlock); every
# layer reads `reset` through the same check
@pytest.mark.parametrize(
    "name",
    [
        name
        if name in ("selective_scan", "MambaBlock")
        else pytest.param(name, marks=pytest.mark.slow)
        for name in LAYERS
    ],
)
def test_reset_as_a_list_of_bools(name):
    """`reset` is ArrayLike: a Python list of bools is the array."""
    params, call, size, _ = LAYERS[name](jr.key(6), eqx_seq.SequentialScan())
    x = jr.normal(jr.key(7), (T, size))
    as_list = [bool(r) for r in RESET]
    _close(call(params, x, as_list), call(params, x, RESET))
