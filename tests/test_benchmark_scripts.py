"""The benchmark scripts run end to end at their `--quick` settings (`-m slow`), and
write their tables of stored results without measuring (`--report`)."""

import os
import shutil

import pytest
from helpers import ROOT, run_script


# script -> lines its output must contain
EXPECTED = {
    "recurrence": ["speed-up"],
    "embedding": ["raw jnp.take (anchor)"],
    # the script checks ours against the plain S5 before printing these lines
    "s5": [
        "check: associative forward = plain S5 forward",
        "check: sequential Jacobians = jacrev of the plain S5",
    ],
    "tridiagonal": [
        "jax.lax.linalg.tridiagonal_solve (gtsv)",
        "grad: eqx_seq Thomas, axis=0",
    ],
    "kalman": ["seq filter"],
    # the script checks ours against the plain S6 and RG-LRU before these lines
    "selective": [
        "check: ours, sequential = plain S6",
        "check: ours, associative = plain RG-LRU (lax.scan)",
    ],
    "sequence_parallel": ["linear_recurrence", "Mamba", "Kalman log-likelihood"],
    # the script checks ours against a long-double reference (and dynamax, where
    # installed) before it times anything
    "nonlinear": ["ours vs reference"],
    "ssd": [
        "Mamba2 vs Mamba at equal state",
        "`ssd_scan` against the minimal SSD",
        "one device against the sequence split over two CPU devices",
    ],
    # the script checks ours against the plain scan before timing
    "delta_rule": ["check T=256: |ours - plain lax.scan|"],
    # each program in its own process, the split one on two CPU devices
    "compile": [
        "compile ratio",
        "dynamax `lgssm_filter` gradient",
        "log-likelihood + gradient on 2 devices",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPECTED)
def test_bench_quick(name, tmp_path):
    out = run_script(
        f"benchmarks/bench_{name}.py",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / f"{name}.json"),
        timeout=900,
    )
    for line in EXPECTED[name]:
        assert line in out
    assert (tmp_path / f"{name}.json").exists()
    # the tables it printed, beside the JSON
    assert (tmp_path / f"{name}.md").read_text() in out


def test_report_of_stored_results(tmp_path):
    stored = os.path.join(ROOT, "benchmarks", "results", "h100", "s5")
    shutil.copy(stored + ".json", tmp_path)
    run_script("benchmarks/bench_s5.py", "--report", str(tmp_path / "s5.json"))
    with open(stored + ".md") as f:
        ours = f.read()
    # the same tables; only the path in the first line differs
    assert (tmp_path / "s5.md").read_text().split("\n", 1)[1] == ours.split("\n", 1)[1]
