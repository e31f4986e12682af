"""The docs' plots of the sweeps over T, from the results' JSON (matplotlib).

Writes `docs/benchmarks/<name>-<machine>.png` for every results file of a sweep:
recurrence, S5, selective scan, and Kalman (where it ran more than one T). The
tables are each script's own (`results/<machine>/<name>.md`); `docs/benchmarks.md`
includes them.

    python benchmarks/plots.py                 # every sweep
    python benchmarks/plots.py recurrence s5   # those only
"""

import argparse
import glob
import json
import os


HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "docs", "benchmarks")


def _ms(ax, title):
    ax.set_xlabel("T")
    ax.set_ylabel("ms (median)")
    ax.set_title(title)


def recurrence(p, axes):
    seed = "seed: jacrev h_T wrt a, plain assoc"
    series = {
        "seed (jacrev, plain assoc.)": seed,
        "plain assoc. grad": "plain assoc: grad loss wrt (a, b)",
    }
    for b in ("sequential", "associative"):
        series[f"{b}: grad"] = f"{b}: grad loss wrt (a, b, h0)"
        series[f"{b}: .wrt_a"] = f"{b}: recurrence_jacobians .wrt_a"
    Ts = sorted(p["runs"], key=int)
    for label, key in series.items():
        y = [p["runs"][T][key]["median_ms"] for T in Ts]
        axes[0].loglog([int(T) for T in Ts], y, "o-", label=label)
    _ms(axes[0], "Recurrence: Jacobians and gradients over T")


def _grad_and_forward(ax, runs, kinds, title):
    """Per kind, the gradient (solid) and the forward pass (dashed); runs not
    made (a median of None) left out."""
    for k in kinds:
        color = None
        for what, style, alpha in (("grad", "o-", 1.0), ("forward", "o--", 0.6)):
            pts = [(int(T), r[f"{k}: {what}"]["median_ms"]) for T, r in runs.items()]
            pts = [(x, y) for x, y in pts if y is not None]
            label = {"label": k} if what == "grad" else {}
            (line,) = ax.loglog(*zip(*pts), style, color=color, alpha=alpha, **label)
            color = line.get_color()
    _ms(ax, f"{title}: gradient (solid) and forward (dashed)")


def s5(p, axes):
    kinds = ("plain S5", "sequential", "associative")
    _grad_and_forward(axes[0], p["runs"], kinds, "S5")


def selective(p, axes):
    kinds = ("plain S6", "ours, sequential", "ours, associative")
    _grad_and_forward(axes[0], p["s6"]["runs"], kinds, "Selective scan")


def _kalman_sizes(p):
    sizes = {}
    for key, run in p["runs"].items():
        n, obs, T = key.split("/")
        sizes.setdefault(f"{n}/{obs}", []).append((int(T), run["seq"]))
    return sizes


def kalman(p, axes):
    tasks = ("seq filter", "seq grad", "seq smoother", "seq filter (exact)")
    for ax, (size, runs) in zip(axes, _kalman_sizes(p).items()):
        for colour, task in enumerate(tasks):
            for who, style in (("ours", "o-"), ("dynamax", "s--")):
                key = f"{who}: {task}"
                if all(key in seq for _, seq in runs):
                    y = [seq[key]["median_ms"] for _, seq in runs]
                    x = [T for T, _ in runs]
                    ax.loglog(x, y, style, color=f"C{colour}", label=key)
        ax.set_xlabel("T")
        ax.set_title(f"Kalman, state/obs {size}")
    axes[0].set_ylabel("ms (median)")


# name -> (plot, panels, whether a payload has a sweep to plot)
PLOTS = {
    "recurrence": (recurrence, 1, lambda p: len(p["runs"]) > 1),
    "s5": (s5, 1, lambda p: len(p["runs"]) > 1),
    "selective": (selective, 1, lambda p: len(p["s6"]["runs"]) > 1),
    "kalman": (
        kalman,
        2,
        lambda p: min(len(r) for r in _kalman_sizes(p).values()) > 1,
    ),
}


def plot(name, payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draw, panels, _ = PLOTS[name]
    fig, axes = plt.subplots(
        1, panels, figsize=(6 * panels if panels > 1 else 7, 4.5), squeeze=False
    )
    axes = list(axes[0])
    draw(payload, axes)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    if axes[0].get_legend_handles_labels()[1]:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", default=list(PLOTS))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    for name in args.names:
        for path in sorted(glob.glob(os.path.join(args.results, "*", f"{name}.json"))):
            with open(path) as f:
                payload = json.load(f)
            if not PLOTS[name][2](payload):
                continue
            machine = os.path.basename(os.path.dirname(path))
            png = os.path.join(args.out, f"{name}-{machine}.png")
            plot(name, payload, png)
            print(f"wrote {png}")


if __name__ == "__main__":
    main()
