"""Write the docs' benchmarks page from the JSON results of the bench scripts.

Reads `benchmarks/results/<machine>/<name>.json` (written by `bench_<name>.py`) and
writes `docs/benchmarks.md`: a summary of the headline ratios, then per script and
machine the tables the script prints, with every ratio as "speed-up" (the anchor's
time over the row's) or "x fwd" (the row's time over its own forward pass). Plots go
to `docs/benchmarks/*.png` (matplotlib; `--no-plots` for tables only).

    python benchmarks/make_docs_page.py                  # after a bench run
    python benchmarks/make_docs_page.py --out /tmp/b.md  # elsewhere
"""

import argparse
import glob
import json
import os


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DASH = "–"


# --- formatting ---------------------------------------------------------------------
def ms(x):
    """A time in ms with three significant digits or so."""
    if x is None:
        return DASH
    for bound, digits in ((100, 0), (10, 1), (1, 2)):
        if x >= bound:
            return f"{x:.{digits}f}"
    return f"{x:.3f}"


def times(x):
    """A ratio, `1.23×`; large ones with fewer digits."""
    if x is None:
        return DASH
    if x >= 100:
        return f"{x:.0f}×"
    if x >= 10:
        return f"{x:.1f}×"
    if x >= 0.1:
        return f"{x:.2f}×"
    return f"{x:.2g}×"


def div(a, b):
    return None if a is None or b is None else a / b


def table(headers, rows, left=1):
    """Markdown table; `headers` one string, "a | b | c"; the first `left` columns
    left-aligned, the others right-aligned."""
    headers = headers.split(" | ")
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---"] * left + ["---:"] * (len(headers) - left)) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def span(values, fmt=times):
    values = [v for v in values if v is not None]
    if not values:
        return DASH
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)[:-1]}–{fmt(hi)}"


def faster(values):
    """Speed-ups in words: `2.1–4.1× faster`, `87–640× slower`."""
    values = [v for v in values if v is not None]
    if all(v >= 1 for v in values):
        return span(values) + " faster"
    if all(v < 1 for v in values):
        return span([1 / v for v in values]) + " slower"
    return "speed-up " + span(values)


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


# --- bench_tridiagonal.py -----------------------------------------------------------
THOMAS_TM = "eqx_seq Thomas (SequentialScan), axis=0"
NUMBA_SIMD = "Numba SIMD across systems, time-major, prange"


def tridiagonal_tables(p):
    out = [
        f"{p['batch']} systems of size {p['n']}; anchor: "
        "`jax.lax.linalg.tridiagonal_solve` (LAPACK gtsv) on its last-axis layout. "
        '"vs Numba": against Numba\'s SIMD kernel on time-major data (all cores); '
        '"% floor": the time of `out[:] = a + b + c + d` over the same arrays over '
        "the row's.",
        "",
    ]
    for dtype, res in p["runs"].items():
        fwd = {r["name"]: r for r in res["forward"]}
        simd = fwd.get(NUMBA_SIMD, {}).get("ms")
        rows = [
            [
                f"`{r['name']}`",
                r["layout"],
                ms(r["ms"]),
                times(1 / r["ratio"]),
                times(div(simd, r["ms"])),
                f"{r['floor_pct']:.1f}%",
                f"{r['relerr']:.1e}",
            ]
            for r in res["forward"]
        ]
        out += [f"Forward, {dtype}:", ""]
        out += table(
            "method | layout | ms | vs gtsv | vs Numba | % floor | rel. err", rows
        )
        rows = [
            [f"`{r['name']}`", ms(r["ms"]), times(r["per_fwd"]), times(1 / r["ratio"])]
            for r in res["gradient"]
        ]
        out += [f"Gradient of `sum(x**2)` w.r.t. all four inputs, {dtype}:", ""]
        out += table("method | ms | x own fwd | vs grad through gtsv", rows)
    if "accuracy" in p:
        methods = list(next(iter(p["accuracy"].values())))
        rows = [
            [case] + [f"{m:.1e} / {w:.1e}" for m, w in row.values()]
            for case, row in p["accuracy"].items()
        ]
        out += [
            "Accuracy: float32 solves against float64 gtsv, relative error per "
            "system, median / worst:",
            "",
        ]
        out += table(" | ".join(["matrices"] + methods), rows)
    return out


