"""The prior's options: `prior_at` ("x0" | "x1") and `initialization` ("known" |
"stationary" | "diffuse"), against the float64 NumPy filter, numbers from dynamax
and statsmodels, and a Lyapunov solve."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
import scipy.linalg
from kalman_helpers import (
    assert_filtered,
    BACKENDS,
    build,
    case,
    filter_reference,
    random_model,
)

import eqx_seq


# A fixed model and data, and what dynamax 1.0.3's `lgssm_filter` (which puts the
# prior on the first observed state) returned for them in float64:
# `make_lgssm_params(m0, P0, F, Q, H, R)`, then `.marginal_loglik`,
# `.filtered_means[0]`, `.filtered_covariances[0]`, `.filtered_means[-1]`. Stored,
# not recomputed: dynamax is not a test dependency (it brings TensorFlow
# Probability and a web stack), so a live comparison would only ever be skipped.
F = np.array([[0.9, 0.2, 0.0], [-0.1, 0.8, 0.1], [0.0, 0.3, 0.7]])
H = np.array([[1.0, 0.5, 0.0], [0.0, -0.4, 1.2]])
Q = np.array([[0.3, 0.05, 0.0], [0.05, 0.2, 0.02], [0.0, 0.02, 0.1]])
R = np.array([[0.5, 0.1], [0.1, 0.4]])
M0 = np.array([1.0, -2.0, 0.5])
P0 = np.array([[2.0, 0.3, 0.0], [0.3, 1.0, 0.1], [0.0, 0.1, 0.5]])
YS = np.array(
    [
        [0.002, 0.597],
        [-0.548, -1.781],
        [-0.909, -1.983],
        [0.12, 2.68],
        [-0.984, -1.241],
        [0.98, 0.714],
    ]
)
DYNAMAX = {
    "log_likelihood": -30.063511578451635,
    "first_mean": [1.00633612, -1.83690797, 0.11578246],
    "first_cov": [
        [0.48438197, -0.26539491, -0.03179384],
        [-0.26539491, 0.74196787, 0.20080321],
        [-0.03179384, 0.20080321, 0.22991968],
    ],
    "last_mean": [0.19941159, -0.06914031, -0.06354097],
}


@pytest.mark.parametrize(
    "backend",
    [
        "sequential",
        # slow tier: the associative backend's prior on x_1 runs fast in
        # test_diffuse_nile_matches_statsmodels[trend_missing-x1-associative]
        pytest.param("associative", marks=pytest.mark.slow),
    ],
)
def test_prior_at_x1_matches_dynamax(backend):
    kf = eqx_seq.KalmanFilter.from_matrices(
        F, H, Q, R, M0, P0, prior_at="x1", scan=BACKENDS[backend]
    )
    out = kf.filter(YS)
    # dynamax adds 1e-9 to the diagonal of the matrices it solves with
    tol = dict(rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(out.log_likelihood, DYNAMAX["log_likelihood"], **tol)
    np.testing.assert_allclose(kf.log_likelihood(YS), DYNAMAX["log_likelihood"], **tol)
    np.testing.assert_allclose(out.means[0], DYNAMAX["first_mean"], atol=1e-7)
    np.testing.assert_allclose(out.covs[0], DYNAMAX["first_cov"], atol=1e-7)
    np.testing.assert_allclose(out.means[-1], DYNAMAX["last_mean"], atol=1e-7)
    # the other convention is another model: about a nat away
    x0 = eqx_seq.KalmanFilter.from_matrices(F, H, Q, R, M0, P0, scan=BACKENDS[backend])
    assert abs(float(x0.log_likelihood(YS)) - DYNAMAX["log_likelihood"]) > 0.5


# each backend once, each model once: the prior enters through the first step,
# which both backends share (a compiled program per pair)
@pytest.mark.parametrize(
    "name, backend",
    [
        ("all", "sequential"),
        # slow tier: "all" covers "plain"; the associative backend's prior on x_1
        # runs fast in test_diffuse_nile_matches_statsmodels
        pytest.param("plain", "associative", marks=pytest.mark.slow),
    ],
)
def test_prior_at_x1_against_reference(backend, name):
    model, ys, us = case(name, seed=3)
    kf = build(model, BACKENDS[backend], prior_at="x1")
    f = filter_reference(model, ys, us, prior_at="x1")
    assert_filtered(kf.filter(ys, us=us), f, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(kf.smooth(ys, us=us).filtered.means, f["m"], atol=1e-9)


# slow tier: test_stationary_prior[x1-sequential] checks Fisher's identity against
# plain autodiff (for F) with the prior on x_1
@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prior_at_x1_gradient_is_the_filters(backend):
    # Fisher's identity (log_likelihood) against plain autodiff through the filter
    model, ys, us = case("all", seed=4)
    kf = build(model, BACKENDS[backend], prior_at="x1")
    fisher = jax.grad(lambda kf: kf.log_likelihood(ys, us=us))(kf)
    plain = jax.grad(lambda kf: kf.filter(ys, us=us).log_likelihood)(kf)
    for a, b in zip(jax.tree.leaves(fisher), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)
    # the prior's parameters move the likelihood through x_1 directly
    assert float(jnp.max(jnp.abs(fisher.m0))) > 0


def test_prior_at_x1_sample_starts_from_the_prior():
    kf = eqx_seq.KalmanFilter.from_matrices(F, H, Q, R, M0, P0, prior_at="x1")
    keys = jr.split(jr.key(0), 4000)
    states = jax.vmap(lambda k: kf.sample(k, 2)[0])(keys)
    first = np.asarray(states[:, 0])
    # mean within 5 standard errors of m0, covariance within 10%
    se = np.sqrt(np.diag(P0) / len(keys))
    assert np.all(np.abs(first.mean(0) - M0) < 5 * se)
    np.testing.assert_allclose(np.cov(first.T), P0, atol=0.1 * np.max(P0))


# each backend once, each convention once (the stationary covariance is the
# same computation for both)
@pytest.mark.parametrize(
    "prior_at, backend",
    [
        # slow tier: the other convention of the same check (the test shows both
        # give the same model); the associative backend runs fast in
        # test_diffuse_nile_matches_statsmodels
        pytest.param("x0", "associative", marks=pytest.mark.slow),
        ("x1", "sequential"),
    ],
)
def test_stationary_prior(backend, prior_at):
    rng = np.random.default_rng(11)
    model = random_model(rng, 3, 2)
    ys = rng.normal(size=(25, 2))
    ys[4, 1] = np.nan
    P = scipy.linalg.solve_discrete_lyapunov(model["F"], model["Q"])
    kf = build(model, BACKENDS[backend], prior_at=prior_at, initialization="stationary")
    np.testing.assert_allclose(kf.P0, P, rtol=1e-10)
    stat = {**model, "m0": np.zeros(3), "P0": P}
    f = filter_reference(stat, ys, prior_at=prior_at)
    assert_filtered(kf.filter(ys), f, rtol=1e-8, atol=1e-9)
    # the stationary law is invariant: either convention gives the same model
    other = "x1" if prior_at == "x0" else "x0"
    f_other = filter_reference(stat, ys, prior_at=other)
    np.testing.assert_allclose(f_other["ll"].sum(), f["ll"].sum(), rtol=1e-10)
    # gradients flow into F and Q through the Lyapunov solve, none into m0, P0
    g = jax.grad(lambda kf: kf.log_likelihood(ys))(kf)
    plain = jax.grad(lambda kf: kf.filter(ys).log_likelihood)(kf)
    np.testing.assert_allclose(g.F, plain.F, rtol=1e-7, atol=1e-9)
    assert float(jnp.max(jnp.abs(g.m0))) == 0
    assert float(jnp.max(jnp.abs(g.P0_factor))) == 0


def test_stationary_rejects_an_unstable_or_time_varying_model():
    kf = eqx_seq.KalmanFilter.from_matrices(
        1.01 * np.eye(2), np.eye(2), np.eye(2), np.eye(2), np.zeros(2), np.eye(2),
        initialization="stationary",
    )  # fmt: skip
    with pytest.raises(Exception, match="stable"):
        kf.filter(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="time-invariant"):
        eqx_seq.KalmanFilter.from_matrices(
            np.stack([np.eye(2)] * 5), np.eye(2), np.eye(2), np.eye(2),
            np.zeros(2), np.eye(2), initialization="stationary",
        )  # fmt: skip


@pytest.mark.usefixtures("unchecked_annotations")
def test_prior_options_bad_input():
    with pytest.raises(ValueError, match="prior_at"):
        eqx_seq.KalmanFilter(2, 1, prior_at="x2", key=jr.key(0))
    with pytest.raises(ValueError, match="prior_at"):
        eqx_seq.KalmanFilter(2, 1, prior_at=None, key=jr.key(0))
    with pytest.raises(ValueError, match="initialization"):
        eqx_seq.KalmanFilter(2, 1, initialization="approximate", key=jr.key(0))
    with pytest.raises(ValueError, match="initialization"):
        eqx_seq.KalmanFilter.from_matrices(F, H, Q, R, M0, P0, initialization="Diffuse")


def _statsmodels_llf(ys, F, H, Q, R):
    """statsmodels' exact diffuse log-likelihood (every state diffuse)."""
    from statsmodels.tsa.statespace.mlemodel import MLEModel

    m = MLEModel(ys, k_states=F.shape[0], initialization="diffuse")
    m["design"], m["transition"] = H, F
    m["selection"] = np.eye(F.shape[0])
    m["obs_cov"], m["state_cov"] = R, Q
    return m.filter([]).llf


