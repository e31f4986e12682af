"""The benchmark scripts run end to end at their `--quick` settings (`-m slow`)."""

import pytest
from helpers import run_script


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
