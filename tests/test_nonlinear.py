"""eqx_seq.NonlinearKalmanFilter against textbook float64 NumPy filters and
smoothers (extended, cubature, unscented; Sarkka, *Bayesian Filtering and
Smoothing*, 2013), the linear Kalman filter on a linear model, the MAP optimality
of the iterated extended smoother, the backends (one device, in parallel in time,
two devices), derivatives against finite differences, float32 on a stiff model,
sampling and bad input.

The tests call the layer's own compiled entry points, so that the tests of one
model structure share its programs (the finite differences run them, compiling
nothing); the method and prior combinations beyond one of each run with `-m slow`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array

import eqx_seq


DT = 0.1
METHODS = ("extended", "cubature", "unscented")


# --- the model: a pendulum, the angle seen through a sine ---
class Pendulum(eqx.Module):
    """`f(x, u) = [x0 + dt x1, x1 - g dt sin x0 + dt u0]`, `g` learnt."""

    g: Array

    def __call__(self, x, u=None):
        out = jnp.stack([x[0] + DT * x[1], x[1] - self.g * DT * jnp.sin(x[0])])
        return out if u is None else out + jnp.stack([jnp.zeros_like(u[0]), DT * u[0]])


def observe(x, u=None):
    """`h(x, u) = [sin x0 + u1, x1 / 2 + x0^2 / 5]`."""
    out = jnp.stack([jnp.sin(x[0]), 0.5 * x[1] + 0.2 * x[0] ** 2])
    return out if u is None else out + jnp.stack([u[1], jnp.zeros_like(u[1])])


# the same in NumPy, with their Jacobians by hand
def f_np(x, u, g):
    out = np.array([x[0] + DT * x[1], x[1] - g * DT * np.sin(x[0])])
    return out if u is None else out + np.array([0.0, DT * u[0]])


def F_np(x, g):
    return np.array([[1.0, DT], [-g * DT * np.cos(x[0]), 1.0]])


def h_np(x, u):
    out = np.array([np.sin(x[0]), 0.5 * x[1] + 0.2 * x[0] ** 2])
    return out if u is None else out + np.array([u[1], 0.0])


def H_np(x):
    return np.array([[np.cos(x[0]), 0.0], [0.4 * x[0], 0.5]])


G = 9.81
PARAMS = dict(
    Q=0.5 * np.array([[DT**3 / 3, DT**2 / 2], [DT**2 / 2, DT]]) + 1e-3 * np.eye(2),
    R=np.array([[0.05, 0.01], [0.01, 0.08]]),
    m0=np.array([1.2, -0.3]),
    P0=np.array([[0.2, 0.05], [0.05, 0.3]]),
)


def simulate(rng, T, us=None, prior_at="x0", g=G, params=PARAMS):
    """States and observations drawn in NumPy."""
    p = params
    x = rng.multivariate_normal(p["m0"], p["P0"])
    xs, ys = [], []
    for t in range(T):
        u = None if us is None else us[t]
        if t > 0 or prior_at == "x0":
            x = f_np(x, u, g) + rng.multivariate_normal(np.zeros(2), p["Q"])
        xs.append(x)
        ys.append(h_np(x, u) + rng.multivariate_normal(np.zeros(2), p["R"]))
    return np.array(xs), np.array(ys)


def with_missing(ys):
    ys = ys.copy()
    ys[4] = np.nan  # a whole step
    ys[[7, 15], 0] = np.nan  # single entries
    ys[[10, 21], 1] = np.nan
    ys[-1] = np.nan  # the last step too
    return ys


def case(name, T=30, seed=0):
    """`"x0"`: prior on x_0, no controls; `"x1"`: prior on x_1, controls in `f` and
    `h`. Both with missing entries."""
    rng = np.random.default_rng(seed)
    prior_at = name
    us = rng.normal(size=(T, 2)) if name == "x1" else None
    _, ys = simulate(rng, T, us, prior_at)
    return with_missing(ys), us, prior_at


def build(
    prior_at="x0", controls=False, g=G, dtype=None, scan=eqx_seq.SequentialScan(),
    params=PARAMS, observation=observe, **options,
):  # fmt: skip
    p = params
    return eqx_seq.NonlinearKalmanFilter(
        Pendulum(jnp.asarray(g, dtype)), observation, Q=p["Q"], R=p["R"], m0=p["m0"],
        P0=p["P0"], control_size=2 if controls else 0, prior_at=prior_at,
        dtype=dtype, scan=scan, **options,
    )  # fmt: skip


# --- the reference: textbook filters and RTS smoothers in NumPy, float64 ---
def np_points(method, n, alpha=math.sqrt(3), beta=2.0, kappa=1.0):
    """Unit sigma points (rows) and mean and covariance weights: the cubature rule
    (Arasaratnam & Haykin 2009), the unscented transform (Wan & van der Merwe)."""
    if method == "cubature":
        xi = math.sqrt(n) * np.vstack([np.eye(n), -np.eye(n)])
        w = np.full(2 * n, 0.5 / n)
        return xi, w, w
    lam = alpha**2 * (n + kappa) - n
    xi = np.vstack(
        [np.zeros(n), math.sqrt(n + lam) * np.vstack([np.eye(n), -np.eye(n)])]
    )
    wm = np.full(2 * n + 1, 0.5 / (n + lam))
    wm[0] = lam / (n + lam)
    wc = wm.copy()
    wc[0] += 1 - alpha**2 + beta
    return xi, wm, wc


def np_moments(g, jac, m, P, points):
    """`E[g(x)]`, `Cov[g(x)]`, `Cov[x, g(x)]` for `x ~ N(m, P)`: linearised at
    the mean (`points` is None), or by the sigma points of `P`'s Cholesky factor."""
    if points is None:
        J = jac(m)
        return g(m), J @ P @ J.T, P @ J.T
    xi, wm, wc = points
    X = m + xi @ np.linalg.cholesky(P).T
    Y = np.array([g(x) for x in X])
    ybar = wm @ Y
    dY, dX = Y - ybar, X - m
    return ybar, (wc * dY.T) @ dY, (wc * dX.T) @ dY


