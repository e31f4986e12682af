"""eqx_seq.KalmanFilter against a textbook float64 NumPy filter and RTS smoother."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqx_seq


BACKENDS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


# --- the reference: a textbook Kalman filter and RTS smoother in NumPy, float64 ---
def _at(x, t):
    return x[t] if x.ndim == 3 else x


def np_filter(F, H, Q, R, m0, P0, ys, B=None, D=None, us=None):
    """Predict, then condition on the observed entries of y_t (missing ones dropped)."""
    T, p = ys.shape
    m, P = m0, P0
    out = {k: [] for k in ("m", "P", "mp", "Pp", "ll")}
    for t in range(T):
        Ft = _at(F, t)
        mp = Ft @ m + (B @ us[t] if B is not None else 0)
        Pp = Ft @ P @ Ft.T + _at(Q, t)
        o = ~np.isnan(ys[t])
        if o.any():
            Ho = _at(H, t)[o]
            yo = ys[t][o] - (D @ us[t] if D is not None else np.zeros(p))[o]
            S = Ho @ Pp @ Ho.T + _at(R, t)[np.ix_(o, o)]
            K = np.linalg.solve(S, Ho @ Pp).T
            v = yo - Ho @ mp
            m, P = mp + K @ v, Pp - K @ S @ K.T
            _, logdet = np.linalg.slogdet(S)
            ll = -0.5 * (
                o.sum() * np.log(2 * np.pi) + logdet + v @ np.linalg.solve(S, v)
            )
        else:
            m, P, ll = mp, Pp, 0.0
        for k, v in zip(("m", "P", "mp", "Pp", "ll"), (m, P, mp, Pp, ll)):
            out[k].append(v)
    return {k: np.array(v) for k, v in out.items()}


def np_smoother(F, f):
    """Rauch-Tung-Striebel from the filter's output."""
    T = len(f["m"])
    ms, Ps, cross = [f["m"][-1]], [f["P"][-1]], []
    for t in range(T - 2, -1, -1):
        Fn = _at(F, t + 1)
        G = f["P"][t] @ Fn.T @ np.linalg.inv(f["Pp"][t + 1])
        cross.append(G @ Ps[0])
        ms.insert(0, f["m"][t] + G @ (ms[0] - f["mp"][t + 1]))
        Ps.insert(0, f["P"][t] + G @ (Ps[0] - f["Pp"][t + 1]) @ G.T)
    return np.array(ms), np.array(Ps), np.array(cross[::-1])


# --- models ---
def random_spd(rng, n, scale=1.0):
    A = rng.normal(size=(n, n))
    return scale * (A @ A.T / n + 0.3 * np.eye(n))


def random_model(rng, n, p, *, T=None, c=0):
    """A random stable model; time-varying F, H, Q, R when T is given."""

    def stack(f):
        return f() if T is None else np.stack([f() for _ in range(T)])

    def transition():
        U, _ = np.linalg.qr(rng.normal(size=(n, n)))
        return 0.95 * U

    model = dict(
        F=stack(transition),
        H=stack(lambda: rng.normal(size=(p, n))),
        Q=stack(lambda: random_spd(rng, n, 0.3)),
        R=stack(lambda: random_spd(rng, p, 0.5)),
        m0=rng.normal(size=n),
        P0=random_spd(rng, n),
    )
    if c:
        model["B"] = rng.normal(size=(n, c))
        model["D"] = rng.normal(size=(p, c))
    return model


def simulate(rng, model, T, us=None):
    """Observations from the model, in NumPy."""
    x = rng.multivariate_normal(model["m0"], model["P0"])
    ys = []
    for t in range(T):
        x = _at(model["F"], t) @ x + rng.multivariate_normal(
            np.zeros(len(x)), _at(model["Q"], t)
        )
        y = _at(model["H"], t) @ x + rng.multivariate_normal(
            np.zeros(_at(model["R"], t).shape[0]), _at(model["R"], t)
        )
        if us is not None:
            x = x + model["B"] @ us[t]
            y = y + model["D"] @ us[t] + _at(model["H"], t) @ model["B"] @ us[t]
        ys.append(y)
    return np.array(ys)


