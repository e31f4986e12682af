"""eqx_seq.KalmanFilter against a textbook float64 NumPy filter and RTS smoother:
values, sampling, construction and checks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from kalman_helpers import (
    assert_filtered,
    BACKENDS,
    build,
    case,
    filter_reference,
    random_model,
    reference,
    simulate,
)

import eqx_seq


# Fast cases: "all" (time-varying + controls + missing) covers each feature, on the
# associative backend; the sequential one runs "plain" (the thin wrappers) and
# "missing", which share one program. The other pairs add no property that these
# do not check, so they run with `-m slow` only.
PAIRS = [
    ("sequential", "plain"),
    ("sequential", "missing"),
    ("associative", "all"),
] + [
    pytest.param(b, c, marks=pytest.mark.slow)
    for b, c in [
        ("sequential", "all"),
        ("associative", "plain"),
        ("sequential", "time_varying"),
        ("sequential", "controls"),
        ("associative", "missing"),
        ("associative", "time_varying"),
        ("associative", "controls"),
    ]
]


@pytest.mark.parametrize("backend,name", PAIRS)
def test_filter_and_smoother_match_reference(backend, name):
    model, ys, us = case(name)
    f, sm, sP, cross = reference(model, ys, us)
    kf = build(model, BACKENDS[backend])
    sm_out = kf.smooth(ys, us=us)
    out = sm_out.filtered
    tol = dict(rtol=1e-7, atol=1e-9)
    assert_filtered(out, f, **tol)
    if (backend, name) == ("sequential", "plain"):  # the thin wrappers, once
        np.testing.assert_allclose(kf.log_likelihood(ys, us=us), f["ll"].sum(), **tol)
        np.testing.assert_allclose(kf(ys, us=us), f["m"], **tol)
        np.testing.assert_allclose(kf.filter(ys, us=us).covs, f["P"], **tol)
    np.testing.assert_allclose(sm_out.means, sm, **tol)
    np.testing.assert_allclose(sm_out.covs, sP, **tol)
    np.testing.assert_allclose(sm_out.cross_covs, cross, **tol)
    np.testing.assert_allclose(sm_out.filtered.log_likelihood, f["ll"].sum(), **tol)
    assert np.all(out.covs == np.swapaxes(out.covs, -1, -2))


def constant_velocity(T, dtype):
    """The 2-D constant-velocity tracker of dynamax issue 423: the state drifts away."""
    dt = 0.1
    F = np.eye(4) + dt * np.eye(4, k=2)
    Q = np.kron(np.array([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]]), np.eye(2))
    H = np.eye(2, 4)
    model = dict(F=F, H=H, Q=Q, R=0.25 * np.eye(2), m0=np.zeros(4), P0=np.eye(4))
    rng = np.random.default_rng(1)
    x = np.zeros(4)
    x[2:] = [30.0, -20.0]  # a fast start: |x| reaches ~3e3 at T=1000
    xs, ys = [], []
    for _ in range(T):
        x = F @ x + rng.multivariate_normal(np.zeros(4), Q)
        ys.append(H @ x + 0.5 * rng.normal(size=2))
        xs.append(x)
    return model, np.array(ys)


FAR_T = 1000  # the f32 programs are shared with test_backends_agree_float32


@pytest.mark.parametrize(
    "backend",
    [
        # slow tier: the parallel filter is the one that got this wrong
        # (associative, fast); the sequential backend's float32 runs fast in
        # test_kalman_stiff.py
        pytest.param("sequential", marks=pytest.mark.slow),
        "associative",
    ],
)
def test_log_likelihood_far_from_zero(backend):
    """Parallel filters that accumulate the likelihood in the scan get this wrong."""
    model, ys = constant_velocity(FAR_T, np.float64)
    assert np.abs(ys).max() > 1e3
    f = filter_reference(model, ys)
    ref = f["ll"].sum()
    kf64 = build(model, BACKENDS[backend])
    np.testing.assert_allclose(kf64.smooth(ys).filtered.log_likelihood, ref, rtol=1e-9)
    kf32 = build(model, BACKENDS[backend], dtype=jnp.float32)
    ll32 = kf32.smooth(ys.astype(np.float32)).filtered.log_likelihood
    # float32 rounding of states ~3e3 alone moves it by ~0.01-0.1 nats, depending
    # on the order of the combines; the in-scan likelihood was 24-39 nats off
    assert abs(float(ll32) / ref - 1) < 1e-4, (float(ll32), ref)


# slow tier: test_log_likelihood_far_from_zero[associative] and
# test_kalman_stiff.py's float32 tests check each backend's float32 against float64
@pytest.mark.slow
def test_backends_agree_float32():
    rng = np.random.default_rng(8)
    model = random_model(rng, 4, 2)
    kfs = {k: build(model, s, dtype=jnp.float32) for k, s in BACKENDS.items()}
    ys = simulate(rng, model, FAR_T).astype(np.float32)
    a, b = (kfs[k].smooth(ys) for k in BACKENDS)
    np.testing.assert_allclose(a.means, b.means, atol=1e-4)
    np.testing.assert_allclose(a.covs, b.covs, atol=1e-5)
    np.testing.assert_allclose(
        a.filtered.log_likelihood, b.filtered.log_likelihood, rtol=1e-5
    )


def test_sample_follows_the_model():
    """With (almost) no noise the sample is the deterministic recursion."""
    rng = np.random.default_rng(2)
    model = random_model(rng, 3, 2, c=1)
    tiny = 1e-24
    model.update(Q=tiny * np.eye(3), R=tiny * np.eye(2), P0=tiny * np.eye(3))
    us = rng.normal(size=(10, 1))
    kf = build(model, eqx_seq.SequentialScan())
    xs, ys = kf.sample(jr.key(0), 10, us=us)
    x = model["m0"]
    for t in range(10):
        x = model["F"] @ x + model["B"] @ us[t]
        np.testing.assert_allclose(xs[t], x, atol=1e-9)
        np.testing.assert_allclose(
            ys[t], model["H"] @ x + model["D"] @ us[t], atol=1e-9
        )


def test_sample_noise_statistics():
    """The sampled observations have the model's stationary covariance."""
    kf = eqx_seq.KalmanFilter(2, 2, key=jr.key(3))  # stationary: Cov x = I
    xs, ys = jax.vmap(lambda k: kf.sample(k, 3))(jr.split(jr.key(4), 20_000))
    cov_x = np.cov(np.asarray(xs[:, -1]).T)
    cov_y = np.cov(np.asarray(ys[:, -1]).T)
    np.testing.assert_allclose(cov_x, np.eye(2), atol=0.05)
    np.testing.assert_allclose(cov_y, kf.H @ kf.H.T + kf.R, atol=0.06)


