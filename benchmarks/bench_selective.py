"""The selective layers: Mamba's selective scan and the RG-LRU against plain JAX.

Anchors, written here independently of eqx_seq and run on the same inputs (the
script checks that both give the same outputs and gradients before reporting):

- **plain S6**: the selective scan as the pure-JAX Mamba ports write it
  (vvvm23/mamba-jax): `exp(Δ A)` and `(Δ u) B` materialised over `(T, D, N)`,
  `lax.associative_scan` with `(a_j a_i, a_j b_i + b_j)`, the read-out `h_t C_t`,
  skip and gate, and gradients by plain autodiff through all of it.
- **plain RG-LRU**: the recurrence as recurrentgemma's `lax.scan` path writes it:
  gates from block-diagonal linears, `log a = -8 r softplus(Λ)`, the input scaled
  by `sqrt(1 - a²)`, `lax.scan` over time, autodiff through the scan.

Setting of the issue: batch 8 by `jax.vmap`, float32; S6 with D = 256 channels and
N = 16 states, RG-LRU with width 256 in 4 heads; T in {1k, 4k, 16k}. Loss: the mean
square of the outputs; gradients w.r.t. every input. Peak memory: temporaries +
arguments + output of the compiled program (`memory_analysis()`). Medians of
interleaved repeats after a warm-up, with `block_until_ready`; ratios against the
anchors measured in the same run. An anchor whose compiled peak exceeds
`--max-anchor-gib` is compiled (for its memory) but not run.

    python benchmarks/bench_selective.py            # full run
    python benchmarks/bench_selective.py --quick    # T=256 only, for a smoke test
"""

import argparse
import os
import sys

import equinox as eqx
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
    span,
    table,
    times,
    write_reports,
)
from bench_s5 import compiled  # noqa: E402


# --- the anchors -------------------------------------------------------------------
def plain_s6(u, delta, A, B, C, D, z, delta_bias):
    """The selective scan of one sequence with every state materialised."""
    delta = jax.nn.softplus(delta + delta_bias)
    a = jnp.exp(delta[:, :, None] * A[None])
    b = (delta * u)[:, :, None] * B[:, None, :]
    op = lambda x, y: (y[0] * x[0], y[0] * x[1] + y[1])
    _, h = lax.associative_scan(op, (a, b))
    y = jnp.einsum("tdn,tn->td", h, C) + D * u
    return y * jax.nn.silu(z)


def ours_s6(scan):
    def fn(u, delta, A, B, C, D, z, delta_bias):
        return eqx_seq.selective_scan(
            u, delta, A, B, C, D, z=z, delta_bias=delta_bias, delta_softplus=True,
            scan=scan,
        )  # fmt: skip

    return fn


def plain_rglru(params, x):
    """The RG-LRU of one sequence, `lax.scan` over time as recurrentgemma's."""
    a_param, wa, ba, wx, bx = params
    heads = wa.shape[0]

    def gate(w, b):
        blocks = x.reshape(x.shape[0], heads, -1)
        return jax.nn.sigmoid(jnp.einsum("thi,hij->thj", blocks, w) + b).reshape(
            x.shape
        )

    log_a = -8.0 * gate(wa, ba) * jax.nn.softplus(a_param)
    a = jnp.exp(log_a)
    b = jnp.sqrt(1 - jnp.exp(2 * log_a)) * (gate(wx, bx) * x)

    def step(h, ab):
        h = ab[0] * h + ab[1]
        return h, h

    return lax.scan(step, jnp.zeros_like(x[0]), (a, b))[1]


def rglru_params(layer):
    return (
        layer.a_param,
        layer.a_gate_weight,
        layer.a_gate_bias,
        layer.input_gate_weight,
        layer.input_gate_bias,
    )


# --- programs ----------------------------------------------------------------------
def loss_of(y):
    return jnp.mean(y**2)


