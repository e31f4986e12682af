"""The Kalman filter, smoother and log-likelihood with the time axis split over
devices (`eqx_seq.ShardedScan` inside `jax.shard_map`): against the textbook NumPy
filter and smoother of `kalman_helpers`, and against one device.

On the CPU devices of `conftest.py`: four (blocks with neighbours on both sides),
or two where a block must be long (the steady state, chunks of a block's element).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from kalman_helpers import build, case, reference, STEADY_T

import eqx_seq
from eqx_seq._kalman._sharded import log_likelihood_sharded


pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs four devices (conftest.py asks for them)"
)

INNER = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


def _specs(kf):
    """The filter's time-varying matrices split like the observations."""
    return jax.tree.map(lambda x: P("seq") if x.ndim == 3 else P(), kf)


def _mesh(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("seq",))


def _run(kf, method, ys, us=None, out_specs=P("seq"), devices=2):
    mesh = _mesh(devices)
    us_spec = None if us is None else P("seq")
    fn = jax.shard_map(
        lambda kf, ys, us: method(kf, ys, us),
        mesh=mesh,
        in_specs=(_specs(kf), P("seq"), us_spec),
        out_specs=out_specs,
    )
    return jax.jit(fn)(kf, ys, us)


def _filtered(kf, ys, us):
    r = kf.filter(ys, us=us)
    per_step = (r.means, r.covs, r.predicted_means, r.predicted_covs)
    return (*per_step, r.log_likelihoods), r.log_likelihood


def _smoothed(kf, ys, us):
    r = kf.smooth(ys, us=us)
    return (r.means, r.covs, r.cross_covs), r.filtered.log_likelihood


def _split(kf, ys, us=None, outputs=None, out_specs=None, devices=2, chunk=None):
    """From one compiled program on `devices` devices: `outputs(kf, ys, us)` (its
    `out_specs`; `None`: nothing), and the split log-likelihood with its gradient
    with respect to `kf`'s parameters (time-varying ones split like the data).
    With `chunk`, the log-likelihood is the private function under
    `KalmanFilter.log_likelihood`, a block's element computed `chunk` steps at a
    time."""
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    in_specs = (_specs(params), P("seq"), None if us is None else P("seq"))

    def on_blocks(fn, out_specs):
        return jax.shard_map(
            lambda p, ys, us: fn(eqx.combine(p, static), ys, us),
            mesh=_mesh(devices),
            in_specs=in_specs,
            out_specs=out_specs,
        )

    if chunk is None:
        ll = on_blocks(lambda kf, ys, us: kf.log_likelihood(ys, us=us), P())
    else:
        ll = on_blocks(
            lambda kf, ys, us: log_likelihood_sharded(
                kf._model(), ys, us, kf.scan, chunk=chunk
            ),
            P(),
        )

    def program(params, ys, us):
        out = None if outputs is None else on_blocks(outputs, out_specs)(params, ys, us)
        return out, jax.value_and_grad(ll)(params, ys, us)

    return jax.jit(program)(params, ys, us)


@eqx.filter_jit
def _one_device(kf, ys, us):
    """One device's filtered means, and its log-likelihood with the gradient by
    plain autodiff through the filter: one compiled program, which the tests of
    the same shapes share."""
    loss = lambda kf: (lambda r: (r.log_likelihood, r.means))(kf.filter(ys, us=us))
    (value, means), grads = eqx.filter_value_and_grad(loss, has_aux=True)(kf)
    return value, means, grads


def _trim(model, T):
    return {k: v[:T] if np.ndim(v) == 3 else v for k, v in model.items()}


