"""The benchmark results are filed by machine, and the docs page is generated from
them: a table for every results file, and the committed page up to date."""

import glob
import importlib.util
import json
import os
import re

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
FILES = sorted(glob.glob(os.path.join(RESULTS, "*", "*.json")))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def load_generator():
    path = os.path.join(ROOT, "benchmarks", "make_docs_page.py")
    spec = importlib.util.spec_from_file_location("make_docs_page", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("docs") / "benchmarks.md"
    return out, load_generator().render(RESULTS, str(out))


def test_results_are_filed_by_machine():
    assert FILES, "no results under benchmarks/results/<machine>/"
    assert not glob.glob(os.path.join(RESULTS, "*.json")), "results outside a machine"
    for path in FILES:
        folder = os.path.basename(os.path.dirname(path))
        with open(path) as f:
            machine = json.load(f)["machine"]
        if machine["platform"] == "cpu":
            assert folder == f"cpu-{machine['cores']}core", path
        else:
            assert not folder.startswith("cpu"), path


def test_page_has_a_table_per_results_file(generated):
    out, text = generated
    sections = text.split("\n### ")[1:]
    assert len(sections) == len(FILES)
    for path in FILES:
        rel = os.path.relpath(path, ROOT)
        (section,) = [s for s in sections if f"From `{rel}`" in s]
        assert re.search(r"^\|:---\|", section, re.MULTILINE), rel
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (out.parent / image).is_file(), image


def test_committed_page_is_up_to_date(generated):
    _, text = generated
    with open(PAGE) as f:
        committed = f.read()
    assert committed == text, (
        "docs/benchmarks.md is stale: run `python benchmarks/make_docs_page.py`"
    )
