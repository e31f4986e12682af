"""Kalman filter: eqx_seq.KalmanFilter vs dynamax (jax issue 2491's Kalman setting).

float32, one sequence, constant model; state 4 / obs 2 and state 16 / obs 8; T in
{1k, 10k, 100k}. Per size and length, in one interleaved run (`_timing.measure_many`):

- "seq filter": our sequential filter (means, covariances, log-likelihood; the
  model is time-invariant and the data complete, so after the exact head it runs
  the steady-state filter once the covariance has settled), and dynamax's
  `lgssm_filter` (the anchor of the "x dynamax" column); "seq filter (exact)":
  ours with every step exact, for comparison;
- "seq grad": `jax.grad` of `kf.log_likelihood` w.r.t. all parameters: here plain
  autodiff through the steady-state filter (for models that do not settle, or
  with missing data, Fisher's identity: filter + smoother + a scan-free
  gradient); "x fwd" is divided by our own forward filter; dynamax's is autodiff
  through its filter; "seq grad (plain AD)": ours by plain autodiff through
  `kf.filter(ys).log_likelihood`, for comparison;
- "seq smoother": our RTS smoother (Bryson-Frazier form) and dynamax's
  `lgssm_smoother`;
- "par filter": our parallel (Särkkä & García-Fernández) filter, compile time
  reported; its scan is `AssociativeScan.associative_scan`, by default
  `eqx_seq._scan.level_scan` (levels as a loop). "par (lax.assoc)" is the
  same filter with `AssociativeScan(_pytree_scan="lax")`, i.e.
  `lax.associative_scan`, for comparison (the previous implementation). Parallel programs run in a
  subprocess with a timeout: long `lax.associative_scan` programs have stalled on
  this CPU (benchmarks/README.md).

With `--extras`, instead: forecasts and posterior samples, timed against our own
filter ("x filter": the filter of the same backend in the same run). For state 4 /
obs 2 and 16 / 8, T in {1k, 10k}, sequential ("seq") and parallel ("par")
backends: the filter, the smoother (for scale), `forecast(ys, 100)` and
`posterior_sample(key, ys, 100)`; and one step of online filtering
(`update(predict(state), y)`, called from Python: its latency, T-independent).
Each backend runs in a subprocess with a timeout (`--extras-timeout`). Results in
`results/<machine>/kalman_extras.json`.

With `--em`, instead: one EM iteration, `kf.fit_em` against dynamax's
`LinearGaussianSSM.fit_em` (no biases), float32, complete data (dynamax has no
missing data; ours also with 10% of the entries missing, for its cost), state
4 / obs 2 and 16 / 8, T in {1k, 10k}: the same data (drawn
from another model) and the same initial parameters, ours with `prior_at="x1"`
(dynamax's convention, so that both run the same EM). Both loops are compiled
whole (`lax.scan` over iterations); "ms/iter" is the median time of `--em-iters`
iterations divided by their number (ours includes the one E-step after the last
iteration, which gives the last log-likelihood). The trace check compares the
log-likelihoods: our entry i (after iteration i + 1) is dynamax's entry i + 1
(before its iteration i + 2).

    python benchmarks/bench_kalman.py            # a few minutes
    python benchmarks/bench_kalman.py --quick    # T=1k only, one size: a smoke test
    python benchmarks/bench_kalman.py --extras   # forecasts and posterior samples
    python benchmarks/bench_kalman.py --em       # EM vs dynamax, a few minutes
"""

import argparse
import json
import os
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqx_seq


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    DASH,
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


# dynamax, the optional anchor (the `benchmarks` extra): imported by `main`, not
# on import of this module, since importing it runs JAX, which fixes the devices
# before another script (tests/test_benchmarks.py imports them all) sets them
lgssm_filter = lgssm_smoother = make_lgssm_params = LinearGaussianSSM = None


def _load_dynamax() -> None:
    global lgssm_filter, lgssm_smoother, make_lgssm_params, LinearGaussianSSM
    try:
        from dynamax.linear_gaussian_ssm import LinearGaussianSSM
        from dynamax.linear_gaussian_ssm.inference import (
            lgssm_filter,
            lgssm_smoother,
            make_lgssm_params,
        )
    except ImportError:
        pass


