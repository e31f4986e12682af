"""Jacobians and gradients of a diagonal linear recurrence: eqx_seq vs the seed method.

Reproduces jax issue 19498 ("Computing Jacobian w.r.t. parameters used in
lax.associative_scan is unexpectedly slow") on this machine: float32, T=1024,
state 64, batch 16 via `jax.vmap`. The *seed method* is `jax.jacrev` of the final
state `h_T` w.r.t. the decay through a plain `lax.associative_scan` with the operator
`(a_j*a_i, a_j*b_i + b_j)` over a decay broadcast to `(T, N)`, as in that issue.

Every number is a median of repeats after a warm-up, with `block_until_ready`; the
table prints ratios against anchors measured in the same run: the forward pass of
the same backend ("x fwd") and the seed method or plain autodiff ("speed-up").

    python benchmarks/bench_recurrence.py            # full run, a few minutes
    python benchmarks/bench_recurrence.py --quick    # smaller sweep, for a smoke test
"""

import argparse
import os
import sys

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr

import eqx_seq


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    div,
    faster,
    machine,
    measure_many,
    ms,
    results_path,
    save,
    table,
    times,
    write_reports,
)


BACKENDS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


# --- the tools people use today (written here, independent of eqx_seq) ------------
def plain_associative(a, b):
    """h_t = a * h_{t-1} + b_t by lax.associative_scan over a broadcast decay."""
    a = jnp.broadcast_to(a, b.shape)
    op = lambda x, y: (y[0] * x[0], y[0] * x[1] + y[1])
    return lax.associative_scan(op, (a, b))[1]


def plain_scan(a, b):
    """h_t = a * h_{t-1} + b_t by lax.scan."""

    def step(h, b_t):
        h = a * h + b_t
        return h, h

    return lax.scan(step, jnp.zeros_like(b[0]), b)[1]


def loss_of(h):
    return 0.5 * jnp.mean(h**2)


def programs(T, N, batch, key):
    """Jitted, vmapped programs and their inputs for one length T."""
    ka, kb = jr.split(key)
    a = jr.uniform(ka, (batch, N), jnp.float32, 0.5, 0.999)
    b = jr.normal(kb, (batch, T, N), jnp.float32)
    h0 = jnp.zeros((batch, N), jnp.float32)
    vj = lambda f: jax.jit(jax.vmap(f))
    progs = {
        "seed: jacrev h_T wrt a, plain assoc": (
            vj(jax.jacrev(lambda a, b: plain_associative(a, b)[-1])),
            (a, b),
        ),
        "plain assoc: forward": (vj(plain_associative), (a, b)),
        "plain assoc: grad loss wrt (a, b)": (
            vj(jax.grad(lambda a, b: loss_of(plain_associative(a, b)), argnums=(0, 1))),
            (a, b),
        ),
        "plain scan: forward": (vj(plain_scan), (a, b)),
        "plain scan: grad loss wrt (a, b)": (
            vj(jax.grad(lambda a, b: loss_of(plain_scan(a, b)), argnums=(0, 1))),
            (a, b),
        ),
    }
    for name, scan in BACKENDS.items():
        rec = lambda a, b, h0, scan=scan: eqx_seq.linear_recurrence(a, b, h0, scan=scan)
        progs[f"{name}: forward"] = (vj(rec), (a, b, h0))
        progs[f"{name}: recurrence_jacobians .wrt_a"] = (
            vj(
                lambda a, b, h0, scan=scan: (
                    eqx_seq.recurrence_jacobians(a, b, h0, scan=scan).wrt_a
                )
            ),
            (a, b, h0),
        )
        progs[f"{name}: recurrence_jacobians (all)"] = (
            vj(
                lambda a, b, h0, scan=scan: eqx_seq.recurrence_jacobians(
                    a, b, h0, scan=scan
                )
            ),
            (a, b, h0),
        )
        progs[f"{name}: jacrev h_T wrt a"] = (
            vj(jax.jacrev(lambda a, b, h0, rec=rec: rec(a, b, h0)[-1])),
            (a, b, h0),
        )
        progs[f"{name}: grad loss wrt (a, b, h0)"] = (
            vj(
                jax.grad(
                    lambda a, b, h0, rec=rec: loss_of(rec(a, b, h0)), argnums=(0, 1, 2)
                )
            ),
            (a, b, h0),
        )
    return progs


SEED = "seed: jacrev h_T wrt a, plain assoc"


def run(T, N, batch, repeats, only=None):
    progs = programs(T, N, batch, jr.key(T))
    if only is not None:
        progs = {
            k: v
            for k, v in progs.items()
            if any(k.endswith(o) or k.startswith(o) for o in only)
        }
    return measure_many(progs, repeats=repeats, min_time=0.05, slow=(SEED,))


# --- the report: printed, and written beside the JSON ------------------------------
PLAIN_GRAD = "plain assoc: grad loss wrt (a, b)"


def headline_T(p):
    return max(p["runs"], key=lambda T: (len(p["runs"][T]), int(T)))