def np_filter_smoother(ys, us, prior_at, method, g=G, unscented=()):
    """The extended / cubature / unscented Kalman filter (covariance form), each
    step's observation conditioned on its observed entries only, and the
    extended / sigma-point RTS smoother (Sarkka 2013, Algorithms 9.3 and 9.5)."""
    p = PARAMS
    Q, R = p["Q"], p["R"]
    points = None if method == "extended" else np_points(method, 2, *unscented)
    m, P = p["m0"], p["P0"]
    out = {k: [] for k in ("m", "P", "mp", "Pp", "ll", "D")}
    for t in range(len(ys)):
        u = None if us is None else us[t]
        fbar, Pff, D = np_moments(
            lambda x: f_np(x, u, g), lambda x: F_np(x, g), m, P, points
        )
        if t == 0 and prior_at == "x1":
            mp, Pp = p["m0"], p["P0"]
        else:
            mp, Pp = fbar, Pff + Q
        ybar, Pyy, Pxy = np_moments(lambda x: h_np(x, u), H_np, mp, Pp, points)
        o = ~np.isnan(ys[t])
        if o.any():
            S = Pyy[np.ix_(o, o)] + R[np.ix_(o, o)]
            K = Pxy[:, o] @ np.linalg.inv(S)
            v = ys[t][o] - ybar[o]
            m, P = mp + K @ v, Pp - K @ S @ K.T
            ll = -0.5 * (
                o.sum() * np.log(2 * np.pi)
                + np.linalg.slogdet(S)[1]
                + v @ np.linalg.solve(S, v)
            )
        else:
            m, P, ll = mp, Pp, 0.0
        for k, val in zip(out, (m, P, mp, Pp, ll, D)):
            out[k].append(val)
    out = {k: np.array(v) for k, v in out.items()}
    # RTS: D[t+1] = Cov[x_t, f(x_t)] under the filtered N(m_t, P_t)
    T = len(ys)
    ms, Ps, cross = [out["m"][-1]], [out["P"][-1]], []
    for t in range(T - 2, -1, -1):
        Gain = out["D"][t + 1] @ np.linalg.inv(out["Pp"][t + 1])
        cross.insert(0, Gain @ Ps[0])
        ms.insert(0, out["m"][t] + Gain @ (ms[0] - out["mp"][t + 1]))
        Ps.insert(0, out["P"][t] + Gain @ (Ps[0] - out["Pp"][t + 1]) @ Gain.T)
    out.update(sm=np.array(ms), sP=np.array(Ps), cross=np.array(cross))
    return out


# --- 1. the textbook filters and smoothers ---
UNSCENTED_OTHER = (0.5, 2.0, 1.0)  # a negative mean weight, positive covariance ones


