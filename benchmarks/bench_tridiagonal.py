"""Batched tridiagonal solves: eqx_seq vs jax.lax.linalg, the jax-issue-2491 seed,
NumPy and Numba.

The setting of jax issue 2491: 100k systems of size 100, float32 and float64, in the
seed's layout (systems along the last axis, shape (100000, 100)) and time-major
(shape (100, 100000), solved along axis 0). The anchor is
`jax.lax.linalg.tridiagonal_solve` (LAPACK gtsv, with pivoting) on its native
last-axis layout; every row gives its time and its ratio to that anchor, measured in
the same interleaved run. The *seed* is the issue's `lax.scan` TDMA with transposes,
with its carry `init` corrected to `(batch,)`: as written it broadcasts to
`(n, batch)` for 2-D inputs and computes n copies of the answer.

"% floor" divides the bandwidth floor by the row's time. The floor is the best of
twenty runs of `out[:] = a + b + c + d` over the same four arrays into a preallocated
`out` (four reads, one write: the traffic of an ideal solve), with Numba on all
cores (NumPy, one core, if Numba is missing), measured in the same run. "x Numba"
divides by Numba's SIMD kernel on time-major data (all cores); the same kernel also
runs on one thread, since XLA runs our sweeps on one; and ours also runs with the
systems split over one CPU device per core by `jax.shard_map` (the "shard_map" rows),
the JAX way to use every core. Gradients are of `sum(x**2)` w.r.t. all four inputs.

    python benchmarks/bench_tridiagonal.py            # about 4 minutes on 2 cores
    python benchmarks/bench_tridiagonal.py --quick    # 10k systems, a smoke test
"""

import argparse
import os
import sys
import time

import jax


jax.config.update("jax_enable_x64", True)
# one CPU device per core, for the rows that split the systems over devices with
# `jax.shard_map` (everything else runs on the first device, as with one)
DEVICES = os.cpu_count() or 1
jax.config.update("jax_num_cpu_devices", DEVICES)

import jax.lax as lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_seq  # noqa: E402


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


try:
    import numba
except ImportError:  # optional anchor
    numba = None


# --- the tools people use today (written here, independent of eqx_seq) ------------
def lax_gtsv(a, b, c, d):
    """jax.lax.linalg on (batch, n) data: LAPACK gtsv per system on CPU."""
    return lax.linalg.tridiagonal_solve(a, b, c, d[..., None])[..., 0]


def scan_time_major(a, b, c, d):
    """The seed's scan on (n, batch) data: no transposes, no blocking."""

    def forward(carry, x):
        cp_prev, dp_prev = carry
        a_i, b_i, c_i, d_i = x
        denom = b_i - a_i * cp_prev
        cp = c_i / denom
        dp = (d_i - a_i * dp_prev) / denom
        return (cp, dp), (cp, dp)

    init = jnp.zeros(a.shape[1:], a.dtype)
    _, (cp, dp) = lax.scan(forward, (init, init), (a, b, c, d))

    def backward(x_next, x):
        cp_i, dp_i = x
        x_i = dp_i - cp_i * x_next
        return x_i, x_i

    return lax.scan(backward, init, (cp, dp), reverse=True)[1]


def seed_tdma(a, b, c, d):
    """jax issue 2491's TDMA: lax.scan over transposed (batch, n) data. The carry
    init is corrected from (n, batch) to (batch,): the scan above, with the
    seed's transposes in and out."""
    return scan_time_major(a.T, b.T, c.T, d.T).T


def numpy_tdma(a, b, c, d):
    """The NumPy loop of jax issue 2491, vectorised over systems, (batch, n) data."""
    n = a.shape[-1]
    cp = np.empty_like(a)
    dp = np.empty_like(a)
    cp[..., 0] = c[..., 0] / b[..., 0]
    dp[..., 0] = d[..., 0] / b[..., 0]
    for i in range(1, n):
        denom = b[..., i] - a[..., i] * cp[..., i - 1]
        cp[..., i] = c[..., i] / denom
        dp[..., i] = (d[..., i] - a[..., i] * dp[..., i - 1]) / denom
    x = np.empty_like(a)
    x[..., -1] = dp[..., -1]
    for i in range(n - 2, -1, -1):
        x[..., i] = dp[..., i] - cp[..., i] * x[..., i + 1]
    return x


