"""Every layer under `jax.shard_map` (data parallel over two CPU devices, with
shard_map's default `check_vma=True`): the same values and gradients as without.

On two of the CPU devices that `conftest.py` asks for. Parameters are shared by
the devices (`P()`); the data is split along its batch axis. Gradients are taken
outside the `shard_map`, so a shared parameter's gradient is summed over the
devices by JAX.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


pytestmark = pytest.mark.skipif(
    jax.device_count() < 2, reason="needs two devices (conftest.py asks for them)"
)

SCANS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("batch",))


def _loss(out) -> jax.Array:
    # NaN outputs (Embedding's "fill") contribute nothing
    return sum(jnp.sum(jnp.abs(jnp.nan_to_num(x)) ** 2) for x in jax.tree.leaves(out))


def check_sharded(
    fn, params, data, *, data_spec=P("batch"), rtol=1e-9, wrt_data=True, grad=True
):
    """`fn(params, *data)` with the data split over two devices equals `fn` on one,
    and (with `grad`) so do the gradients of a sum of squares w.r.t. `params` (and
    `data`, with `wrt_data`). Non-finite values must agree (NaN fills)."""
    sharded = jax.shard_map(
        fn,
        mesh=_mesh(),
        in_specs=(P(),) + (data_spec,) * len(data),
        out_specs=data_spec,
    )
    argnums = tuple(range(1 + len(data))) if wrt_data else 0
    results = []
    for f in (fn, sharded):
        if grad:  # values and gradients from one program: half the compiling
            loss = lambda *a, f=f: (lambda out: (_loss(out), out))(f(*a))
            value_and_grad = jax.value_and_grad(loss, argnums=argnums, has_aux=True)
            (_, value), grads = jax.jit(value_and_grad)(params, *data)
            results.append((value, grads))
        else:
            results.append(jax.jit(f)(params, *data))
    want, got = (jax.tree.leaves(r) for r in results)
    assert len(want) == len(got) > 0
    for w, g in zip(want, got):
        assert jnp.any(jnp.isfinite(w))
        scale = jnp.max(jnp.abs(jnp.where(jnp.isfinite(w), w, 0)))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def check_layer(layer, data, **kwargs):
    """`jax.vmap(layer)` over the batch, the layer's arrays shared."""
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    fn = lambda p, *d: jax.vmap(eqx.combine(p, static))(*d)
    check_sharded(fn, params, data, **kwargs)


# slow tier: a shared decay on the associative backend and per-sequence decays on
# the sequential one; each backend and each kind of decay runs once in the fast tier
@pytest.mark.parametrize(
    "shared_decay,scan",
    [
        pytest.param(True, SCANS["sequential"], id="shared-a-sequential"),
        pytest.param(
            True, SCANS["associative"], id="shared-a-associative",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            False, SCANS["sequential"], id="per-seq-a-sequential",
            marks=pytest.mark.slow,
        ),
        pytest.param(False, SCANS["associative"], id="per-seq-a-associative"),
    ],
)  # fmt: skip
def test_linear_recurrence(scan, shared_decay, getkey):
    b = jr.normal(getkey(), (4, 16, 3))
    h0 = jr.normal(getkey(), (4, 3))
    a = jr.uniform(
        getkey(), (3,) if shared_decay else (4, 16, 3), minval=0.5, maxval=0.9
    )
    if shared_decay:
        fn = lambda a, b, h0: jax.vmap(
            lambda b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan)
        )(b, h0)
        check_sharded(fn, a, (b, h0))
    else:
        fn = lambda _, a, b, h0: jax.vmap(
            lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan)
        )(a, b, h0)
        check_sharded(fn, jnp.zeros(()), (a, b, h0))


