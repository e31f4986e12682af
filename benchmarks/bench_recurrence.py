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
    machine,
    measure_many,
    results_path,
    write_json,
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


def ratio_table(res):
    seed = res[SEED]["median_ms"]
    plain_grad = res["plain assoc: grad loss wrt (a, b)"]["median_ms"]
    lines = [
        f"{'method':45s} {'ms':>9s} {'x fwd':>7s} {'speed-up':>16s} {'compile s':>9s}"
    ]
    for name, r in res.items():
        backend = name.split(":")[0]
        fwd = res.get(f"{backend}: forward", {}).get("median_ms")
        xf = f"{r['median_ms'] / fwd:7.2f}" if fwd else f"{'':7s}"
        if "jacrev" in name or "jacobians" in name:
            su = f"{seed / r['median_ms']:8.1f}x seed"
        elif "grad" in name:
            su = f"{plain_grad / r['median_ms']:6.1f}x p.assoc"
        else:
            su = ""
        lines.append(
            f"{name:45s} {r['median_ms']:9.2f} {xf} {su:>16s} {r['first_call_s']:9.2f}"
        )
    return "\n".join(lines)


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
    args = parser.parse_args()
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
    print(
        f"\n== jax issue 19498 setting: float32, T={headline_T}, state {N}, batch {batch} (vmap) =="
    )
    res = run(headline_T, N, batch, args.repeats)
    print(ratio_table(res))
    payload["runs"][str(headline_T)] = res

    sweep = [64, 256] if args.quick else [64, 256, 1024, 4096]
    print(
        "\n== sweep over T (ms, medians; ratios to the seed / plain-assoc grad in the same run) =="
    )
    keep = [
        "forward",
        "grad loss wrt (a, b, h0)",
        "grad loss wrt (a, b)",
        "jacrev h_T wrt a",
        "recurrence_jacobians .wrt_a",
        "seed",
    ]
    header = f"{'T':>6s} {'backend':12s} {'fwd':>8s} {'grad':>8s} {'grad/fwd':>8s} {'jac.wrt_a':>9s} {'jac/fwd':>7s} {'jacrev':>8s} {'seed':>9s} {'seed/jac':>8s} {'seed/jacrev':>11s} {'p.assoc grad/grad':>17s}"
    rows = [header]
    for T in sweep:
        r = res if T == headline_T else run(T, N, batch, args.repeats, only=keep)
        payload["runs"][str(T)] = r
        seed = r[SEED]["median_ms"]
        pg = r["plain assoc: grad loss wrt (a, b)"]["median_ms"]
        for name in BACKENDS:
            f = r[f"{name}: forward"]["median_ms"]
            g = r[f"{name}: grad loss wrt (a, b, h0)"]["median_ms"]
            j = r[f"{name}: recurrence_jacobians .wrt_a"]["median_ms"]
            jr_ = r[f"{name}: jacrev h_T wrt a"]["median_ms"]
            rows.append(
                f"{T:6d} {name:12s} {f:8.3f} {g:8.3f} {g / f:8.2f} {j:9.3f} {j / f:7.2f} {jr_:8.2f} {seed:9.1f} {seed / j:8.0f} {seed / jr_:11.1f} {pg / g:17.1f}"
            )
    print("\n".join(rows))

    print(
        "\n== SequentialScan unroll on this machine (T=1024; forward and grad, ms) =="
    )
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
    unroll = {
        u: {k: timed[(u, k)]["median_ms"] for k in ("forward_ms", "grad_ms")}
        for u in [1, 2, 4, 8, 16]
    }
    base = unroll[1]
    for u, r in unroll.items():
        print(
            f"unroll={u:2d}  forward {r['forward_ms']:7.3f} ({r['forward_ms'] / base['forward_ms']:.2f}x unroll=1)"
            f"  grad {r['grad_ms']:7.3f} ({r['grad_ms'] / base['grad_ms']:.2f}x)"
        )
    payload["unroll_T1024"] = {str(u): r for u, r in unroll.items()}
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
