import jax
import jax.random as jr
import pytest


# float64 for the references; strict promotion so the package never relies on
# implicit casts (lineax and equinox test the same way).
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# two CPU devices for the `jax.shard_map` tests (test_shard_map.py); programs that
# are not sharded run on the first, as with one
jax.config.update("jax_num_cpu_devices", 2)


@pytest.fixture
def getkey():
    keys = iter(jr.split(jr.key(5678), 10_000))
    return lambda: next(keys)