# slow tier: the associative solve; the backends are covered by test_linear_
# recurrence, and the solve's own run-time check under the split by the sequential row
@pytest.mark.parametrize(
    "method",
    ["sequential", pytest.param("associative", marks=pytest.mark.slow), "pivoting"],
    ids=str,
)
def test_tridiagonal_solve(method, getkey):
    # time-major (n, systems): the systems are split over the devices
    n, systems = 9, 6
    scan = SCANS["sequential" if method == "pivoting" else method]
    kw = dict(scan=scan, pivoting=method == "pivoting")
    lower, upper = (jr.uniform(getkey(), (n, systems), minval=-1) for _ in range(2))
    diag = 3 + jr.uniform(getkey(), (n, systems))
    rhs = jr.normal(getkey(), (n, systems))
    spec = P(None, "batch")
    # diagonals per system (split like the right-hand sides)
    fn = lambda _, l, d, u, r: eqx_seq.tridiagonal_solve(l, d, u, r, **kw)
    check_sharded(fn, jnp.zeros(()), (lower, diag, upper, rhs), data_spec=spec)
    # diagonals shared by all systems (broadcast along the system axis)
    shared = (lower[:, :1], diag[:, :1], upper[:, :1])
    fn = lambda ldu, r: eqx_seq.tridiagonal_solve(*ldu, r, **kw)
    check_sharded(fn, shared, (rhs,), data_spec=spec)
    if method == "sequential":
        # the run-time check raises for a system that only the second device has
        fn = lambda _, l, d, u, r: eqx_seq.tridiagonal_solve(l, d, u, r, check=True)
        sharded = jax.shard_map(
            fn, mesh=_mesh(), in_specs=(P(),) + (spec,) * 4, out_specs=spec
        )
        args = (lower, diag.at[4, 5].set(0.1), upper, rhs)
        with pytest.raises(Exception, match="not diagonally dominant"):
            jax.block_until_ready(eqx.filter_jit(sharded)(jnp.zeros(()), *args))


# slow tier: the layers that a fast row runs inside a block (S5 in S5Block, Mamba in
# MambaBlock), the LRU (S5's diagonal recurrence, its own coefficients), the
# bidirectional S5 (its reverse scan is the recurrence's) and HawkBlock (the RG-LRU
# row, with a convolution as MambaBlock's)
@pytest.mark.parametrize(
    "kind, scan",
    [
        pytest.param("S5", SCANS["sequential"], marks=pytest.mark.slow),
        pytest.param("S5-bidirectional", SCANS["associative"], marks=pytest.mark.slow),
        pytest.param("LRU", SCANS["associative"], marks=pytest.mark.slow),
        ("S5Block", SCANS["sequential"]),
        pytest.param("Mamba", SCANS["sequential"], marks=pytest.mark.slow),
        ("MambaBlock", SCANS["associative"]),
        ("RGLRU", SCANS["associative"]),
        pytest.param("HawkBlock", SCANS["sequential"], marks=pytest.mark.slow),
    ],
    ids=[
        "S5-sequential",
        "S5-bidirectional-associative",
        "LRU-associative",
        "S5Block-sequential",
        "Mamba-sequential",
        "MambaBlock-associative",
        "RGLRU-associative",
        "HawkBlock-sequential",
    ],
)
def test_ssm_layers(kind, scan, getkey):
    # the backends are covered by test_linear_recurrence; here the layers'
    # own arithmetic (discretisation, projections, norms) around them
    if kind == "LRU":
        layer = eqx_seq.LRU(5, 8, scan=scan, key=getkey())
    elif kind == "RGLRU":
        layer = eqx_seq.RGLRU(6, num_heads=2, scan=scan, key=getkey())
    elif kind == "HawkBlock":
        layer = eqx_seq.HawkBlock(5, lru_width=6, num_heads=2, scan=scan, key=getkey())
    elif kind.startswith("Mamba"):
        layer = eqx_seq.Mamba(5, state_size=4, chunk_size=5, scan=scan, key=getkey())
        if kind == "MambaBlock":
            layer = eqx_seq.MambaBlock(layer)
    else:
        bi = kind == "S5-bidirectional"
        layer = eqx_seq.S5(5, 8, bidirectional=bi, scan=scan, key=getkey())
        if kind == "S5Block":
            layer = eqx_seq.S5Block(layer, key=getkey())
    size = 6 if kind == "RGLRU" else 5
    check_layer(layer, (jr.normal(getkey(), (4, 12, size)),))


def test_s5_jacobians_and_streaming(getkey):
    layer = eqx_seq.S5(5, 8, key=getkey())
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def fn(params, u):
        layer = eqx.combine(params, static)
        jac = jax.vmap(layer.parameter_jacobians)(u)
        return jac.wrt_B, jac.wrt["log_step"], jax.vmap(layer.final_state)(u)

    check_sharded(fn, params, (jr.normal(getkey(), (4, 12, 5)),), grad=False)