def tables(p):
    """The markdown of a results payload: the headline setting, the sweep over T,
    the unroll table."""
    T = headline_T(p)
    res = p["runs"][T]
    seed, pg = res[SEED]["median_ms"], res[PLAIN_GRAD]["median_ms"]
    rows = []
    for name, r in res.items():
        fwd = res.get(f"{name.split(':')[0]}: forward", {}).get("median_ms")
        if "jacrev" in name or "jacobians" in name:
            su = f"{times(seed / r['median_ms'])} seed"
        elif "grad" in name:
            su = f"{times(pg / r['median_ms'])} plain assoc. grad"
        else:
            su = ""
        rows.append(
            [
                f"`{name}`",
                ms(r["median_ms"]),
                times(div(r["median_ms"], fwd)),
                su,
                f"{r['first_call_s']:.2f}",
            ]
        )
    out = [
        f"jax issue 19498's setting: float32, T={T}, state {p['state']}, batch "
        f"{p['batch']} by `jax.vmap`.",
        "",
    ]
    out += table("method | ms | x fwd | speed-up | first call s", rows)
    rows = []
    for T, r in sorted(p["runs"].items(), key=lambda kv: int(kv[0])):
        for b in BACKENDS:
            f = r[f"{b}: forward"]["median_ms"]
            g = r[f"{b}: grad loss wrt (a, b, h0)"]["median_ms"]
            j = r[f"{b}: recurrence_jacobians .wrt_a"]["median_ms"]
            jrev = r[f"{b}: jacrev h_T wrt a"]["median_ms"]
            rows.append(
                [
                    T,
                    b,
                    ms(f),
                    ms(g),
                    times(g / f),
                    ms(j),
                    times(j / f),
                    times(r[SEED]["median_ms"] / j),
                    times(r[SEED]["median_ms"] / jrev),
                    times(r[PLAIN_GRAD]["median_ms"] / g),
                ]
            )
    out += ["Over T (ms; speed-ups against the seed and plain-assoc. autodiff):", ""]
    out += table(
        "T | backend | fwd | grad | grad x fwd | `.wrt_a` | `.wrt_a` x fwd | "
        "`.wrt_a` vs seed | jacrev vs seed | grad vs plain assoc.",
        rows,
    )
    if "unroll_T1024" in p:
        base = p["unroll_T1024"]["1"]
        rows = [
            [
                u,
                ms(r["forward_ms"]),
                times(r["forward_ms"] / base["forward_ms"]),
                ms(r["grad_ms"]),
                times(r["grad_ms"] / base["grad_ms"]),
            ]
            for u, r in p["unroll_T1024"].items()
        ]
        out += ["`SequentialScan(unroll=...)` at T=1024 (ms):", ""]
        out += table("unroll | fwd | x unroll=1 | grad | x unroll=1", rows)
    return out


def headline(p):
    res = p["runs"][headline_T(p)]
    seed, pg = res[SEED]["median_ms"], res[PLAIN_GRAD]["median_ms"]
    jac = [
        seed / res[f"{b}: recurrence_jacobians .wrt_a"]["median_ms"] for b in BACKENDS
    ]
    grad = [pg / res[f"{b}: grad loss wrt (a, b, h0)"]["median_ms"] for b in BACKENDS]
    return (
        f"`recurrence_jacobians(...).wrt_a` vs the seed: sequential "
        f"{faster(jac[:1])}, associative {faster(jac[1:])}; gradient vs plain-assoc. "
        f"autodiff: sequential {faster(grad[:1])}, associative {faster(grad[1:])}"
    )


REPORTS = {"recurrence": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short sweep (T up to 256), for smoke tests",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--json",
        default=results_path("recurrence"),
        help="default: results/<machine>/recurrence.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    N, batch = 64, 16
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, jax {info['jax']}"
    )
    print(allocator_line(info))
    payload = {
        "machine": info,
        "state": N,
        "batch": batch,
        "dtype": "float32",
        "runs": {},
    }

    headline_T = 256 if args.quick else 1024
    print(f"measuring: jax issue 19498's setting, T={headline_T}")
    res = run(headline_T, N, batch, args.repeats)
    payload["runs"][str(headline_T)] = res

    sweep = [64, 256] if args.quick else [64, 256, 1024, 4096]
    keep = [
        "forward",
        "grad loss wrt (a, b, h0)",
        "grad loss wrt (a, b)",
        "jacrev h_T wrt a",
        "recurrence_jacobians .wrt_a",
        "seed",
    ]
    for T in sweep:
        if T != headline_T:
            print(f"measuring: the sweep, T={T}")
            payload["runs"][str(T)] = run(T, N, batch, args.repeats, only=keep)

    print("measuring: SequentialScan(unroll=...), T=1024")
    a = jr.uniform(jr.key(0), (batch, N), jnp.float32, 0.5, 0.999)
    b = jr.normal(jr.key(1), (batch, 1024, N), jnp.float32)
    progs = {}
    for u in [1, 2, 4, 8, 16]:
        scan = eqx_seq.SequentialScan(unroll=u)
        progs[(u, "forward_ms")] = (
            jax.jit(
                jax.vmap(
                    lambda a, b, scan=scan: eqx_seq.linear_recurrence(a, b, scan=scan)
                )
            ),
            (a, b),
        )
        progs[(u, "grad_ms")] = (
            jax.jit(
                jax.vmap(
                    jax.grad(
                        lambda a, b, scan=scan: loss_of(
                            eqx_seq.linear_recurrence(a, b, scan=scan)
                        ),
                        argnums=(0, 1),
                    )
                )
            ),
            (a, b),
        )
    timed = measure_many(progs, repeats=args.repeats, min_time=0.05)
    payload["unroll_T1024"] = {
        str(u): {k: timed[(u, k)]["median_ms"] for k in ("forward_ms", "grad_ms")}
        for u in [1, 2, 4, 8, 16]
    }
    save(args.json, payload, REPORTS["recurrence"])


if __name__ == "__main__":
    main()
