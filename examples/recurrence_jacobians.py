"""Jacobians of a two-layer linear-recurrent model, the fast way and the slow way.

The Jacobian of the model's final state with respect to its decays, input weights
and initial states, by `jax.jacrev` through `eqx_seq.linear_recurrence` (and by
`eqx_seq.recurrence_jacobians`), checked against `jax.jacfwd` through a plain
`lax.scan` and timed against `jax.jacrev` through a plain `lax.associative_scan`.
docs/examples/recurrence_jacobians.md walks through it.

    python examples/recurrence_jacobians.py
    python examples/recurrence_jacobians.py --length 4096 --state 64
"""

# --8<-- [start:setup]
import argparse
import functools as ft
import statistics
import time

import equinox as eqx
import jax


jax.config.update("jax_enable_x64", True)  # float64, so the check can be tight

import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

import eqx_seq


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--length", type=int, default=1024, help="sequence length T")
parser.add_argument("--state", type=int, default=32, help="state size of each layer")
parser.add_argument("--repeats", type=int, default=5, help="timed calls per method")
args = parser.parse_args()
INPUTS = 4
# --8<-- [end:setup]


# --8<-- [start:model]
class LinearRecurrentLayer(eqx.Module):
    """h_t = decay * h_{t-1} + B u_t, y_t = C h_t."""

    decay: Float[Array, " state"]
    B: Float[Array, "state inputs"]
    C: Float[Array, "outputs state"]
    h0: Float[Array, " state"]

    def __init__(self, inputs: int, state: int, outputs: int, *, key):
        kd, kb, kc, kh = jr.split(key, 4)
        self.decay = jr.uniform(kd, (state,), minval=0.9, maxval=0.999)
        self.B = jr.normal(kb, (state, inputs)) / np.sqrt(inputs)
        self.C = jr.normal(kc, (outputs, state)) / np.sqrt(state)
        self.h0 = 0.1 * jr.normal(kh, (state,))

    def __call__(self, u, recurrence):
        h = recurrence(self.decay, u @ self.B.T, self.h0)
        return h @ self.C.T, h


kmodel, kdata = jr.split(jr.key(0))
k1, k2 = jr.split(kmodel)
model = (
    LinearRecurrentLayer(INPUTS, args.state, args.state // 2, key=k1),
    LinearRecurrentLayer(args.state // 2, args.state, 1, key=k2),
)
u = jr.normal(kdata, (args.length, INPUTS))


def differentiated(model):
    """The parameters we differentiate: decays, input weights, initial states."""
    l1, l2 = model
    return (l1.decay, l2.decay, l1.B, l2.B, l1.h0, l2.h0)


NAMES = ["decay1", "decay2", "B1", "B2", "h1_0", "h2_0"]
params = differentiated(model)


def final_state(params, recurrence):
    """h2_T, the final state of layer 2, as a function of the parameters."""
    layer1, layer2 = eqx.tree_at(differentiated, model, params)
    y, _ = layer1(u, recurrence)
    return layer2(y, recurrence)[1][-1]


print(
    f"two-layer linear-recurrent model: T={args.length}, state {args.state} per "
    f"layer, {sum(x.size for x in params)} differentiated parameters;\n"
    f"Jacobian of h2_T ({args.state},) w.r.t. decays, B and h0 "
    f"(float64, {jax.default_backend()})"
)
# --8<-- [end:model]


# --8<-- [start:recurrences]
def with_eqx_seq(scan):
    return lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan)


def plain_scan(a, b, h0):  # the reference: no eqx_seq code
    def step(h, b_t):
        h = a * h + b_t
        return h, h

    return lax.scan(step, h0, b)[1]


def plain_associative(a, b, h0):  # the seed method of jax issue 19498
    b = b.at[0].add(a * h0)
    op = lambda x, y: (y[0] * x[0], y[0] * x[1] + y[1])
    return lax.associative_scan(op, (jnp.broadcast_to(a, b.shape), b))[1]


METHODS = {
    "eqx_seq jacrev (SequentialScan)": (with_eqx_seq(eqx_seq.SequentialScan()), "rev"),
    "eqx_seq jacrev (AssociativeScan)": (
        with_eqx_seq(eqx_seq.AssociativeScan()),
        "rev",
    ),
    "reference: jacfwd, plain lax.scan": (plain_scan, "fwd"),
    "seed: jacrev, plain associative_scan": (plain_associative, "rev"),
}
STRUCTURED = "eqx_seq recurrence_jacobians (layer 2, all T steps)"
# --8<-- [end:recurrences]

# --8<-- [start:jacobians]
calls = {}
for name, (recurrence, mode) in METHODS.items():
    f = ft.partial(final_state, recurrence=recurrence)
    calls[name] = ft.partial(
        jax.jit(jax.jacrev(f) if mode == "rev" else jax.jacfwd(f)), params
    )
# the diagonal Jacobians of layer 2 at every step, by two more recurrences
y1, _ = model[0](u, with_eqx_seq(eqx_seq.AutoScan()))
calls[STRUCTURED] = ft.partial(
    jax.jit(eqx_seq.recurrence_jacobians),
    model[1].decay,
    y1 @ model[1].B.T,
    model[1].h0,
)

# Samples are taken round-robin, so that a slow spell on a shared machine slows
# every method alike and the ratios stay meaningful.
outputs, first, samples = {}, {}, {name: [] for name in calls}
for name, call in calls.items():
    start = time.perf_counter()
    outputs[name] = jax.block_until_ready(call())
    first[name] = time.perf_counter() - start
for _ in range(args.repeats):
    for name, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call())
        samples[name].append(time.perf_counter() - start)
# --8<-- [end:jacobians]


# --8<-- [start:result]
def relative_error(x, y):
    return float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-300))


reference = outputs["reference: jacfwd, plain lax.scan"]
print(
    "\ncheck against jax.jacfwd through a plain lax.scan "
    "(max |difference| / max |reference|):"
)
for name in [n for n in METHODS if not n.startswith("reference")]:
    diffs = [relative_error(x, y) for x, y in zip(outputs[name], reference)]
    print(f"  {name:38s} " + "  ".join(f"{d:.1e}" for d in diffs))
    assert max(diffs) < 1e-9, f"{name} disagrees with the reference"
print(f"  (columns: {', '.join(f'd h2_T / d {n}' for n in NAMES)})")
checks = {
    "recurrence_jacobians.wrt_a[-1] vs diag(d h2_T/d decay2)": (
        outputs[STRUCTURED].wrt_a[-1],
        jnp.diagonal(reference[1]),
    ),
    "recurrence_jacobians.wrt_h0[-1] vs diag(d h2_T/d h2_0)": (
        outputs[STRUCTURED].wrt_h0[-1],
        jnp.diagonal(reference[5]),
    ),
}
for name, (x, y) in checks.items():
    d = relative_error(x, y)
    print(f"  {name:58s} {d:.1e}")
    assert d < 1e-9, f"{name} disagrees with the reference"

median = {name: statistics.median(s) for name, s in samples.items()}
seed = median["seed: jacrev, plain associative_scan"]
print(f"\n{'method':55s} {'median ms':>10s} {'vs seed':>9s} {'first call s':>13s}")
for name in calls:
    print(
        f"{name:55s} {1e3 * median[name]:10.2f} {seed / median[name]:8.1f}x "
        f"{first[name]:13.2f}"
    )
# --8<-- [end:result]
