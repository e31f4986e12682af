"""The test command: `python -m tests [--jobs N] [paths or node ids] [pytest options]`.

Runs every test file (or the files named) in its own pytest process, `--jobs` of
them at a time. One process per file, as lineax runs its tests: a single process
that keeps the compiled programs of the whole suite grows until XLA's compiler
crashes late in the run, and clearing JAX's caches between modules only hid that.
The processes share one on-disk XLA compilation cache (see `conftest.py`), so a
program that several files compile is compiled once.

Each file's output is printed whole when it finishes, then a table of the files'
wall times. The exit code is 0 when every file passed, the largest failing code
otherwise; a file that collects no test (e.g. under `-m slow`) is not a failure,
but a run that collects none at all exits 5, as pytest does.
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time


_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
_TIMES = _ROOT / ".pytest_cache" / "eqx_seq" / "file_times.json"
# Without times from an earlier run (a fresh clone), these start first: they run
# the package end to end and are the longest files, so starting them last would
# leave one job alone at the end.
_LONG_FIRST = (
    "test_examples.py",
    "test_docs.py",
    "test_docs_kalman.py",
    "test_sequence_parallel_kalman.py",
)
_NO_TESTS = 5  # pytest's exit code when nothing was collected


def split_args(args: list[str]) -> tuple[dict[pathlib.Path, list[str]], list[str]]:
    """The files to run, each with the node ids named in it (none: the whole file),
    apart from the options for pytest."""
    files: dict[pathlib.Path, list[str]] = {}
    options = []
    for arg in args:
        path = pathlib.Path(arg.split("::")[0])
        if arg.startswith("-"):
            options.append(arg)
        elif path.is_dir():
            for file in sorted(path.resolve().rglob("test_*.py")):
                files.setdefault(file, [])
        elif path.suffix == ".py" and path.is_file():
            ids = files.setdefault(path.resolve(), [])
            if "::" in arg:
                ids.append(arg)
        else:
            options.append(arg)  # an option's value, e.g. of `-m` or `-k`
    return files, options


def order(files: list[pathlib.Path]) -> list[pathlib.Path]:
    """Longest first (times of the last run where there is one), so the jobs end
    together."""
    try:
        times = json.loads(_TIMES.read_text())
    except (OSError, ValueError):
        times = {}
    rank = {name: -i for i, name in enumerate(reversed(_LONG_FIRST))}
    return sorted(files, key=lambda f: (-times.get(f.name, 0.0), rank.get(f.name, 1)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="files run at once"
    )
    known, rest = parser.parse_known_args(argv)
    if known.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {known.jobs}")
    named, options = split_args(rest)
    if not named:
        named = {file: [] for file in _HERE.glob("test_*.py")}
    files = order(list(named))

    owns_cache = "EQX_SEQ_TESTS_XLA_CACHE" not in os.environ
    if owns_cache:
        os.environ["EQX_SEQ_TESTS_XLA_CACHE"] = tempfile.mkdtemp(
            prefix="eqx_seq-tests-xla-"
        )
    lock = threading.Lock()
    results: dict[pathlib.Path, tuple[int, float, str]] = {}

    def run(file: pathlib.Path) -> None:
        cmd = [sys.executable, "-m", "pytest", *(named[file] or [str(file)]), *options]
        start = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        wall = time.perf_counter() - start
        lines = proc.stdout.rstrip().splitlines()
        with lock:
            results[file] = (proc.returncode, wall, lines[-1] if lines else "")
            print(f"==> {file.relative_to(_ROOT)} ({wall:.0f} s)", flush=True)
            print(proc.stdout, end="" if proc.stdout.endswith("\n") else "\n")
            sys.stdout.flush()

    start = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(known.jobs) as pool:
            for future in [pool.submit(run, f) for f in files]:
                future.result()
    finally:
        if owns_cache:
            shutil.rmtree(os.environ.pop("EQX_SEQ_TESTS_XLA_CACHE"), ignore_errors=True)
    wall = time.perf_counter() - start

    print(f"\n{'file':<42} {'exit':>4} {'wall s':>7}  summary")
    for file, (code, seconds, summary) in sorted(
        results.items(), key=lambda r: -r[1][1]
    ):
        print(f"{file.name:<42} {code:>4} {seconds:>7.0f}  {summary.strip('= ')}")
    print(
        f"{len(results)} files in {wall:.0f} s wall, "
        f"{sum(r[1] for r in results.values()):.0f} s over {known.jobs} jobs"
    )
    _TIMES.parent.mkdir(parents=True, exist_ok=True)
    _TIMES.write_text(json.dumps({f.name: r[1] for f, r in results.items()}))

    return exit_code([code for code, _, _ in results.values()])


def exit_code(codes: list[int]) -> int:
    """The run's exit code from its files': the largest failing one; 0 when every
    file passed or collected nothing, `_NO_TESTS` when none collected a test."""
    failed = [code for code in codes if code not in (0, _NO_TESTS)]
    if failed:
        return max(failed)
    return 0 if 0 in codes else _NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
