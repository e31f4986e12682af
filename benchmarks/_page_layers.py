"""Benchmarks-page sections of the layer benchmarks: recurrence, S5, embedding,
selective layers."""

from _page_format import div, faster, ms, span, table, times


# --- bench_recurrence.py ------------------------------------------------------------
SEED = "seed: jacrev h_T wrt a, plain assoc"
PLAIN_GRAD = "plain assoc: grad loss wrt (a, b)"
BACKENDS = ("sequential", "associative")


def recurrence_headline_T(p):
    return max(p["runs"], key=lambda T: (len(p["runs"][T]), int(T)))


def recurrence_tables(p):
    T = recurrence_headline_T(p)
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
            jr = r[f"{b}: jacrev h_T wrt a"]["median_ms"]
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
                    times(r[SEED]["median_ms"] / jr),
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


def recurrence_summary(p):
    res = p["runs"][recurrence_headline_T(p)]
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


def recurrence_plot(p, ax):
    Ts = sorted(p["runs"], key=int)
    x = [int(T) for T in Ts]
    series = {"seed (jacrev, plain assoc.)": SEED, "plain assoc. grad": PLAIN_GRAD}
    for b in BACKENDS:
        series[f"{b}: grad"] = f"{b}: grad loss wrt (a, b, h0)"
        series[f"{b}: .wrt_a"] = f"{b}: recurrence_jacobians .wrt_a"
    for label, key in series.items():
        ax.loglog(x, [p["runs"][T][key]["median_ms"] for T in Ts], "o-", label=label)
    ax.set_xlabel("T")
    ax.set_ylabel("ms (median)")
    ax.set_title("Recurrence: Jacobians and gradients over T")


# --- bench_s5.py --------------------------------------------------------------------
S5_KINDS = ("plain S5", "sequential", "associative")


def s5_tables(p):
    rows = []
    for T, res in p["runs"].items():
        plain = res["plain S5: grad"]
        for k in S5_KINDS:
            f, g = res[f"{k}: forward"], res[f"{k}: grad"]
            rows.append(
                [
                    T,
                    k,
                    ms(f["median_ms"]),
                    ms(g["median_ms"]),
                    times(g["median_ms"] / f["median_ms"]),
                    times(plain["median_ms"] / g["median_ms"]),
                    f"{g['peak_mb']:.0f}",
                    times(g["peak_mb"] / plain["peak_mb"]),
                    f"{g['compile_s']:.2f}",
                ]
            )
    out = [
        f"H={p['H']} features, `state_size` {p['state_size']} (`conj_sym`), batch "
        f"{p['batch']} by `jax.vmap`, float32; loss: mean square of the outputs. "
        "Peak: XLA's memory analysis of the compiled gradient.",
        "",
    ]
    out += table(
        "T | layer | fwd ms | grad ms | grad x fwd | grad vs plain | grad peak MB | "
        "peak x plain | grad compile s",
        rows,
    )
    rows = []
    for T, res in p.get("jacobians", {}).items():
        anchor = next(v for k, v in res.items() if k.startswith("plain S5"))
        for name, r in res.items():
            kind = name.split(": ")[0]
            fwd = res.get(f"{kind}: forward (1 sequence)", {}).get("median_ms")
            rows.append(
                [
                    T,
                    f"`{name}`",
                    ms(r["median_ms"]),
                    times(div(r["median_ms"], fwd)),
                    times(anchor["median_ms"] / r["median_ms"]),
                    f"{r['compile_s']:.2f}",
                ]
            )
    if rows:
        out += ["Final-state parameter Jacobians, one sequence:", ""]
        out += table("T | method | ms | x fwd | speed-up vs jacrev | compile s", rows)
    return out


def s5_summary(p):
    parts = []
    for k in S5_KINDS[1:]:
        su = [
            r["plain S5: grad"]["median_ms"] / r[f"{k}: grad"]["median_ms"]
            for r in p["runs"].values()
        ]
        mem = [
            r[f"{k}: grad"]["peak_mb"] / r["plain S5: grad"]["peak_mb"]
            for r in p["runs"].values()
        ]
        parts.append(f"{k} {faster(su)} at {span(mem)} the peak memory")
    Ts = "/".join(p["runs"])
    return f"gradient vs the plain S5 (T={Ts}): " + "; ".join(parts)


def s5_plot(p, ax):
    Ts = list(p["runs"])
    x = [int(T) for T in Ts]
    for k in S5_KINDS:
        (line,) = ax.loglog(
            x, [p["runs"][T][f"{k}: grad"]["median_ms"] for T in Ts], "o-", label=k
        )
        ax.loglog(
            x,
            [p["runs"][T][f"{k}: forward"]["median_ms"] for T in Ts],
            "o--",
            color=line.get_color(),
            alpha=0.6,
        )
    ax.set_xlabel("T")
    ax.set_ylabel("ms (median)")
    ax.set_title("S5: gradient (solid) and forward (dashed)")


