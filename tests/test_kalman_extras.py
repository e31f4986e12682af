"""eqx_seq.KalmanFilter's forecasts, posterior samples and online filtering against
float64 NumPy references written here (the prediction iterated by hand, the
textbook filter and RTS smoother of kalman_helpers)."""

import beartype
import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import directional_fd
from jaxtyping import jaxtyped
from kalman_helpers import _at, BACKENDS, build, case, filter_reference, reference

import eqx_seq


TOL = dict(rtol=1e-7, atol=1e-9)


def with_missing(ys):
    ys = np.array(ys)
    ys[4] = np.nan  # a whole step
    ys[[7, 15], 1] = np.nan  # single entries
    ys[[9], 0] = np.nan
    return ys


# --- forecast ---


def np_forecast(model, ys, us, horizon, prior_at="x0", last=None):
    """The last filtered moments (`last`, or the reference filter's), then the
    prediction step by hand, `R` added."""
    T = len(ys)
    if last is None:
        f = filter_reference(model, ys, None if us is None else us[:T], prior_at)
        last = f["m"][-1], f["P"][-1]
    m, P = last
    out = {k: [] for k in ("m", "P", "y", "S")}
    for t in range(T, T + horizon):
        F, H = _at(model["F"], t), _at(model["H"], t)
        m = F @ m + (model["B"] @ us[t] if us is not None else 0)
        P = F @ P @ F.T + _at(model["Q"], t)
        y = H @ m + (model["D"] @ us[t] if us is not None else 0)
        S = H @ P @ H.T + _at(model["R"], t)
        for k, v in zip(out, (m, P, y, S)):
            out[k].append(v)
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize(
    "backend,name,prior_at",
    [
        # slow tier: "all" (associative) covers "plain"'s features; the sequential
        # backend's forecast runs fast in test_forecast_edges and
        # test_forecast_after_a_diffuse_prior, the prior on x_1 in
        # test_streaming_matches_the_filter
        pytest.param("sequential", "plain", "x0", marks=pytest.mark.slow),
        pytest.param("sequential", "all", "x1", marks=pytest.mark.slow),
        ("associative", "all", "x0"),
    ],
)
def test_forecast_matches_reference(backend, name, prior_at):
    # "all": time-varying, controls, missing entries (the last step too); a
    # time-varying model forecasts its remaining steps from a shorter `ys`
    model, ys, us = case(name)
    T, horizon = (30, 7) if name == "all" else (len(ys), 12)
    if name == "plain":
        ys = with_missing(ys)
    kf = build(model, BACKENDS[backend], prior_at=prior_at)
    out = kf.forecast(ys[:T], horizon, us=us)
    ref = np_forecast(model, ys[:T], us, horizon, prior_at)
    assert isinstance(out, eqx_seq.KalmanForecastResult)
    np.testing.assert_allclose(out.means, ref["m"], **TOL)
    np.testing.assert_allclose(out.covs, ref["P"], **TOL)
    np.testing.assert_allclose(out.obs_means, ref["y"], **TOL)
    np.testing.assert_allclose(out.obs_covs, ref["S"], **TOL)


def test_forecast_after_a_diffuse_prior():
    # a local linear trend from an exact diffuse prior: once the data determine
    # the state, the forecast iterates from the (diffuse) filter's last moments
    F = np.array([[1.0, 1.0], [0.0, 1.0]])
    model = dict(F=F, H=np.array([[1.0, 0.0]]), Q=0.1 * np.eye(2), R=np.eye(1))
    model.update(m0=np.zeros(2), P0=np.eye(2))
    ys = np.sin(np.arange(20.0))[:, None]
    ys[[0, 5]] = np.nan
    kf = build(model, eqx_seq.SequentialScan(), initialization="diffuse")
    f = kf.filter(ys)
    out = kf.forecast(ys, 4)
    ref = np_forecast(model, ys, None, 4, last=(f.means[-1], f.covs[-1]))
    np.testing.assert_allclose(out.means, ref["m"], **TOL)
    np.testing.assert_allclose(out.covs, ref["P"], **TOL)
    np.testing.assert_allclose(out.obs_covs, ref["S"], **TOL)


def test_forecast_edges():
    model, ys, us = case("controls")
    kf = build(model, eqx_seq.SequentialScan())
    T = len(ys)
    out = kf.forecast(ys, 0, us=us)  # horizon 0: the controls of the data only
    assert out.means.shape == (0, 3) and out.obs_covs.shape == (0, 2, 2)
    # under jit; the first forecast step is the filter's next prediction
    fc = eqx.filter_jit(lambda kf, ys, us: kf.forecast(ys, 1, us=us))
    one = fc(kf, ys[: T - 1], us)
    f = kf.filter(ys, us=us)
    np.testing.assert_allclose(one.means[0], f.predicted_means[-1], **TOL)
    np.testing.assert_allclose(one.covs[0], f.predicted_covs[-1], **TOL)


