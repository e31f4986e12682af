"""The Kalman filter's square-root form: float32 on stiff models, and its cost.

First, the stiff table: models with a vague prior (`P0` 1e4-1e6) and precise
observations (`R` 1e-4-1e-6 relative), `T = 1000`, the log-likelihood of the
float32 filter against the float64 one on the same (float32) data, on both
backends; whether the float32 filter, smoother and gradient are finite, and how
close to singular their covariances come. "floor": what rounding a float64
filter's means to float32 after every step alone moves the log-likelihood by, which
no float32 algorithm can beat (the state's magnitude against float32's precision).
"cov f32": the covariance-form filter (the private `_square_root=False`) in
float32.

Then the square-root form's cost against the covariance form on the non-stiff
models of `bench_kalman.py` (the default `KalmanFilter(n, p)`, float32, complete
data), the two forms' programs interleaved in one run per size and length; the
parallel filters in a subprocess with a timeout (the covariance form's batched
LAPACK calls can stall XLA:CPU). JSON to results/<machine>/kalman_sqrt.json.

    python benchmarks/bench_kalman_sqrt.py           # about ten minutes
    python benchmarks/bench_kalman_sqrt.py --quick   # state 4 / obs 2, T = 1k only
"""

import argparse
import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import eqx_seq


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    DASH,
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


def _tracker(q, r, p0, T, start, rng, q_kind="cv"):
    """The 2-D constant-velocity tracker (dt = 0.1, state 4, obs 2), `R = r I`,
    `P0 = p0 I`; data from `start` (None: from the vague prior itself)."""
    dt = 0.1
    F = np.eye(4) + dt * np.eye(4, k=2)
    cv = np.kron(np.array([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]]), np.eye(2))
    Q = q * (cv if q_kind == "cv" else np.eye(4))
    model = dict(F=F, H=np.eye(2, 4), Q=Q, R=r * np.eye(2), P0=p0 * np.eye(4))
    x = rng.normal(size=4) * np.sqrt(p0) if start is None else np.asarray(start)
    L_Q, ys = np.linalg.cholesky(Q), []
    for _ in range(T):
        x = F @ x + L_Q @ rng.normal(size=4)
        ys.append(x[:2] + np.sqrt(r) * rng.normal(size=2))
    return model, np.array(ys)


def _random_stiff(n, p, r, p0, T, rng):
    """A random stable model (`F = 0.95 U`), `R` about `r` times `Q`'s scale."""
    U, _ = np.linalg.qr(rng.normal(size=(n, n)))
    A, B = rng.normal(size=(n, n)), rng.normal(size=(p, p))
    Q = 0.1 * (A @ A.T / n + 0.3 * np.eye(n))
    model = dict(
        F=0.95 * U, H=rng.normal(size=(p, n)), Q=Q,
        R=r * (B @ B.T / p + 0.3 * np.eye(p)), P0=p0 * np.eye(n),
    )  # fmt: skip
    x, ys = rng.normal(size=n), []
    for _ in range(T):
        x = model["F"] @ x + rng.multivariate_normal(np.zeros(n), Q)
        ys.append(model["H"] @ x + rng.multivariate_normal(np.zeros(p), model["R"]))
    return model, np.array(ys)


def stiff_cases(T=1000):
    """name -> (model, float32 observations). The first are the issue's tracker
    with data drawn from the vague prior itself (states of 1e2-1e5); the others
    have states of a few units."""
    rng = lambda: np.random.default_rng(0)
    start = [1.0, -0.5, 0.05, 0.02]
    cases = {}
    for q, kind in ((1e-3, "I"), (1e-6, "I"), (1e-3, "cv")):
        for p0, r in ((1e4, 1e-4), (1e6, 1e-6)):
            name = f"tracker Q={q:.0e}{'I' if kind == 'I' else '*cv'} P0={p0:.0e} R={r:.0e}"
            cases[name + " (from prior)"] = _tracker(q, r, p0, T, None, rng(), kind)
    for q, kind in ((1e-4, "cv"), (1e-6, "I")):
        for p0, r in ((1e4, 1e-4), (1e6, 1e-6)):
            name = f"tracker Q={q:.0e}{'I' if kind == 'I' else '*cv'} P0={p0:.0e} R={r:.0e}"
            cases[name] = _tracker(q, r, p0, T, start, rng(), kind)
    model, ys = _tracker(1e-4, 1e-6, 1e6, T, start, rng())
    ys[[3, 50, 400], 0] = np.nan
    ys[[7, 600]] = np.nan
    cases["tracker Q=1e-04*cv P0=1e+06 R=1e-06, missing"] = (model, ys)
    for n, p in ((5, 2), (8, 3)):
        for p0, r in ((1e4, 1e-4), (1e6, 1e-6)):
            name = f"random {n}/{p} P0={p0:.0e} R={r:.0e}*Q"
            cases[name] = _random_stiff(n, p, r, p0, T, rng())
    return {k: (m, ys.astype(np.float32)) for k, (m, ys) in cases.items()}