# slow tier: test_sample_noise_statistics checks the default initialisation's
# stationary covariance through its samples
@pytest.mark.slow
def test_init_is_stable_and_stationary(getkey):
    kf = eqx_seq.KalmanFilter(5, 3, control_size=2, key=getkey())
    assert np.allclose(np.abs(np.linalg.eigvals(kf.F)), 0.9)
    np.testing.assert_allclose(kf.F @ kf.P0 @ kf.F.T + kf.Q, kf.P0, atol=1e-6)
    assert kf.B.shape == (5, 2) and kf.D.shape == (3, 2)
    ys = jnp.ones((4, 3))
    assert kf(ys, us=jnp.ones((4, 2))).shape == (4, 5)


def test_any_parameter_values_give_a_valid_model(getkey):
    """The unconstrained factors always give positive-definite covariances."""
    # the shapes and backend of the "plain" case: its filter program is reused
    kf = eqx_seq.KalmanFilter(3, 2, scan=eqx_seq.SequentialScan(), key=getkey())
    noisy = jax.tree.map(
        lambda x: x + 3.0 * jr.normal(getkey(), x.shape, x.dtype),
        kf,
        is_leaf=eqx.is_inexact_array,
    )
    for M in (noisy.Q, noisy.R, noisy.P0):
        assert np.all(np.linalg.eigvalsh(np.asarray(M, np.float64)) > 0)
    _, ys, _ = case("plain")
    assert np.isfinite(noisy.log_likelihood(ys))