def model(n, p, backend, **private):
    return eqx_seq.KalmanFilter(n, p, scan=backend, key=jr.key(0), **private)


def dynamax_params(kf):
    # our x_0 is the state before the first observation; dynamax observes its
    # initial state, so its prior is our one-step prediction
    F, Q, P0 = kf.F, kf.Q, kf.P0
    return make_lgssm_params(F @ kf.m0, F @ P0 @ F.T + Q, F, Q, kf.H, kf.R)


def programs(n, p, T):
    kf = model(n, p, eqx_seq.SequentialScan())
    # the same model with every step exact (the steady state switched off)
    exact = model(n, p, eqx_seq.SequentialScan(), _steady_state=False)
    _, ys = kf.sample(jr.key(1), T)
    filt = eqx.filter_jit(lambda kf, ys: kf.filter(ys))
    ll = lambda kf, ys: kf.log_likelihood(ys)
    plain = lambda kf, ys: kf.filter(ys).log_likelihood
    progs = {
        "ours: seq filter": (filt, (kf, ys)),
        "ours: seq filter (exact)": (filt, (exact, ys)),
        "ours: seq grad": (eqx.filter_jit(eqx.filter_grad(ll)), (kf, ys)),
        "ours: seq grad (plain AD)": (eqx.filter_jit(eqx.filter_grad(plain)), (kf, ys)),
        "ours: seq smoother": (
            eqx.filter_jit(lambda kf, ys: kf.smooth(ys).means),
            (kf, ys),
        ),
    }
    check = {"ours": float(ll(kf, ys))}
    if lgssm_filter is not None:
        params = dynamax_params(kf)
        dll = lambda params, ys: lgssm_filter(params, ys).marginal_loglik
        progs["dynamax: seq filter"] = (jax.jit(lgssm_filter), (params, ys))
        progs["dynamax: seq grad"] = (jax.jit(jax.grad(dll)), (params, ys))
        progs["dynamax: seq smoother"] = (
            jax.jit(lambda params, ys: lgssm_smoother(params, ys).smoothed_means),
            (params, ys),
        )
        check["dynamax"] = float(dll(params, ys))
    return progs, check


