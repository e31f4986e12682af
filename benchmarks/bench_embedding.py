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
    ms,
    results_path,
    save,
    span,
    table,
    times,
    write_reports,
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


# --- the report: printed, and written beside the JSON ------------------------------
TAKE = "raw jnp.take (anchor)"


def tables(p):
    """The markdown of a results payload: one table, both id shapes."""
    rows = []
    for shape, res in p["runs"].items():
        anchor = res[TAKE]
        for name, r in res.items():
            hf, hg = r["hlo_forward"], r["hlo_grad"]
            rows.append(
                [
                    f"`{shape}`",
                    f"`{name}`",
                    ms(r["forward_ms"]),
                    times(anchor["forward_ms"] / r["forward_ms"]),
                    ms(r["grad_ms"]),
                    times(anchor["grad_ms"] / r["grad_ms"]),
                    f"{hf['gather']}/{hf['scatter']}/{hf['instructions']}",
                    f"{hg['gather']}/{hg['scatter']}/{hg['instructions']}",
                ]
            )
    out = [
        f"Weight ({p['vocab']}, {p['dim']}) float32; speed-ups against raw "
        "`jnp.take` in the same run; HLO: gathers / scatters / instructions.",
        "",
    ]
    return out + table(
        "ids | variant | fwd ms | fwd vs take | grad ms | grad vs take | HLO fwd | "
        "HLO grad",
        rows,
    )


def headline(p):
    fwd, grad = [], []
    for res in p["runs"].values():
        for name, r in res.items():
            if name.startswith("eqx_seq"):
                fwd.append(res[TAKE]["forward_ms"] / r["forward_ms"])
                grad.append(res[TAKE]["grad_ms"] / r["grad_ms"])
    return (
        f"`eqx_seq.Embedding` vs raw `jnp.take`: forward {span(fwd)}, "
        f"gradient {span(grad)} (speed-up; 1× is par)"
    )


REPORTS = {"embedding": (headline, tables)}


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
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
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
    save(args.json, payload, REPORTS["embedding"])


if __name__ == "__main__":
    main()
