"""Shared by the tests: finite differences, tree comparison, running a script, the
docs' code blocks."""

import glob
import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def directional_fd(fn, tree, direction, eps: float = 1e-6):
    """Central finite difference of `fn` at `tree` along `direction`:
    `(fn(tree + eps * direction) - fn(tree - eps * direction)) / (2 * eps)`.

    `tree` and `direction` are PyTrees of the same structure (a single array
    included); `fn`'s output may be any PyTree of arrays.
    """
    plus = jax.tree.map(lambda x, d: x + eps * d, tree, direction)
    minus = jax.tree.map(lambda x, d: x - eps * d, tree, direction)
    return jax.tree.map(lambda p, m: (p - m) / (2 * eps), fn(plus), fn(minus))


def directional_derivative(grad, direction):
    """The derivative of a real function along `direction`, from its gradient `grad`.

    JAX's convention for complex inputs: the derivative of `L(z + e v)` in `e` is
    `Re(sum(grad * v))`, without conjugation.
    """
    terms = [
        jnp.real(jnp.sum(g * d))
        for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction), strict=True)
    ]
    return sum(terms[1:], terms[0])


def tree_allclose(x, y, *, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Whether two PyTrees have the same structure and close leaves (as
    `jnp.allclose`, leaf by leaf)."""
    return bool(eqx.tree_equal(x, y, rtol=rtol, atol=atol))


def run_script(path: str, *args: str, timeout: float = 600, env=None) -> str:
    """Run `python path *args` from the repository root on the CPU, importing this
    checkout's `eqx_seq`; assert that it succeeds and return its standard output."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, path, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def recurrence_inputs(T: int, S: tuple, varying: bool):
    """`(a, b, h0, w)` of a diagonal recurrence of `T` steps and state shape `S`,
    float64: a time-varying real decay, or a time-invariant complex one (a rotation
    and decay) with complex inputs; `w` weights the states in a test's loss."""
    k = jr.split(jr.key(0), 5)
    a = jr.uniform(k[0], (T, *S) if varying else S, minval=-0.99, maxval=0.99)
    b = jr.normal(k[1], (T, *S))
    h0 = jr.normal(k[2], S)
    if not varying:
        a = a.astype(jnp.complex128) * jnp.exp(0.4j)
        b = jax.lax.complex(b, jr.normal(k[3], (T, *S)))
        h0 = h0.astype(jnp.complex128) - 0.5j
    return a, b, h0, jr.normal(k[4], (T, *S))


def slow_except(cases, fast: list, ids: list[str] | None = None) -> list:
    """`cases` for `pytest.mark.parametrize`, all but those in `fast` in the slow
    tier (`-m slow`); a tuple case gives one value per argument, as in
    `parametrize`. With `ids` (one per case), `fast` lists ids."""
    cases = list(cases)
    ids = ids or [None] * len(cases)
    return [
        pytest.param(
            *(case if isinstance(case, tuple) else (case,)),
            id=id_,
            marks=[] if (case if id_ is None else id_) in fast else [pytest.mark.slow],
        )
        for case, id_ in zip(cases, ids, strict=True)
    ]


FENCE = re.compile(r"```(?:python|py)\n(.*?)```", re.DOTALL)
# a fenced block that only includes a file (`--8<-- "examples/x.py"`): the example
# scripts, which tests/test_examples.py runs
SNIPPET = re.compile(r'\s*--8<--\s+"[^"]+"\s*')
# every page of docs/, relative to the repository root
PAGES = sorted(
    os.path.relpath(path, ROOT)
    for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)

# their blocks run in test_docs_kalman.py, the other pages' in test_docs.py, so that
# the two files share the run's jobs
KALMAN_PAGES = [
    "docs/api/kalman.md",
    "docs/api/nonlinear.md",
    "docs/usage/kalman.md",
    "docs/usage/nonlinear.md",
    "docs/usage/several-devices.md",
]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def blocks(text: str) -> list[str]:
    """The Python blocks of a Markdown text, dedented."""
    return [textwrap.dedent(b) for b in FENCE.findall(text)]


def block_params(pages: list[str]) -> list:
    """One `pytest.param` per runnable Python block of `pages` (paths relative to the
    repository root), with the id `page-index`."""
    return [
        pytest.param(code, id=f"{page}-{i}")
        for page in pages
        for i, code in enumerate(blocks(read(os.path.join(ROOT, page))))
        if not SNIPPET.fullmatch(code)
    ]


def run_block(code: str) -> None:
    """Run a documentation block as its readers do, with JAX's default settings: no
    x64, standard promotion."""
    with (
        jax.enable_x64(False),
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
    ):
        exec(compile(code, "<doc>", "exec"), {})
