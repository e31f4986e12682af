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
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _page_layers as layers  # noqa: E402
import _page_solvers as solvers  # noqa: E402
from _page_format import DASH, ms, table  # noqa: E402


# --- the page -----------------------------------------------------------------------
BENCHES = {
    "recurrence": dict(
        title="Diagonal recurrence: Jacobians and gradients",
        what="`linear_recurrence` and `recurrence_jacobians` on both backends against "
        "jax issue 19498's seed (`jax.jacrev` through a plain `lax.associative_scan`) "
        "and plain autodiff through `lax.associative_scan` / `lax.scan`.",
        tables=layers.recurrence_tables,
        summary=layers.recurrence_summary,
        plot=layers.recurrence_plot,
        panels=1,
    ),
    "s5": dict(
        title="S5 layer",
        what="`eqx_seq.S5` (forward, gradient, peak memory, parameter Jacobians) "
        "against S5 as the reference implementation (lindermanlab/S5) writes it, on "
        "the same parameters, differentiated by plain autodiff.",
        tables=layers.s5_tables,
        summary=layers.s5_summary,
        plot=layers.s5_plot,
        panels=1,
    ),
    "embedding": dict(
        title="Embedding lookups",
        what="`eqx_seq.Embedding` under each out-of-range policy against raw "
        "`jnp.take`, `jax.vmap`-ed `eqx.nn.Embedding` and a one-hot matmul.",
        tables=layers.embedding_tables,
        summary=layers.embedding_summary,
    ),
    "selective": dict(
        title="Selective layers",
        what="`selective_scan` against a plain S6 that materialises its states "
        "(the pure-JAX Mamba ports' method), and `RGLRU` against a plain `lax.scan` "
        "RG-LRU (recurrentgemma's way).",
        tables=layers.selective_tables,
        summary=layers.selective_summary,
        plot=layers.selective_plot,
    ),
    "tridiagonal": dict(
        title="Batched tridiagonal solves",
        what="`tridiagonal_solve` against `jax.lax.linalg.tridiagonal_solve` (gtsv), "
        "jax issue 2491's `lax.scan` seed, its NumPy loop and Numba kernels.",
        tables=solvers.tridiagonal_tables,
        summary=solvers.tridiagonal_summary,
        plot=solvers.tridiagonal_plot,
        panels=2,
    ),
    "sequence_parallel": dict(
        title="Sequence parallelism",
        what="One sequence split along time over two CPU devices (`ShardedScan`) "
        "against one device: `linear_recurrence`, an `S5` and a `Mamba` layer, and "
        "the Kalman log-likelihood, forward and gradient, time and memory per "
        "device.",
        tables=layers.sequence_parallel_tables,
        summary=layers.sequence_parallel_summary,
    ),
    "sequence_parallel_scaling": dict(
        title="Sequence parallelism: the exchange on more devices",
        script="bench_sequence_parallel.py --devices 8",
        what="`ShardedScan` on 1, 2, 4 and 8 forced CPU devices, with each "
        "exchange (`all_gather`, `ppermute`).",
        tables=layers.sequence_parallel_scaling_tables,
        summary=layers.sequence_parallel_scaling_summary,
    ),
    "kalman": dict(
        title="Kalman filter",
        what="`KalmanFilter` (filter, gradient of the log-likelihood, smoother, "
        "parallel filter) against dynamax's `lgssm_filter` / `lgssm_smoother`.",
        tables=solvers.kalman_tables,
        summary=solvers.kalman_summary,
        plot=solvers.kalman_plot,
        panels=2,
        can_plot=solvers.kalman_can_plot,
    ),
    "kalman_sqrt": dict(
        title="Kalman filter, square-root form",
        script="bench_kalman_sqrt.py",
        what="float32 against float64 on stiff models (vague prior, precise "
        "observations), and the cost of the square-root form against the covariance "
        "form.",
        tables=solvers.kalman_sqrt_tables,
        summary=solvers.kalman_sqrt_summary,
    ),
    "kalman_extras": dict(
        title="Kalman filter: forecasts and posterior samples",
        script="bench_kalman.py --extras",
        what="`KalmanFilter.forecast` (100 steps) and `posterior_sample` (100 "
        "paths) against our own filter, on both backends; one step of online "
        "filtering.",
        tables=solvers.kalman_extras_tables,
        summary=solvers.kalman_extras_summary,
    ),
    "kalman_em": dict(
        title="Kalman filter: expectation-maximisation",
        script="bench_kalman.py --em",
        what="`KalmanFilter.fit_em` against dynamax's `LinearGaussianSSM.fit_em` "
        "(the same data and start, complete data), and ours with 10% of the entries "
        "missing.",
        tables=solvers.kalman_em_tables,
        summary=solvers.kalman_em_summary,
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
        script = spec.get("script", f"bench_{bench}.py")
        lines += [f"`benchmarks/{script}`: {spec.get('what', '')}".rstrip(), ""]
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