def s6_programs(T, D, N, batch, key):
    k = jr.split(key, 8)
    f32 = jnp.float32
    args = (
        jr.normal(k[0], (batch, T, D), f32),
        jr.normal(k[1], (batch, T, D), f32) - 2.0,
        -jnp.broadcast_to(jnp.arange(1.0, N + 1, dtype=f32), (D, N)),
        jr.normal(k[2], (batch, T, N), f32),
        jr.normal(k[3], (batch, T, N), f32),
        jnp.ones(D, f32),
        jr.normal(k[4], (batch, T, D), f32),
        jnp.zeros(D, f32),
    )
    axes = (0, 0, None, 0, 0, None, 0, None)
    out = {}
    for name, fn in [
        ("plain S6", plain_s6),
        ("ours, sequential", ours_s6(eqx_seq.SequentialScan())),
        ("ours, associative", ours_s6(eqx_seq.AssociativeScan())),
    ]:
        forward = jax.vmap(fn, in_axes=axes)

        def loss(*args, forward=forward):
            return loss_of(forward(*args))

        out[f"{name}: forward"] = (forward, args)
        out[f"{name}: grad"] = (jax.grad(loss, argnums=tuple(range(8))), args)
    return out


def rglru_programs(T, width, heads, batch, key):
    lkey, xkey = jr.split(key)
    layer = eqx_seq.RGLRU(width, num_heads=heads, dtype=jnp.float32, key=lkey)
    x = jr.normal(xkey, (batch, T, width), jnp.float32)
    params = rglru_params(layer)
    out = {}

    def plain_forward(params, x):
        return jax.vmap(lambda x: plain_rglru(params, x))(x)

    for name, forward in [("plain RG-LRU (lax.scan)", plain_forward)] + [
        (
            f"ours, {kind}",
            lambda params, x, scan=scan: jax.vmap(
                eqx.tree_at(
                    rglru_params, eqx.tree_at(lambda l: l.scan, layer, scan), params
                )
            )(x),
        )
        for kind, scan in [
            ("sequential", eqx_seq.SequentialScan()),
            ("associative", eqx_seq.AssociativeScan()),
        ]
    ]:

        def loss(params, x, forward=forward):
            return loss_of(forward(params, x))

        out[f"{name}: forward"] = (forward, (params, x))
        out[f"{name}: grad"] = (jax.grad(loss, argnums=(0, 1)), (params, x))
    return out


# --- measuring ----------------------------------------------------------------------
def measure(progs, repeats, max_anchor_gib):
    """Compile each program (timed, with its peak memory), then time those that fit."""
    stats = {name: compiled(fn, args) for name, (fn, args) in progs.items()}
    run = {
        name: (stats[name][0], progs[name][1])
        for name in progs
        if not (name.startswith("plain") and stats[name][2] > max_anchor_gib * 1024)
    }
    slow = [name for name in run if name.startswith("plain")]
    res = measure_many(run, repeats=repeats, slow=slow)
    for name, (_, seconds, peak) in stats.items():
        res.setdefault(name, {"first_call_s": None, "median_ms": None})
        res[name].update(compile_s=seconds, peak_mb=peak)
    return res


def check(progs, res, anchor):
    """Ours against the anchor: outputs and gradients, relative error."""
    if res[f"{anchor}: forward"]["median_ms"] is None:
        print(f"check: skipped ({anchor} not run)")
        return
    fn, args = progs[f"{anchor}: forward"]
    reference = jax.jit(fn)(*args)
    ref_grads = jax.jit(progs[f"{anchor}: grad"][0])(*args)
    for name in progs:
        if name.startswith("plain") or not name.endswith("forward"):
            continue
        kind = name.split(": ")[0]
        ours = jax.jit(progs[name][0])(*progs[name][1])
        err = float(jnp.max(jnp.abs(ours - reference)) / jnp.max(jnp.abs(reference)))
        grads = jax.jit(progs[f"{kind}: grad"][0])(*progs[name][1])
        g_err = max(
            float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
        )
        assert err < 1e-3 and g_err < 1e-2, (kind, err, g_err)
        print(
            f"check: {kind} = {anchor} (max rel. err {err:.1e} forward, "
            f"{g_err:.1e} gradient, by leaf)"
        )


# --- the report: printed, and written beside the JSON ------------------------------
def _selective_rows(runs, anchor, kinds):
    rows = []
    for T, res in runs.items():
        plain = res[f"{anchor}: grad"]
        for k in kinds:
            f, g = res[f"{k}: forward"], res[f"{k}: grad"]
            rows.append(
                [
                    T,
                    k,
                    ms(f["median_ms"]),
                    ms(g["median_ms"]),
                    times(div(g["median_ms"], f["median_ms"])),
                    times(div(plain["median_ms"], g["median_ms"])),
                    f"{g['peak_mb']:.0f}",
                    times(g["peak_mb"] / plain["peak_mb"]),
                    f"{g['compile_s']:.2f}",
                ]
            )
    return table(
        "T | method | fwd ms | grad ms | grad x fwd | grad speed-up | grad peak MiB | "
        "peak x plain | grad compile s",
        rows,
        left=2,
    )