# --- posterior samples ---


def z_scores(draws, means, covs, cross):
    """Standardised errors of the draws' means, covariances and lag-one
    cross-covariances against the smoother's (Gaussian standard errors)."""
    N = draws.shape[0]
    mean = draws.mean(0)
    d = draws - mean
    cov = np.einsum("sti,stj->tij", d, d) / (N - 1)
    lag = np.einsum("sti,stj->tij", d[:, :-1], d[:, 1:]) / (N - 1)
    var = np.diagonal(covs, axis1=1, axis2=2)  # (T, n)
    z_mean = (mean - means) / np.sqrt(var / N)
    z_cov = (cov - covs) / np.sqrt((var[:, :, None] * var[:, None, :] + covs**2) / N)
    se_lag = np.sqrt((var[:-1, :, None] * var[1:, None, :] + cross**2) / N)
    z_lag = (lag - cross) / se_lag
    return max(np.abs(z).max() for z in (z_mean, z_cov, z_lag))


@pytest.mark.parametrize(
    "prior_at",
    [
        "x0",
        # slow tier: the other prior convention of the same check (x_1's prior
        # runs fast in test_streaming_matches_the_filter)
        pytest.param("x1", marks=pytest.mark.slow),
    ],
)
def test_posterior_samples_converge_to_the_smoother(prior_at):
    # time-varying, controls, missing entries (and a missing last step); both
    # backends draw the same paths from one key, to round-off
    model, ys, us = case("all")
    f, sm, sP, cross = reference(model, ys, us, prior_at)
    N = 4000
    draws = {}
    for backend in ("sequential", "associative"):
        kf = build(model, BACKENDS[backend], prior_at=prior_at)
        draws[backend] = np.asarray(kf.posterior_sample(jr.key(0), ys, N, us=us))
        assert draws[backend].shape == (N, len(ys), 3)
        # ~650 statistics: a max |z| of 5 has chance below 1e-3 under the null
        assert z_scores(draws[backend], sm, sP, cross) < 5
    np.testing.assert_allclose(draws["sequential"], draws["associative"], atol=1e-8)
    # the test has power: the filter's moments fail it, and so do draws with the
    # right marginals but independent steps (each step's draws shuffled)
    assert z_scores(draws["sequential"], f["m"], f["P"], cross) > 20
    rng = np.random.default_rng(0)
    steps = draws["sequential"].swapaxes(0, 1)
    shuffled = np.stack([rng.permutation(x) for x in steps]).swapaxes(0, 1)
    assert z_scores(shuffled, sm, sP, cross) > 20


# slow tier: test_posterior_samples_converge_to_the_smoother checks the draws on
# both backends; this adds jit, vmap and one step
@pytest.mark.slow
def test_posterior_sample_jit_vmap_and_length_one():
    model, ys, _ = case("missing")
    kf = build(model, eqx_seq.SequentialScan())
    sample = eqx.filter_jit(lambda kf, key, ys: kf.posterior_sample(key, ys, 3))
    keys = jr.split(jr.key(1), 2)
    out = jax.vmap(sample, in_axes=(None, 0, None))(kf, keys, ys)
    assert out.shape == (2, 3, len(ys), 3)
    np.testing.assert_allclose(out[1], sample(kf, keys[1], ys), **TOL)
    # T = 1: draws of x_1 | y_1 from the filtered moments
    f = filter_reference(model, ys[:1])
    for scan in BACKENDS.values():
        kf = build(model, scan)
        x = np.asarray(kf.posterior_sample(jr.key(2), ys[:1], 4000))[:, 0]
        z = (x.mean(0) - f["m"][0]) / np.sqrt(np.diag(f["P"][0]) / 4000)
        assert x.shape == (4000, 3) and np.abs(z).max() < 4.5