def _rounding_floor(model, ys):
    """The float64 log-likelihood of a square-root filter (NumPy, float64) whose
    means are rounded to float32 after every step: what representing the state in
    float32 alone costs, whatever the algorithm."""

    def tria(A):
        R = np.linalg.qr(A.T, mode="r")
        return (R * np.sign(np.diag(R))[:, None]).T

    F, H, n = model["F"], model["H"], model["F"].shape[0]
    L_Q = np.linalg.cholesky(model["Q"])
    m, L, total = np.zeros(n), np.linalg.cholesky(model["P0"]), 0.0
    r32 = lambda x: x.astype(np.float32).astype(np.float64)
    for y in ys.astype(np.float64):
        m_pred, L = r32(F @ m), tria(np.hstack([F @ L, L_Q]))
        o = ~np.isnan(y)
        k = int(o.sum())
        if not k:
            m = m_pred
            continue
        Ho, L_R = H[o], np.linalg.cholesky(model["R"][np.ix_(o, o)])
        X = tria(np.block([[Ho @ L, L_R], [L, np.zeros((n, k))]]))
        nu = np.linalg.solve(X[:k, :k], y[o] - Ho @ m_pred)
        m, L = r32(m_pred + X[k:, :k] @ nu), X[k:, k:]
        logdet = 2 * np.log(np.abs(np.diag(X[:k, :k]))).sum()
        total += -0.5 * (k * np.log(2 * np.pi) + logdet + nu @ nu)
    return total


_GRAD = eqx.filter_jit(eqx.filter_grad(lambda kf, ys: kf.log_likelihood(ys)))


def _stiff_row(model, ys, scan):
    """One case and backend: float32 and float64 log-likelihoods (the same float32
    data), the covariance form's float32 one, whether the float32 filter, smoother
    and gradient are finite, and the smallest `min eig / max eig` of the float32
    filtered, predicted and smoothed covariances."""
    n = model["F"].shape[0]
    kf = lambda dtype: eqx_seq.KalmanFilter.from_matrices(
        model["F"], model["H"], model["Q"], model["R"], np.zeros(n), model["P0"],
        scan=scan, dtype=dtype,
    )  # fmt: skip
    kf32 = kf(jnp.float32)
    f32, sm32 = kf32.filter(ys), kf32.smooth(ys)
    grad = _GRAD(kf32, ys)
    finite = all(
        bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((f32, sm32, grad))
    )
    ratio = []
    for P in (f32.covs, f32.predicted_covs, sm32.covs):
        ev = np.linalg.eigvalsh(np.asarray(P, np.float64))
        ratio.append(float((ev[..., 0] / ev[..., -1]).min()))
    cov32 = kf32._with_private(_square_root=False).filter(ys)
    ll64 = float(kf(jnp.float64).filter(ys.astype(np.float64)).log_likelihood)
    return {
        "float32": float(f32.log_likelihood),
        "float64": ll64,
        "covariance form float32": float(cov32.log_likelihood),
        "finite": finite,
        "min eig / max eig": min(ratio),
        "float32 means floor": abs(_rounding_floor(model, ys) - ll64),
    }


def stiff_table(T=1000):
    print(f"measuring: the stiff models, T = {T}")
    rows = {}
    for name, (model, ys) in stiff_cases(T).items():
        for label, scan in (
            ("seq", eqx_seq.SequentialScan()),
            ("par", eqx_seq.AssociativeScan()),
        ):
            r = _stiff_row(model, ys, scan)
            r["|diff|"] = abs(r["float32"] - r["float64"])
            rows[f"{name} / {label}"] = r
    return rows