@pytest.mark.parametrize(
    "name",
    [
        "x0",
        # slow tier: the same check with controls and the prior on x_1, which run
        # fast in test_ieks_is_the_map_trajectory[x1] and the split smoother's test
        pytest.param("x1", marks=pytest.mark.slow),
    ],
)
def test_filters_and_smoothers_match_textbook(name):
    """Means, covariances (filtered, predicted, smoothed, cross) and
    log-likelihoods of the extended, cubature and unscented filters and RTS
    smoothers equal the covariance-form textbook recursions, with missing entries
    (a whole step, single entries of a correlated 2-D observation), for both prior
    conventions, with controls in `f` and `h` (`"x1"`); the unscented transform
    with the default parameters and others (`"x0"`)."""
    ys, us, prior_at = case(name)
    model = build(prior_at, controls=us is not None)
    models = {k: model for k in METHODS}
    refs = {k: np_filter_smoother(ys, us, prior_at, k) for k in METHODS}
    if name == "x0":
        models["unscented/other"] = build(prior_at, unscented=UNSCENTED_OTHER)
        refs["unscented/other"] = np_filter_smoother(
            ys, us, prior_at, "unscented", unscented=UNSCENTED_OTHER
        )
    # the layer's own compiled programs, which the other tests of these structures
    # share (a program per method)
    out = {k: m.smooth(ys, us=us, method=k.split("/")[0]) for k, m in models.items()}
    tol = dict(rtol=1e-10, atol=1e-12)
    for k, ref in refs.items():
        r, f = out[k], out[k].filtered
        for got, want in [
            (f.means, ref["m"]),
            (f.covs, ref["P"]),
            (f.predicted_means, ref["mp"]),
            (f.predicted_covs, ref["Pp"]),
            (f.log_likelihoods, ref["ll"]),
            (f.log_likelihood, ref["ll"].sum()),
            (r.means, ref["sm"]),
            (r.covs, ref["sP"]),
            (r.cross_covs, ref["cross"]),
        ]:
            np.testing.assert_allclose(got, want, **tol, err_msg=k)
        assert int(r.num_iterations) == 1 and bool(r.converged)
    # the methods differ on this model (the comparison is not vacuous)
    assert np.abs(refs["extended"]["m"] - refs["cubature"]["m"]).max() > 1e-3
    assert np.abs(refs["unscented"]["m"] - refs["cubature"]["m"]).max() > 1e-4
    if name == "x0":
        other = refs["unscented/other"]["m"] - refs["unscented"]["m"]
        assert np.abs(other).max() > 1e-5


# --- 2. a linear model: every method is the Kalman filter ---
class Affine(eqx.Module):
    """`x -> M x + B u`."""

    M: Array
    B: Array

    def __call__(self, x, u):
        return self.M @ x + self.B @ u


def _linear_case(seed=3, T=24):
    rng = np.random.default_rng(seed)
    n, p, c = 3, 2, 1
    U, _ = np.linalg.qr(rng.normal(size=(n, n)))

    def spd(k, scale):
        A = rng.normal(size=(k, k))
        return scale * (A @ A.T / k + 0.3 * np.eye(k))

    mats = dict(
        F=0.95 * U,
        H=rng.normal(size=(p, n)),
        Q=np.stack([spd(n, 0.3) for _ in range(T)]),  # one per step
        R=spd(p, 0.5),
        m0=rng.normal(size=n),
        P0=spd(n, 1.0),
        B=rng.normal(size=(n, c)),
        D=rng.normal(size=(p, c)),
    )
    us = rng.normal(size=(T, c))
    ys = with_missing(rng.normal(size=(T, p)))
    return mats, ys, us


@eqx.filter_jit
def _linear_outputs(nkf, kf, ys, us, method):
    T, n = ys.shape[0], nkf.state_size
    # any trajectory: the linearisation of a linear model is exact
    init = (jnp.zeros((T, n)), jnp.broadcast_to(jnp.eye(n), (T, n, n)))
    return {
        "kalman": kf.smooth(ys, us=us),
        method: nkf.smooth(ys, us=us, method=method),
        method + "/iterated": nkf.smooth(
            ys, us=us, method=method, iterated=True, init=init
        ),
    }


# all with `-m slow` (an iterated smoother's program per case): the textbook
# test checks every one-pass method, the MAP and the backends' tests the iterated
# ones
LINEAR = [
    pytest.param(prior_at, method, marks=pytest.mark.slow)
    for prior_at in ("x0", "x1")
    for method in METHODS
]


