"""The code in the README and in the docstrings runs as written."""

import inspect
import os
import re
import textwrap

import jax
import pytest

import eqx_seq


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def blocks(text):
    return [textwrap.dedent(b) for b in FENCE.findall(text)]


def run_block(code):
    # documentation is read by people with default settings: no x64, standard promotion
    with (
        jax.enable_x64(False),
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
    ):
        exec(compile(code, "<doc>", "exec"), {})


with open(os.path.join(ROOT, "README.md")) as f:
    README_BLOCKS = blocks(f.read())


def test_readme_has_a_python_quickstart():
    assert len(README_BLOCKS) >= 4, "the README should show every layer in Python"


# one test per block, so that the workers share them
@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_python_blocks(index):
    run_block(README_BLOCKS[index])


PUBLIC = [getattr(eqx_seq, name) for name in dir(eqx_seq) if not name.startswith("_")]
DOCUMENTED = [obj for obj in PUBLIC if callable(obj)]


@pytest.mark.parametrize("obj", DOCUMENTED, ids=lambda o: o.__name__)
def test_public_objects_have_docstrings_and_examples_run(obj):
    doc = inspect.getdoc(obj)
    assert doc and len(doc.splitlines()[0]) > 10, f"{obj.__name__} needs a docstring"
    for code in blocks(textwrap.dedent(doc)):
        run_block(code)