def filter_reference(model, ys, us=None):
    return np_filter(
        model["F"], model["H"], model["Q"], model["R"], model["m0"], model["P0"], ys,
        model.get("B"), model.get("D"), us,
    )  # fmt: skip


def reference(model, ys, us=None):
    f = filter_reference(model, ys, us)
    sm, sP, cross = np_smoother(model["F"], f)
    return f, sm, sP, cross


def assert_filtered(out, f, **tol):
    """A `KalmanFilterResult` equals the reference filter's output `f`."""
    np.testing.assert_allclose(out.means, f["m"], **tol)
    np.testing.assert_allclose(out.covs, f["P"], **tol)
    np.testing.assert_allclose(out.predicted_means, f["mp"], **tol)
    np.testing.assert_allclose(out.predicted_covs, f["Pp"], **tol)
    np.testing.assert_allclose(out.log_likelihoods, f["ll"], **tol)
    np.testing.assert_allclose(out.log_likelihood, f["ll"].sum(), **tol)


def build(model, scan, dtype=None):
    return eqx_seq.KalmanFilter.from_matrices(
        model["F"], model["H"], model["Q"], model["R"], model["m0"], model["P0"],
        B=model.get("B"), D=model.get("D"), scan=scan, dtype=dtype,
    )  # fmt: skip


CASES = ["plain", "time_varying", "controls", "missing", "all"]


def case(name, seed=0):
    rng = np.random.default_rng(seed)
    n, p, T = 3, 2, 37
    tv = name in ("time_varying", "all")
    c = 2 if name in ("controls", "all") else 0
    model = random_model(rng, n, p, T=T if tv else None, c=c)
    us = rng.normal(size=(T, c)) if c else None
    ys = simulate(rng, model, T, us)
    if name in ("missing", "all"):
        ys[3] = np.nan  # a whole step
        ys[[5, 11, 20], 1] = np.nan  # single entries
        ys[[8, 30], 0] = np.nan
        ys[-1] = np.nan  # the last step too
    return model, ys, us


