"""The example scripts run end to end (small settings)."""

import glob
import os
import re

import pytest
from helpers import ROOT, run_script, slow_except


def test_recurrence_jacobians_example():
    out = run_script(
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


def test_train_digits_example(tmp_path):
    out = run_script(
        "examples/train_digits.py",
        "--epochs",
        "1",
        "--limit",
        "64",
        "--out",
        str(tmp_path),
    )
    assert "final test accuracy" in out and "reloaded checkpoint" in out
    assert (tmp_path / "model.eqx").exists()
    assert (tmp_path / "training_curves.png").exists()


@pytest.mark.slow
def test_train_digits_reaches_the_goal(tmp_path):
    out = run_script("examples/train_digits.py", "--out", str(tmp_path))
    accuracy = float(out.split("final test accuracy: ")[1].split()[0])
    assert accuracy >= 0.95


def test_train_mnist1d_example(tmp_path):
    out = run_script(
        "examples/train_mnist1d.py",
        "--mixers",
        "s5",
        "--epochs",
        "1",
        "--validation",
        "64",
        "--out",
        str(tmp_path),
    )
    assert "s5     epoch   1" in out and "val acc" in out
    # the table: our row beside the published ones
    assert "s5 (ours)" in out and "CNN (published)" in out and "best mixer: s5" in out
    assert (tmp_path / "s5.eqx").exists() and (tmp_path / "mnist1d_curves.png").exists()


@pytest.mark.slow
def test_train_mnist1d_reaches_the_goal(tmp_path):
    out = run_script(
        "examples/train_mnist1d.py",
        "--out",
        str(tmp_path),
        timeout=3600,
    )
    accuracy = float(out.split("best mixer: ")[1].split("test accuracy ")[1].split()[0])
    assert accuracy >= 0.96


def test_train_char_lm_example(tmp_path):
    out = run_script(
        "examples/train_char_lm.py",
        "--steps",
        "2",
        "--max-bytes",
        "20000",
        "--out",
        str(tmp_path),
    )
    assert "held-out bits per character" in out and "sample (step mode" in out
    assert (tmp_path / "model.eqx").exists() and (tmp_path / "sample.txt").exists()


def test_tridiagonal_smoother_example(tmp_path):
    out = run_script(
        "examples/tridiagonal_smoother.py",
        "--steps",
        "3",
        "--out",
        str(tmp_path),
    )
    assert "learned kappa" in out and "smoothed error / noisy error" in out
    assert (tmp_path / "layer.eqx").exists() and (tmp_path / "smoothing.png").exists()


def test_kalman_nile_example(tmp_path):
    out = run_script(
        "examples/kalman_nile.py", "--steps", "300", "--out", str(tmp_path)
    )
    # the classic maximum-likelihood values (Durbin & Koopman 2012, ch. 2)
    eps = float(out.split("sigma2_eps = ")[1].split()[0])
    eta = float(out.split("sigma2_eta = ")[1].split()[0])
    assert abs(eps - 15099) / 15099 < 0.01 and abs(eta - 1469.1) / 1469.1 < 0.01
    assert (tmp_path / "nile.png").exists()


def test_kalman_pendulum_example(tmp_path):
    # the extended estimators only: the iterated smoother's compilation is most of it
    out = run_script(
        "examples/kalman_pendulum.py",
        *("--steps", "100", "--runs", "2", "--fit-steps", "30"),
        *("--methods", "extended", "--fit-method", "extended", "--out", str(tmp_path)),
    )
    rows = [row.split("|")[1:-1] for row in out.splitlines() if row.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows]
    names = [row[0] for row in rows]
    for name in ("EKF", "ERTSS", "IEKS"):
        assert names.count(name) == 2  # all observations, and with a gap
    assert all(row[-1] == "2/2" for row in rows if row[0] == "IEKS")  # converged
    rmse = {}
    for row in rows:
        rmse.setdefault(row[0], row[2])  # the first table's: all observations
    ekf, ertss, ieks = (float(rmse[name]) for name in ("EKF", "ERTSS", "IEKS"))
    assert ieks < ekf and ertss < ekf < 0.3
    g = float(out.split("over the 2 runs: g = ")[1].split()[0])
    assert 8 < g < 11.5  # from g = 5 towards the true 9.81
    assert (tmp_path / "kalman_pendulum.png").exists()


def test_kalman_irregular_example(tmp_path):
    out = run_script(
        "examples/kalman_irregular.py",
        "--steps",
        "3",
        "--num-obs",
        "40",
        "--out",
        str(tmp_path),
    )
    assert "negative log-likelihood" in out and "fitted: omega = " in out
    assert (tmp_path / "kalman_irregular.png").exists()


# one mixer in the fast tier (each compiles its own training step); every mixer's
# row in the slow tier
@pytest.mark.parametrize(
    "mixers", ["mamba", pytest.param("mamba,mamba2,s5", marks=pytest.mark.slow)]
)
def test_selective_copying_example(tmp_path, mixers):
    out = run_script(
        "examples/selective_copying.py",
        "--mixers",
        mixers,
        "--length",
        "20",
        "--eval-lengths",
        "24",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    )
    for mixer in mixers.split(","):
        assert f"| {mixer} | 20 | 20 |" in out
    assert "| mamba | 20 | 24 |" in out
    assert "| paper: Mamba | 4096 | 4096 | 0.998 |" in out
    assert (tmp_path / "selective_copying.png").exists()


def test_selective_copying_rejects_bad_settings(tmp_path):
    for bad in (["--mixers", "gru"], ["--length", "8"]):
        with pytest.raises(AssertionError, match="error"):
            run_script("examples/selective_copying.py", *bad, "--out", str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a training of several minutes, longer on a loaded CPU
def test_selective_copying_mamba_reaches_the_goal(tmp_path):
    out = run_script(
        "examples/selective_copying.py",
        "--mixers",
        "mamba",
        "--out",
        str(tmp_path),
        timeout=3600,
    )
    row = next(line for line in out.splitlines() if line.startswith("| mamba |"))
    assert float(row.split("|")[4]) >= 0.99


# Mamba-2 in the fast tier (Mamba's branch: the slow test below); Gated DeltaNet's
# in the slow tier
@pytest.mark.parametrize(
    "mixer", slow_except(["mamba2", "gated_deltanet"], fast=["mamba2"])
)
def test_parity_example(tmp_path, mixer):
    out = run_script(
        "examples/parity.py",
        "--mixers",
        mixer,
        "--length",
        "8",
        "--eval-lengths",
        "12",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    )
    kind = "eigenvalues" if mixer == "gated_deltanet" else "decays"
    for range_ in ("[0, 1]", "(-1, 1)"):
        assert f"| {mixer}, {kind} {range_} |" in out
    assert "| paper: Mamba, decays [-1, 1] | perfect (1.0)" in out
    assert (tmp_path / "parity.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_parity_negative_decays_reach_the_goal(tmp_path):
    """At 256 bits, trained on 40: Mamba with decays in (-1, 1) near perfect, with
    decays in [0, 1] near chance."""
    out = run_script(
        "examples/parity.py", "--mixers", "mamba", "--out", str(tmp_path), timeout=3600
    )
    rows = {
        line.split("|")[1].strip(): float(line.split("|")[-3])
        for line in out.splitlines()
        if line.startswith("| mamba, decays")
    }
    assert rows["mamba, decays (-1, 1)"] >= 0.9
    assert rows["mamba, decays [0, 1]"] <= 0.75


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_parity_negative_eigenvalues_reach_the_goal(tmp_path):
    """At 256 bits, trained on 40 (issue 42's goal): Gated DeltaNet with
    `negative_eigenvalues=True` at least 0.99, without at most 0.75."""
    out = run_script(
        "examples/parity.py",
        "--mixers",
        "gated_deltanet",
        "--out",
        str(tmp_path),
        timeout=3600,
    )
    rows = {
        line.split("|")[1].strip(): float(line.split("|")[-3])
        for line in out.splitlines()
        if line.startswith("| gated_deltanet, eigenvalues")
    }
    assert rows["gated_deltanet, eigenvalues (-1, 1)"] >= 0.99
    assert rows["gated_deltanet, eigenvalues [0, 1]"] <= 0.75


# one mixer at the default slices in the fast tier (Mamba-2's training runs in
# test_parity_example); in the slow tier the equal-state pair and S5 at the slices of
# the docs' Gated DeltaNet table
@pytest.mark.parametrize(
    "mixers, slices",
    slow_except(
        [("s5", None), ("mamba2,gated_deltanet,s5", "128:8,256:16")],
        fast=["s5"],
        ids=["s5", "equal-state"],
    ),
)
def test_mqar_example(tmp_path, mixers, slices):
    out = run_script(
        "examples/mqar.py",
        "--mixers",
        mixers,
        # the equal-state pair as the docs' last three-seed runs start them
        *(["--slices", slices, "--decay-init", "stratified"] if slices else []),
        "--learning-rates",
        "1e-2",  # each rate compiles its own training step
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    )
    names = mixers.split(",")
    rows = [
        line
        for line in out.splitlines()
        if line.startswith(tuple(f"| {name} |" for name in names))
    ]
    assert len(rows) == len(names)
    # each row: the best rate's accuracy per slice, and the sweep
    lengths = [s.split(":")[0] for s in (slices or "64:4,128:8").split(",")]
    for row in rows:
        assert row.count("(rate ") == len(lengths)
        assert all(f"T={n}: " in row for n in lengths)
    assert (tmp_path / "mqar.png").exists()


def test_mqar_rejects_bad_settings(tmp_path):
    for bad in (
        ["--mixers", "gru"],
        ["--learning-rates", "-1"],
        ["--slices", "64:40"],  # more pairs than the sequence holds
        ["--seed", "-1"],
        ["--decay-init", "uniform"],
    ):
        with pytest.raises(AssertionError, match="error"):
            run_script("examples/mqar.py", *bad, "--out", str(tmp_path))


@pytest.mark.parametrize(
    "script", sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
)
def test_docs_page_shows_the_whole_script(script):
    """The script is the page's single source: every line after its docstring lies in
    a snippet section, and the page includes every section, in the script's order."""
    name = os.path.basename(script)
    with open(script, encoding="utf-8") as f:
        text = f.read()
    body = text[text.index('"""', 3) + 3 :]  # after the module docstring
    sections = re.findall(r"^# --8<-- \[start:(\w+)\]$", body, re.MULTILINE)
    outside = re.sub(
        r"^# --8<-- \[start:(\w+)\]$.*?^# --8<-- \[end:\1\]$",
        "",
        body,
        flags=re.MULTILINE | re.DOTALL,
    )
    assert sections and not outside.strip(), f"{name}: code outside the sections"
    page = os.path.join(ROOT, "docs", "examples", name.replace(".py", ".md"))
    with open(page, encoding="utf-8") as f:
        included = re.findall(rf'--8<-- "examples/{re.escape(name)}:(\w+)"', f.read())
    assert included == sections
