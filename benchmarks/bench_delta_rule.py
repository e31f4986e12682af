"""The delta rule: `eqx_seq.delta_rule_scan` (chunked) against the recurrence written
as a plain `lax.scan` of its step, differentiated by autodiff (the anchor).

float32, one sequence, H heads of dk = dv channels, gates, beta in (0, 1), unit
queries and keys, T in {1024, 4096} (`--quick`: T = 256, smaller heads). Per size,
forward and gradient (with respect to q, k, v, beta and g, of the outputs' mean
square) of both. The script first checks that both give the same outputs. Every
program is lowered and compiled first (timed: "lower s", "compile s", and the
optimised HLO's instructions, counted as `bench_compile.py` counts them), in one
process, the anchor's programs first; then the compiled programs are timed
interleaved (`_timing.measure_many`: medians of repeats after a warm-up). "peak
MiB": temporaries + arguments + outputs of the compiled program (XLA's memory
analysis). "speed-up" is the anchor's time over ours, "memory /" the anchor's
peak over ours, "compile x" our lower + compile seconds over the anchor's.

Then the largest size split over two CPU devices along time (`eqx_seq.ShardedScan`
in `jax.shard_map`, inputs already split), forward and gradient, against one
device. A split loop can gain no more than the same loops split over an
independent axis, here the heads (each device runs half of them on the whole
sequence, nothing exchanged): measured in the same interleaved run, it is the
machine's ceiling, and "of ceiling" is the time split's speed-up over it. The
script first checks that the split outputs equal one device's.
"""

import argparse
import functools as ft
import time

import equinox as eqx
import jax


