"""The test command's runner (`python -m tests`, tests/__main__.py): how it reads
its arguments, orders the files and sums their exit codes. Nothing is run."""

import importlib.util
import pathlib

import pytest


HERE = pathlib.Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("tests_main", HERE / "__main__.py")
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)


def test_arguments_are_files_node_ids_and_options():
    files, options = runner.split_args(
        [
            "tests/test_ssd.py::test_a",
            "-k",
            "reset",
            "tests/test_ssd.py::test_b",
            "-m",
            "slow",
            "tests/test_layers.py",
            "--durations=0",
        ]
    )
    assert files == {
        HERE / "test_ssd.py": [
            "tests/test_ssd.py::test_a",
            "tests/test_ssd.py::test_b",
        ],
        HERE / "test_layers.py": [],
    }
    assert options == ["-k", "reset", "-m", "slow", "--durations=0"]
    everything, _ = runner.split_args(["tests"])
    assert set(everything) == set(HERE.glob("test_*.py"))


def test_long_files_start_first_without_earlier_times(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "_TIMES", tmp_path / "none.json")
    files = sorted(HERE.glob("test_*.py"))
    ordered = runner.order(files)
    assert [f.name for f in ordered[: len(runner._LONG_FIRST)]] == list(
        runner._LONG_FIRST
    )
    assert sorted(ordered) == files


@pytest.mark.parametrize(
    "codes, expected",
    [
        ([0, 0], 0),
        ([0, 5], 0),  # a file without tests (e.g. under -m slow) is not a failure
        ([5, 5], 5),  # a run without any test is
        ([0, 1, 5], 1),
        ([2, 1], 2),
    ],
)
def test_exit_code(codes, expected):
    assert runner.exit_code(codes) == expected