# slow tier: the sequential backend, whose tridiagonal solve under `jax.shard_map` is
# checked by test_tridiagonal_solve[sequential]
@pytest.mark.parametrize(
    "scan",
    [
        pytest.param(SCANS["sequential"], marks=pytest.mark.slow),
        SCANS["associative"],
    ],
    ids=SCANS.keys(),
)
def test_tridiagonal_implicit(scan, getkey):
    layer = eqx_seq.TridiagonalImplicit(3, scan=scan, key=getkey())
    check_layer(layer, (jr.normal(getkey(), (4, 10, 3)),))


@pytest.mark.parametrize(
    "scan",
    [
        # slow tier: the Kalman filter, smoother and log-likelihood gradient inside
        # `jax.shard_map` are checked by test_sequence_parallel_kalman.py's
        # test_filter_smoother_and_gradient (a time axis split, `check_vma` on)
        pytest.param(SCANS["sequential"], marks=pytest.mark.slow),
        # about a minute of compiling; the parallel filter's own branches
        pytest.param(SCANS["associative"], marks=pytest.mark.slow),
    ],
    ids=SCANS.keys(),
)
def test_kalman_filter(scan, getkey):
    # float32 and T > 33 so that the sequential filter tries its steady state; one
    # device's sequences have missing entries and the other's do not, so the
    # devices take different branches of the filter's `lax.cond`s
    kf = eqx_seq.KalmanFilter(3, 2, scan=scan, dtype=jnp.float32, key=getkey())
    ys = jr.normal(getkey(), (4, 40, 2), jnp.float32)
    ys = ys.at[2, 5, 0].set(jnp.nan).at[3, 7:9].set(jnp.nan)
    params, static = eqx.partition(kf, eqx.is_inexact_array)

    # the log-likelihood with its gradient (Fisher's identity or the steady state,
    # chosen per device)
    def log_likelihood(params, ys):
        return jax.vmap(eqx.combine(params, static).log_likelihood)(ys)

    check_sharded(log_likelihood, params, (ys,), rtol=2e-5)

    # the filter and the smoother, without
    def outputs(params, ys):
        model = eqx.combine(params, static)
        filtered, smoothed = jax.vmap(model.filter)(ys), jax.vmap(model.smooth)(ys)
        return filtered.means, filtered.covs, smoothed.means, smoothed.covs

    check_sharded(outputs, params, (ys,), rtol=2e-5, grad=False)


@pytest.mark.parametrize("out_of_range", ["error", "clip", "fill"])
def test_embedding(out_of_range, getkey):
    emb = eqx_seq.Embedding(20, 4, out_of_range=out_of_range, key=getkey())
    high = 20 if out_of_range == "error" else 25  # else some out of range
    ids = jr.randint(getkey(), (4, 6), -high, high)
    params, static = eqx.partition(emb, eqx.is_inexact_array)
    fn = lambda p, ids: eqx.combine(p, static)(ids)
    check_sharded(fn, params, (ids,), wrt_data=False)
    if out_of_range == "error":
        # one out-of-range id, on the second device only, still raises
        sharded = jax.shard_map(
            fn, mesh=_mesh(), in_specs=(P(), P("batch")), out_specs=P("batch")
        )
        with pytest.raises(Exception, match="out of range"):
            jax.block_until_ready(eqx.filter_jit(sharded)(params, ids.at[3, 2].set(20)))


# slow tier: the model's parts are split in the fast tier (the S5 block in
# test_ssm_layers[S5Block-sequential], the embedding in test_embedding)
@pytest.mark.slow
def test_language_model(getkey):
    model = eqx_seq.LanguageModel(16, width=8, depth=1, state_size=4, key=getkey())
    ids = jr.randint(getkey(), (4, 10), 0, 16)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    fn = lambda p, ids: jax.vmap(eqx.combine(p, static))(ids)
    # float32: the gradient is summed over the devices in another order
    check_sharded(fn, params, (ids,), wrt_data=False, rtol=2e-5)