def numba_kernels():
    """Numba TDMAs: per system on (batch, n) data, and SIMD across systems on
    time-major (n, batch) data in cache-sized column blocks (the research note's
    fastest CPU kernel). `error_model="numpy"` lets LLVM vectorise the divisions."""
    jit = numba.njit(parallel=True, fastmath=False, error_model="numpy", cache=False)

    @jit
    def per_system(a, b, c, d):
        batch, n = a.shape
        x = np.empty_like(d)
        for s in numba.prange(batch):
            cp = np.empty(n, a.dtype)
            dp = np.empty(n, a.dtype)
            cp[0] = c[s, 0] / b[s, 0]
            dp[0] = d[s, 0] / b[s, 0]
            for i in range(1, n):
                denom = b[s, i] - a[s, i] * cp[i - 1]
                cp[i] = c[s, i] / denom
                dp[i] = (d[s, i] - a[s, i] * dp[i - 1]) / denom
            x[s, n - 1] = dp[n - 1]
            for i in range(n - 2, -1, -1):
                x[s, i] = dp[i] - cp[i] * x[s, i + 1]
        return x

    @jit
    def time_major(a, b, c, d):
        n, batch = a.shape
        block = 1024
        x = np.empty_like(d)
        for k in numba.prange((batch + block - 1) // block):
            lo = k * block
            hi = min(lo + block, batch)
            m = hi - lo
            cp = np.empty((n, m), a.dtype)
            dp = np.empty((n, m), a.dtype)
            for j in range(m):
                cp[0, j] = c[0, lo + j] / b[0, lo + j]
                dp[0, j] = d[0, lo + j] / b[0, lo + j]
            for i in range(1, n):
                for j in range(m):
                    denom = b[i, lo + j] - a[i, lo + j] * cp[i - 1, j]
                    cp[i, j] = c[i, lo + j] / denom
                    dp[i, j] = (d[i, lo + j] - a[i, lo + j] * dp[i - 1, j]) / denom
            for j in range(m):
                x[n - 1, lo + j] = dp[n - 1, j]
            for i in range(n - 2, -1, -1):
                for j in range(m):
                    x[i, lo + j] = dp[i, j] - cp[i, j] * x[i + 1, lo + j]
        return x

    return per_system, time_major


def stream_floor_ms(arrays, repeats=20):
    """Best time of `out[:] = a + b + c + d` into a preallocated `out`, in ms."""
    a, b, c, d = arrays
    out = np.empty_like(a)
    if numba is not None:

        @numba.njit(parallel=True)
        def stream(a, b, c, d, out):
            flat = out.reshape(-1)
            fa, fb, fc, fd = a.reshape(-1), b.reshape(-1), c.reshape(-1), d.reshape(-1)
            for i in numba.prange(flat.size):
                flat[i] = fa[i] + fb[i] + fc[i] + fd[i]

    else:

        def stream(a, b, c, d, out):
            np.add(a, b, out=out)
            out += c
            out += d

    stream(a, b, c, d, out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        stream(a, b, c, d, out)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def make_data(batch, n, dtype, seed=0):
    """Diagonally dominant systems, (batch, n), the ignored corners zeroed."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (batch, n))
    c = rng.uniform(-1, 1, (batch, n))
    b = (np.abs(a) + np.abs(c) + 1 + rng.uniform(0, 1, (batch, n))) * rng.choice(
        [-1.0, 1.0], (batch, n)
    )
    d = rng.uniform(-1, 1, (batch, n))
    a[:, 0] = 0
    c[:, -1] = 0
    return tuple(np.ascontiguousarray(x, dtype) for x in (a, b, c, d))


def ours(scan=None, axis=0, pivoting=False):
    kw = dict(axis=axis, pivoting=pivoting)
    if scan is not None:
        kw["scan"] = scan
    return lambda a, b, c, d: eqx_seq.tridiagonal_solve(a, b, c, d, **kw)


def over_devices(solve, systems_axis):
    """`solve` with its systems (`systems_axis` of the 2-D inputs) split over the CPU
    devices with `jax.shard_map`: each device solves its share, on its own thread."""
    mesh = Mesh(np.array(jax.devices()), ("systems",))
    spec = P(None, "systems") if systems_axis == 1 else P("systems", None)
    sharded = jax.shard_map(solve, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    return sharded, lambda *xs: tuple(
        jax.device_put(x, NamedSharding(mesh, spec)) for x in xs
    )


def grad_of(solve):
    loss = lambda *args: jnp.sum(solve(*args) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


ANCHOR = "jax.lax.linalg.tridiagonal_solve (gtsv)"
SPLIT = f"eqx_seq Thomas, axis=0, shard_map x{DEVICES} CPU"
SPLIT_LAST = f"eqx_seq Thomas, axis=-1, shard_map x{DEVICES} CPU"
GRAD_SPLIT = f"grad: eqx_seq Thomas, axis=0, shard_map x{DEVICES}"
NUMBA_SIMD = "Numba SIMD across systems, time-major, prange"


def one_thread(fn):
    """`fn` (a parallel Numba kernel) run with Numba limited to one thread."""

    def run(*args):
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return fn(*args)
        finally:
            numba.set_num_threads(threads)

    return run


def run_dtype(dtype, batch, n, repeats, with_pcr):
    last = make_data(batch, n, dtype)  # (batch, n): the seed's layout
    tm = tuple(np.ascontiguousarray(x.T) for x in last)  # (n, batch)
    last_j = tuple(jnp.asarray(x) for x in last)
    tm_j = tuple(jnp.asarray(x) for x in tm)
    thomas, pcr = eqx_seq.SequentialScan(), eqx_seq.AssociativeScan()
    fwd = {
        ANCHOR: ("last", jax.jit(lax_gtsv), last_j),
        "seed: lax.scan with transposes (init fixed)": (
            "last",
            jax.jit(seed_tdma),
            last_j,
        ),
        "eqx_seq Thomas (SequentialScan), axis=-1": (
            "last",
            jax.jit(ours(thomas, axis=-1)),
            last_j,
        ),
        "eqx_seq pivoting=True, axis=-1": (
            "last",
            jax.jit(ours(axis=-1, pivoting=True)),
            last_j,
        ),
        "plain lax.scan Thomas, time-major": ("tm", jax.jit(scan_time_major), tm_j),
        "eqx_seq Thomas (SequentialScan), axis=0": (
            "tm",
            jax.jit(ours(thomas, axis=0)),
            tm_j,
        ),
    }
    slow = []
    if with_pcr:
        fwd["eqx_seq PCR (AssociativeScan), axis=0"] = (
            "tm",
            jax.jit(ours(pcr, axis=0)),
            tm_j,
        )
        slow.append("eqx_seq PCR (AssociativeScan), axis=0")
    fwd["NumPy vectorised loop (issue 2491)"] = ("last", numpy_tdma, last)
    slow.append("NumPy vectorised loop (issue 2491)")
    if numba is not None:
        per_system, time_major = numba_kernels()
        fwd["Numba per system, prange"] = ("last", per_system, last)
        fwd[NUMBA_SIMD] = ("tm", time_major, tm)
        # XLA runs our sweeps on one thread: the same kernel on one thread
        fwd["Numba SIMD across systems, time-major, 1 thread"] = (
            "tm",
            one_thread(time_major),
            tm,
        )
    # CPU only: on an accelerator the mesh would be the one accelerator
    cpu = jax.default_backend() == "cpu"
    split = cpu and batch % DEVICES == 0 and DEVICES > 1
    if split:
        sharded, put = over_devices(ours(thomas, axis=0), systems_axis=1)
        tm_split = put(*tm_j)
        fwd[SPLIT] = ("tm", jax.jit(sharded), tm_split)
        sharded_last, put_last = over_devices(ours(thomas, axis=-1), systems_axis=0)
        fwd[SPLIT_LAST] = ("last", jax.jit(sharded_last), put_last(*last_j))
    programs = {name: (fn, args) for name, (_, fn, args) in fwd.items()}
    grads = {
        "grad: jax.lax.linalg.tridiagonal_solve": (grad_of(lax_gtsv), last_j),
        "grad: eqx_seq Thomas, axis=-1": (grad_of(ours(thomas, axis=-1)), last_j),
        "grad: eqx_seq Thomas, axis=0": (grad_of(ours(thomas, axis=0)), tm_j),
    }
    if split:
        grads[GRAD_SPLIT] = (grad_of(sharded), tm_split)
    programs.update(grads)
    timed = measure_many(programs, repeats=repeats, slow=tuple(slow))

    # accuracy against float64 gtsv on the same (rounded) inputs
    ref = np.asarray(lax_gtsv(*(jnp.asarray(x, jnp.float64) for x in last)))
    scale = np.abs(ref).max()
    rows = []
    anchor = timed[ANCHOR]["median_ms"]
    simd = timed[NUMBA_SIMD]["median_ms"] if NUMBA_SIMD in timed else float("nan")
    floor = stream_floor_ms(tm)
    for name, (layout, fn, args) in fwd.items():
        out = np.asarray(fn(*args))
        out = out.T if layout == "tm" else out
        err = np.abs(out.astype(np.float64) - ref).max() / scale
        t = timed[name]
        rows.append(
            dict(
                name=name,
                layout="(n, batch)" if layout == "tm" else "(batch, n)",
                ms=t["median_ms"],
                ratio=t["median_ms"] / anchor,
                per_numba=t["median_ms"] / simd,
                floor_pct=100 * floor / t["median_ms"],
                first_s=t["first_call_s"],
                relerr=float(err),
            )
        )
    grad_rows = []
    fwd_of = {
        "grad: jax.lax.linalg.tridiagonal_solve": ANCHOR,
        "grad: eqx_seq Thomas, axis=-1": "eqx_seq Thomas (SequentialScan), axis=-1",
        "grad: eqx_seq Thomas, axis=0": "eqx_seq Thomas (SequentialScan), axis=0",
        GRAD_SPLIT: SPLIT,
    }
    anchor_grad = timed["grad: jax.lax.linalg.tridiagonal_solve"]["median_ms"]
    for name in grads:
        t = timed[name]
        grad_rows.append(
            dict(
                name=name,
                ms=t["median_ms"],
                per_fwd=t["median_ms"] / timed[fwd_of[name]]["median_ms"],
                ratio=t["median_ms"] / anchor_grad,
                first_s=t["first_call_s"],
            )
        )
    return dict(forward=rows, gradient=grad_rows, floor_ms=floor)


def accuracy(batch=500, n=100):
    """Relative error per system (max-norm), float32 solves vs float64 gtsv, on three
    kinds of matrices: median and worst over the systems."""
    rng = np.random.default_rng(1)
    cases = {}
    a, b, c, d = make_data(batch, n, np.float64, seed=1)
    cases["diagonally dominant"] = (a, b, c, d)
    cases["random N(0,1), not dominant"] = tuple(
        rng.normal(size=(batch, n)) for _ in range(4)
    )
    tiny = b.copy()
    tiny[:, 0] = 1e-7
    cases["dominant but diag[0] = 1e-7"] = (a, tiny, c, d)
    methods = {
        "Thomas (SequentialScan)": dict(scan=eqx_seq.SequentialScan()),
        "PCR (AssociativeScan)": dict(scan=eqx_seq.AssociativeScan()),
        "pivoting=True (gtsv)": dict(pivoting=True),
    }
    out = {}
    for case, arrays in cases.items():
        ref = np.asarray(lax_gtsv(*map(jnp.asarray, arrays)))
        lo32 = [jnp.asarray(x, jnp.float32) for x in arrays]
        out[case] = {}
        for name, kw in methods.items():
            x = np.asarray(eqx_seq.tridiagonal_solve(*lo32, axis=-1, **kw), np.float64)
            err = np.abs(x - ref).max(-1) / np.abs(ref).max(-1)
            out[case][name] = (float(np.median(err)), float(err.max()))
    return out


# --- the report: printed, and written beside the JSON ------------------------------
THOMAS_TM = "eqx_seq Thomas (SequentialScan), axis=0"


def tables(p):
    """The markdown of a results payload: forward and gradient per dtype, accuracy."""
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


def headline(p):
    parts = []
    for dtype, res in p["runs"].items():
        fwd = {r["name"]: r for r in res["forward"]}
        if THOMAS_TM in fwd:
            parts.append(f"{dtype} {faster([1 / fwd[THOMAS_TM]['ratio']])}")
    return "forward (Thomas, time-major, one device) vs `lax.linalg` (gtsv): " + (
        ", ".join(parts)
    )


REPORTS = {"tridiagonal": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10k systems, smoke test")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pcr", action="store_true", help="skip the slow PCR row")
    parser.add_argument(
        "--json",
        default=results_path("tridiagonal"),
        help="default: results/<machine>/tridiagonal.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    batch, n = (10_000, 100) if args.quick else (100_000, 100)
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
        f"jax {info['jax']}, numba {numba.__version__ if numba else 'not installed'}"
    )
    print(allocator_line(info))
    payload = {"machine": info, "batch": batch, "n": n, "runs": {}}
    for dtype, name in [(np.float32, "float32"), (np.float64, "float64")]:
        print(f"measuring: {name}, {batch} systems of size {n}")
        res = run_dtype(dtype, batch, n, args.repeats, with_pcr=not args.no_pcr)
        payload["runs"][name] = res
    payload["accuracy"] = accuracy()
    save(args.json, payload, REPORTS["tridiagonal"])


if __name__ == "__main__":
    main()