@pytest.mark.slow  # a smoke test: two more float32 compilations
def test_posterior_sample_float32_is_finite():
    kf = eqx_seq.KalmanFilter(4, 2, dtype=jnp.float32, key=jr.key(0))
    _, ys = kf.sample(jr.key(1), 200)
    ys = ys.at[50:60].set(jnp.nan)
    for scan in BACKENDS.values():
        kf = eqx.tree_at(lambda k: k.scan, kf, scan)
        out = kf.posterior_sample(jr.key(2), ys, 8)
        assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_gradients_match_finite_differences():
    # plain autodiff through the filter, the forecast and the backward draws
    # (pathwise: a fixed key makes the draws smooth functions of the model)
    model, ys, us = case("controls")
    ys = with_missing(ys)
    kf = build(model, eqx_seq.SequentialScan())
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    direction = jax.tree.map(lambda x: jr.normal(jr.key(3), x.shape, x.dtype), params)

    def loss(params):
        kf = eqx.combine(params, static)
        fc = kf.forecast(ys, 3, us=np.concatenate([us, us[:3]]))
        draws = kf.posterior_sample(jr.key(4), ys, 2, us=us)
        return jnp.sum(fc.obs_means) + jnp.sum(fc.obs_covs) + jnp.sum(draws**2)

    grad = jax.grad(loss)(params)
    ad = sum(jnp.sum(g * d) for g, d in zip(*map(jax.tree.leaves, (grad, direction))))
    np.testing.assert_allclose(ad, directional_fd(loss, params, direction), rtol=1e-6)


# --- online filtering ---


def stream(kf, ys, us, first_update=False):
    """init_state, then predict + update per step (no predict at step 1 with
    `first_update`): every state along the way."""
    state = kf.init_state()
    predicted, filtered = [], []
    for t in range(len(ys)):
        u = None if us is None else us[t]
        if t or not first_update:
            state = kf.predict(state, u=u)
        predicted.append(state)
        state = kf.update(state, ys[t], u=u)
        filtered.append(state)
    return predicted, filtered


@pytest.mark.parametrize(
    "name,options",
    [
        ("controls", {}),
        # slow tier: every case has missing entries; controls run fast in the
        # first case, the prior on x_1 in the last
        pytest.param("missing", {}, marks=pytest.mark.slow),
        pytest.param("controls", dict(prior_at="x1"), marks=pytest.mark.slow),
        ("missing", dict(prior_at="x1", initialization="stationary")),
    ],
)
def test_streaming_matches_the_filter(name, options):
    # with prior_at="x1" the prior is x_1's: the first call is `update`
    model, ys, us = case(name)
    ys = with_missing(ys)
    ys[-1] = np.nan
    kf = build(model, eqx_seq.SequentialScan(), **options)
    if options.get("initialization") == "stationary":
        F, Q = model["F"], model["Q"]
        n = len(F)
        P = np.linalg.solve(np.eye(n * n) - np.kron(F, F), Q.ravel()).reshape(n, n)
        model = {**model, "m0": np.zeros(n), "P0": P}
    prior_at = options.get("prior_at", "x0")
    f = filter_reference(model, ys, us, prior_at)
    state = kf.init_state()
    assert isinstance(state, eqx_seq.KalmanState)
    np.testing.assert_allclose(state.mean, model["m0"], **TOL)
    np.testing.assert_allclose(state.cov, model["P0"], **TOL)
    assert float(state.log_likelihood) == 0
    predicted, filtered = stream(kf, ys, us, first_update=prior_at == "x1")
    np.testing.assert_allclose([s.mean for s in predicted], f["mp"], **TOL)
    np.testing.assert_allclose([s.cov for s in predicted], f["Pp"], **TOL)
    np.testing.assert_allclose([s.mean for s in filtered], f["m"], **TOL)
    np.testing.assert_allclose([s.cov for s in filtered], f["P"], **TOL)
    lls = np.array([s.log_likelihood for s in filtered])
    np.testing.assert_allclose(np.diff(lls, prepend=0), f["ll"], **TOL)
    np.testing.assert_allclose(lls[-1], kf.filter(ys, us=us).log_likelihood, **TOL)


def test_streaming_under_jit_in_a_scan():
    model, ys, us = case("controls")
    ys = with_missing(ys)
    kf = build(model, eqx_seq.SequentialScan())

    @eqx.filter_jit
    def run(kf, ys, us):
        def step(state, yu):
            y, u = yu
            state = kf.update(kf.predict(state, u=u), y, u=u)
            return state, state.mean

        return lax.scan(step, kf.init_state(), (ys, us))

    state, means = run(kf, ys, us)
    f = kf.filter(ys, us=us)
    np.testing.assert_allclose(means, f.means, **TOL)
    np.testing.assert_allclose(state.log_likelihood, f.log_likelihood, **TOL)


# --- annotations and bad input ---


