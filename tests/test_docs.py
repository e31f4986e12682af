"""The documentation: the site builds, every public name has an API entry, and the
code in the README, in the docs pages and in the docstrings runs as written."""

import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest
from helpers import block_params, blocks, KALMAN_PAGES, PAGES, read, ROOT, run_block

import eqx_seq


DOCS = os.path.join(ROOT, "docs")
# the Kalman pages' blocks run in test_docs_kalman.py
CODE = block_params(["README.md", *(p for p in PAGES if p not in KALMAN_PAGES)])


# one test per block
@pytest.mark.parametrize("code", CODE)
def test_python_blocks(code):
    run_block(code)


def test_readme_has_a_python_example():
    assert blocks(read(os.path.join(ROOT, "README.md"))), "the README needs an example"


PUBLIC = {
    name: getattr(eqx_seq, name)
    for name in dir(eqx_seq)
    if not name.startswith("_")
    and not isinstance(getattr(eqx_seq, name), types.ModuleType)
}


def test_docs_show_every_public_name_in_python():
    """What the README once showed layer by layer, the docs pages now show: every
    public name is used in a Python block that the tests above run."""
    code = "".join(b for page in PAGES for b in blocks(read(os.path.join(ROOT, page))))
    missing = [name for name in PUBLIC if f"eqx_seq.{name}" not in code]
    assert not missing, f"no Python block in docs/ uses {missing}"


DOCUMENTED = [obj for obj in PUBLIC.values() if callable(obj)]


@pytest.mark.parametrize("obj", DOCUMENTED, ids=lambda o: o.__name__)
def test_public_objects_have_docstrings_and_examples_run(obj):
    doc = inspect.getdoc(obj)
    assert doc and len(doc.splitlines()[0]) > 10, f"{obj.__name__} needs a docstring"
    for code in blocks(textwrap.dedent(doc)):
        run_block(code)


# `::: eqx_seq.Name` and the `members:` list below it, in docs/api/*.md
DIRECTIVE = re.compile(
    r"^(?P<indent> *):::\s*(?P<path>eqx_seq(?:\.\w+)*)\s*\n"
    r"(?:(?P=indent) +options:\s*\n(?:(?P=indent) +members:\s*\n"
    r"(?P<members>(?:(?P=indent) +- \w+\s*\n)*))?)?",
    re.MULTILINE,
)


def api_entries():
    """`{path: [members]}` for every `::: path` of the API pages."""
    entries = {}
    for path in glob.glob(os.path.join(DOCS, "api", "*.md")):
        for m in DIRECTIVE.finditer(read(path)):
            members = re.findall(r"- (\w+)", m["members"] or "")
            entries.setdefault(m["path"], []).extend(members)
    return entries


def test_every_public_name_has_an_api_entry():
    entries = api_entries()
    listed = set(entries) | {
        f"{path}.{member}" for path, members in entries.items() for member in members
    }
    missing = [name for name in PUBLIC if f"eqx_seq.{name}" not in listed]
    assert not missing, f"no `::: eqx_seq.Name` in docs/api/ for {missing}"


def test_api_entries_exist():
    """Every documented path and member is real (mkdocstrings skips an unknown
    member silently)."""
    for path, members in api_entries().items():
        obj = eqx_seq
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        for member in members:
            assert hasattr(obj, member), f"{path} has no member {member}"


def test_docs_site_builds(tmp_path):
    """`mkdocs build --strict`: a broken cross-reference, link or anchor, an unknown
    object or a page missing from the nav fails it."""
    # the `test` extra installs the site's packages: missing, the test fails
    for module in ("mkdocs", "material", "mkdocstrings_handlers"):
        assert importlib.util.find_spec(module) is not None, (
            f"`{module}` is not installed: pip install -e '.[test]'"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        "NO_MKDOCS_2_WARNING": "1",  # mkdocs-material's banner about its successor
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert os.path.exists(tmp_path / "api" / "kalman" / "index.html")