@pytest.mark.parametrize("prior_at, method", LINEAR)
def test_linear_model_is_the_kalman_filter(prior_at, method):
    """With `f(x, u) = F x + B u` and `h(x, u) = H x + D u` (noise per step, missing
    entries), the method's filter, one-pass smoother and iterated smoother equal
    `eqx_seq.KalmanFilter`'s; the iterated one on the sequential backend (prior on
    `x_0`) and in parallel in time (on `x_1`)."""
    mats, ys, us = _linear_case()
    scan = {"x0": eqx_seq.SequentialScan(), "x1": eqx_seq.AssociativeScan()}[prior_at]
    kf = eqx_seq.KalmanFilter.from_matrices(
        mats["F"], mats["H"], mats["Q"], mats["R"], mats["m0"], mats["P0"],
        B=mats["B"], D=mats["D"], scan=scan, prior_at=prior_at,
    )  # fmt: skip
    nkf = eqx_seq.NonlinearKalmanFilter(
        Affine(jnp.asarray(mats["F"]), jnp.asarray(mats["B"])),
        Affine(jnp.asarray(mats["H"]), jnp.asarray(mats["D"])),
        Q=mats["Q"], R=mats["R"], m0=mats["m0"], P0=mats["P0"], control_size=1,
        scan=scan, prior_at=prior_at,
    )  # fmt: skip
    out = _linear_outputs(nkf, kf, ys, us, method)
    ref = out.pop("kalman")
    tol = dict(rtol=1e-12, atol=1e-12)
    for k, r in out.items():
        for got, want in [
            (r.means, ref.means),
            (r.covs, ref.covs),
            (r.cross_covs, ref.cross_covs),
            (r.filtered.means, ref.filtered.means),
            (r.filtered.covs, ref.filtered.covs),
            (r.filtered.predicted_means, ref.filtered.predicted_means),
            (r.filtered.predicted_covs, ref.filtered.predicted_covs),
            (r.filtered.log_likelihoods, ref.filtered.log_likelihoods),
            (r.filtered.log_likelihood, ref.filtered.log_likelihood),
        ]:
            np.testing.assert_allclose(got, want, **tol, err_msg=k)
        assert bool(r.converged), k
        if k.endswith("iterated"):  # exact after one pass, seen by the second
            assert int(r.num_iterations) <= 2, (k, r.num_iterations)


# --- 3. the IEKS is the MAP trajectory ---
def np_map_gradient(z, ys, us, prior_at, g=G):
    """The gradient of the negative log joint density of the chain `z` (`x_1..x_T`
    with `prior_at="x1"`, `x_0..x_T` with `"x0"`), `-log N(z_0; m0, P0) -
    sum log N(x_t; f(x_{t-1}, u_t), Q) - sum log N(y_t; h(x_t, u_t), R)` (each
    observation's observed entries only), with the Jacobians by hand."""
    p = PARAMS
    Qi = np.linalg.inv(p["Q"])
    off = 1 if prior_at == "x0" else 0  # z[t + off] is x_{t+1}, of row t
    u = (lambda t: None) if us is None else (lambda t: us[t])
    grad = np.zeros_like(z)
    grad[0] += np.linalg.solve(p["P0"], z[0] - p["m0"])
    for k in range(1, len(z)):
        e = z[k] - f_np(z[k - 1], u(k - off), g)
        grad[k] += Qi @ e
        grad[k - 1] -= F_np(z[k - 1], g).T @ Qi @ e
    for t in range(len(ys)):
        o = ~np.isnan(ys[t])
        if o.any():
            x = z[t + off]
            v = ys[t][o] - h_np(x, u(t))[o]
            grad[t + off] -= H_np(x)[o].T @ np.linalg.solve(p["R"][np.ix_(o, o)], v)
    return grad


def np_best_x0(x1, u1, g=G):
    """`argmin_x0 -log N(x0; m0, P0) - log N(x1; f(x0, u1), Q)` by Gauss-Newton."""
    p = PARAMS
    Qi, P0i = np.linalg.inv(p["Q"]), np.linalg.inv(p["P0"])
    x0 = p["m0"].copy()
    for _ in range(100):
        F = F_np(x0, g)
        grad = P0i @ (x0 - p["m0"]) - F.T @ Qi @ (x1 - f_np(x0, u1, g))
        x0 = x0 - np.linalg.solve(P0i + F.T @ Qi @ F, grad)
    return x0


TIGHT = 1e-13  # the iterated smoothers' tolerance where a test needs the fixed point


def _prior_init(T):
    """The prior at every step: the default `init` on a split time axis."""
    m0, P0 = PARAMS["m0"], PARAMS["P0"]
    return np.broadcast_to(m0, (T, 2)).copy(), np.broadcast_to(P0, (T, 2, 2)).copy()


