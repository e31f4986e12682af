"""Kalman filter: eqx_seq.KalmanFilter vs dynamax (jax issue 2491's Kalman setting).

float32, one sequence, constant model; state 4 / obs 2 and state 16 / obs 8; T in
{1k, 10k, 100k}. Per size and length, in one interleaved run (`_timing.measure_many`):

- "seq filter": our sequential filter (means, covariances, log-likelihood; the
  model is time-invariant and the data complete, so after the exact head it runs
  the steady-state filter once the covariance has settled), and dynamax's
  `lgssm_filter` (the anchor of the "x dynamax" column); "seq filter (exact)":
  ours with every step exact, for comparison;
- "seq grad": `jax.grad` of `kf.log_likelihood` w.r.t. all parameters, by
  Fisher's identity: here from the steady-state smoother's sums over the steps
  (for models that do not settle, or with missing data, from the exact filter
  and smoother: a scan-free gradient); "x fwd" is divided by our own forward
  filter; dynamax's is autodiff
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

With `--cuthbert`, instead: ours against cuthbert's (state-space-models/cuthbert)
square-root Kalman filter and smoother (`cuthbert.gaussian.kalman`, called as its
docs do: `build_filter` / `build_smoother`, then `cuthbert.filter` /
`cuthbert.smoother`), float32, one sequence, state 4 / obs 2 and 16 / 8, T in
{1k, 10k} (cuthbert's sequential filter takes seconds a call at 100k), complete
data and 10% of the entries missing (NaN, which both skip): our sequential backend against cuthbert's `parallel=False`, our parallel
backend against its `parallel=True` (`lax.associative_scan`; in a subprocess
with a timeout, `--cuthbert-timeout`). "filter": the filter's whole
result; "smoother": the smoothed means (filter included). Both take the prior on
x_0, the state before the first observation (ours: `prior_at="x0"`). Every program
is compiled first (`lower().compile()`, timed: the compile columns), then the
compiled programs are timed interleaved. Before timing, a subprocess in float64
(`JAX_ENABLE_X64=1`) checks that both give the same filtered means and covariances,
log-likelihood and smoothed means and covariances (T = 1k, each backend pair, both
data); the run stops if they differ by more than 1e-9. Results in
`results/<machine>/kalman_cuthbert.json`. cuthbert's parallel programs make batched
LAPACK calls (QR, triangular solves): on 2 cores run with
`XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false` (docs/faq.md, the
LAPACK deadlock); its float64 check of state 16 hung there without it.

    python benchmarks/bench_kalman.py            # a few minutes
    python benchmarks/bench_kalman.py --quick    # T=1k only, one size: a smoke test
    python benchmarks/bench_kalman.py --extras   # forecasts and posterior samples
    python benchmarks/bench_kalman.py --em       # EM vs dynamax, a few minutes
    python benchmarks/bench_kalman.py --cuthbert # vs cuthbert, 10-30 minutes
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


# --- against cuthbert (--cuthbert) ---------------------------------------------------
# cuthbert (optional, the `benchmarks` extra) is imported by the functions that use it,
# for the same reason as dynamax
CUTHBERT_TOL = 1e-9  # the float64 check: means, covariances, relative log-likelihood
MISSING = {"complete": 0.0, "10% missing": 0.1}


def cuthbert_params(kf):
    """cuthbert's parameters of our model: the prior on x_0 (as ours, with
    `prior_at="x0"`) and generalized Cholesky factors of the covariances."""
    chol = jnp.linalg.cholesky
    return kf.m0, chol(kf.P0), kf.F, chol(kf.Q), kf.H, chol(kf.R)


def cuthbert_filter(params, ys, parallel):
    """cuthbert's Kalman filter, as its docs call it; the model inputs are the
    observations (a jit argument, like ours, not a closed-over constant)."""
    import cuthbert
    from cuthbert.gaussian import kalman

    m0, chol_P0, F, chol_Q, H, chol_R = params
    c, d = jnp.zeros_like(m0), jnp.zeros(H.shape[0], H.dtype)
    filt = kalman.build_filter(
        m0, chol_P0, lambda _: (F, c, chol_Q), lambda y: (H, d, chol_R, y)
    )
    # T + 1 states: the first is the prior on x_0
    return cuthbert.filter(filt, ys, filt.init_prepare(), parallel=parallel)


def cuthbert_smoother(params, ys, parallel):
    import cuthbert
    from cuthbert.gaussian import kalman

    _, _, F, chol_Q, _, _ = params
    c = jnp.zeros(F.shape[0], F.dtype)
    smoother = kalman.build_smoother(lambda _: (F, c, chol_Q))
    states = cuthbert_filter(params, ys, parallel)
    return cuthbert.smoother(smoother, states, parallel=parallel)


def cuthbert_data(n, p, T, missing, parallel, dtype=None):
    """Our model on one backend and its data, `missing` of the entries NaN (the
    same model and data on both backends)."""
    scan = eqx_seq.AssociativeScan() if parallel else eqx_seq.SequentialScan()
    kf = eqx_seq.KalmanFilter(n, p, scan=scan, dtype=dtype, key=jr.key(0))
    _, ys = kf.sample(jr.key(1), T)
    holes = jr.uniform(jr.key(3), ys.shape) < missing
    return kf, jnp.where(holes, jnp.nan, ys)


def cuthbert_check_child(n, p, T):
    """Run in a subprocess with JAX_ENABLE_X64=1: the largest differences, float64."""
    assert jax.config.jax_enable_x64
    gram = lambda L: L @ jnp.swapaxes(L, -1, -2)
    out = {}
    for data, missing in MISSING.items():
        for parallel in (False, True):
            kf, ys = cuthbert_data(n, p, T, missing, parallel, jnp.float64)
            params = cuthbert_params(kf)
            f, s = kf.filter(ys), kf.smooth(ys)
            cf = jax.jit(cuthbert_filter, static_argnums=2)(params, ys, parallel)
            cs = jax.jit(cuthbert_smoother, static_argnums=2)(params, ys, parallel)
            ll = cf.log_normalizing_constant[-1]
            diffs = {  # cuthbert's row 0 is x_0, before the first observation
                "filtered means": jnp.abs(cf.mean[1:] - f.means).max(),
                "filtered covs": jnp.abs(gram(cf.chol_cov[1:]) - f.covs).max(),
                "log-likelihood (rel.)": jnp.abs(ll / f.log_likelihood - 1),
                "smoothed means": jnp.abs(cs.mean[1:] - s.means).max(),
                "smoothed covs": jnp.abs(gram(cs.chol_cov[1:]) - s.covs).max(),
            }
            pair = "par" if parallel else "seq"
            out[f"{data}, {pair}"] = {k: float(v) for k, v in diffs.items()}
            out[f"{data}, {pair}"]["log-likelihood"] = float(f.log_likelihood)
    print(json.dumps(out))


def cuthbert_check(n, p, T, timeout):
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    cmd = [sys.executable, __file__, "--cuthbert-check-child", f"{n},{p},{T}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the float64 check failed to run:\n{out.stderr}")
    check = json.loads(out.stdout.strip().splitlines()[-1])
    for case, diffs in check.items():
        line = ", ".join(
            f"{k} {v:.1e}" for k, v in diffs.items() if k != "log-likelihood"
        )
        print(f"  check (float64, T={T}) {n}/{p}, {case}: {line}")
        bad = {k: v for k, v in diffs.items() if k != "log-likelihood"}
        bad = {k: v for k, v in bad.items() if not v <= CUTHBERT_TOL}
        if bad:
            raise RuntimeError(
                f"ours and cuthbert's disagree ({n}/{p}, {case}): {bad} > "
                f"{CUTHBERT_TOL:g}; the timings would compare different things"
            )
    return check


def cuthbert_programs(n, p, T, parallel):
    """The compiled programs of one backend pair, both data; their compile times;
    the float32 log-likelihoods."""
    tag = "par" if parallel else "seq"
    programs, compiled, compile_s, loglik = {}, {}, {}, {}
    ours_filter = eqx.filter_jit(lambda kf, ys: kf.filter(ys))
    ours_smoother = eqx.filter_jit(lambda kf, ys: kf.smooth(ys).means)
    theirs_filter = jax.jit(lambda params, ys: cuthbert_filter(params, ys, parallel))
    theirs_smoother = jax.jit(
        lambda params, ys: cuthbert_smoother(params, ys, parallel).mean
    )
    for data, missing in MISSING.items():
        kf, ys = cuthbert_data(n, p, T, missing, parallel)
        params = cuthbert_params(kf)
        for lib, task, fn, args in (
            ("ours", "filter", ours_filter, (kf, ys)),
            ("ours", "smoother", ours_smoother, (kf, ys)),
            ("cuthbert", "filter", theirs_filter, (params, ys)),
            ("cuthbert", "smoother", theirs_smoother, (params, ys)),
        ):
            # one program for both data (the same shapes): NaN is data to both
            program = f"{lib}: {tag} {task}"
            if program not in compiled:
                start = time.perf_counter()
                compiled[program] = fn.lower(*args).compile()
                compile_s[program] = time.perf_counter() - start
            programs[f"{program}, {data}"] = (compiled[program], args)
        out = jax.block_until_ready(programs[f"ours: {tag} filter, {data}"][0](kf, ys))
        theirs = programs[f"cuthbert: {tag} filter, {data}"][0](params, ys)
        assert theirs.mean.dtype == ys.dtype == jnp.float32, theirs.mean.dtype
        loglik[data] = {
            "ours": float(out.log_likelihood),
            "cuthbert": float(theirs.log_normalizing_constant[-1]),
        }
    return programs, compile_s, loglik


def cuthbert_measure(n, p, T, parallel, repeats):
    programs, compile_s, loglik = cuthbert_programs(n, p, T, parallel)
    # long programs (cuthbert's at T = 100k take seconds): one call per sample
    slow = [k for k in programs if T >= 100_000 and k.startswith("cuthbert")]
    res = measure_many(programs, repeats=repeats, slow=slow)
    return {"times": res, "compile_s": compile_s, "loglik_f32": loglik}


def cuthbert_child(n, p, T, parallel, repeats):
    """Run in a subprocess: the parallel programs, interleaved."""
    print(json.dumps(cuthbert_measure(n, p, T, bool(parallel), repeats)))


def cuthbert_parallel(n, p, T, repeats, timeout):
    cmd = [sys.executable, __file__, "--cuthbert-child", f"{n},{p},{T},1,{repeats}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout} s (stalled or slow)"}
    if out.returncode != 0:
        return {"status": "failed: " + out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def cuthbert_main(args, info):
    try:
        import cuthbert
    except ImportError:
        raise SystemExit("--cuthbert needs cuthbert: pip install cuthbert")
    sizes = [(4, 2)] if args.quick else [(4, 2), (16, 8)]
    # not T = 100k: cuthbert's sequential filter takes seconds a call there
    lengths = [1000] if args.quick else [1000, 10_000]
    payload = {
        "machine": info,
        "dtype": "float32",
        "cuthbert": cuthbert.__version__,
        "tolerance": CUTHBERT_TOL,
        "check": {},
        "runs": {},
    }
    print(f"cuthbert {cuthbert.__version__}")
    for n, p in sizes:
        payload["check"][f"{n}/{p}"] = cuthbert_check(n, p, 1000, args.cuthbert_timeout)
    for n, p in sizes:
        for T in lengths:
            print(f"measuring: {n}/{p}, T={T}")
            repeats = max(1, args.repeats // (3 if T >= 100_000 else 1))
            seq = cuthbert_measure(n, p, T, False, repeats)
            par = {"status": "skipped: only T <= 10k"}
            if T <= 10_000:
                par = cuthbert_parallel(
                    n, p, T, max(1, repeats // 2), args.cuthbert_timeout
                )
            for data, ll in seq["loglik_f32"].items():
                rel = abs(ll["cuthbert"] / ll["ours"] - 1)
                print(f"  float32 log-likelihoods, {data}: rel. diff. {rel:.1e}")
            payload["runs"][f"{n}/{p}/{T}"] = {"seq": seq, "par": par}
    save(
        args.json or results_path("kalman_cuthbert"),
        payload,
        REPORTS["kalman_cuthbert"],
    )


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


def cuthbert_rows(p):
    """(size, T, backend, data, {name: median ms}) or a status, per row."""
    for size, T, run in kalman_rows(p):
        for tag in ("seq", "par"):
            res = run[tag]
            if "status" in res:
                if not res["status"].startswith("skipped"):
                    yield size, T, tag, None, res["status"]
                continue
            for data in MISSING:
                t = {
                    k.split(": ")[0] + " " + k.split(" ")[2][:-1]: v["median_ms"]
                    for k, v in res["times"].items()
                    if k.endswith(", " + data)
                }
                yield size, T, tag, data, t


def kalman_cuthbert_tables(p):
    rows, compiles = [], []
    for size, T, tag, data, t in cuthbert_rows(p):
        if data is None:  # timed out or failed
            rows.append([size, T, tag, DASH, t] + [DASH] * 5)
            continue
        row = [size, T, tag, data]
        for task in ("filter", "smoother"):
            ours, theirs = t[f"ours {task}"], t[f"cuthbert {task}"]
            row += [ms(ours), ms(theirs), times(theirs / ours)]
        rows.append(row)
    for size, T, run in kalman_rows(p):
        for tag in ("seq", "par"):
            res = run[tag].get("compile_s")
            if res is None:
                continue
            c = lambda lib, task: f"{res[f'{lib}: {tag} {task}']:.2f}"
            compiles.append(
                [size, T, tag]
                + [
                    c(lib, task)
                    for task in ("filter", "smoother")
                    for lib in ("ours", "cuthbert")
                ]
            )
    out = [
        f"{p['dtype']}, one sequence, the default `KalmanFilter(n, p)` model; "
        f"cuthbert {p['cuthbert']} (`cuthbert.gaussian.kalman`, square-root form); "
        '"speed-up": cuthbert\'s time over ours in the same run; "seq": our '
        'sequential backend against cuthbert\'s `parallel=False`, "par": our '
        "parallel backend against its `parallel=True` (both associative scans, "
        'in a subprocess); "filter": the whole result; "smoother": the '
        'smoothed means, filter included; "10% missing": NaN entries, which both '
        "skip exactly (ours then runs every step exact, without the steady state).",
        "",
    ]
    out += table(
        "n/p | T | backend | data | ours filter ms | cuthbert filter ms | "
        "filter speed-up | ours smoother ms | cuthbert smoother ms | "
        "smoother speed-up",
        rows,
        left=4,
    )
    out += [
        "Compile time (s, `lower().compile()`; one program for both data):",
        "",
    ]
    out += table(
        "n/p | T | backend | ours filter | cuthbert filter | ours smoother | "
        "cuthbert smoother",
        compiles,
        left=3,
    )
    out += [
        f"Agreement, float64, T = 1000: the largest absolute difference between "
        "ours and cuthbert's (the log-likelihood: relative); the run stops above "
        f"{p['tolerance']:g}.",
        "",
    ]
    checks = []
    for size, check in p["check"].items():
        for case, d in check.items():
            data, tag = case.rsplit(", ", 1)
            checks.append(
                [size, data, tag]
                + [
                    f"{d[k]:.1e}"
                    for k in (
                        "filtered means",
                        "filtered covs",
                        "log-likelihood (rel.)",
                        "smoothed means",
                        "smoothed covs",
                    )
                ]
            )
    out += table(
        "n/p | data | backend | filtered means | filtered covs | log-likelihood "
        "(rel.) | smoothed means | smoothed covs",
        checks,
        left=3,
    )
    return out


def kalman_cuthbert_summary(p):
    ratios = {}
    for _, _, tag, data, t in cuthbert_rows(p):
        if data is None:
            continue
        for task in ("filter", "smoother"):
            key = f"{tag} {task}"
            ratios.setdefault(key, []).append(t[f"cuthbert {task}"] / t[f"ours {task}"])
    return "vs cuthbert: " + "; ".join(f"{k} {faster(v)}" for k, v in ratios.items())


REPORTS = {
    "kalman": (kalman_summary, kalman_tables),
    "kalman_extras": (kalman_extras_summary, kalman_extras_tables),
    "kalman_em": (kalman_em_summary, kalman_em_tables),
    "kalman_cuthbert": (kalman_cuthbert_summary, kalman_cuthbert_tables),
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
        "--extras, kalman_cuthbert.json with --cuthbert)",
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
        "--cuthbert", action="store_true", help="vs cuthbert's Kalman filter only"
    )
    parser.add_argument("--cuthbert-timeout", type=float, default=600)
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--extras-child", help=argparse.SUPPRESS)
    parser.add_argument("--cuthbert-child", help=argparse.SUPPRESS)
    parser.add_argument("--cuthbert-check-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    if args.cuthbert_child:
        cuthbert_child(*map(int, args.cuthbert_child.split(",")))
        return
    if args.cuthbert_check_child:
        cuthbert_check_child(*map(int, args.cuthbert_check_child.split(",")))
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
    if args.cuthbert:
        cuthbert_main(args, info)
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