def _nile():
    import statsmodels.api as sm

    return sm.datasets.nile.load_pandas().data["volume"].to_numpy(float)[:, None]


LOCAL_LEVEL = (np.eye(1), np.eye(1), np.array([[1469.1]]), np.array([[15099.0]]))
LOCAL_TREND = (
    np.array([[1.0, 1.0], [0.0, 1.0]]),
    np.array([[1.0, 0.0]]),
    np.diag([1469.1, 10.0]),
    np.array([[15099.0]]),
)


# every model; each backend and each convention with every model, paired so that
# each (backend, convention) pair also occurs
@pytest.mark.parametrize(
    "model, prior_at, backend",
    [
        # slow tier: "trend_missing" (a local trend with missing data, on the
        # associative backend) runs fast; the sequential backend's diffuse prior
        # runs fast in test_diffuse_gradient_against_finite_differences
        pytest.param("level", "x0", "sequential", marks=pytest.mark.slow),
        pytest.param("level", "x1", "associative", marks=pytest.mark.slow),
        pytest.param("trend", "x1", "sequential", marks=pytest.mark.slow),
        pytest.param("trend", "x0", "associative", marks=pytest.mark.slow),
        pytest.param("trend_missing", "x0", "sequential", marks=pytest.mark.slow),
        ("trend_missing", "x1", "associative"),
    ],
)
def test_diffuse_nile_matches_statsmodels(backend, prior_at, model):
    F, H, Q, R = LOCAL_LEVEL if model == "level" else LOCAL_TREND
    ys = _nile()
    if model == "trend_missing":
        ys = ys.copy()
        ys[[0, 2, 50, 51]] = np.nan  # the diffuse part resolves later
    kf = eqx_seq.KalmanFilter.from_matrices(
        F, H, Q, R, np.zeros(len(F)), np.eye(len(F)),
        initialization="diffuse", prior_at=prior_at, scan=BACKENDS[backend],
    )  # fmt: skip
    expected = _statsmodels_llf(ys, F, H, Q, R)
    out = kf.filter(ys)
    np.testing.assert_allclose(out.log_likelihood, expected, rtol=1e-10)
    np.testing.assert_allclose(kf.log_likelihood(ys), expected, rtol=1e-10)
    assert np.all(np.isfinite(out.means))
    # the undetermined states have infinite variance until the data resolve them
    assert np.all(np.isinf(np.diagonal(out.predicted_covs[0])))
    if model != "level":
        assert np.isinf(out.covs[0, 1, 1])  # one observation cannot fix a slope
    assert np.all(np.isfinite(out.covs[3:]))