def test_from_matrices_round_trip():
    model = random_model(np.random.default_rng(5), 3, 2, c=1)
    kf = build(model, eqx_seq.AutoScan())
    for k in ("Q", "R", "P0"):
        np.testing.assert_allclose(getattr(kf, k), model[k], rtol=1e-12)
    assert kf.B.shape == (3, 1) and kf.control_size == 1
    # D defaults to zero when only B is given
    only_b = eqx_seq.KalmanFilter.from_matrices(
        model["F"], model["H"], model["Q"], model["R"], model["m0"], model["P0"],
        B=model["B"],
    )  # fmt: skip
    assert np.all(only_b.D == 0)


# slow tier: test_kalman_steady.py's test_steady_state_smoother_matches_reference
# checks the filter under `vmap` over a batch of sequences
@pytest.mark.slow
def test_jit_and_vmap_over_a_batch():
    model, ys, _ = case("missing")
    kf = build(model, eqx_seq.SequentialScan())
    batch = np.stack([ys, ys[::-1], np.nan_to_num(ys)])
    lls = eqx.filter_jit(jax.vmap(lambda y: kf.log_likelihood(y)))(batch)
    for b, ll in zip(batch, lls):
        np.testing.assert_allclose(ll, kf.log_likelihood(b), rtol=1e-12)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input(getkey):
    kf = eqx_seq.KalmanFilter(3, 2, key=getkey())
    with pytest.raises(ValueError, match="obs_size"):
        kf(jnp.ones((5, 3)))
    with pytest.raises(ValueError, match=r"\(T, obs_size\)"):
        kf.filter(jnp.ones((2, 5, 2)))
    with pytest.raises(ValueError, match="floating"):
        kf.smooth(jnp.ones((5, 2), jnp.int32))
    with pytest.raises(ValueError, match="control_size=0"):
        kf(jnp.ones((5, 2)), us=jnp.ones((5, 1)))
    with_u = eqx_seq.KalmanFilter(3, 2, control_size=1, key=getkey())
    with pytest.raises(ValueError, match="pass `us`"):
        with_u(jnp.ones((5, 2)))
    with pytest.raises(ValueError, match="control_size"):
        with_u(jnp.ones((5, 2)), us=jnp.ones((4, 1)))
    with pytest.raises(ValueError, match="scan"):
        eqx_seq.KalmanFilter(3, 2, scan="sequential", key=getkey())
    with pytest.raises(ValueError, match="state_size"):
        eqx_seq.KalmanFilter(0, 2, key=getkey())
    I2, I3 = np.eye(2), np.eye(3)
    m = np.zeros(3)
    with pytest.raises(ValueError, match="square"):
        eqx_seq.KalmanFilter.from_matrices(
            np.ones((3, 2)), np.ones((2, 3)), I3, I2, m, I3
        )
    with pytest.raises(ValueError, match="`H`"):
        eqx_seq.KalmanFilter.from_matrices(I3, np.ones((2, 4)), I3, I2, m, I3)
    with pytest.raises(ValueError, match="`R`"):
        eqx_seq.KalmanFilter.from_matrices(I3, np.ones((2, 3)), I3, I3, m, I3)
    with pytest.raises(ValueError, match="one length"):
        eqx_seq.KalmanFilter.from_matrices(
            np.stack([I3] * 4), np.ones((5, 2, 3)), I3, I2, m, I3
        )
    with pytest.raises(ValueError, match="columns"):
        eqx_seq.KalmanFilter.from_matrices(
            I3, np.ones((2, 3)), I3, I2, m, I3, B=np.ones((3, 1)), D=np.ones((2, 2))
        )
    tv = eqx_seq.KalmanFilter.from_matrices(
        np.stack([I3] * 4), np.ones((2, 3)), I3, I2, m, I3
    )
    with pytest.raises(ValueError, match="time-varying with 4 steps"):
        tv(jnp.ones((5, 2)))
    not_pd = np.diag([1.0, -1.0, 1.0])
    with pytest.raises(RuntimeError, match="`Q` must be symmetric positive definite"):
        eqx_seq.KalmanFilter.from_matrices(I3, np.ones((2, 3)), not_pd, I2, m, I3)
    asym = I2 + np.array([[0.0, 0.5], [0.0, 0.0]])
    with pytest.raises(RuntimeError, match="`R` must be symmetric positive definite"):
        eqx_seq.KalmanFilter.from_matrices(I3, np.ones((2, 3)), I3, asym, m, I3)
    # on a GPU the error comes with the result (asynchronous dispatch)
    with pytest.raises(RuntimeError, match="`P0`"):
        jax.block_until_ready(
            jax.jit(
                lambda P0: (
                    eqx_seq.KalmanFilter.from_matrices(
                        I3, np.ones((2, 3)), I3, I2, m, P0
                    ).P0
                )
            )(-np.eye(3))
        )