# Fast cases: "all" (time-varying + controls + missing) covers each feature on both
# backends; "plain" and "missing" share one program. The single-feature cases add
# no property that "all" does not check, so they run with `-m slow` only.
PAIRS = [
    ("sequential", "plain"),
    ("sequential", "missing"),
    ("sequential", "all"),
    ("associative", "plain"),
    ("associative", "all"),
] + [
    pytest.param(b, c, marks=pytest.mark.slow)
    for b, c in [
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


@pytest.mark.parametrize("backend", list(BACKENDS))
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


def _directional_fd(fn, tree, direction, eps=1e-6):
    plus = jax.tree.map(lambda x, d: x + eps * d, tree, direction)
    minus = jax.tree.map(lambda x, d: x - eps * d, tree, direction)
    return (fn(plus) - fn(minus)) / (2 * eps)


@pytest.mark.parametrize(
    "backend,name",
    [
        ("sequential", "all"),
        ("associative", "all"),
        pytest.param("sequential", "missing", marks=pytest.mark.slow),
    ],
)
def test_gradient_matches_finite_differences(backend, name):
    """`log_likelihood` (Fisher's identity) plus a weighted sum of the filtered means.

    The means' gradient is plain autodiff through the filter; the same loss with
    `filter(...).log_likelihood` (plain autodiff) must give the same gradient, with
    respect to the parameters, the observations and the controls.
    """
    model, ys, us = case(name, seed=3)
    kf = build(model, BACKENDS[backend])
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    ys_j = jnp.asarray(ys)
    us_j = None if us is None else jnp.asarray(us)
    obs = ~np.isnan(ys)
    w = np.random.default_rng(1).normal(size=(ys.shape[0], 3)) / ys.shape[0]

    @ft.partial(jax.jit, static_argnames="fisher")
    def loss(params, ys, us, fisher=True):
        kf = eqx.combine(params, static)
        out = kf.filter(ys, us=us)
        ll = kf.log_likelihood(ys, us=us) if fisher else out.log_likelihood
        return ll + jnp.sum(w * out.means)

    @jax.jit
    def grads(params, ys, us):
        g = jax.grad(loss, argnums=(0, 1, 2))
        return g(params, ys, us), g(params, ys, us, fisher=False)

    (grad_p, grad_y, grad_u), plain = grads(params, ys_j, us_j)
    for a, b in zip(jax.tree.leaves((grad_p, grad_y, grad_u)), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
    assert np.all(np.asarray(grad_y)[~obs] == 0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        direction = jax.tree.map(
            lambda x: jnp.asarray(rng.normal(size=x.shape)), params
        )
        fd = _directional_fd(lambda q: loss(q, ys_j, us_j), params, direction)
        ad = sum(
            jnp.vdot(g, d)
            for g, d in zip(jax.tree.leaves(grad_p), jax.tree.leaves(direction))
        )
        np.testing.assert_allclose(ad, fd, rtol=1e-6)
    # every parameter matters, and gets its own check
    for leaf, g in zip(jax.tree.leaves(params), jax.tree.leaves(grad_p)):
        assert g.shape == leaf.shape and np.all(np.isfinite(g))
    y_dir = np.where(obs, rng.normal(size=ys.shape), 0)
    fd_y = _directional_fd(lambda y: loss(params, y, us_j), ys_j, jnp.asarray(y_dir))
    np.testing.assert_allclose(jnp.vdot(grad_y, y_dir), fd_y, rtol=1e-6)
    if us is not None:
        u_dir = jnp.asarray(rng.normal(size=us.shape))
        fd_u = _directional_fd(lambda u: loss(params, ys_j, u), us_j, u_dir)
        np.testing.assert_allclose(jnp.vdot(grad_u, u_dir), fd_u, rtol=1e-6)


def test_fisher_gradient_forward_mode_and_second_order():
    """The custom JVP: forward mode, and Hessian-vector products (through the
    smoother's statistics), equal plain autodiff through the filter."""
    model, ys, _ = case("missing", seed=4)
    kf = build(model, eqx_seq.SequentialScan())
    params, static = eqx.partition(kf, eqx.is_inexact_array)

    def fisher(p):
        return eqx.combine(p, static).log_likelihood(ys)

    def plain(p):
        return eqx.combine(p, static).filter(ys).log_likelihood

    rng = np.random.default_rng(5)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)

    @jax.jit
    def run(params, direction):
        out = {}
        for name, f in (("fisher", fisher), ("plain", plain)):
            out[name] = (
                jax.jvp(f, (params,), (direction,)),
                jax.jvp(jax.grad(f), (params,), (direction,))[1],
            )
        return out

    out = run(params, direction)
    (v_f, t_f), hvp_f = out["fisher"]
    (v_p, t_p), hvp_p = out["plain"]
    np.testing.assert_allclose(v_f, v_p, rtol=1e-12)
    np.testing.assert_allclose(t_f, t_p, rtol=1e-9)
    for a, b in zip(jax.tree.leaves(hvp_f), jax.tree.leaves(hvp_p)):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)


def test_float32_long_run_agrees_with_float64():
    """T=100k in float32: finite, log-likelihood within 1e-3 relative of float64,
    and its gradient (Fisher's identity) within 5e-3 of float64's, leaf by leaf."""
    rng = np.random.default_rng(7)
    model = random_model(rng, 4, 2)
    kf64 = build(model, eqx_seq.SequentialScan())
    _, ys = kf64.sample(jr.key(0), 100_000)
    kf32 = build(model, eqx_seq.SequentialScan(), dtype=jnp.float32)

    @eqx.filter_jit
    def run(kf, ys):
        out = kf.filter(ys)
        return out, eqx.filter_grad(lambda kf: kf.log_likelihood(ys))(kf)

    out32, g32 = run(kf32, ys.astype(jnp.float32))
    out64, g64 = run(kf64, ys)
    assert np.all(np.isfinite(out32.means)) and np.all(np.isfinite(out32.covs))
    rel = float(out32.log_likelihood) / float(out64.log_likelihood) - 1
    assert abs(rel) < 1e-3
    # measured 3e-7 .. 1.9e-3 per leaf (plain autodiff in float32: 3e-7 .. 1.7e-3;
    # the largest is the R factor's, whose gradient is a small sum of 1e5 terms)
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g64)):
        assert np.all(np.isfinite(a))
        err = np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
        assert err < 5e-3, err


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