def test_diffuse_gradient_against_finite_differences():
    F, H, Q, R = LOCAL_TREND
    ys = _nile()[:60]
    kf = eqx_seq.KalmanFilter.from_matrices(
        F, H, Q, R, np.zeros(2), np.eye(2), initialization="diffuse"
    )
    g = jax.grad(lambda kf: kf.log_likelihood(ys))(kf)
    eps = 1e-6
    for name in ("Q_factor", "R_factor"):
        leaf = getattr(kf, name)
        direction = np.tril(np.ones(leaf.shape))
        step = lambda s: eqx.tree_at(
            lambda k: getattr(k, name), kf, leaf + s * direction
        )
        fd = (step(eps).log_likelihood(ys) - step(-eps).log_likelihood(ys)) / (2 * eps)
        np.testing.assert_allclose(jnp.vdot(getattr(g, name), direction), fd, rtol=1e-5)
    assert np.all(np.isfinite(g.F))


def test_diffuse_bad_use():
    F, H, Q, R = LOCAL_LEVEL
    kf = eqx_seq.KalmanFilter.from_matrices(
        F, H, Q, R, np.zeros(1), np.eye(1), initialization="diffuse"
    )
    with pytest.raises(NotImplementedError, match="diffuse"):
        kf.smooth(_nile())
    with pytest.raises(ValueError, match="diffuse"):
        kf.sample(jr.key(0), 10)
    assert np.isinf(kf.P0[0, 0])
    # a state the observations never see stays diffuse: an error, not a wrong number
    blind = eqx_seq.KalmanFilter.from_matrices(
        np.eye(2), np.array([[1.0, 0.0]]), np.eye(2), np.eye(1), np.zeros(2),
        np.eye(2), initialization="diffuse",
    )  # fmt: skip
    with pytest.raises(Exception, match="not resolved"):
        blind.filter(np.ones((40, 1)))