def parallel_child(n, p, T, repeats, use_lax):
    """Run in a subprocess: compile and time our parallel filter."""
    scan = eqx_seq.AssociativeScan(_pytree_scan="lax" if use_lax else "levels")
    kf = model(n, p, scan)
    _, ys = kf.sample(jr.key(1), T)
    f = eqx.filter_jit(lambda kf, ys: kf.filter(ys))
    start = time.perf_counter()
    compiled = f.lower(kf, ys).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(kf, ys))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(kf, ys))
        times.append(time.perf_counter() - start)
    times.sort()
    seq = model(n, p, eqx_seq.SequentialScan()).log_likelihood(ys)
    print(
        json.dumps(
            {
                "compile_s": compile_s,
                "median_ms": 1e3 * times[len(times) // 2],
                "loglik_rel_diff_vs_seq": abs(
                    float(out.log_likelihood) / float(seq) - 1
                ),
            }
        )
    )


def parallel(n, p, T, repeats, timeout, use_lax):
    cmd = [sys.executable, __file__, "--child", f"{n},{p},{T},{repeats},{use_lax:d}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout} s (stalled or slow)"}
    if out.returncode != 0:
        return {"status": "failed: " + out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def extras_programs(n, p, T, label):
    """Forecast and posterior sampling beside the filter, on one backend."""
    scan = {"seq": eqx_seq.SequentialScan(), "par": eqx_seq.AssociativeScan()}[label]
    kf = model(n, p, scan)
    _, ys = kf.sample(jr.key(1), T)
    filt = eqx.filter_jit(lambda kf, ys: kf.filter(ys))
    smooth = eqx.filter_jit(lambda kf, ys: kf.smooth(ys))
    fc = eqx.filter_jit(lambda kf, ys: kf.forecast(ys, 100))
    draw = eqx.filter_jit(lambda kf, key, ys: kf.posterior_sample(key, ys, 100))
    return {
        f"{label}: filter": (filt, (kf, ys)),
        f"{label}: smoother": (smooth, (kf, ys)),
        f"{label}: forecast (h=100)": (fc, (kf, ys)),
        f"{label}: posterior_sample (100)": (draw, (kf, jr.key(2), ys)),
    }


def extras_child(n, p, T, label, repeats):
    """Run in a subprocess: one backend's programs, interleaved."""
    res = measure_many(extras_programs(n, p, T, label), repeats=repeats)
    print(json.dumps(res))


def extras(args, info):
    sizes = [(4, 2)] if args.quick else [(4, 2), (16, 8)]
    lengths = [1000] if args.quick else [1000, 10_000]
    payload = {"machine": info, "dtype": "float32", "runs": {}, "stream_step": {}}
    for n, p in sizes:
        for T in lengths:
            run = payload["runs"][f"{n}/{p}/{T}"] = {}
            for label in ("seq", "par"):
                print(f"measuring: {n}/{p}, T={T}, {label}")
                # a subprocess with a timeout: batched LAPACK calls (the parallel
                # filter's) have stalled on this CPU's thread pool
                child = f"{n},{p},{T},{label},{args.repeats}"
                cmd = [sys.executable, __file__, "--extras-child", child]
                try:
                    out = subprocess.run(
                        cmd,
                        capture_output=True,
                        text=True,
                        timeout=args.extras_timeout,
                    )
                except subprocess.TimeoutExpired:
                    run[label] = {"status": f"timed out after {args.extras_timeout} s"}
                    print(f"{n:>2d}/{p:<2d} {T:>6d} {label}: {run[label]['status']}")
                    continue
                if out.returncode != 0:
                    msg = "failed: " + out.stderr.strip().splitlines()[-1]
                    run[label] = {"status": msg}
                    print(f"{n:>2d}/{p:<2d} {T:>6d} {label}: {msg}")
                    continue
                run[label] = json.loads(out.stdout.strip().splitlines()[-1])
        # online filtering: one predict + update from Python (dispatch included)
        kf = model(n, p, eqx_seq.SequentialScan())
        _, ys = kf.sample(jr.key(1), 1)
        step = lambda kf, state, y: kf.update(kf.predict(state), y)
        res = measure_many({"step": (step, (kf, kf.init_state(), ys[0]))}, min_time=0.2)
        payload["stream_step"][f"{n}/{p}"] = res["step"]
    path = args.json or results_path("kalman_extras")
    save(path, payload, REPORTS["kalman_extras"])


def em_programs(n, p, T, iters):
    """Our `fit_em` and dynamax's on the same data and initial parameters."""
    start = eqx_seq.KalmanFilter(
        n, p, scan=eqx_seq.SequentialScan(), prior_at="x1", key=jr.key(0)
    )
    truth = eqx_seq.KalmanFilter(n, p, prior_at="x1", key=jr.key(1))
    _, ys = truth.sample(jr.key(2), T)
    ours = eqx.filter_jit(lambda kf, ys: kf.fit_em(ys, num_iters=iters))
    progs = {"ours": (ours, (start, ys))}
    traces, compile_s = {}, {}

    def first_call(name, fn, args):
        # compilation included: the time a user waits for the first fit
        t0 = time.perf_counter()
        traces[name] = jax.block_until_ready(fn(*args))[1]
        compile_s[name] = time.perf_counter() - t0

    first_call("ours", ours, (start, ys))
    # ours with 10% of the entries missing (every step exact), for the cost
    holes = jr.uniform(jr.key(3), ys.shape) < 0.1
    progs["ours missing"] = (ours, (start, jnp.where(holes, jnp.nan, ys)))
    first_call("ours missing", ours, progs["ours missing"][1])
    if LinearGaussianSSM is not None:
        lgssm = LinearGaussianSSM(
            n, p, has_dynamics_bias=False, has_emissions_bias=False
        )
        params, props = lgssm.initialize(
            jr.key(0),
            initial_mean=start.m0,
            initial_covariance=start.P0,
            dynamics_weights=start.F,
            dynamics_covariance=start.Q,
            emission_weights=start.H,
            emission_covariance=start.R,
        )
        theirs = jax.jit(
            lambda params, ys: lgssm.fit_em(
                params, props, ys, num_iters=iters, verbose=False
            )
        )
        progs["dynamax"] = (theirs, (params, ys))
        first_call("dynamax", theirs, (params, ys))
    return progs, traces, compile_s


def em_main(args, info):
    iters = args.em_iters
    payload = {"machine": info, "dtype": "float32", "iters": iters, "runs": {}}
    sizes = [(4, 2)] if args.quick else [(4, 2), (16, 8)]
    lengths = [1000] if args.quick else [1000, 10_000]
    for n, p in sizes:
        for T in lengths:
            print(f"measuring: EM, {n}/{p}, T={T}")
            progs, traces, first = em_programs(n, p, T, iters)
            res = measure_many(progs, repeats=args.repeats)
            per = {k: r["median_ms"] / iters for k, r in res.items()}
            ours = traces["ours"]
            row = {"ms_per_iter": per, "first_call_s": {}, "trace": {}}
            row["trace"]["ours"] = [float(v) for v in ours]
            if "dynamax" in per:
                theirs = traces["dynamax"]
                row["trace"]["dynamax"] = [float(v) for v in theirs]
                rel = abs(ours[:-1] - theirs[1:]) / abs(theirs[1:])
                row["trace_max_rel_diff"] = float(rel.max()) if iters > 1 else None
                row["speedup"] = per["dynamax"] / per["ours"]
            row["first_call_s"] = first
            payload["runs"][f"{n}/{p}/{T}"] = row
    save(args.em_json, payload, REPORTS["kalman_em"])


# --- the reports: printed, and written beside the JSON -----------------------------
def kalman_rows(p):
    for key, run in p["runs"].items():
        n, obs, T = key.split("/")
        yield f"{n}/{obs}", int(T), run


def kalman_tables(p):
    """The markdown of a results payload: the ratios, then every time."""
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


REPORTS = {
    "kalman": (kalman_summary, kalman_tables),
    "kalman_extras": (kalman_extras_summary, kalman_extras_tables),
    "kalman_em": (kalman_em_summary, kalman_em_tables),
}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T=1k, state 4 only")
    parser.add_argument(
        "--extras", action="store_true", help="forecasts and posterior samples"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parallel-timeout", type=float, default=120)
    parser.add_argument(
        "--json",
        help="default: results/<machine>/kalman.json (kalman_extras.json with "
        "--extras)",
    )
    parser.add_argument("--extras-timeout", type=float, default=600)
    parser.add_argument("--em", action="store_true", help="EM vs dynamax only")
    parser.add_argument("--em-iters", type=int, default=10)
    parser.add_argument(
        "--em-json",
        default=results_path("kalman_em"),
        help="default: results/<machine>/kalman_em.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--extras-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    if args.child:
        parallel_child(*map(int, args.child.split(",")))
        return
    if args.extras_child:
        n, p, T, label, repeats = args.extras_child.split(",")
        extras_child(int(n), int(p), int(T), label, int(repeats))
        return
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
        f"jax {info['jax']}, float32"
    )
    print(allocator_line(info))
    if args.extras:
        extras(args, info)
        return
    _load_dynamax()
    if lgssm_filter is None:
        print("dynamax not installed: its rows are skipped (pip install dynamax)")
    if args.em:
        em_main(args, info)
        return
    sizes = [(4, 2)] if args.quick else [(4, 2), (16, 8)]
    lengths = [1000] if args.quick else [1000, 10_000, 100_000]
    payload = {"machine": info, "dtype": "float32", "runs": {}}
    for n, p in sizes:
        for T in lengths:
            print(f"measuring: {n}/{p}, T={T}")
            progs, check = programs(n, p, T)
            repeats = max(1, args.repeats // (3 if T >= 100_000 else 1))
            res = measure_many(progs, repeats=repeats)
            pars = {}
            for label, use_lax in (("par filter", 0), ("par (lax.assoc)", 1)):
                par = {"status": "skipped: only T <= 10k"}
                if T <= 10_000:
                    par = parallel(
                        n, p, T, max(1, repeats // 2), args.parallel_timeout, use_lax
                    )
                pars[label] = par
            ll = ", ".join(f"{k} {v:.6g}" for k, v in check.items())
            print(f"  log-likelihoods: {ll}")
            payload["runs"][f"{n}/{p}/{T}"] = {"seq": res, "par": pars, "loglik": check}
    save(args.json or results_path("kalman"), payload, REPORTS["kalman"])


if __name__ == "__main__":
    main()
