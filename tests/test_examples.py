"""The README's main job and the benchmark scripts run end to end (small settings)."""

import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_recurrence_jacobians_example():
    out = run(
        "examples/recurrence_jacobians.py",
        "--length",
        "64",
        "--state",
        "8",
        "--repeats",
        "1",
    )
    # the script asserts its own checks; these lines show they ran
    assert "check against jax.jacfwd" in out
    assert "recurrence_jacobians.wrt_a[-1]" in out
    assert "seed: jacrev, plain associative_scan" in out


@pytest.mark.slow
def test_bench_recurrence_quick(tmp_path):
    out = run(
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
    out = run(
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
    out = run(
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


def test_train_digits_example(tmp_path):
    out = run(
        "examples/train_digits.py",
        "--epochs",
        "1",
        "--limit",
        "64",
        "--width",
        "8",
        "--depth",
        "1",
        "--state-size",
        "8",
        "--ssm-blocks",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path),
    )
    assert "final test accuracy" in out and "reloaded checkpoint" in out
    assert (tmp_path / "model.eqx").exists()
    assert (tmp_path / "training_curves.png").exists()


@pytest.mark.slow
def test_train_digits_reaches_the_goal(tmp_path):
    out = run("examples/train_digits.py", "--no-progress", "--out", str(tmp_path))
    accuracy = float(out.split("final test accuracy: ")[1].split()[0])
    assert accuracy >= 0.95


def test_train_char_lm_example(tmp_path):
    out = run(
        "examples/train_char_lm.py",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--length",
        "16",
        "--width",
        "8",
        "--depth",
        "1",
        "--state-size",
        "8",
        "--max-bytes",
        "20000",
        "--sample",
        "10",
        "--no-progress",
        "--out",
        str(tmp_path),
    )
    assert "held-out bits per character" in out and "sample (step mode" in out
    assert (tmp_path / "model.eqx").exists() and (tmp_path / "sample.txt").exists()


def test_tridiagonal_smoother_example(tmp_path):
    out = run(
        "examples/tridiagonal_smoother.py",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--length",
        "32",
        "--out",
        str(tmp_path),
    )
    assert "learned kappa" in out and "smoothed error / noisy error" in out
    assert (tmp_path / "layer.eqx").exists() and (tmp_path / "smoothing.png").exists()


def test_kalman_nile_example(tmp_path):
    out = run("examples/kalman_nile.py", "--steps", "300", "--out", str(tmp_path))
    # the classic maximum-likelihood values (Durbin & Koopman 2012, ch. 2)
    eps = float(out.split("sigma2_eps = ")[1].split()[0])
    eta = float(out.split("sigma2_eta = ")[1].split()[0])
    assert abs(eps - 15099) / 15099 < 0.01 and abs(eta - 1469.1) / 1469.1 < 0.01
    assert (tmp_path / "nile.png").exists()