# --- bench_embedding.py -------------------------------------------------------------
TAKE = "raw jnp.take (anchor)"


def embedding_tables(p):
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


def embedding_summary(p):
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


# --- bench_selective.py -------------------------------------------------------------
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


def selective_tables(p):
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


def selective_summary(p):
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


def selective_plot(p, ax):
    runs = p["s6"]["runs"]
    Ts = list(runs)
    x = [int(T) for T in Ts]
    for k in ("plain S6",) + SELECTIVE_KINDS:
        y = [runs[T][f"{k}: grad"]["median_ms"] for T in Ts]
        pts = [(a, b) for a, b in zip(x, y) if b is not None]
        (line,) = ax.loglog(*zip(*pts), "o-", label=k)
        f = [(a, runs[T][f"{k}: forward"]["median_ms"]) for a, T in zip(x, Ts)]
        f = [(a, b) for a, b in f if b is not None]
        ax.loglog(*zip(*f), "o--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("T")
    ax.set_ylabel("ms (median)")
    ax.set_title("Selective scan: gradient (solid) and forward (dashed)")


# --- bench_sequence_parallel.py -----------------------------------------------------
_SP_WORK = {
    "recurrence": "`linear_recurrence`, T = 10^6, state 64",
    "s5": "`S5`, T = 2·10^5",
    "mamba": "`Mamba` (16 features), T = 10^5",
    "kalman": "Kalman log-likelihood, state 4, T = 10^6",
    "kalman_missing": "the same, 1 entry in 97 missing",
}


def sequence_parallel_tables(p):
    rows = []
    for work, label in _SP_WORK.items():
        for what, r in p.get(work, {}).items():
            mib = r["mib_per_device"]
            rows.append(
                [
                    label,
                    what,
                    ms(r["one device"]["median_ms"]),
                    ms(r["sharded"]["median_ms"]),
                    times(r["speed_up"]),
                    f"{mib['one device']:.0f}",
                    f"{mib['sharded']:.0f}",
                    times(mib["sharded"] / mib["one device"]),
                ]
            )
    out = [
        "float32, one sequence: one device against the same sequence split along "
        "time over two CPU devices (`ShardedScan` in `shard_map`, inputs already "
        "split); memory per device from XLA's analysis of the compiled program "
        "(arguments, outputs, temporaries).",
        "",
    ]
    return out + table(
        "workload | program | one device ms | two devices ms | speed-up | "
        "MiB/device, one | MiB/device, two | memory, two / one",
        rows,
        left=2,
    )


def sequence_parallel_summary(p):
    runs = [r for work in _SP_WORK for r in p.get(work, {}).values()]
    mem = [
        r["mib_per_device"]["sharded"] / r["mib_per_device"]["one device"] for r in runs
    ]
    return (
        f"two CPU devices against one: {faster([r['speed_up'] for r in runs])}, "
        f"{span(mem)} the memory per device"
    )


def sequence_parallel_scaling_tables(p):
    rows = [
        [
            *key.split(" "),
            ms(r["forward"]["median_ms"]),
            ms(r["grad"]["median_ms"]),
            f"{r['exchange']['median_ms']:.3f}",
            r["bytes_forward"],
        ]
        for key, r in p["scaling"].items()
    ]
    out = [
        "`linear_recurrence` with `ShardedScan`, T = 10^6, state 64, float32, on "
        "forced CPU devices that share the machine's two cores (how the exchange "
        "scales, not a speed-up), with each `exchange`; 'exchange ms': the "
        "recurrence with one step per device (the exchange alone); bytes: what one "
        "device receives per exchange in the forward pass, from the collectives' "
        "shapes.",
        "",
    ]
    return out + table(
        "devices | exchange | forward ms | gradient ms | exchange ms | "
        "received bytes/device",
        rows,
        left=2,
    )


def sequence_parallel_scaling_summary(p):
    runs = p["scaling"]
    last = max({int(k.split(" ")[0]) for k in runs})
    one = runs["1 all_gather"]["forward"]["median_ms"]
    return (
        f"forward {ms(one)} ms on 1 device, on {last}: "
        f"{ms(runs[f'{last} all_gather']['forward']['median_ms'])} ms (all_gather), "
        f"{ms(runs[f'{last} ppermute']['forward']['median_ms'])} ms (ppermute)"
    )