def tridiagonal_summary(p):
    parts = []
    for dtype, res in p["runs"].items():
        fwd = {r["name"]: r for r in res["forward"]}
        if THOMAS_TM in fwd:
            parts.append(f"{dtype} {faster([1 / fwd[THOMAS_TM]['ratio']])}")
    return "forward (Thomas, time-major, one device) vs `lax.linalg` (gtsv): " + (
        ", ".join(parts)
    )


def tridiagonal_plot(p, axes):
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, (dtype, res) in zip(axes, p["runs"].items()):
        rows = res["forward"]
        colours = ["C0" if r["name"].startswith("eqx_seq") else "0.6" for r in rows]
        ax.barh(
            [r["name"] for r in rows], [1 / r["ratio"] for r in rows], color=colours
        )
        ax.axvline(1, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.invert_yaxis()
        ax.set_title(f"forward, {dtype}: speed-up vs gtsv")
    axes[-1].tick_params(labelleft=False)


# --- bench_kalman.py ----------------------------------------------------------------
def kalman_rows(p):
    for key, run in p["runs"].items():
        n, obs, T = key.split("/")
        yield f"{n}/{obs}", int(T), run


def kalman_tables(p):
    rows, full = [], []
    for size, T, run in kalman_rows(p):
        seq, par = run["seq"], run["par"]
        t = {k: v["median_ms"] for k, v in seq.items()}
        f = t["ours: seq filter"]
        pf = par.get("par filter", {})
        rows.append(
            [
                size,
                T,
                ms(f),
                times(div(t.get("dynamax: seq filter"), f)),
                times(t["ours: seq filter (exact)"] / f),
                times(t["ours: seq grad"] / f),
                times(div(t.get("dynamax: seq grad"), t["ours: seq grad"])),
                times(t["ours: seq smoother"] / f),
                times(div(t.get("dynamax: seq smoother"), t["ours: seq smoother"])),
                times(div(pf.get("median_ms"), f)),
                f"{pf['compile_s']:.2f}" if "compile_s" in pf else DASH,
            ]
        )
        full.append(
            [size, T]
            + [ms(t.get(k)) for k in KALMAN_COLUMNS]
            + [
                ms(par.get(k, {}).get("median_ms"))
                for k in ("par filter", "par (lax.assoc)")
            ]
        )
    out = [
        f"{p['dtype']}, one sequence, the default `KalmanFilter(n, p)` model; "
        '"vs dynamax": dynamax\'s time for the same task over ours; parallel '
        "filter only at T ≤ 10k, in a subprocess.",
        "",
    ]
    out += table(
        "n/p | T | filter ms | filter vs dynamax | exact x fwd | grad x fwd | "
        "grad vs dynamax | smoother x fwd | smoother vs dynamax | parallel x fwd | "
        "parallel compile s",
        rows,
    )
    out += ["All times (ms):", ""]
    names = KALMAN_COLUMNS + ("ours: par filter", "ours: par (lax.assoc)")
    out += table(" | ".join(["n/p", "T"] + [f"`{k}`" for k in names]), full)
    return out


KALMAN_COLUMNS = (
    "ours: seq filter",
    "ours: seq filter (exact)",
    "ours: seq grad",
    "ours: seq grad (plain AD)",
    "ours: seq smoother",
    "dynamax: seq filter",
    "dynamax: seq grad",
    "dynamax: seq smoother",
)


def kalman_summary(p):
    filt, grad = {}, {}
    for size, _, run in kalman_rows(p):
        t = {k: v["median_ms"] for k, v in run["seq"].items()}
        if "dynamax: seq filter" in t:
            filt.setdefault(size, []).append(
                t["dynamax: seq filter"] / t["ours: seq filter"]
            )
            grad.setdefault(size, []).append(
                t["dynamax: seq grad"] / t["ours: seq grad"]
            )
        else:
            grad.setdefault(size, []).append(
                t["ours: seq grad"] / t["ours: seq filter"]
            )
    if not filt:  # no dynamax on that machine
        return (
            "gradient "
            + ", ".join(f"{span(v)} the filter at {s}" for s, v in grad.items())
            + " (dynamax not installed)"
        )
    return (
        "vs dynamax: filter "
        + ", ".join(f"{faster(v)} ({s})" for s, v in filt.items())
        + "; gradient "
        + ", ".join(f"{faster(v)} ({s})" for s, v in grad.items())
    )


def kalman_plot(p, axes):
    sizes = {}
    for size, T, run in kalman_rows(p):
        sizes.setdefault(size, []).append((T, run["seq"]))
    tasks = ("seq filter", "seq grad", "seq smoother", "seq filter (exact)")
    for ax, (size, runs) in zip(axes, sizes.items()):
        x = [T for T, _ in runs]
        for colour, task in enumerate(tasks):
            for who, style in (("ours", "o-"), ("dynamax", "s--")):
                key = f"{who}: {task}"
                if all(key in seq for _, seq in runs):
                    y = [seq[key]["median_ms"] for _, seq in runs]
                    ax.loglog(x, y, style, color=f"C{colour}", label=key)
        ax.set_xlabel("T")
        ax.set_title(f"Kalman, state/obs {size}")
    axes[0].set_ylabel("ms (median)")


def kalman_can_plot(p):
    return len({T for _, T, _ in kalman_rows(p)}) > 1


# --- the page -----------------------------------------------------------------------
BENCHES = {
    "recurrence": dict(
        title="Diagonal recurrence: Jacobians and gradients",
        what="`linear_recurrence` and `recurrence_jacobians` on both backends against "
        "jax issue 19498's seed (`jax.jacrev` through a plain `lax.associative_scan`) "
        "and plain autodiff through `lax.associative_scan` / `lax.scan`.",
        tables=recurrence_tables,
        summary=recurrence_summary,
        plot=recurrence_plot,
        panels=1,
    ),
    "s5": dict(
        title="S5 layer",
        what="`eqx_seq.S5` (forward, gradient, peak memory, parameter Jacobians) "
        "against S5 as the reference implementation (lindermanlab/S5) writes it, on "
        "the same parameters, differentiated by plain autodiff.",
        tables=s5_tables,
        summary=s5_summary,
        plot=s5_plot,
        panels=1,
    ),
    "embedding": dict(
        title="Embedding lookups",
        what="`eqx_seq.Embedding` under each out-of-range policy against raw "
        "`jnp.take`, `jax.vmap`-ed `eqx.nn.Embedding` and a one-hot matmul.",
        tables=embedding_tables,
        summary=embedding_summary,
    ),
    "tridiagonal": dict(
        title="Batched tridiagonal solves",
        what="`tridiagonal_solve` against `jax.lax.linalg.tridiagonal_solve` (gtsv), "
        "jax issue 2491's `lax.scan` seed, its NumPy loop and Numba kernels.",
        tables=tridiagonal_tables,
        summary=tridiagonal_summary,
        plot=tridiagonal_plot,
        panels=2,
    ),
    "kalman": dict(
        title="Kalman filter",
        what="`KalmanFilter` (filter, gradient of the log-likelihood, smoother, "
        "parallel filter) against dynamax's `lgssm_filter` / `lgssm_smoother`.",
        tables=kalman_tables,
        summary=kalman_summary,
        plot=kalman_plot,
        panels=2,
        can_plot=kalman_can_plot,
    ),
}


def generic_tables(p):
    """Any other results file: every timed program, flattened."""
    rows = []

    def walk(node, path):
        if isinstance(node, dict):
            if "median_ms" in node:
                rows.append([f"`{' / '.join(path)}`", ms(node["median_ms"])])
            else:
                for k, v in node.items():
                    walk(v, path + [k])

    walk({k: v for k, v in p.items() if k != "machine"}, [])
    return table("program | ms", rows or [[DASH, DASH]])


def load(results):
    """`{bench: {machine: (path, payload)}}`, machines with CPU ones first."""
    found = {}
    for path in sorted(glob.glob(os.path.join(results, "*", "*.json"))):
        machine = os.path.basename(os.path.dirname(path))
        bench = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            found.setdefault(bench, {})[machine] = (path, json.load(f))
    order = list(BENCHES) + sorted(set(found) - set(BENCHES))
    return {
        b: dict(
            sorted(
                found[b].items(), key=lambda kv: (not kv[0].startswith("cpu"), kv[0])
            )
        )
        for b in order
        if b in found
    }


def measured_on(m):
    env = m.get("malloc_env")
    if env is None:
        alloc = "not recorded"
    elif env:
        alloc = " ".join(f"`{k}={v}`" for k, v in sorted(env.items()))
    else:
        alloc = "glibc defaults"
    device = m["platform"]
    if m["platform"] != "cpu":
        device += f" ({m.get('device_kind') or ', '.join(m['devices'])})"
    if len(m["devices"]) > 1:
        device += f" ({len(m['devices'])} devices)"
    return (
        f"{m['cpu']} ({m['cores']} cores), {device}, jax "
        f"{m['jax']}, Python {m['python']}, commit `{m['commit']}`; XLA flags: "
        f"{'`' + m['xla_flags'] + '`' if m['xla_flags'] else 'default'}; "
        f"allocator: {alloc}."
    )


def plot(spec, payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = spec.get("panels", 1)
    fig, axes = plt.subplots(
        1, panels, figsize=(6 * panels if panels > 1 else 7, 4.5), squeeze=False
    )
    axes = list(axes[0])
    spec["plot"](payload, axes if panels > 1 else axes[0])
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if labels:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def render(results, out, plots=True):
    """Write the page to `out` (and its plots next to it); return its text."""
    data = load(results)
    image_dir = os.path.join(os.path.dirname(out), "benchmarks")
    lines = [
        "<!-- Generated by benchmarks/make_docs_page.py from benchmarks/results/; "
        "edit those, not this page. -->",
        "",
        "# Benchmarks",
        "",
        "Every number below is the median of interleaved repeats of a jitted program "
        "after a warm-up, and every ratio is against an anchor measured in the same "
        "run. \"Speed-up\" is the anchor's time over the row's (above 1×: faster "
        'than the anchor); "x fwd" is the row\'s time over its own forward pass. '
        "The scripts are in `benchmarks/` (see its README for how to run them); each "
        "writes `benchmarks/results/<machine>/<name>.json`, and "
        "`python benchmarks/make_docs_page.py` turns those into this page. "
        "Why some of these numbers move with the machine's settings (allocator, "
        "threads, TF32) is in the [FAQ](faq.md).",
        "",
        "## Summary",
        "",
    ]
    rows = []
    for bench, machines in data.items():
        spec = BENCHES.get(bench)
        for machine, (_, payload) in machines.items():
            try:
                summary = spec["summary"](payload) if spec else DASH
            except KeyError:  # a quick run or an older layout: no headline
                summary = DASH
            rows.append([spec["title"] if spec else bench, f"`{machine}`", summary])
    lines += table("benchmark | machine | headline", rows, left=3)
    for bench, machines in data.items():
        spec = BENCHES.get(bench, {})
        lines += [f"## {spec.get('title', bench)}", ""]
        lines += [f"`benchmarks/bench_{bench}.py`: {spec.get('what', '')}".rstrip(), ""]
        for machine, (path, payload) in machines.items():
            rel = os.path.abspath(path)
            if rel.startswith(ROOT + os.sep):
                rel = os.path.relpath(rel, ROOT)
            lines += [f"### {spec.get('title', bench)}: `{machine}`", ""]
            lines += [
                f"Measured on {measured_on(payload['machine'])} From `{rel}`.",
                "",
            ]
            lines += spec.get("tables", generic_tables)(payload)
            can_plot = spec.get("can_plot", lambda p: True)
            if plots and "plot" in spec and can_plot(payload):
                name = f"{bench}-{machine}.png"
                plot(spec, payload, os.path.join(image_dir, name))
                lines += [f"![{spec['title']}, {machine}](benchmarks/{name})", ""]
    text = "\n".join(lines).rstrip() + "\n"
    with open(out, "w") as f:
        f.write(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    render(args.results, args.out, plots=not args.no_plots)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