@pytest.mark.parametrize(
    "name",
    [
        # slow tier: the other prior convention of the same check ("x1" runs fast)
        pytest.param("x0", marks=pytest.mark.slow),
        "x1",
    ],
)
def test_ieks_is_the_map_trajectory(name):
    """At the iterated extended smoother's fixed point the gradient of the negative
    log joint density vanishes: with `prior_at="x1"` that of `x_1..x_T`; with
    `"x0"` that of `x_0..x_T` at `x_0` the best for the smoothed `x_1` (the IEKS
    linearises the first transition about the smoothed `x_0`, so that its fixed
    point is the joint MAP). The one-pass smoother's trajectory is not."""
    ys, us, prior_at = case(name)
    model = build(prior_at, controls=us is not None)
    # the default start (the one-pass smoother) with `"x0"`, the prior at every
    # step with `"x1"` (the program of the backends' tests below)
    init = None if name == "x0" else _prior_init(len(ys))
    ieks = model.smooth(
        ys, us=us, method="extended", iterated=True, tol=TIGHT, init=init
    )
    eks = model.smooth(ys, us=us, method="extended")
    assert bool(ieks.converged) and int(ieks.num_iterations) > 2

    def chain(xs):
        xs = np.asarray(xs)
        if prior_at == "x1":
            return xs
        return np.vstack([np_best_x0(xs[0], None if us is None else us[0]), xs])

    grad = np_map_gradient(chain(ieks.means), ys, us, prior_at)
    grad_eks = np_map_gradient(chain(eks.means), ys, us, prior_at)
    scale = np.abs(grad_eks).max()
    assert scale > 1e-2, scale
    assert np.abs(grad).max() < 1e-9 * max(scale, 1.0), (np.abs(grad).max(), scale)


# --- 4. the backends of the iterated smoothers ---
def _iterated(model, ys, us, init, method):
    """The iterated smoother's means, covariances, passes and convergence."""
    r = model.smooth(ys, us=us, method=method, iterated=True, tol=TIGHT, init=init)
    return r.means, r.covs, r.num_iterations, r.converged


ITERATED = ["extended", pytest.param("cubature", marks=pytest.mark.slow)]