# two CPU devices for the split rows, set before JAX starts its backend; the other
# programs run on the first
jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from _timing import (  # noqa: E402
    div,
    hlo_instructions,
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_seq  # noqa: E402


def plain_delta_rule(q, k, v, beta, g):
    """The recurrence as a `lax.scan` of its step, as the field's reference loops
    write it (queries and keys unit, `(T, H, d)`)."""
    scale = q.shape[-1] ** -0.5

    def step(S, row):
        q_t, k_t, v_t, b_t, g_t = row
        S = jnp.exp(g_t)[:, None, None] * S
        u = b_t[:, None] * (v_t - jnp.einsum("hde,hd->he", S, k_t))
        S = S + k_t[:, :, None] * u[:, None, :]
        return S, scale * jnp.einsum("hde,hd->he", S, q_t)

    H, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    return jax.lax.scan(step, jnp.zeros((H, dk, dv), q.dtype), (q, k, v, beta, g))[1]


def ours(q, k, v, beta, g, chunk, scan=eqx_seq.AutoScan()):
    return eqx_seq.delta_rule_scan(q, k, v, beta, g=g, chunk_size=chunk, scan=scan)


def inputs(T, H, d, seed=0):
    kq, kk, kv, kb, kg = jr.split(jr.key(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return (
        unit(jr.normal(kq, (T, H, d))),
        unit(jr.normal(kk, (T, H, d))),
        jr.normal(kv, (T, H, d)),
        jax.nn.sigmoid(jr.normal(kb, (T, H))),
        -jax.nn.softplus(jr.normal(kg, (T, H))) * 0.1,
    )


def gradient(fn):
    loss = lambda *x: jnp.mean(fn(*x) ** 2)
    return jax.grad(loss, argnums=range(5))


def compile_one(fn, args):
    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    m = compiled.memory_analysis()
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    return compiled, {
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "hlo": hlo_instructions(compiled.as_text()),
        "peak_mib": peak / 2**20,
    }


def split_programs(x, chunk) -> dict:
    """`delta_rule_scan` on one device, split over two along time, and split over
    two along the heads (the ceiling): `name -> (fn, args)`, forward and gradient,
    the split programs given their inputs already split."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    one = ft.partial(ours, chunk=chunk, scan=eqx_seq.SequentialScan())
    programs = {"one device": (one, x)}
    for name, spec, scan in [
        ("time split", P("d"), eqx_seq.ShardedScan("d", eqx_seq.SequentialScan())),
        ("heads split", P(None, "d"), eqx_seq.SequentialScan()),
    ]:
        fn = jax.shard_map(
            ft.partial(ours, chunk=chunk, scan=scan),
            mesh=mesh,
            in_specs=(spec,) * len(x),
            out_specs=spec,
        )
        programs[name] = (
            fn,
            tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a in x),
        )
    return {
        f"{name} {what}": (fn if what == "fwd" else gradient(fn), args)
        for name, (fn, args) in programs.items()
        for what in ("fwd", "grad")
    }


def run_split(x, args) -> dict:
    T, H, d = x[2].shape
    progs, cost = {}, {}
    for name, (fn, inputs) in split_programs(x, args.chunk).items():
        compiled, cost[name] = compile_one(fn, inputs)
        progs[name] = (compiled, inputs)
    out = {
        n: np.asarray(progs[f"{n} fwd"][0](*progs[f"{n} fwd"][1]))
        for n in ("one device", "time split")
    }
    check = float(np.max(np.abs(out["time split"] - out["one device"])))
    print(f"check T={T}: |split over two devices - one device| = {check:.2e}")
    if not check < 1e-4:
        raise SystemExit(f"the split and one device differ by {check} at T={T}")
    timed = measure_many(progs, repeats=args.repeats, min_time=0.05)
    return {
        "T": T, "H": H, "dk": d, "dv": d, "chunk": args.chunk, "check": check,
        "programs": {n: {**cost[n], **timed[n]} for n in progs},
    }  # fmt: skip


def run_layers(args) -> dict:
    """`GatedDeltaNet` against `Mamba2` at equal state (`2 width state` per layer:
    `width / state` heads of `state` key and `2 state` value channels, against
    `2 width / 64` heads of 64 channels and `state` states), each's forward and
    gradient (with respect to the input and every parameter, of the outputs' mean
    square) in one program."""
    T, width, state = (256, 32, 16) if args.quick else (4096, 256, 64)
    x = jr.normal(jr.key(1), (T, width), jnp.float32)
    layers = {
        "GatedDeltaNet": eqx_seq.GatedDeltaNet(
            width, num_heads=width // state, head_dim=state, chunk_size=args.chunk,
            dtype=jnp.float32, key=jr.key(0),
        ),
        "Mamba2": eqx_seq.Mamba2(
            width, state_size=state, head_dim=min(64, 2 * width),
            chunk_size=args.chunk, dtype=jnp.float32, key=jr.key(0),
        ),
    }  # fmt: skip
    programs, cost = {}, {}
    for name, layer in layers.items():
        params, static = eqx.partition(layer, eqx.is_inexact_array)
        loss = lambda p, x, static=static: jnp.mean(eqx.combine(p, static)(x) ** 2)
        compiled, cost[name] = compile_one(
            jax.value_and_grad(loss, (0, 1)), (params, x)
        )
        programs[name] = (compiled, (params, x))
    timed = measure_many(programs, repeats=args.repeats, min_time=0.05)
    return {
        "T": T, "width": width, "state": state, "chunk": args.chunk,
        "programs": {n: {**cost[n], **timed[n]} for n in programs},
    }  # fmt: skip


def run(args) -> dict:
    quick = args.quick
    H, d = (2, 16) if quick else (4, 64)
    lengths = [256] if quick else [1024, 4096]
    rows = []
    for T in lengths:
        x = inputs(T, H, d)
        mine = ft.partial(ours, chunk=args.chunk)
        programs, cost = {}, {}
        for name, fn in [
            ("plain fwd", plain_delta_rule),
            ("plain grad", gradient(plain_delta_rule)),
            ("ours fwd", mine),
            ("ours grad", gradient(mine)),
        ]:
            compiled, cost[name] = compile_one(fn, x)
            programs[name] = (compiled, x)
        outputs = [programs[n][0](*x) for n in ("ours fwd", "plain fwd")]
        check = float(jnp.max(jnp.abs(outputs[0] - outputs[1])))
        print(f"check T={T}: |ours - plain lax.scan| = {check:.2e}")
        if not check < 1e-4:
            raise SystemExit(f"ours and the plain scan differ by {check} at T={T}")
        timed = measure_many(programs, repeats=args.repeats, min_time=0.05)
        rows.append(
            {
                "T": T, "H": H, "dk": d, "dv": d, "chunk": args.chunk,
                "check": check,
                "programs": {n: {**cost[n], **timed[n]} for n in programs},
            }
        )  # fmt: skip
    print(f"measuring: T={lengths[-1]} split over two devices")
    split = run_split(x, args)
    print("measuring: the GatedDeltaNet layer against Mamba2 at equal state")
    layers = run_layers(args)
    return {
        "machine": machine(), "quick": quick, "rows": rows, "split": split,
        "layers": layers,
    }  # fmt: skip


def headline(payload) -> str:
    if payload.get("quick"):
        raise KeyError("quick")
    row = max(payload["rows"], key=lambda r: r["T"])
    p = row["programs"]
    return (
        f"at T = {row['T']} (H = {row['H']}, dk = dv = {row['dk']}), forward + "
        f"gradient {times(div(p['plain grad']['median_ms'], p['ours grad']['median_ms']))} "
        f"faster than autodiff through a `lax.scan` of the step, its peak memory "
        f"{times(div(p['plain grad']['peak_mib'], p['ours grad']['peak_mib']))} lower, "
        "compile (lower + compile) "
        + span(
            [
                div(
                    p[f"ours {w}"]["lower_s"] + p[f"ours {w}"]["compile_s"],
                    p[f"plain {w}"]["lower_s"] + p[f"plain {w}"]["compile_s"],
                )
                for w in ("fwd", "grad")
            ]
        )
        + " the plain scan's"
        + _split_headline(payload)
        + _layers_headline(payload)
    )


def _layers_headline(payload) -> str:
    if "layers" not in payload:
        return ""
    p = payload["layers"]["programs"]
    ratio = div(p["GatedDeltaNet"]["median_ms"], p["Mamba2"]["median_ms"])
    return (
        f"; the `GatedDeltaNet` layer's forward + gradient {times(ratio)} "
        "`Mamba2`'s time at equal state"
    )


def _split_speed_ups(split, what) -> tuple:
    """The time split's speed-up over one device, the ceiling's (the heads split),
    and the first over the second."""
    p = split["programs"]
    one = p[f"one device {what}"]["median_ms"]
    time_split = div(one, p[f"time split {what}"]["median_ms"])
    ceiling = div(one, p[f"heads split {what}"]["median_ms"])
    return time_split, ceiling, div(time_split, ceiling)


def _split_headline(payload) -> str:
    if "split" not in payload:
        return ""
    ups = {w: _split_speed_ups(payload["split"], w) for w in ("fwd", "grad")}
    return (
        "; split over two CPU devices along time, forward and gradient a speed-up "
        f"of {span([ups[w][0] for w in ups])} (the ceiling, split along the heads: "
        f"{span([ups[w][1] for w in ups])})"
    )


def tables(payload) -> list[str]:
    out = ["float32, one sequence; anchor: the recurrence as a plain `lax.scan`.", ""]
    lines = []
    for row in payload["rows"]:
        p = row["programs"]
        for w in ("fwd", "grad"):
            o, a = p[f"ours {w}"], p[f"plain {w}"]
            lines.append(
                [
                    f"{row['T']}, H {row['H']}, d {row['dk']}, C {row['chunk']}",
                    w,
                    ms(o["median_ms"]),
                    ms(a["median_ms"]),
                    times(div(a["median_ms"], o["median_ms"])),
                    f"{o['peak_mib']:.1f}",
                    f"{a['peak_mib']:.1f}",
                    times(div(a["peak_mib"], o["peak_mib"])),
                    f"{o['lower_s']:.2f} + {o['compile_s']:.2f}",
                    f"{a['lower_s']:.2f} + {a['compile_s']:.2f}",
                    times(
                        div(
                            o["lower_s"] + o["compile_s"], a["lower_s"] + a["compile_s"]
                        )
                    ),
                    f"{o['hlo']} / {a['hlo']}",
                ]
            )
    return (
        out
        + table(
            "T, heads, d, chunk | program | ours ms | plain ms | speed-up | ours peak "
            "MiB | plain peak MiB | memory / | ours lower + compile s | plain lower + "
            "compile s | compile x | HLO ours / plain",
            lines,
            left=2,
        )
        + _split_tables(payload)
        + _layers_tables(payload)
    )


def _layers_tables(payload) -> list[str]:
    if "layers" not in payload:
        return []
    L = payload["layers"]
    p = L["programs"]
    rows = [
        [
            name,
            ms(p[name]["median_ms"]),
            times(div(p[name]["median_ms"], p["Mamba2"]["median_ms"])),
            f"{p[name]['peak_mib']:.1f}",
            f"{p[name]['lower_s']:.2f} + {p[name]['compile_s']:.2f}",
            str(p[name]["hlo"]),
        ]
        for name in ("GatedDeltaNet", "Mamba2")
    ]
    return [
        f"The layers at equal state, T = {L['T']}, width {L['width']}, "
        f"{2 * L['width'] * L['state']} states per layer, chunks of {L['chunk']}: "
        "forward + gradient (input and parameters) in one program.",
        "",
    ] + table(
        "layer | fwd + grad ms | / Mamba2 | peak MiB | lower + compile s | HLO", rows
    )


def _split_tables(payload) -> list[str]:
    if "split" not in payload:
        return []
    split = payload["split"]
    p = split["programs"]
    rows = []
    for what in ("fwd", "grad"):
        time_split, ceiling, fraction = _split_speed_ups(split, what)
        rows.append(
            [
                what,
                ms(p[f"one device {what}"]["median_ms"]),
                ms(p[f"time split {what}"]["median_ms"]),
                times(time_split),
                ms(p[f"heads split {what}"]["median_ms"]),
                times(ceiling),
                times(fraction),
                f"{p[f'one device {what}']['peak_mib']:.1f}",
                f"{p[f'time split {what}']['peak_mib']:.1f}",
                f"{p[f'heads split {what}']['peak_mib']:.1f}",
            ]
        )
    return [
        f"T = {split['T']}, H {split['H']}, d {split['dk']}, C {split['chunk']}: one "
        "device against the sequence split over two CPU devices along time "
        "(`ShardedScan`, inputs already split) and, the ceiling of a split loop on "
        "this machine, along the heads (half the heads per device, nothing "
        "exchanged). Peak MiB per device.",
        "",
    ] + table(
        "program | one device ms | time split ms | speed-up | heads split ms | "
        "ceiling | of ceiling | one device MiB | time split MiB | heads split MiB",
        rows,
    )


REPORTS = {"delta_rule": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T=256, small heads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--json", help="default: results/<machine>/delta_rule.json")
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    np.set_printoptions(precision=3)
    payload = run(args)
    save(args.json or results_path("delta_rule"), payload, REPORTS["delta_rule"])


if __name__ == "__main__":
    main()
