"""The benchmark results are filed by machine, each with the tables its script makes
of it (`<name>.md` beside `<name>.json`), and the docs page includes every one."""

import glob
import importlib.util
import json
import os
import re

from helpers import ROOT, run_script


RESULTS = os.path.join(ROOT, "benchmarks", "results")
FILES = sorted(glob.glob(os.path.join(RESULTS, "*", "*.json")))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def load(name):
    """A module of benchmarks/ that imports no bench script (those set JAX options)."""
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def payloads():
    for path in FILES:
        with open(path) as f:
            yield path, json.load(f)


def test_results_are_filed_by_machine():
    assert FILES, "no results under benchmarks/results/<machine>/"
    assert not glob.glob(os.path.join(RESULTS, "*.json")), "results outside a machine"
    slug = load("_timing").machine_slug
    cpus = {}
    for path, payload in payloads():
        folder = os.path.basename(os.path.dirname(path))
        machine = payload["machine"]
        if machine["platform"] == "cpu" or "device_kind" in machine:
            assert folder == slug(machine), path
        else:  # an accelerator's run from before the JSON recorded its kind
            assert not folder.endswith("core"), path
        if machine["platform"] == "cpu":
            cpus.setdefault(folder, set()).add((machine["cpu"], machine["cores"]))
    assert all(len(models) == 1 for models in cpus.values()), cpus


# in a subprocess: the bench scripts set JAX options (x64, CPU devices) on import
RENDER = """
import glob, importlib, json, os, sys
sys.path.insert(0, "benchmarks")
import _timing
reports = {}
for script in sorted(glob.glob("benchmarks/bench_*.py")):
    reports.update(importlib.import_module(os.path.basename(script)[:-3]).REPORTS)
out = {}
for path in sorted(glob.glob("benchmarks/results/*/*.json")):
    with open(path) as f:
        payload = json.load(f)
    name = os.path.basename(path)[: -len(".json")]
    out[os.path.abspath(path)] = _timing.markdown(path, payload, reports[name])
print(json.dumps(out))
"""


def test_tables_are_the_scripts_formatters():
    rendered = json.loads(run_script("-c", RENDER).strip().splitlines()[-1])
    assert sorted(rendered) == FILES
    for path, text in rendered.items():
        md = path[: -len(".json")] + ".md"
        assert os.path.isfile(md), f"no tables beside {path}"
        with open(md) as f:
            assert f.read() == text, (
                f"{md} is stale: run the script with `--report {path}`"
            )
    stray = set(glob.glob(os.path.join(RESULTS, "*", "*.md")))
    assert stray == {p[: -len(".json")] + ".md" for p in FILES}, "a .md without JSON"


def test_page_includes_every_table_and_plot():
    with open(PAGE) as f:
        page = f.read()
    included = re.findall(r'^--8<-- "([^"]+)"$', page, re.MULTILINE)
    tables = [os.path.relpath(p[: -len(".json")] + ".md", ROOT) for p in FILES]
    assert sorted(included) == sorted(tables)
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    for image in images:
        assert os.path.isfile(os.path.join(ROOT, "docs", image)), image
    plots = load("plots").PLOTS
    for path, payload in payloads():
        name = os.path.basename(path)[: -len(".json")]
        if name in plots and plots[name][2](payload):
            machine = os.path.basename(os.path.dirname(path))
            assert f"benchmarks/{name}-{machine}.png" in images, path
