import os


# The suite's time is mostly XLA compiling (hundreds of small programs), a large
# part of it LLVM's optimisation passes on CPU, and the tests check numbers, not
# speed: so those passes are off. XLA's own (HLO) optimisations, fusion included,
# still run. Set before JAX starts its backend; flags given by the user are kept.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
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


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(5678), 10_000))
    return lambda: next(keys)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: a worker that keeps
    every program of the suite's modules crashed (a segfault inside XLA's
    compiler, at a large program late in the run)."""
    yield
    jax.clear_caches()
