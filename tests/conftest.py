import os
import shutil
import tempfile


# The suite's time is mostly XLA compiling (hundreds of small programs), and the
# tests check numbers, not speed: so LLVM's optimisation passes are off, and XLA:CPU
# emits its fusions with its older elemental emitters, whose code compiles faster
# than the fusion emitters' (the same HLO, fused the same way: XLA's own
# optimisations still run; see the FAQ on XLA flags). Set before JAX starts its
# backend; flags given by the user are kept.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402


# float64 for the references; strict promotion so the package never relies on
# implicit casts (lineax and equinox test the same way).
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# four CPU devices for the `jax.shard_map` tests: a batch split over two of them
# (test_shard_map.py), one sequence split over four (test_sequence_parallel*.py: two
# rounds of the `ppermute` exchange, a device with blocks before and after it), or
# three (a count that is not a power of two). Programs that are not sharded run on
# the first, as with one. docs/usage/several-devices.md asks for the same count (a
# different one, once JAX has started, is an error).
jax.config.update("jax_num_cpu_devices", 4)


def pytest_configure(config):
    """One XLA compilation cache for the run, on disk, shared by its processes
    (`python -m tests` runs one per test file): a program that several files
    compile is compiled once. Made fresh by the process that starts the run (the
    others inherit its environment), so a run never reads what an earlier one
    wrote, and removed at its end."""
    if _CACHE not in os.environ:
        os.environ[_CACHE] = tempfile.mkdtemp(prefix="eqx_seq-tests-xla-")
        config._owns_jax_cache = True
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if getattr(config, "_owns_jax_cache", False):
        shutil.rmtree(os.environ.pop(_CACHE), ignore_errors=True)


_CACHE = "EQX_SEQ_TESTS_XLA_CACHE"


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(5678), 10_000))
    return lambda: next(keys)


@pytest.fixture
def unchecked_annotations():
    """jaxtyping's runtime checks off for one test: the import hook
    (`--jaxtyping-packages` in pyproject.toml) would reject a bad input with its own
    `TypeCheckError` before the package's own validation runs, and the tests of bad
    input check the messages that users who do not run the hook get. The wrappers
    the hook adds read this flag at each call."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)