def test_jit_and_vmap_over_a_batch():
    model, ys, _ = case("missing")
    kf = build(model, eqx_seq.SequentialScan())
    batch = np.stack([ys, ys[::-1], np.nan_to_num(ys)])
    lls = eqx.filter_jit(jax.vmap(lambda y: kf.log_likelihood(y)))(batch)
    for b, ll in zip(batch, lls):
        np.testing.assert_allclose(ll, kf.log_likelihood(b), rtol=1e-12)


def test_vmap_branches_once_for_the_batch():
    """Under `vmap` the complete-data branch is taken for the whole batch or not at
    all (`_all_observed` answers for the batch, so the `lax.cond` stays a branch
    instead of a `select` that runs both). A batch with one missing entry runs the
    exact filter for all its sequences: the same numbers, to round-off, as each
    sequence alone (where a complete one settles into the steady state)."""
    from eqx_seq import _kalman

    rng = np.random.default_rng(14)
    model = random_model(rng, 3, 2)
    ys = simulate(rng, model, STEADY_T)
    gappy = ys[::-1].copy()
    gappy[40, 1] = np.nan
    kf = build(model, eqx_seq.SequentialScan())
    assert _settled(kf, jnp.asarray(ys))
    obs = ~np.isnan(np.stack([ys, gappy]))
    np.testing.assert_array_equal(jax.vmap(_kalman._all_observed)(obs), [False] * 2)
    np.testing.assert_array_equal(
        jax.vmap(jax.vmap(_kalman._all_observed))(
            np.stack([obs, obs[:1].repeat(2, 0)])
        ),
        [[False] * 2] * 2,
    )
    assert bool(jax.vmap(_kalman._all_observed)(obs[:1].repeat(3, 0))[0])
    params, static = eqx.partition(kf, eqx.is_inexact_array)

    def ll(params, y):
        return eqx.combine(params, static).log_likelihood(y)

    tol = dict(rtol=1e-9, atol=1e-11)
    for batch in ([ys, gappy], [ys, ys[::-1]]):
        batch = jnp.asarray(np.stack(batch))
        filtered = jax.vmap(kf.filter)(batch)
        values, grads = jax.vmap(jax.value_and_grad(ll), in_axes=(None, 0))(
            params, batch
        )
        for i, y in enumerate(batch):
            alone = kf.filter(y)
            np.testing.assert_allclose(filtered.means[i], alone.means, **tol)
            np.testing.assert_allclose(filtered.covs[i], alone.covs, **tol)
            value, grad = jax.value_and_grad(ll)(params, y)
            np.testing.assert_allclose(values[i], value, **tol)
            for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(grad)):
                np.testing.assert_allclose(g[i], h, **tol)


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


@pytest.mark.slow
def test_bench_kalman_quick(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_kalman.py", "--quick", "--repeats", "1",
         "--json", str(tmp_path / "k.json")],
        cwd=root, capture_output=True, text=True, timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "seq filter" in out.stdout and (tmp_path / "k.json").exists()


