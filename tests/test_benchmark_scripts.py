"""The benchmark scripts run end to end at their `--quick` settings (`-m slow`)."""

import pytest
from helpers import run_script


@pytest.mark.slow
def test_bench_recurrence_quick(tmp_path):
    out = run_script(
        "benchmarks/bench_recurrence.py",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert "speed-up" in out and (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_bench_embedding_quick(tmp_path):
    out = run_script(
        "benchmarks/bench_embedding.py",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / "e.json"),
    )
    assert "raw jnp.take (anchor)" in out and (tmp_path / "e.json").exists()


@pytest.mark.slow
def test_bench_s5_quick(tmp_path):
    out = run_script(
        "benchmarks/bench_s5.py",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / "s5.json"),
    )
    # the script checks ours against the plain S5 before printing these lines
    assert "check: associative forward = plain S5 forward" in out
    assert "check: sequential Jacobians = jacrev of the plain S5" in out
    assert (tmp_path / "s5.json").exists()


@pytest.mark.slow
def test_bench_tridiagonal_quick(tmp_path):
    out = run_script(
        "benchmarks/bench_tridiagonal.py",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / "t.json"),
    )
    assert "jax.lax.linalg.tridiagonal_solve (gtsv)" in out
    assert "grad: eqx_seq Thomas, axis=0" in out
    assert (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_bench_kalman_quick(tmp_path):
    out = run_script(
        "benchmarks/bench_kalman.py",
        "--quick",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / "k.json"),
        timeout=900,
    )
    assert "seq filter" in out and (tmp_path / "k.json").exists()