def _sqrt_vs_cov_programs(n, p, T, parallel):
    """The programs `(fn, args)` of one size and length, square-root and covariance
    form, keyed `"sqrt: seq filter"` etc.; the parallel filter's alone."""
    filt = eqx.filter_jit(lambda kf, ys: kf.filter(ys))
    grad = eqx.filter_jit(eqx.filter_grad(lambda kf, ys: kf.log_likelihood(ys)))
    smooth = eqx.filter_jit(lambda kf, ys: kf.smooth(ys).means)
    scan = eqx_seq.AssociativeScan() if parallel else eqx_seq.SequentialScan()
    base = eqx_seq.KalmanFilter(n, p, scan=scan, dtype=jnp.float32, key=jr.key(0))
    _, ys = base.sample(jr.key(1), T)
    progs = {}
    for form, private in (("sqrt", {}), ("cov", {"_square_root": False})):
        kf = base._with_private(**private)
        if parallel:
            progs[f"{form}: par filter"] = (filt, (kf, ys))
            continue
        exact = base._with_private(_steady_state=False, **private)
        progs[f"{form}: seq filter"] = (filt, (kf, ys))
        progs[f"{form}: seq filter (exact)"] = (filt, (exact, ys))
        progs[f"{form}: seq grad"] = (grad, (kf, ys))
        progs[f"{form}: seq smoother"] = (smooth, (kf, ys))
    return progs


def sqrt_vs_cov_child(n, p, T, repeats):
    """Run in a subprocess: the parallel filters, which in covariance form make
    batched LAPACK calls that can deadlock on CPU (`docs/devdocs/kalman.md`)."""
    res = measure_many(_sqrt_vs_cov_programs(n, p, T, True), repeats=repeats)
    print(json.dumps(res))


def sqrt_vs_covariance(sizes, lengths, repeats, timeout):
    """The square-root filter's cost against the covariance form (the private
    `_square_root=False`), on the non-stiff models of the main table, float32,
    the two forms' programs interleaved in one `measure_many` run per size and
    length (the parallel filters in a subprocess with a timeout)."""
    out = {}
    for n, p in sizes:
        for T in lengths:
            print(f"measuring: square-root vs covariance form, {n}/{p}, T={T}")
            res = measure_many(_sqrt_vs_cov_programs(n, p, T, False), repeats=repeats)
            arg = f"{n},{p},{T},{max(1, repeats // 2)}"
            status = "missing"
            cmd = [sys.executable, __file__, "--child", arg]
            try:
                child = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=timeout
                )
                if child.returncode == 0:
                    res.update(json.loads(child.stdout.strip().splitlines()[-1]))
                else:
                    status = "failed: " + child.stderr.strip().splitlines()[-1]
            except subprocess.TimeoutExpired:
                status = f"timed out after {timeout} s (stalled or slow)"
            for what in ("seq filter", "seq filter (exact)", "seq grad",
                         "seq smoother", "par filter"):  # fmt: skip
                a, b = res.get(f"sqrt: {what}"), res.get(f"cov: {what}")
                if a is None:
                    out[f"{n}/{p}/{T}/{what}"] = {"status": status}
                    continue
                ratio = a["median_ms"] / b["median_ms"]
                out[f"{n}/{p}/{T}/{what}"] = {"sqrt": a, "cov": b, "ratio": ratio}
    return out


# --- the report: printed, and written beside the JSON ------------------------------
def tables(p):
    """The markdown of a results payload: the stiff table, the cost table."""
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


def headline(p):
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


REPORTS = {"kalman_sqrt": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T=1k, state 4 only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parallel-timeout", type=float, default=300)
    parser.add_argument(
        "--json",
        default=results_path("kalman_sqrt"),
        help="default: results/<machine>/kalman_sqrt.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    if args.child:
        sqrt_vs_cov_child(*map(int, args.child.split(",")))
        return
    jax.config.update("jax_enable_x64", True)  # the float64 columns
    info = machine()
    print(f"machine: {info['cpu']} ({info['cores']} cores), jax {info['jax']}")
    print(allocator_line(info))
    sizes = [(4, 2)] if args.quick else [(4, 2), (16, 8)]
    lengths = [1000] if args.quick else [1000, 10_000]
    payload = {
        "machine": info,
        "stiff": stiff_table(),
        "sqrt_vs_covariance": sqrt_vs_covariance(
            sizes, lengths, args.repeats, args.parallel_timeout
        ),
    }
    save(args.json, payload, REPORTS["kalman_sqrt"])


if __name__ == "__main__":
    main()