def test_gradient_with_missing_data_does_not_hang():
    """Regression: with missing observations the per-step whitening factored a
    Cholesky per step with batched LAPACK; two such calls scheduled at once by
    XLA:CPU deadlocked on a 2-core machine (state 16 / obs 8, T = 2000-10000, most
    runs). `_small_linalg` replaced them. Run in a subprocess so that a hang fails
    the test instead of stalling the worker."""
    import os
    import subprocess
    import sys

    script = (
        "import jax, jax.numpy as jnp, jax.random as jr, equinox as eqx, eqx_seq\n"
        "scan = eqx_seq.SequentialScan()\n"
        "kf = eqx_seq.KalmanFilter(16, 8, scan=scan, key=jr.key(0))\n"
        "_, ys = kf.sample(jr.key(1), 3000)\n"
        "ys = ys.at[5, 0].set(jnp.nan)\n"
        "grad = eqx.filter_jit(eqx.filter_grad(lambda kf: kf.log_likelihood(ys)))\n"
        "for _ in range(5):\n"
        "    g = jax.block_until_ready(grad(kf))\n"
        "ok = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))\n"
        "print('finite' if ok else 'not finite')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root, capture_output=True, text=True, timeout=240,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("finite") and "not" not in out.stdout


# --- the steady-state filter: time-invariant model, complete data, T > K ---


def _settled(kf, ys, us=None):
    """Whether the steady-state path is taken (white-box: the filter's own test)."""
    from eqx_seq import _kalman

    params, static = eqx.partition(kf, eqx.is_inexact_array)
    return bool(
        eqx.filter_jit(_kalman._steady_log_likelihood)(params, ys, us, static)[1]
    )


def _stacked(model, T):
    """The same model with F given per step: time-varying, so every step is exact."""
    return {**model, "F": np.broadcast_to(model["F"], (T, *model["F"].shape))}


STEADY_T = 300  # > 128 + 1 exact steps (float64)


def test_steady_state_filter_matches_reference():
    """After the covariance settles the filter runs the steady-state recursion; its
    means, covariances and log-likelihoods must still be the textbook filter's, also
    under `vmap` over sequences."""
    rng = np.random.default_rng(11)
    model = random_model(rng, 3, 2, c=2)
    us = rng.normal(size=(STEADY_T, 2))
    ys = simulate(rng, model, STEADY_T, us)
    kf = build(model, eqx_seq.SequentialScan())
    assert _settled(kf, jnp.asarray(ys), jnp.asarray(us))
    f = filter_reference(model, ys, us)
    batch = jax.vmap(lambda y, u: kf.filter(y, us=u))(
        jnp.stack([ys, ys[::-1]]), jnp.stack([us, us[::-1]])
    )
    out = jax.tree.map(lambda x: x[0], batch)
    tol = dict(rtol=1e-9, atol=1e-11)
    assert_filtered(out, f, **tol)
    np.testing.assert_allclose(kf.log_likelihood(ys, us=us), f["ll"].sum(), **tol)
    rev = kf.filter(ys[::-1], us=us[::-1])
    np.testing.assert_allclose(batch.means[1], rev.means, **tol)


def test_steady_state_float32():
    """State 8 / obs 4 in float32 (settles after the 32 exact steps): within
    float32 round-off of the float64 textbook filter."""
    rng = np.random.default_rng(12)
    model = random_model(rng, 8, 4)
    ys = simulate(rng, model, 200)
    kf = build(model, eqx_seq.SequentialScan(), dtype=jnp.float32)
    ys32 = jnp.asarray(ys, jnp.float32)
    assert _settled(kf, ys32)
    f = filter_reference(model, ys)
    out = jax.tree.map(lambda x: np.asarray(x, np.float64), kf.filter(ys32))
    scale = np.abs(f["m"]).max()
    assert np.abs(out.means - f["m"]).max() < 1e-5 * scale
    assert np.abs(out.covs - f["P"]).max() < 1e-5 * np.abs(f["P"]).max()
    assert abs(float(out.log_likelihood) / f["ll"].sum() - 1) < 1e-5


def _steady_gradient_case():
    rng = np.random.default_rng(13)
    model = random_model(rng, 3, 2, c=1)
    us = jnp.asarray(rng.normal(size=(STEADY_T, 1)))
    ys = jnp.asarray(simulate(rng, model, STEADY_T, np.asarray(us)))

    def ll(params, static, ys, us):
        return eqx.combine(params, static).log_likelihood(ys, us=us)

    grad = jax.jit(jax.grad(ll, argnums=(0, 2, 3)), static_argnums=1)
    return rng, model, ys, us, ll, grad


def test_steady_state_gradient():
    """`log_likelihood`'s gradient on the steady-state path (plain autodiff through
    it) equals the exact path's (the same model with a per-step F, which goes
    through Fisher's identity), w.r.t. parameters, observations and controls, and
    finite differences; forward mode works too."""
    rng, model, ys, us, ll, grad = _steady_gradient_case()
    kf = build(model, eqx_seq.SequentialScan())
    kf_tv = build(_stacked(model, STEADY_T), eqx_seq.SequentialScan())
    assert _settled(kf, ys, us)
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    g_p, g_y, g_u = grad(params, static, ys, us)
    t_p, t_y, t_u = grad(*eqx.partition(kf_tv, eqx.is_inexact_array), ys, us)
    t_p = eqx.tree_at(lambda k: k.F, t_p, t_p.F.sum(0))
    for a, b in zip(jax.tree.leaves((g_p, g_y, g_u)), jax.tree.leaves((t_p, t_y, t_u))):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    loss = jax.jit(lambda p: ll(p, static, ys, us))
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    fd = _directional_fd(loss, params, d)
    ad = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(g_p), jax.tree.leaves(d)))
    np.testing.assert_allclose(ad, fd, rtol=1e-6)
    tangent = jax.jit(lambda p, d: jax.jvp(loss, (p,), (d,))[1])(params, d)
    np.testing.assert_allclose(tangent, ad, rtol=1e-9)