def test_annotations():
    checked = lambda fn: eqx.filter_jit(jaxtyped(typechecker=beartype.beartype)(fn))
    kf = eqx_seq.KalmanFilter(3, 2, control_size=1, key=jr.key(0))
    ys, us = jnp.ones((5, 2)).at[1, 0].set(jnp.nan), jnp.ones((8, 1))
    out = checked(type(kf).forecast)(kf, ys, 3, us=us)
    assert out.means.shape == (3, 3) and out.obs_covs.shape == (3, 2, 2)
    draws = checked(type(kf).posterior_sample)(kf, jr.key(1), ys, 4, us=us[:5])
    assert draws.shape == (4, 5, 3)
    state = checked(type(kf).init_state)(kf)
    state = checked(type(kf).predict)(kf, state, u=us[0])
    state = checked(type(kf).update)(kf, state, ys[1], u=us[0])
    assert state.mean.shape == (3,) and state.log_likelihood.shape == ()


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    kf = eqx_seq.KalmanFilter(3, 2, key=jr.key(0))
    ys = jnp.ones((6, 2))
    for horizon in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match="`horizon` must be a non-negative int"):
            kf.forecast(ys, horizon)
    for bad in (jnp.ones((6, 3)), jnp.ones(6), jnp.ones((6, 2), int)):
        with pytest.raises(ValueError, match="`ys`"):
            kf.forecast(bad, 2)
        with pytest.raises(ValueError, match="`ys`"):
            kf.posterior_sample(jr.key(0), bad, 2)
    for num in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="`num_samples` must be a positive int"):
            kf.posterior_sample(jr.key(0), ys, num)
    with pytest.raises(ValueError, match="control_size=0"):
        kf.forecast(ys, 2, us=jnp.ones((8, 1)))

    # controls: those of the forecast steps are needed too
    kfc = eqx_seq.KalmanFilter(3, 2, control_size=1, key=jr.key(0))
    with pytest.raises(ValueError, match=r"controls of the forecast steps.*\(8, 1\)"):
        kfc.forecast(ys, 2, us=jnp.ones((6, 1)))
    with pytest.raises(ValueError, match="control_size=1"):
        kfc.forecast(ys, 2)
    with pytest.raises(ValueError, match="`us` must be"):
        kfc.forecast(ys, 2, us=jnp.ones((8, 2)))
    with pytest.raises(ValueError, match="`us` must be"):
        kfc.posterior_sample(jr.key(0), ys, 2, us=jnp.ones((8, 1)))

    # a time-varying model: no forecast past its steps, no online filtering
    model, ys_tv, _ = case("time_varying")
    kft = build(model, eqx_seq.SequentialScan())
    with pytest.raises(ValueError, match="cannot forecast past them"):
        kft.forecast(ys_tv, 1)
    with pytest.raises(ValueError, match="time-varying with 37 steps"):
        kft.posterior_sample(jr.key(0), ys_tv[:30], 2)
    for call in (
        kft.init_state,
        lambda: kft.predict(kf.init_state()),
        lambda: kft.update(kf.init_state(), ys[0]),
    ):
        with pytest.raises(ValueError, match="needs a time-invariant model"):
            call()

    # a diffuse prior: no smoother, so no posterior paths; no Gaussian state
    kfd = eqx_seq.KalmanFilter(3, 2, initialization="diffuse", key=jr.key(0))
    with pytest.raises(NotImplementedError, match="posterior_sample"):
        kfd.posterior_sample(jr.key(0), ys, 2)
    for call in (
        kfd.init_state,
        lambda: kfd.predict(kf.init_state()),
        lambda: kfd.update(kf.init_state(), ys[0]),
    ):
        with pytest.raises(NotImplementedError, match='initialization="diffuse"'):
            call()

    # streaming: the state, the observation and the controls
    state = kf.init_state()
    with pytest.raises(ValueError, match="`state` must be an `eqx_seq.KalmanState`"):
        kf.predict((state.mean, state.cov))
    L = state.cov_factor
    for bad in (
        eqx_seq.KalmanState(jnp.zeros(2), L, state.log_likelihood),
        eqx_seq.KalmanState(state.mean, jnp.eye(2), state.log_likelihood),
        eqx_seq.KalmanState(state.mean, L, jnp.zeros(1)),
        eqx_seq.KalmanState(state.mean, L.astype(int), state.log_likelihood),
    ):
        with pytest.raises(
            ValueError, match="`state.(mean|cov_factor|log_likelihood)`"
        ):
            kf.update(bad, ys[0])
    for y in (jnp.ones(3), jnp.ones((1, 2)), jnp.ones(2, int)):
        with pytest.raises(ValueError, match="`y` is one step's"):
            kf.update(state, y)
    with pytest.raises(ValueError, match="control_size=0"):
        kf.predict(state, u=jnp.ones(1))
    statec = kfc.init_state()
    with pytest.raises(ValueError, match=r"controls `u` of shape \(1,\)"):
        kfc.predict(statec)
    with pytest.raises(ValueError, match="`u` is one step's"):
        kfc.update(statec, ys[0], u=jnp.ones((1, 1)))
