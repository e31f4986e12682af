"""Embedding lookups: eqx_seq.Embedding vs vmapped eqx.nn.Embedding, raw take, one-hot.

Vocabulary 32k x 512, float32; ids of shape (64, 512) and (4096,). Forward and the
gradient with respect to the weight (a VJP with a fixed random cotangent, which
builds the dense (V, D) gradient), jitted, samples interleaved round-robin, medians.
Ratios are against raw `jnp.take(weight, ids, axis=0)` measured in the same run.

    python benchmarks/bench_embedding.py            # a few minutes on 2 CPU cores
    python benchmarks/bench_embedding.py --quick    # smaller vocabulary, for a smoke test
"""

import argparse
import collections
import os
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqx_seq


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    machine,
    measure_many,
    results_path,
    write_json,
)


def lookups(ids_ndim):
    """name -> f(weight, ids) for every variant."""

    def eqx_vmapped(w, ids):
        layer = eqx.nn.Embedding(weight=w)
        for _ in range(ids_ndim):
            layer = jax.vmap(layer)
        return layer(ids)

    def ours(policy):
        return lambda w, ids: eqx_seq.Embedding.from_pretrained(w, out_of_range=policy)(
            ids
        )

    return {
        "raw jnp.take (anchor)": lambda w, ids: jnp.take(w, ids, axis=0),
        'eqx_seq.Embedding "clip"': ours("clip"),
        'eqx_seq.Embedding "fill"': ours("fill"),
        'eqx_seq.Embedding "error"': ours("error"),
        f"vmap^{ids_ndim}(eqx.nn.Embedding)": eqx_vmapped,
        "one-hot @ weight": lambda w, ids: (
            jax.nn.one_hot(ids, w.shape[0], dtype=w.dtype) @ w
        ),
    }


def op_counts(fn, *args):
    """Counts of gather/scatter/fusion and all instructions in `fn`'s optimised HLO.

    `fn` is one of the jitted programs that are timed.
    """
    text = fn.lower(*args).compile().as_text()
    ops = collections.Counter(re.findall(r"=\s*\S+\s+([a-z\-]+)\(", text))
    return {
        "gather": ops["gather"],
        "scatter": ops["scatter"],
        "fusion": ops["fusion"],
        "instructions": sum(ops.values()),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--json",
        default=results_path("embedding"),
        help="default: results/<machine>/embedding.json",
    )
    args = parser.parse_args()
    V, D = (4000, 128) if args.quick else (32000, 512)
    shapes = [(8, 64), (512,)] if args.quick else [(64, 512), (4096,)]
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, jax {info['jax']}"
    )
    print(allocator_line(info))
    w = jr.normal(jr.key(0), (V, D), jnp.float32)
    payload = {"machine": info, "vocab": V, "dim": D, "runs": {}}
    for shape in shapes:
        ids = jr.randint(jr.key(1), shape, 0, V)
        ct = jr.normal(jr.key(2), (*shape, D), jnp.float32)
        progs, counts = {}, {}
        for name, f in lookups(len(shape)).items():
            if name.startswith("one-hot") and len(shape) > 1:
                continue  # (64, 512) one-hot: a 4.2 GB buffer and ~1 TFLOP per call
            fwd = jax.jit(f)
            grad = jax.jit(
                lambda w, ids, ct, f=f: jax.vjp(lambda w: f(w, ids), w)[1](ct)[0]
            )
            progs[(name, "forward")] = (fwd, (w, ids))
            progs[(name, "grad wrt weight")] = (grad, (w, ids, ct))
            counts[name] = (op_counts(fwd, w, ids), op_counts(grad, w, ids, ct))
        slow = [k for k in progs if k[0].startswith("one-hot")]
        res = measure_many(progs, repeats=args.repeats, min_time=0.1, slow=slow)
        anchor = {
            kind: res[("raw jnp.take (anchor)", kind)]["median_ms"]
            for kind in ("forward", "grad wrt weight")
        }
        print(
            f"\n== ids {shape}, weight ({V}, {D}) float32; ms (median), ratio to raw take =="
        )
        print(
            f"{'variant':34s} {'forward':>9s} {'ratio':>6s} {'grad':>9s} {'ratio':>6s}   HLO fwd: gather/scatter/instr   bwd: gather/scatter/instr"
        )
        for name in counts:
            f_ms = res[(name, "forward")]["median_ms"]
            g_ms = res[(name, "grad wrt weight")]["median_ms"]
            cf, cb = counts[name]
            print(
                f"{name:34s} {f_ms:9.2f} {f_ms / anchor['forward']:6.2f} {g_ms:9.2f} {g_ms / anchor['grad wrt weight']:6.2f}"
                f"   {cf['gather']:>6d}/{cf['scatter']}/{cf['instructions']:<4d}"
                f"                 {cb['gather']:>3d}/{cb['scatter']}/{cb['instructions']}"
            )
        payload["runs"][str(shape)] = {
            name: {
                "forward_ms": res[(name, "forward")]["median_ms"],
                "grad_ms": res[(name, "grad wrt weight")]["median_ms"],
                "first_call_s": res[(name, "forward")]["first_call_s"],
                "hlo_forward": counts[name][0],
                "hlo_grad": counts[name][1],
            }
            for name in counts
        }
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