@pytest.mark.slow
def test_steady_state_hessian_vector_products():
    """Forward-over-reverse through the steady-state path, against differences of
    gradients (slow: compiling the second-order program takes ~25 s)."""
    rng, model, ys, us, ll, grad = _steady_gradient_case()
    params, static = eqx.partition(
        build(model, eqx_seq.SequentialScan()), eqx.is_inexact_array
    )
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    hvp = jax.jit(
        lambda p, d: jax.jvp(lambda q: grad(q, static, ys, us)[0], (p,), (d,))[1]
    )(params, d)
    eps = 1e-5
    plus, minus = (
        grad(jax.tree.map(lambda x, v: x + s * v, params, d), static, ys, us)[0]
        for s in (eps, -eps)
    )
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (hvp, plus, minus))):
        np.testing.assert_allclose(a, (b - c) / (2 * eps), rtol=1e-5, atol=1e-7)


def test_steady_state_not_settled_falls_back():
    """A covariance still moving after the exact head (a slow, barely observed
    state): every step stays exact, and the gradient (Fisher's identity, after the
    steady-state attempt) matches finite differences."""
    rng = np.random.default_rng(14)
    n, p = 2, 1
    c, s = np.cos(0.01), np.sin(0.01)
    model = dict(
        F=0.9995 * np.array([[c, -s], [s, c]]), H=np.array([[0.02, 0.01]]),
        Q=1e-3 * np.eye(n), R=np.eye(p), m0=np.zeros(n), P0=np.eye(n),
    )  # fmt: skip
    ys = simulate(rng, model, STEADY_T)
    kf = build(model, eqx_seq.SequentialScan())
    assert not _settled(kf, jnp.asarray(ys))
    f = filter_reference(model, ys)
    out = kf.filter(ys)
    np.testing.assert_allclose(out.means, f["m"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.covs, f["P"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.log_likelihood, f["ll"].sum(), rtol=1e-12)
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    loss = jax.jit(lambda q: eqx.combine(q, static).log_likelihood(ys))
    g = jax.jit(jax.grad(loss))(params)
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    ad = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(d)))
    np.testing.assert_allclose(ad, _directional_fd(loss, params, d), rtol=1e-6)


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


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("missing", [False, True])
def test_products_at_full_precision(backend, missing):
    """Every matrix product the filter traces asks for `Precision.HIGHEST`, also in
    its derivatives: with JAX's default, an H100 computed float32 products in TF32
    and the float32 log-likelihood came out 20% off (the float32 tests here failed
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