# --- matrix products at full precision (GPUs default to TF32 for float32) ---
def _dot_precisions(jaxpr, found):
    """The `precision` of every `dot_general` in `jaxpr` and the jaxprs inside it."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, ClosedJaxpr):
                    _dot_precisions(sub.jaxpr, found)
                elif isinstance(sub, Jaxpr):
                    _dot_precisions(sub, found)
    return found


# slow tier: the associative backend and missing data; [False-sequential] (fast)
# reads every program of the sequential backend, whose products the others share
# for the most part
@pytest.mark.parametrize(
    "backend", ["sequential", pytest.param("associative", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("missing", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_products_at_full_precision(backend, missing):
    """Every matrix product the filter traces asks for `Precision.HIGHEST`, also in
    its derivatives: with JAX's default, GPUs compute float32 products in TF32,
    too coarse for the float32 log-likelihood (the float32 tests here failed
    there). Read from the programs, so it is checked on any platform."""
    rng = np.random.default_rng(21)
    model = random_model(rng, 3, 2, c=1)
    T = 60  # past the 32 exact steps of float32: the steady-state path is traced
    us = rng.normal(size=(T, 1))
    ys = simulate(rng, model, T, us)
    if missing:
        ys[5, 0] = ys[9] = np.nan
    kf = build(model, BACKENDS[backend], dtype=jnp.float32)
    ys, us = jnp.asarray(ys, jnp.float32), jnp.asarray(us, jnp.float32)
    params, static = eqx.partition(kf, eqx.is_inexact_array)

    def ll(params, ys):
        return eqx.combine(params, static).log_likelihood(ys, us=us)

    def smoothed_means(params, ys):
        return jnp.sum(eqx.combine(params, static).smooth(ys, us=us).means)

    programs = {
        "filter": lambda: kf.filter(ys, us=us),
        "smooth": lambda: kf.smooth(ys, us=us),
        "log_likelihood": lambda: ll(params, ys),
        "grad log_likelihood": lambda: jax.grad(ll, argnums=(0, 1))(params, ys),
        "jvp log_likelihood": lambda: jax.jvp(ll, (params, ys), (params, ys)),
        "grad smooth": lambda: jax.grad(smoothed_means, argnums=(0, 1))(params, ys),
        "sample": lambda: kf.sample(jr.key(0), T, us=us),
        "Q, R, P0": lambda: (kf.Q, kf.R, kf.P0),
    }
    for name, fn in programs.items():
        found = _dot_precisions(jax.make_jaxpr(fn)().jaxpr, [])
        assert found, name  # the check is not vacuous
        highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
        assert all(p == highest for p in found), (name, set(found))


# --- what the filter asks of the backend: `parallel`, `associative_scan`, `select` ---


class _UserSequential(eqx_seq.AbstractLocalScan):
    parallel = False
    unroll = 1

    def recurrence(self, a, b, h0=None, *, reverse=False):
        return eqx_seq.SequentialScan().recurrence(a, b, h0, reverse=reverse)


class _UserParallel(eqx_seq.AbstractLocalScan):
    parallel = True
    unroll = 1

    def recurrence(self, a, b, h0=None, *, reverse=False):
        return eqx_seq.AssociativeScan().recurrence(a, b, h0, reverse=reverse)

    def associative_scan(self, fn, elems, *, reverse=False):
        return jax.lax.associative_scan(fn, elems, reverse=reverse)


class _PicksParallel(eqx_seq.AutoScan):
    """An automatic rule of one's own: layers run what `select` returns."""

    def select(self):
        return eqx_seq.AssociativeScan()


