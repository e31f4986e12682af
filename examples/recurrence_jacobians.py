"""Jacobians of a two-layer linear-recurrent model, the fast way and the slow way.

The model: two diagonal linear recurrences stacked,

    layer 1:  h1_t = lambda1 * h1_{t-1} + B1 u_t,      y_t = C1 h1_t
    layer 2:  h2_t = lambda2 * h2_{t-1} + B2 y_t

and we want the Jacobian of the final state h2_T with respect to the decays
(lambda1, lambda2), the input weights (B1, B2) and the initial states (h1_0, h2_0).

- `eqx_seq`: `jax.jacrev` through `eqx_seq.linear_recurrence`, whose reverse pass is a
  hand-written adjoint (one reverse recurrence), with either backend; plus
  `eqx_seq.recurrence_jacobians` for the diagonal Jacobians of layer 2 at every step.
- checked against `jax.jacfwd` through the same model written with a plain `lax.scan`
  (no eqx_seq code involved);
- timed against the seed method of jax issue 19498: `jax.jacrev` through a plain
  `lax.associative_scan`.

    python examples/recurrence_jacobians.py               # ~1 minute on a laptop CPU
    python examples/recurrence_jacobians.py --length 4096 --state 64
"""

import argparse
import functools as ft
import statistics
import time

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

import eqx_seq


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

    def __call__(self, u: Float[Array, "T inputs"], recurrence) -> tuple[Array, Array]:
        h = recurrence(self.decay, u @ self.B.T, self.h0)
        return h @ self.C.T, h


class TwoLayerModel(eqx.Module):
    layer1: LinearRecurrentLayer
    layer2: LinearRecurrentLayer

    def __init__(self, inputs: int, state: int, *, key):
        k1, k2 = jr.split(key)
        self.layer1 = LinearRecurrentLayer(inputs, state, state // 2, key=k1)
        self.layer2 = LinearRecurrentLayer(state // 2, state, 1, key=k2)

    def final_state(self, u, recurrence):
        y, _ = self.layer1(u, recurrence)
        _, h = self.layer2(y, recurrence)
        return h[-1]


# The recurrences to compare. The last two are written here, with no eqx_seq code.
def eqx_seq_recurrence(scan):
    return lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan)


def plain_scan(a, b, h0):
    def step(h, b_t):
        h = a * h + b_t
        return h, h

    return lax.scan(step, h0, b)[1]


def plain_associative(a, b, h0):
    b = b.at[0].add(a * h0)
    op = lambda x, y: (y[0] * x[0], y[0] * x[1] + y[1])
    return lax.associative_scan(op, (jnp.broadcast_to(a, b.shape), b))[1]


def differentiable_part(model):
    """The parameters we differentiate: decays, input weights and initial states."""
    return (
        (model.layer1.decay, model.layer2.decay),
        (model.layer1.B, model.layer2.B),
        (model.layer1.h0, model.layer2.h0),
    )


def with_params(model, params):
    (d1, d2), (b1, b2), (i1, i2) = params
    return eqx.tree_at(
        lambda m: (
            m.layer1.decay,
            m.layer2.decay,
            m.layer1.B,
            m.layer2.B,
            m.layer1.h0,
            m.layer2.h0,
        ),
        model,
        (d1, d2, b1, b2, i1, i2),
    )


def jacobian_fn(model, u, recurrence, mode):
    def f(params):
        return with_params(model, params).final_state(u, recurrence)

    jac = jax.jacrev(f) if mode == "rev" else jax.jacfwd(f)
    return jax.jit(lambda params: jac(params))


def relative_error(x, y):
    return float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-300))


