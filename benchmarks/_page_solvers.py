"""Benchmarks-page sections of the solver benchmarks: tridiagonal, Kalman."""

from _page_format import DASH, div, faster, ms, span, table, times


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


# --- bench_kalman_sqrt.py -------------------------------------------------------------
def kalman_sqrt_tables(p):
    stiff = [
        [
            f"`{case}`",
            f"{r['float32']:.4f}",
            f"{r['float64']:.4f}",
            f"{r['|diff|']:.4f}",
            f"{r['float32 means floor']:.4f}",
            "yes" if r["finite"] else "**no**",
            f"{r['min eig / max eig']:.1e}",
            f"{r['covariance form float32']:.6g}",
        ]
        for case, r in p["stiff"].items()
    ]
    out = [
        "Stiff models, T = 1000: log-likelihoods in float32 and float64 on the same "
        '(float32) data; "floor": what rounding a float64 filter\'s means to '
        'float32 alone moves it by; "finite": the float32 filter, smoother and '
        'gradient; "min eig": the smallest min/max eigenvalue ratio of the float32 '
        'covariances; "cov f32": the covariance form\'s float32 log-likelihood.',
        "",
    ]
    out += table(
        "case / backend | float32 | float64 | abs diff | floor | finite | min eig | "
        "cov f32",
        stiff,
    )
    cost = []
    for key, r in p["sqrt_vs_covariance"].items():
        n, obs, T, what = key.split("/", 3)
        if "ratio" not in r:
            cost.append([f"{n}/{obs}", T, what, DASH, DASH, r.get("status", DASH)])
            continue
        a, b = r["sqrt"]["median_ms"], r["cov"]["median_ms"]
        cost.append([f"{n}/{obs}", T, what, ms(a), ms(b), times(r["ratio"])])
    out += [
        "The square-root form against the covariance form (`_square_root=False`) on "
        "the non-stiff models, float32, interleaved:",
        "",
    ]
    out += table("n/p | T | program | sqrt ms | cov ms | sqrt / cov", cost)
    return out


def kalman_sqrt_summary(p):
    ok = [r["|diff|"] for c, r in p["stiff"].items() if "from prior" not in c]
    ratios = {}
    for key, r in p["sqrt_vs_covariance"].items():
        if "ratio" in r:
            ratios.setdefault(key.split("/", 3)[3], []).append(r["ratio"])
    cost = ", ".join(f"{k} {span(v)}" for k, v in ratios.items())
    return (
        f"float32 within {max(ok):.4f} nats of float64 on the stiff models it can "
        f"represent; square-root / covariance form: {cost}"
    )


# --- bench_kalman.py --extras -------------------------------------------------------
EXTRAS_PROGRAMS = ("filter", "smoother", "forecast (h=100)", "posterior_sample (100)")


def kalman_extras_tables(p):
    rows = []
    for size, T, run in kalman_rows(p):
        for label in ("seq", "par"):
            res = run.get(label, {})
            if "status" in res:
                rows.append([size, T, label, res["status"]] + [DASH] * 6)
                continue
            t = {k.split(": ", 1)[1]: v["median_ms"] for k, v in res.items()}
            f = t["filter"]
            rows.append(
                [size, T, label, ms(f)]
                + [ms(t[k]) for k in EXTRAS_PROGRAMS[1:]]
                + [times(t[k] / f) for k in EXTRAS_PROGRAMS[1:]]
            )
    out = [
        f"{p['dtype']}, one sequence, the default `KalmanFilter(n, p)` model, complete "
        'data; "x filter": the time over the same backend\'s filter in the same run '
        "(each backend in its own subprocess).",
        "",
    ]
    out += table(
        "n/p | T | backend | filter ms | smoother ms | forecast ms | "
        "posterior_sample ms | smoother x filter | forecast x filter | "
        "posterior_sample x filter",
        rows,
        left=3,
    )
    steps = p.get("stream_step", {})
    if steps:
        out += [
            "Online filtering, one `update(predict(state), y)` called from Python:",
            "",
        ]
        out += table(
            "n/p | ms per step",
            [[size, ms(r["median_ms"])] for size, r in steps.items()],
        )
    return out


def kalman_extras_summary(p):
    fc, ps = [], []
    for _, _, run in kalman_rows(p):
        res = run.get("seq", {})
        if "seq: filter" in res:
            f = res["seq: filter"]["median_ms"]
            fc.append(res["seq: forecast (h=100)"]["median_ms"] / f)
            ps.append(res["seq: posterior_sample (100)"]["median_ms"] / f)
    return (
        f"sequential: forecast of 100 steps {span(fc)} the filter; 100 posterior "
        f"paths {span(ps)} the filter"
    )


# --- bench_kalman.py --em -----------------------------------------------------------
def kalman_em_tables(p):
    rows = []
    for size, T, run in kalman_rows(p):
        t = run["ms_per_iter"]
        first = run["first_call_s"]
        rel = run.get("trace_max_rel_diff")
        rows.append(
            [
                size,
                T,
                ms(t["ours"]),
                ms(t.get("dynamax")),
                times(div(t.get("dynamax"), t["ours"])),
                ms(t.get("ours missing")),
                f"{first['ours']:.1f}",
                f"{first['dynamax']:.1f}" if "dynamax" in first else DASH,
                DASH if rel is None else f"{rel:.1e}",
            ]
        )
    out = [
        f"{p['dtype']}, one sequence, {p['iters']} iterations per call (ours "
        "includes the E-step after the last); ms per iteration; compile: the first "
        "call, compilation included; trace: the largest relative difference of the "
        "log-likelihoods after each iteration, ours against dynamax's.",
        "",
    ]
    return out + table(
        "n/p | T | ours ms | dynamax ms | speed-up | ours, 10% missing, ms | "
        "ours compile s | dynamax compile s | trace rel. diff.",
        rows,
    )


def kalman_em_summary(p):
    ratios = {}
    for size, _, run in kalman_rows(p):
        t = run["ms_per_iter"]
        if "dynamax" in t:
            ratios.setdefault(size, []).append(t["dynamax"] / t["ours"])
    if not ratios:
        return DASH + " (dynamax not installed)"
    return "vs dynamax, per iteration: " + ", ".join(
        f"{faster(v)} ({s})" for s, v in ratios.items()
    )