# each inner backend once, each model once: the split (elements, exchange, the
# blocks' filters from the state before them) is the same for both models. Slow
# tier: the associative inner backend, which the one-device tests check.
@pytest.mark.parametrize(
    "name, inner",
    [
        pytest.param("plain", "associative", marks=pytest.mark.slow),
        ("all", "sequential"),
    ],
)
def test_filter_smoother_and_gradient(name, inner):
    """On four blocks of 9 steps, from one compiled program: every per-step output
    of the filter and the smoother, and the log-likelihood, equal the textbook
    filter's on the whole sequence (time-varying matrices split like the data,
    controls, missing entries, a whole step too); and the gradient of the split
    log-likelihood with respect to every parameter (the time-varying ones come
    back split) equals one device's (within 1e-8 absolute too)."""
    model, ys, us = case(name)
    T = 36  # four blocks of 9
    model, ys = _trim(model, T), ys[:T]
    us = None if us is None else us[:T]
    f, sm, sP, cross = reference(model, ys, us)
    kf = build(model, eqx_seq.ShardedScan("seq", INNER[inner]))
    both = lambda kf, ys, us: (_filtered(kf, ys, us), _smoothed(kf, ys, us))
    out_specs = ((P("seq"), P()),) * 2
    outputs, (value, grads) = _split(kf, ys, us, both, out_specs, devices=4)
    (r, ll), ((means, covs, crosses), ll_smoother) = outputs
    tol = dict(rtol=1e-8, atol=1e-9)
    for got, want in zip(r, (f["m"], f["P"], f["mp"], f["Pp"], f["ll"])):
        np.testing.assert_allclose(got, want, **tol)
    np.testing.assert_allclose(ll, f["ll"].sum(), **tol)
    np.testing.assert_allclose(means, sm, **tol)
    np.testing.assert_allclose(covs, sP, **tol)
    # a row per step: each block's last row is the cross-covariance across the
    # boundary after it, the last block's is zero
    np.testing.assert_allclose(crosses[:-1], cross, **tol)
    np.testing.assert_array_equal(crosses[-1], 0)
    np.testing.assert_allclose(ll_smoother, f["ll"].sum(), **tol)
    one = build(model, eqx_seq.SequentialScan())
    value1, grads1 = eqx.filter_value_and_grad(lambda kf: kf.log_likelihood(ys, us=us))(
        one
    )
    np.testing.assert_allclose(value, value1, rtol=1e-10)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(g, g1, rtol=1e-7, atol=1e-9)
        assert float(np.max(np.abs(g - g1))) < 1e-8