def test_user_backends():
    """A user's backend that declares `parallel` runs the matching algorithm: the
    same numbers as the library's backend of that kind; a parallel one runs its own
    `associative_scan`; `select()` is what every path reads (so an `AutoScan` whose
    rule picks the parallel backend runs it, on CPU too)."""
    model, ys, us = case("all")
    ref = {k: build(model, s).filter(ys, us=us) for k, s in BACKENDS.items()}
    tol = dict(rtol=1e-9, atol=1e-11)
    for scan, kind in [
        (_UserSequential(), "sequential"),
        (_UserParallel(), "associative"),
        (_PicksParallel(), "associative"),
    ]:
        out = build(model, scan).filter(ys, us=us)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref[kind])):
            np.testing.assert_allclose(a, b, **tol)
    kf = build(model, _UserSequential())
    f, sm, _, _ = reference(model, ys, us)
    np.testing.assert_allclose(kf.smooth(ys, us=us).means, sm, **tol)
    np.testing.assert_allclose(kf.log_likelihood(ys, us=us), f["ll"].sum(), **tol)


def test_user_backends_missing_what_the_filter_needs(getkey):
    """Never silently replaced: a backend without `parallel` cannot be made (the
    contract declares it), and a parallel one that keeps the one-element-after-
    another `associative_scan` is refused by the filter, with the reason."""

    class NoFlag(eqx_seq.AbstractLocalScan):
        unroll = 1

        def recurrence(self, a, b, h0=None, *, reverse=False):
            return b

    class NoPytreeScan(NoFlag):
        parallel = True

    with pytest.raises(TypeError, match="abstract class attributes {'parallel'}"):
        NoFlag()
    I2, I3 = np.eye(2), np.eye(3)
    for scan, match in [(NoPytreeScan(), "implement `associative_scan`")]:
        with pytest.raises(ValueError, match=match):
            eqx_seq.KalmanFilter(3, 2, scan=scan, key=getkey())
        with pytest.raises(ValueError, match=match):
            eqx_seq.KalmanFilter.from_matrices(
                I3, np.ones((2, 3)), I3, I2, np.zeros(3), I3, scan=scan
            )


# The files of `eqx_seq/_kalman/`, top down: each imports only files below it.
KALMAN_LAYERS = [
    ["_layer"],
    ["_em", "_fisher", "_predictive", "_sharded", "_continuous"],
    ["_m_step"],
    ["_e_step"],
    ["_dispatch"],
    ["_smoother"],
    ["_parallel"],
    ["_diffuse"],
    ["_filter"],
    ["_interface"],
    ["_model"],
    ["_linalg"],
]


def test_kalman_files_import_downwards():
    """The structure of `eqx_seq/_kalman/` (white-box, parsed, nothing run): only
    `_layer` (and the package's `__init__`) knows `KalmanFilter`, nothing imports
    under `TYPE_CHECKING`, and every file imports only files below it."""
    import ast
    import pathlib

    root = pathlib.Path(eqx_seq.__file__).parent / "_kalman"
    rank = {name: i for i, names in enumerate(KALMAN_LAYERS) for name in names}
    files = sorted(root.glob("*.py"))
    assert {f.stem for f in files} == set(rank) | {"__init__"}
    for f in files:
        source = f.read_text()
        assert "TYPE_CHECKING" not in source, f.name
        targets = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module is None:  # `from . import _x`
                    targets |= {a.name for a in node.names}
                else:
                    targets.add(node.module)
                    names = {a.name for a in node.names}
                    if f.stem not in ("__init__", "_layer"):
                        assert "KalmanFilter" not in names, f.name
        if f.stem in ("__init__", "_layer"):
            continue
        assert "_layer" not in targets, f.name
        below = [t for t in targets if rank[t] <= rank[f.stem]]
        assert not below, (f.name, below)