def timed(calls: dict, repeats: int) -> dict:
    """name -> (output, first-call seconds, median seconds) for `name -> thunk`.

    Samples are taken round-robin, so a slow spell on a shared machine slows every
    method alike and the ratios stay meaningful.
    """
    outputs, first, samples = {}, {}, {name: [] for name in calls}
    for name, call in calls.items():
        start = time.perf_counter()
        outputs[name] = jax.block_until_ready(call())
        first[name] = time.perf_counter() - start
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            samples[name].append(time.perf_counter() - start)
    return {n: (outputs[n], first[n], statistics.median(samples[n])) for n in calls}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=1024, help="sequence length T")
    parser.add_argument(
        "--state", type=int, default=32, help="state size of each layer"
    )
    parser.add_argument("--inputs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # float64, so the check is tight

    kmodel, kdata = jr.split(jr.key(args.seed))
    model = TwoLayerModel(args.inputs, args.state, key=kmodel)
    u = jr.normal(kdata, (args.length, args.inputs))
    params = differentiable_part(model)
    print(
        f"two-layer linear-recurrent model: T={args.length}, "
        f"state {args.state} per layer, "
        f"{sum(x.size for x in jax.tree.leaves(params))} differentiated parameters;\n"
        f"Jacobian of h2_T ({args.state},) w.r.t. decays, B and h0 "
        f"(float64, {jax.default_backend()})"
    )

    methods = {
        "eqx_seq jacrev (SequentialScan)": (
            eqx_seq_recurrence(eqx_seq.SequentialScan()),
            "rev",
        ),
        "eqx_seq jacrev (AssociativeScan)": (
            eqx_seq_recurrence(eqx_seq.AssociativeScan()),
            "rev",
        ),
        "reference: jacfwd, plain lax.scan": (plain_scan, "fwd"),
        "seed: jacrev, plain associative_scan": (plain_associative, "rev"),
    }
    calls = {
        name: ft.partial(jacobian_fn(model, u, rec, mode), params)
        for name, (rec, mode) in methods.items()
    }
    # Structured Jacobians of layer 2: every step, diagonal, by two more recurrences.
    y1, _ = model.layer1(u, eqx_seq_recurrence(eqx_seq.AutoScan()))
    layer2_inputs = y1 @ model.layer2.B.T
    structured = jax.jit(lambda a, b, h0: eqx_seq.recurrence_jacobians(a, b, h0))
    calls["eqx_seq recurrence_jacobians (layer 2, all T steps)"] = ft.partial(
        structured, model.layer2.decay, layer2_inputs, model.layer2.h0
    )
    results = timed(calls, args.repeats)
    jac2 = results["eqx_seq recurrence_jacobians (layer 2, all T steps)"][0]

    reference = results["reference: jacfwd, plain lax.scan"][0]
    print(
        "\ncheck against jax.jacfwd through a plain lax.scan "
        "(max |difference| / max |reference|):"
    )
    names = [
        "d h2_T / d decay1",
        "d h2_T / d decay2",
        "d h2_T / d B1",
        "d h2_T / d B2",
        "d h2_T / d h1_0",
        "d h2_T / d h2_0",
    ]
    for name in [
        "eqx_seq jacrev (SequentialScan)",
        "eqx_seq jacrev (AssociativeScan)",
        "seed: jacrev, plain associative_scan",
    ]:
        diffs = [
            relative_error(x, y)
            for x, y in zip(
                jax.tree.leaves(results[name][0]), jax.tree.leaves(reference)
            )
        ]
        print(f"  {name:38s} " + "  ".join(f"{d:.1e}" for d in diffs))
        assert max(diffs) < 1e-9, f"{name} disagrees with the reference"
    print(f"  (columns: {', '.join(names)})")
    (_, ref_d2), _, (_, ref_h2) = reference
    checks = {
        "recurrence_jacobians.wrt_a[-1] vs diag(d h2_T/d decay2)": (
            jac2.wrt_a[-1],
            jnp.diagonal(ref_d2),
        ),
        "recurrence_jacobians.wrt_h0[-1] vs diag(d h2_T/d h2_0)": (
            jac2.wrt_h0[-1],
            jnp.diagonal(ref_h2),
        ),
    }
    for name, (x, y) in checks.items():
        d = relative_error(x, y)
        print(f"  {name:58s} {d:.1e}")
        assert d < 1e-9

    seed = results["seed: jacrev, plain associative_scan"][2]
    print(f"\n{'method':55s} {'median ms':>10s} {'vs seed':>9s} {'first call s':>13s}")
    for name, (_, first, med) in results.items():
        print(f"{name:55s} {1e3 * med:10.2f} {seed / med:8.1f}x {first:13.2f}")


if __name__ == "__main__":
    main()