SELECTIVE_KINDS = ("ours, sequential", "ours, associative")


def tables(p):
    """The markdown of a results payload: the S6 table, the RG-LRU table."""
    s6, rg = p["s6"], p["rglru"]
    out = [
        f"Selective scan (S6): D={s6['D']} channels, N={s6['N']} states, batch "
        f"{p['batch']} by `jax.vmap`, float32, gradient w.r.t. every input; anchor: "
        "the plain S6 (states materialised, `lax.associative_scan`, autodiff). A dash: "
        "not run, its compiled peak being above the script's limit. Peak: XLA's "
        "memory analysis of the compiled gradient.",
        "",
    ]
    out += _selective_rows(s6["runs"], "plain S6", ("plain S6",) + SELECTIVE_KINDS)
    out += [
        f"RG-LRU: width {rg['width']} in {rg['heads']} heads, batch {p['batch']}, "
        "float32; anchor: the plain RG-LRU (`lax.scan`, autodiff).",
        "",
    ]
    anchor = "plain RG-LRU (lax.scan)"
    out += _selective_rows(rg["runs"], anchor, (anchor,) + SELECTIVE_KINDS)
    return out


def headline(p):
    s6 = p["s6"]["runs"]
    k = SELECTIVE_KINDS[0]
    ran = [T for T, r in s6.items() if r["plain S6: grad"]["median_ms"] is not None]
    su = [
        div(s6[T]["plain S6: grad"]["median_ms"], s6[T][f"{k}: grad"]["median_ms"])
        for T in ran
    ]
    mem = [
        r["plain S6: grad"]["peak_mb"] / r[f"{k}: grad"]["peak_mb"] for r in s6.values()
    ]
    rg = [
        div(
            r["plain RG-LRU (lax.scan): grad"]["median_ms"],
            r[f"{k}: grad"]["median_ms"],
        )
        for r in p["rglru"]["runs"].values()
    ]
    return (
        f"S6 gradient vs the plain S6: {faster(su)} (T={'/'.join(ran)}), "
        f"{span(mem)} less peak memory (T={'/'.join(s6)}); RG-LRU gradient vs "
        f"`lax.scan`: {faster(rg)}"
    )


REPORTS = {"selective": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T=256 only (smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--max-anchor-gib",
        type=float,
        default=8.0,
        help="anchors with a larger compiled peak are not run (default 8)",
    )
    parser.add_argument(
        "--json",
        default=results_path("selective"),
        help="default: results/<machine>/selective.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    batch, D, N, width, heads = 8, 256, 16, 256, 4
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
        f"jax {info['jax']}"
    )
    print(allocator_line(info))
    payload = {
        "machine": info,
        "batch": batch,
        "s6": {"D": D, "N": N, "runs": {}},
        "rglru": {"width": width, "heads": heads, "runs": {}},
    }
    lengths = [256] if args.quick else [1024, 4096, 16384]
    key = jr.key(0)
    for T in lengths:
        print(
            f"\n== selective scan (S6), float32, T={T}, D={D}, N={N}, batch {batch} "
            "(vmap); speed-up vs the plain S6 =="
        )
        progs = s6_programs(T, D, N, batch, key)
        res = measure(progs, args.repeats, args.max_anchor_gib)
        check(progs, res, "plain S6")
        payload["s6"]["runs"][str(T)] = res
    for T in lengths:
        print(
            f"\n== RG-LRU, float32, T={T}, width={width}, {heads} heads, batch {batch} "
            "(vmap); speed-up vs the plain RG-LRU =="
        )
        progs = rglru_programs(T, width, heads, batch, key)
        res = measure(progs, args.repeats, args.max_anchor_gib)
        check(progs, res, "plain RG-LRU (lax.scan)")
        payload["rglru"]["runs"][str(T)] = res
    save(args.json, payload, REPORTS["selective"])


if __name__ == "__main__":
    main()