# with `-m slow`: the fast set runs the parallel backend inside the split one
@pytest.mark.slow
@pytest.mark.parametrize("method", ["extended", "cubature"])
def test_sequential_and_parallel_iterated_smoothers_agree(method):
    """From the same trajectory (the prior at every step, a start far from the
    result), the IEKS and the iterated cubature smoother give the same fixed point
    on the sequential backend and in parallel in time (`AssociativeScan`), with
    controls, missing entries and `prior_at="x1"`."""
    ys, us, prior_at = case("x1")
    init = _prior_init(len(ys))
    seq = _iterated(build(prior_at, controls=True), ys, us, init, method)
    par_model = build(prior_at, controls=True, scan=eqx_seq.AssociativeScan())
    par = _iterated(par_model, ys, us, init, method)
    (m1, P1, k1, ok1), (m2, P2, _, ok2) = seq, par
    assert bool(ok1) and bool(ok2) and int(k1) > 2
    np.testing.assert_allclose(m2, m1, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(P2, P1, rtol=1e-8, atol=1e-8)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices (conftest.py)")
@pytest.mark.parametrize("method", ITERATED)
def test_iterated_smoothers_split_over_two_devices(method):
    """The time axis split over two CPU devices (`ShardedScan` in `jax.shard_map`,
    controls and observations split like it, each block smoothed in parallel in
    time): the iterated smoother from the prior at every step equals the
    sequential one on one device, in as many passes."""
    ys, us, prior_at = case("x1")
    init = _prior_init(len(ys))
    m1, P1, k1, ok1 = _iterated(build(prior_at, controls=True), ys, us, init, method)
    # each block in parallel in time
    scan = eqx_seq.ShardedScan("seq", eqx_seq.AssociativeScan())
    model = build(prior_at, controls=True, scan=scan)
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    params, static = eqx.partition(model, eqx.is_array)

    def blocks(params, ys, us, init):
        m, P, k, ok = _iterated(eqx.combine(params, static), ys, us, init, method)
        return m, P, k[None], ok[None]  # the passes and convergence, per block

    split = jax.jit(
        jax.shard_map(
            blocks,
            mesh=mesh,
            in_specs=(P(), P("seq"), P("seq"), P("seq")),
            out_specs=P("seq"),
        )
    )(params, ys, us, init)
    m2, P2, k2, ok2 = split
    assert bool(ok1) and np.all(ok2) and np.all(k2 == k1), (k1, k2)
    np.testing.assert_allclose(m2, m1, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(P2, P1, rtol=1e-9, atol=1e-9)


# --- 5. derivatives against finite differences ---
def _flat(model):
    """The model's parameters (`g` of `f`, the noise and prior factors, `m0`) as
    one vector, and the model of a vector."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)
    return np.asarray(flat), lambda v: eqx.combine(unravel(jnp.asarray(v)), static)


def _central_differences(fn, flat, eps):
    """`d fn / d flat` (each output a row), `fn` run eagerly: the layer's compiled
    programs of these structures, nothing new compiled."""
    cols = []
    for i in range(len(flat)):
        e = np.zeros_like(flat)
        e[i] = eps
        cols.append((np.asarray(fn(flat + e)) - np.asarray(fn(flat - e))) / (2 * eps))
    return np.stack(cols, axis=-1)


GRADIENT_CASES = [("x0", "cubature")] + [
    pytest.param(*c, marks=pytest.mark.slow)
    for c in [("x0", "extended"), ("x0", "unscented"), ("x1", "extended"),
              ("x1", "cubature"), ("x1", "unscented")]
]  # fmt: skip


@pytest.mark.parametrize("name, method", GRADIENT_CASES)
def test_log_likelihood_gradient(name, method):
    """`grad log_likelihood` of the method with respect to `g` (a parameter of
    `f`, an Equinox module), the factors of `Q`, `R`, `P0` and `m0` equals central
    differences (float64), with missing entries, and controls with `"x1"`."""
    ys, us, prior_at = case(name)
    flat, rebuild = _flat(build(prior_at, controls=us is not None))
    assert len(flat) == 1 + 3 * 4 + 2

    def ll(v):
        return rebuild(v).log_likelihood(ys, us=us, method=method)

    def ll_smoother(v):  # the programs of test_filters_and_smoothers_match_textbook
        return rebuild(v).smooth(ys, us=us, method=method).filtered.log_likelihood

    grad = eqx.filter_jit(jax.grad(ll))(flat)
    fd = _central_differences(ll_smoother, flat, 1e-6)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-6)
    assert np.abs(grad[0]) > 1e-2  # with respect to g: not vacuous


# forward mode with respect to g in the fast set; reverse mode (every parameter)
# compiles for longer
DERIVATIVES = [("extended", "forward")] + [
    pytest.param(*c, marks=pytest.mark.slow)
    for c in [("extended", "reverse"), ("cubature", "forward"),
              ("cubature", "reverse")]
]  # fmt: skip


@pytest.mark.parametrize("method, mode", DERIVATIVES)
def test_iterated_smoother_derivatives(method, mode):
    """The converged iterated smoother (IEKS, iterated cubature), differentiated
    through its fixed point (`lax.custom_root`): the derivatives of the sum of its
    smoothed means, of its covariances and of its log-likelihood equal central
    differences of the converged results (a tight tolerance, so that the
    differences are accurate): in reverse mode with respect to every parameter; in
    forward mode with respect to `g` (a parameter of `f`)."""
    ys, us, prior_at = case("x0")
    flat, rebuild = _flat(build(prior_at))

    def outputs(v):
        r = rebuild(v).smooth(ys, method=method, iterated=True, tol=TIGHT)
        return jnp.stack([r.means.sum(), r.covs.sum(), r.filtered.log_likelihood])

    if mode == "reverse":
        jac = eqx.filter_jit(jax.jacrev(outputs))(flat)
        fd = _central_differences(outputs, flat, 1e-5)
    else:  # along g
        along = lambda a: outputs(flat + a[0] * np.eye(len(flat))[0])
        jac = eqx.filter_jit(
            lambda a: jax.jvp(along, (a,), (jnp.ones(1),))[1][:, None]
        )(np.zeros(1))
        fd = _central_differences(along, np.zeros(1), 1e-5)
    np.testing.assert_allclose(jac, fd, rtol=1e-5, atol=1e-6)
    # the derivative of the means with respect to g (not vacuous)
    assert np.abs(jac[0, 0]) > 1e-2, jac[0, 0]


# --- 6. float32 on a stiff model ---
STIFF = dict(PARAMS, R=1e-6 * np.eye(2), P0=1e6 * np.eye(2))


def observe_linear(x):
    """The sine of an angle spread over thousands of radians tells a regression
    over the prior's sigma points nothing (nor does any bounded function): for the
    sigma-point methods the vague state is seen (almost) linearly."""
    return jnp.stack([x[0] + 0.1 * jnp.sin(x[0]), x[1]])


STIFF_METHODS = ["extended"] + [
    pytest.param(m, marks=pytest.mark.slow) for m in METHODS[1:]
]


@pytest.mark.parametrize("method", STIFF_METHODS)
def test_stiff_float32(method):
    """A vague prior (`P0 = 1e6 I`) meeting precise observations (`R = 1e-6 I`):
    in float32 the filter, the one-pass smoother and the iterated smoother are
    finite and close to float64's (the float64 side of the extended one: the
    programs of the tests above)."""
    h = observe if method == "extended" else observe_linear
    p = dict(PARAMS, R=STIFF["R"])
    rng = np.random.default_rng(7)
    x = rng.multivariate_normal(p["m0"], p["P0"])
    ys = []
    for _ in range(30):
        x = f_np(x, None, G) + rng.multivariate_normal(np.zeros(2), p["Q"])
        ys.append(np.asarray(h(jnp.asarray(x))) + 1e-3 * rng.normal(size=2))
    ys = np.array(ys)
    m32, m64 = (
        build(params=STIFF, dtype=d, observation=h) for d in (jnp.float32, jnp.float64)
    )
    assert m32.Q_factor.dtype == m32.m0.dtype == jnp.float32
    ys32 = ys.astype(np.float32)

    def check(a, b):
        # means within 1e-4 of their scale, covariances (~1e-3 down to ~1e-6)
        # within 1e-2 of their largest entry
        for got, want, rel in [
            (a.filtered.means, b.filtered.means, 1e-4),
            (a.means, b.means, 1e-4),
            (a.filtered.covs, b.filtered.covs, 1e-2),
            (a.covs, b.covs, 1e-2),
        ]:
            assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
            atol = rel * (np.abs(want).max() + (1 if rel == 1e-4 else 0))
            np.testing.assert_allclose(got, want, rtol=0, atol=atol)
        ll_a, ll_b = a.filtered.log_likelihood, b.filtered.log_likelihood
        assert abs(float(ll_a) - float(ll_b)) < 1e-4 * abs(float(ll_b)), (ll_a, ll_b)

    check(m32.smooth(ys32, method=method), m64.smooth(ys, method=method))
    iterated = m32.smooth(ys32, method=method, iterated=True)
    check(iterated, m64.smooth(ys, method=method, iterated=True, tol=TIGHT))
    assert bool(iterated.converged)


# --- 7. sampling ---
def test_sample_follows_the_model():
    """With (almost) no noise the sample is the deterministic recursion, from
    `x_1 = f(m0, u_1)` with `prior_at="x0"` and `x_1 = m0` with `"x1"`; shapes and
    dtypes, float32 too."""
    tiny = {k: 1e-24 * np.eye(2) for k in ("Q", "R", "P0")}
    quiet = dict(PARAMS, **tiny)
    T = 12
    us = np.random.default_rng(4).normal(size=(T, 2))
    for prior_at in ("x0", "x1"):
        model = build(prior_at, controls=True, params=quiet)
        xs, ys = model.sample(jr.key(0), T, us=us)
        assert xs.shape == (T, 2) and ys.shape == (T, 2)
        assert xs.dtype == ys.dtype == jnp.float64
        x = PARAMS["m0"]
        for t in range(T):
            if t > 0 or prior_at == "x0":
                x = f_np(x, us[t], G)
            np.testing.assert_allclose(xs[t], x, atol=1e-10, err_msg=prior_at)
            np.testing.assert_allclose(ys[t], h_np(x, us[t]), atol=1e-10)
    model32 = build(dtype=jnp.float32)
    xs, ys = model32.sample(jr.key(1), T)
    assert xs.shape == (T, 2) and ys.shape == (T, 2)
    assert xs.dtype == ys.dtype == jnp.float32
    assert np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))
    # noisy: draws with different keys differ
    xs2, _ = model32.sample(jr.key(2), T)
    assert np.abs(np.asarray(xs) - np.asarray(xs2)).max() > 1e-3


# --- 8. bad input ---
@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    ys, us, _ = case("x1")
    model = build()
    with_u = build(controls=True)
    with pytest.raises(ValueError, match="`method` must be one of"):
        model.filter(ys, method="ukf")
    with pytest.raises(ValueError, match="`method` must be one of"):
        model.smooth(ys, method="EKF", iterated=True)
    with pytest.raises(ValueError, match=r"\(T, obs_size\) = \(T, 2\)"):
        model.filter(np.ones((5, 3)))
    with pytest.raises(ValueError, match=r"\(T, obs_size\)"):
        model.log_likelihood(np.ones((2, 5, 2)))
    with pytest.raises(ValueError, match="floating"):
        model.smooth(np.ones((5, 2), np.int32))
    with pytest.raises(ValueError, match="control_size=0"):
        model.filter(ys, us=us)
    with pytest.raises(ValueError, match="pass `us`"):
        with_u.filter(ys)
    with pytest.raises(ValueError, match=r"`us` must be a floating array"):
        with_u.smooth(ys, us=us[:-1])
    with pytest.raises(ValueError, match=r"`us` must be a floating array"):
        with_u.filter(ys, us=np.ones((len(ys), 2), np.int32))
    p = PARAMS
    make = lambda f=Pendulum(jnp.asarray(G)), h=observe, **kw: (
        eqx_seq.NonlinearKalmanFilter(f, h, **{**p, **kw})
    )
    with pytest.raises(ValueError, match=r"`transition` must return .* \(2,\)"):
        make(f=lambda x: x[:1]).filter(ys)
    with pytest.raises(ValueError, match=r"`observation` must return .* \(2,\)"):
        make(h=lambda x: jnp.sin(x[:1])).smooth(ys)
    with pytest.raises(ValueError, match="`transition` must return"):
        make(f=lambda x: x.astype(jnp.int32)).filter(ys)
    with pytest.raises(ValueError, match="must be callables"):
        make(f=np.eye(2))
    with pytest.raises(ValueError, match="`Q` must have shape"):
        make(Q=np.eye(3))
    with pytest.raises(ValueError, match="`P0` must have shape"):
        make(P0=np.eye(3))
    with pytest.raises(ValueError, match="`R` must have shape"):
        make(R=np.ones(2))
    with pytest.raises(ValueError, match="`m0` must have shape"):
        make(m0=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="same length"):
        make(Q=np.stack([p["Q"]] * 4), R=np.stack([p["R"]] * 5))
    with pytest.raises(ValueError, match="has 4 steps but the sequence has 30"):
        make(Q=np.stack([p["Q"]] * 4)).filter(ys)
    with pytest.raises(RuntimeError, match="`Q` must be symmetric positive definite"):
        make(Q=np.diag([1.0, -1.0]))
    with pytest.raises(ValueError, match="prior_at"):
        make(prior_at="x2")
    with pytest.raises(ValueError, match="control_size"):
        make(control_size=-1)
    with pytest.raises(ValueError, match="negative covariance weight"):
        make(unscented=(1e-3, 0.0, 0.0))
    with pytest.raises(ValueError, match="alpha"):
        make(unscented=(1.0, 2.0, -2.0))  # n + lambda = 0
    # malformed tuples: a ValueError naming the argument, not zip's or float's
    for bad in [(1.0, 2.0), 1.0, "abc", (1.0, 2.0, 3.0, 4.0), (1.0, "b", 0.0), None]:
        with pytest.raises(ValueError, match=r"`unscented` must be a tuple \(alpha"):
            make(unscented=bad)
    with pytest.raises(ValueError, match=r"\(kappa = nan\)"):
        make(unscented=(1.0, 2.0, np.nan))
    T = len(ys)
    means, covs = _prior_init(T)
    with pytest.raises(ValueError, match="`init` must be"):
        model.smooth(ys, iterated=True, init=(means[:-1], covs))
    with pytest.raises(ValueError, match="`init` must be"):
        model.smooth(ys, iterated=True, init=(means, covs[..., 0]))
    with pytest.raises(ValueError, match="`init` is for the iterated smoother"):
        model.smooth(ys, init=(means, covs))
    with pytest.raises(ValueError, match="`iterated` must be a bool"):
        model.smooth(ys, iterated=1)
    for tol in (0.0, -1e-8):
        with pytest.raises(ValueError, match="`tol` must be a finite positive"):
            model.smooth(ys, iterated=True, tol=tol)
    with pytest.raises(ValueError, match="`max_iter` must be a positive int"):
        model.smooth(ys, iterated=True, max_iter=0)
    with pytest.raises(ValueError, match="`num_steps` must be a positive int"):
        model.sample(jr.key(0), 0)
    split = build(scan=eqx_seq.ShardedScan("seq"))
    for call in (
        lambda: split.filter(ys),
        lambda: split.log_likelihood(ys, method="cubature"),
        lambda: split.smooth(ys),
        lambda: split(ys),
    ):
        with pytest.raises(ValueError, match="does not split over devices"):
            call()