@pytest.mark.parametrize(
    "options",
    [{"prior_at": "x1"}, {"initialization": "stationary"}],
    ids=["prior_at_x1", "stationary"],
)
def test_prior_options(options):
    model, ys, _ = case("missing", seed=2)
    ys = ys[:36]
    f = build(model, eqx_seq.SequentialScan(), **options).filter(ys)
    kf = build(model, eqx_seq.ShardedScan("seq"), **options)
    r, ll = _run(kf, _filtered, ys, out_specs=(P("seq"), P()))
    np.testing.assert_allclose(r[0], f.means, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(r[1], f.covs, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(ll, f.log_likelihood, rtol=1e-10)


# slow tier: the fallback, whose every-step-exact element test_filter_smoother_and_
# gradient checks (the steady-state tests of one device check the fallback itself)
@pytest.mark.parametrize(
    "settles",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["settles", "falls_back"],
)
def test_steady_state_blocks(settles):
    """A time-invariant model with complete data and blocks long enough to settle:
    each block's element uses the steady-state filter's tail (closed-form linear
    part), or, for a covariance still moving after the exact head (a slow, barely
    observed state), falls back to every step exact. The filter, and the
    log-likelihood with its gradient, against one device; each side one compiled
    program."""
    rng = np.random.default_rng(3)
    if settles:
        model, _, _ = case("plain", seed=3)
    else:
        c, s = np.cos(0.01), np.sin(0.01)
        model = dict(
            F=0.9995 * np.array([[c, -s], [s, c]]), H=np.array([[0.02, 0.01]]),
            Q=1e-3 * np.eye(2), R=np.eye(1), m0=np.zeros(2), P0=np.eye(2),
        )  # fmt: skip
    p = model["H"].shape[0]
    ys = rng.normal(size=(4 * STEADY_T, p))
    one = build(model, eqx_seq.SequentialScan())
    kf = build(model, eqx_seq.ShardedScan("seq"))
    filtered = lambda kf, ys, us: (lambda r: (r.means, r.log_likelihood))(kf.filter(ys))
    (means, ll), (value, grads) = _split(kf, ys, None, filtered, (P("seq"), P()))
    # one device: plain autodiff through the filter (Fisher's identity, its
    # `log_likelihood`'s gradient, agrees only to about 1e-6 on the slow model)
    value1, means1, grads1 = _one_device(one, ys, None)
    np.testing.assert_allclose(means, means1, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(ll, value1, rtol=1e-10)
    np.testing.assert_allclose(value, value1, rtol=1e-10)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(g, g1, rtol=1e-8, atol=1e-10)


@pytest.mark.slow  # blocks of many chunks: only long sequences on many devices
@pytest.mark.parametrize(
    "name, chunk", [("all", 7), ("steady", 150)], ids=["exact", "steady"]
)
def test_chunked_elements(name, chunk):
    """A block's element computed a chunk at a time (a short `chunk` here, given to
    the private `log_likelihood_sharded`; blocks of the default length, `_CHUNK`,
    need long sequences): the chunks' elements combined in a loop give the
    one-device log-likelihood and its gradient, with exact steps (time-varying,
    controls, missing entries) and in the steady state (a time-invariant model
    with complete data, chunks long enough to settle)."""
    if name == "steady":
        model, _, _ = case("plain", seed=5)
        ys, us = np.random.default_rng(5).normal(size=(4 * chunk * 2, 2)), None
    else:
        model, ys, us = case(name, seed=5)
        model, ys, us = _trim(model, 36), ys[:36], us[:36]
    one = build(model, eqx_seq.SequentialScan())
    kf = build(model, eqx_seq.ShardedScan("seq"))
    _, (value, grads) = _split(kf, ys, us, chunk=chunk)
    value1, _, grads1 = _one_device(one, ys, us)
    np.testing.assert_allclose(value, value1, rtol=1e-10)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(g, g1, rtol=1e-8, atol=1e-10)


@pytest.mark.slow  # vmap inside shard_map: the split's programs under a batch axis
def test_batch_of_split_sequences():
    """`jax.vmap` over sequences inside the `shard_map`, each split over time (a
    missing entry in one sequence only): log-likelihoods, their gradient and the
    smoothed means equal one device's; each side one compiled program."""
    model, _, _ = case("plain", seed=6)
    ys = np.random.default_rng(6).normal(size=(3, 36, 2))
    ys[1, 5, 0] = np.nan
    one = build(model, eqx_seq.SequentialScan())
    kf = build(model, eqx_seq.ShardedScan("seq"))
    batch = lambda fn, out: jax.shard_map(
        fn, mesh=_mesh(2), in_specs=(P(), P(None, "seq")), out_specs=out
    )
    lls = lambda kf, ys: jax.vmap(kf.log_likelihood)(ys)
    smoothed = lambda kf, ys: jax.vmap(lambda y: kf.smooth(y).means)(ys)

    @eqx.filter_jit
    def outputs(kf, lls, smoothed):
        """The log-likelihoods, the gradient of their sum, the smoothed means."""
        total = lambda kf: (lambda x: (jnp.sum(x), x))(lls(kf, ys))
        (_, values), grads = eqx.filter_value_and_grad(total, has_aux=True)(kf)
        return values, grads, smoothed(kf, ys)

    ll, grads, means = outputs(kf, batch(lls, P()), batch(smoothed, P(None, "seq")))
    ll1, grads1, means1 = outputs(one, lls, smoothed)
    np.testing.assert_allclose(ll, ll1, rtol=1e-10)
    np.testing.assert_allclose(means, means1, atol=1e-10)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(g, g1, rtol=1e-8, atol=1e-10)


def test_bad_input():
    model, ys, _ = case("plain")
    scan = eqx_seq.ShardedScan("seq")
    with pytest.raises(ValueError, match='"diffuse" does not run on a time axis'):
        build(model, scan, initialization="diffuse")
    kf = build(model, scan)
    with pytest.raises(ValueError, match="inside `jax.shard_map`"):
        kf.filter(ys)
    with pytest.raises(ValueError, match="fit_em does not run on a time axis"):
        kf.fit_em(ys, num_iters=1)
    with pytest.raises(ValueError, match="forecast does not run on a time axis"):
        kf.forecast(ys, horizon=2)
    with pytest.raises(ValueError, match="posterior_sample does not run"):
        kf.posterior_sample(jr.key(0), ys, 2)
    # time-varying matrices not split like the observations
    tv, ys_tv, _ = case("time_varying")
    tv, ys_tv = _trim(tv, 36), ys_tv[:36]
    kf_tv = build(tv, scan)
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    unsplit = jax.shard_map(
        lambda kf, ys: kf.filter(ys).means,
        mesh=mesh,
        in_specs=(P(), P("seq")),
        out_specs=P("seq"),
    )
    with pytest.raises(ValueError, match="split the time-varying matrices"):
        unsplit(kf_tv, ys_tv)
    # the model's length is the whole sequence's
    with pytest.raises(ValueError, match="time-varying with 36 steps"):
        _run(kf_tv, _filtered, jnp.concatenate([ys_tv, ys_tv]), out_specs=P())
