"""eqx_seq.discretize and KalmanFilter.from_continuous against float64 NumPy/SciPy:
the matrix exponential and a quadrature of the noise integral, closed forms (Wiener
velocity, Ornstein-Uhlenbeck), the textbook filter on the discretised model,
finite-difference gradients, forecasts at future times, and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg as sl
from kalman_helpers import np_filter

import eqx_seq


# a damped oscillator: position and velocity, the noise on the velocity
A_OSC = np.array([[0.0, 1.0], [-1.0, -0.3]])
L_OSC = np.array([[0.0], [1.0]])
QC_OSC = np.array([[0.7]])
H_OSC = np.array([[1.0, 0.0]])
R_OSC = np.array([[0.1]])


def van_loan_free(A, Qc, dt, L=None):
    """`(F, Q)` of one step: SciPy's exponential, and `∫ e^{As} L Qc L^T e^{A^T s}
    ds` by Gauss-Legendre quadrature on 8 panels of 12 nodes (exact to round-off
    for the smooth integrands here), or, for a long step of a stable `A`, the
    stationary covariance `P` less `F P F^T`."""
    L = np.eye(A.shape[0]) if L is None else L
    G = L @ Qc @ L.T
    F = sl.expm(A * dt)
    if dt > 20:
        P = sl.solve_continuous_lyapunov(A, -G)
        return F, P - F @ P @ F.T
    x, w = np.polynomial.legendre.leggauss(12)
    edges = np.linspace(0.0, dt, 9)
    mid, half = (edges[1:] + edges[:-1]) / 2, (edges[1:] - edges[:-1]) / 2
    s = (mid[:, None] + half[:, None] * x).ravel()
    E = sl.expm(A * s[:, None, None])  # batched
    integrand = E @ G @ np.swapaxes(E, -1, -2)
    weights = (half[:, None] * w).ravel()
    return F, np.einsum("s,sij->ij", weights, integrand)


def test_discretize_matches_quadrature_and_closed_forms():
    dts = np.array([0.0, 1e-3, 0.1, 1.3, 7.0, 60.0])
    F, Q = eqx_seq.discretize(A_OSC, QC_OSC, dts, L=L_OSC)
    assert F.shape == Q.shape == (6, 2, 2) and F.dtype == jnp.float64
    for i, dt in enumerate(dts):
        Fr, Qr = van_loan_free(A_OSC, QC_OSC, dt, L_OSC)
        np.testing.assert_allclose(F[i], Fr, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(Q[i], Qr, rtol=1e-9, atol=1e-15)
    np.testing.assert_array_equal(F[0], np.eye(2))
    np.testing.assert_array_equal(Q[0], np.zeros((2, 2)))
    # no `L` (the identity), a full 3x3 drift and diffusion
    rng = np.random.default_rng(0)
    A = rng.normal(size=(3, 3)) - 2 * np.eye(3)
    Qc = np.array([[1.0, 0.3, 0.0], [0.3, 2.0, -0.4], [0.0, -0.4, 0.5]])
    F, Q = eqx_seq.discretize(A, Qc, np.array([0.4, 2.5]))
    for i, dt in enumerate([0.4, 2.5]):
        Fr, Qr = van_loan_free(A, Qc, dt)
        np.testing.assert_allclose(F[i], Fr, rtol=1e-11, atol=1e-14)
        np.testing.assert_allclose(Q[i], Qr, rtol=1e-9, atol=1e-14)
    # growth by a rotation beside a stable mode (the same program): at 1500, F's
    # block e^{750} R(1.5) overflows to ±inf by the signs of cos 1.5 and sin 1.5,
    # the stable mode's entries and the zeros between the two stay exact
    w, dts = 1e-3, np.array([40.0, 1500.0])
    A = np.array([[0.5, -w, 0.0], [w, 0.5, 0.0], [0.0, 0.0, -1.0]])
    F, Q = eqx_seq.discretize(A, np.diag([0.2, 0.2, 0.8]), dts)
    for i, dt in enumerate(dts):
        c, s = np.cos(w * dt), np.sin(w * dt)
        with np.errstate(over="ignore"):
            grow = np.exp(0.5 * dt)
            Fr = sl.block_diag(grow * np.array([[c, -s], [s, c]]), np.exp(-dt))
            var = [0.2 * np.expm1(dt)] * 2 + [-0.4 * np.expm1(-2 * dt)]
        np.testing.assert_allclose(F[i], Fr, rtol=1e-11)
        np.testing.assert_allclose(np.diagonal(Q[i]), var, rtol=1e-11)
        np.testing.assert_array_equal(Q[i, :2, 2], 0.0)  # the two blocks apart

    # Wiener velocity: F = [[1, dt], [0, 1]], Q = q [[dt^3/3, dt^2/2], [dt^2/2, dt]],
    # with a diffusion in large units and steps up to 1e5 (the exponential of the
    # Van Loan matrix alone would exceed its squarings and return NaN)
    q, dts = 3e4, np.array([0.0, 0.01, 1.0, 40.0, 900.0, 1e5])
    F, Q = eqx_seq.discretize(np.eye(2, k=1), np.array([[q]]), dts, L=L_OSC)
    for i, dt in enumerate(dts):
        np.testing.assert_allclose(F[i], [[1, dt], [0, 1]], rtol=1e-13)
        closed = q * np.array([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]])
        np.testing.assert_allclose(Q[i], closed, rtol=1e-11)

    # an unstable and a stable mode (the same program) over steps whose F or Q
    # overflows float64: inf where the exact value does, exact elsewhere, never NaN
    # (Q was all NaN once an inf met a zero); from 1500, the covariance of the two
    # modes is 0: its correlation, about e^{-dt/2}, is below the smallest float64
    # (the documented limit)
    a, l, q = np.array([0.5, -1.0]), np.array([1.0, 0.5]), 0.7
    dts = np.array([0.0, 1.0, 300.0, 1000.0, 1500.0, 1e5])
    F, Q = eqx_seq.discretize(np.diag(a), np.array([[q]]), dts, L=l[:, None])
    s = a[:, None] + a[None, :]
    Fr = np.zeros((len(dts), 2, 2))
    with np.errstate(over="ignore"):
        Fr[:, [0, 1], [0, 1]] = np.exp(a * dts[:, None])
        Qr = q * np.outer(l, l) * np.expm1(s * dts[:, None, None]) / s
    Qr[4:, [0, 1], [1, 0]] = 0.0
    np.testing.assert_allclose(F, Fr, rtol=1e-12)
    np.testing.assert_allclose(Q, Qr, rtol=1e-12)
    assert np.all(np.isinf(F[4:, 0, 0])) and np.all(np.isinf(Q[3:, 0, 0]))

    # Ornstein-Uhlenbeck in float32, with gaps long against its time scale (the
    # exponential of the Van Loan matrix alone would overflow: e^{lam dt}), beside
    # an unstable mode whose F and Q overflow (inf, and the OU entries exact), and
    # the derivatives through both in the same program: through the steps that
    # overflow, and at 50, where Q is finite but a masked doubling's F Q F^T was
    # not (its inf times a zero cotangent made the derivative NaN)
    lam, mu, q, p = 1.5, 0.6, 2.0, 0.5
    dts = np.array([0.2, 30.0, 50.0, 100.0, 200.0])

    def loss(rates):
        Qc = jnp.diag(jnp.array([q, p], jnp.float32))
        F, Q = eqx_seq.discretize(jnp.diag(rates), Qc, dts)
        return jnp.sum(Q[:, 0, 0]) + 1e-25 * Q[2, 1, 1], (F, Q)

    rates = jnp.array([-lam, mu], jnp.float32)
    (_, (F, Q)), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(rates)
    assert F.dtype == Q.dtype == grad.dtype == jnp.float32
    np.testing.assert_allclose(F[:, 0, 0], np.exp(-lam * dts), rtol=1e-5, atol=1e-30)
    closed = q / (2 * lam) * (1 - np.exp(-2 * lam * dts))
    np.testing.assert_allclose(Q[:, 0, 0], closed, rtol=1e-5)
    with np.errstate(over="ignore"):
        F_mu = np.exp(mu * dts).astype(np.float32)  # inf from 200
        Q_mu = (p * np.expm1(2 * mu * dts) / (2 * mu)).astype(np.float32)  # from 100
    # e^{mu dt} has condition mu dt = 60 at 100: 60 float32 roundings
    np.testing.assert_allclose(F[:, 1, 1], F_mu, rtol=1e-4)
    np.testing.assert_allclose(Q[:, 1, 1], Q_mu, rtol=1e-4)
    np.testing.assert_array_equal(F[:, [0, 1], [1, 0]], 0.0)
    np.testing.assert_array_equal(Q[:, [0, 1], [1, 0]], 0.0)

    def dQ(q, a, t):  # d/da of q (e^{2at} - 1) / (2a)
        return q * (t * np.exp(2 * a * t) / a - np.expm1(2 * a * t) / (2 * a * a))

    expected = [sum(dQ(q, -lam, t) for t in dts), 1e-25 * dQ(p, mu, 50.0)]
    np.testing.assert_allclose(grad, expected, rtol=1e-4)


def irregular_data(T=25, seed=1):
    """Exponential gaps, one long gap, and a few missing observations."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(0.6, T)
    gaps[10] = 6.0
    times = 100.0 + np.cumsum(gaps)
    ys = np.sin(times)[:, None] + 0.3 * rng.normal(size=(T, 1))
    ys[[3, 17]] = np.nan
    return times, ys


@pytest.mark.parametrize("prior_at", ["x1", "x0"])
def test_filter_matches_numpy_on_the_discretised_model(prior_at):
    times, ys = irregular_data()
    m0, P0 = np.array([0.5, -0.2]), np.diag([1.0, 2.0])
    prior_time = times[0] - 0.8 if prior_at == "x0" else None
    kf = eqx_seq.KalmanFilter.from_continuous(
        A_OSC, H_OSC, QC_OSC, R_OSC, m0, P0, times, L=L_OSC,
        prior_time=prior_time, prior_at=prior_at,
    )  # fmt: skip
    assert kf.num_steps == len(times) and kf.F.shape == (len(times), 2, 2)
    starts = np.concatenate([[times[0] if prior_time is None else prior_time], times])
    steps = [van_loan_free(A_OSC, QC_OSC, dt, L_OSC) for dt in np.diff(starts)]
    F = np.stack([s[0] for s in steps])
    Q = np.stack([s[1] for s in steps])
    if prior_at == "x1":
        np.testing.assert_array_equal(kf.F[0], np.eye(2))  # the placeholders
        np.testing.assert_allclose(kf.Q[0], np.eye(2), rtol=1e-14)
        Q[0] = np.eye(2)
    np.testing.assert_allclose(kf.F, F, rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(kf.Q, Q, rtol=1e-9, atol=1e-15)
    ref = np_filter(F, H_OSC, Q, R_OSC, m0, P0, ys, prior_at=prior_at)
    out = kf.filter(ys)
    np.testing.assert_allclose(out.means, ref["m"], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(out.covs, ref["P"], rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(out.log_likelihood, ref["ll"].sum(), rtol=1e-9)


def test_forecast_at_future_times():
    """Future times in `times` with NaN observations: their filtered moments are
    the last filtered moments propagated by `expm(A dt)` and the noise integral."""
    times, ys = irregular_data(T=22)  # with the future times, 25: programs shared
    future = times[-1] + np.array([0.3, 2.0, 9.0])
    kf = eqx_seq.KalmanFilter.from_continuous(
        A_OSC, H_OSC, QC_OSC, R_OSC, np.zeros(2), np.eye(2),
        np.concatenate([times, future]), L=L_OSC,
    )  # fmt: skip
    ys_all = np.concatenate([ys, np.full((3, 1), np.nan)])
    out = kf.filter(ys_all)
    m, P = np.asarray(out.means[len(times) - 1]), np.asarray(out.covs[len(times) - 1])
    for i, t in enumerate(future):
        F, Q = van_loan_free(A_OSC, QC_OSC, t - times[-1], L_OSC)  # from the last
        np.testing.assert_allclose(out.means[len(times) + i], F @ m, rtol=1e-9)
        np.testing.assert_allclose(
            out.covs[len(times) + i], F @ P @ F.T + Q, rtol=1e-8, atol=1e-12
        )
    # the predictive law of the observation at a future time
    y_var = H_OSC @ out.covs[-1] @ H_OSC.T + R_OSC
    assert np.all(np.isfinite(y_var)) and y_var[0, 0] > R_OSC[0, 0]


# slow tier: test_kalman_gradients.py's test_gradient_matches_finite_differences
# checks the log-likelihood's gradient (time-varying models included) against
# finite differences; this adds the derivative through the discretisation
@pytest.mark.slow
def test_gradients_match_finite_differences():
    """d/dA, d/dQc and d/dL of the log-likelihood, through the discretisation."""
    times, ys = irregular_data(seed=2)

    def build(A, Qc, L):
        return eqx_seq.KalmanFilter.from_continuous(
            A, H_OSC, Qc, R_OSC, np.zeros(2), np.eye(2), times, L=L,
            prior_time=times[0] - 0.5, prior_at="x0",
        )  # fmt: skip

    args = (jnp.asarray(A_OSC), jnp.asarray(QC_OSC), jnp.asarray(L_OSC + 0.1))
    loglik = lambda *a: build(*a).log_likelihood(ys)  # Fisher's identity
    grads = jax.jit(jax.grad(loglik, argnums=(0, 1, 2)))(*args)
    # the derivative along a random direction of each argument, against central
    # differences of the filter's log-likelihood (plain arithmetic, no gradient)
    rng, h = np.random.default_rng(3), 1e-6
    for k, g in enumerate(grads):
        v = rng.normal(size=g.shape)
        shifted = [
            [a + sign * h * v if j == k else a for j, a in enumerate(args)]
            for sign in (1, -1)
        ]
        plus, minus = (build(*a).filter(ys).log_likelihood for a in shifted)
        fd = (plus - minus) / (2 * h)
        np.testing.assert_allclose(np.sum(g * v), fd, rtol=1e-6)
        assert np.all(np.isfinite(g))


def test_em_and_sampling_on_a_continuous_model(getkey):
    """EM with `F` and `Q` held (time-varying, as EM requires) fits `R`, `m0` and
    `P0`; `H` is given per step here (see the next test)."""
    times, _ = irregular_data()
    T = len(times)
    H = np.broadcast_to(H_OSC, (T, 1, 2))
    kf = eqx_seq.KalmanFilter.from_continuous(
        A_OSC, H, QC_OSC, R_OSC, np.zeros(2), np.eye(2), times, L=L_OSC
    )
    states, ys = kf.sample(getkey(), T)
    assert states.shape == (T, 2) and ys.shape == (T, 1)
    start = eqx.tree_at(lambda k: k.R_factor, kf, kf.R_factor + 1.0)
    fixed = {"F": True, "Q": True, "H": True}
    fitted, lls = start.fit_em(ys, num_iters=4, fixed=fixed)
    assert np.all(np.diff(np.asarray(lls)) >= -1e-9)
    np.testing.assert_array_equal(fitted.F, kf.F)
    with pytest.raises(ValueError, match="hold it fixed"):
        kf.fit_em(ys, num_iters=1)


# slow tier: a regression of EM with F held per step and one H;
# test_kalman_em.py's test_time_varying_fixed_matrices_match_hand_formulas checks
# EM with time-varying matrices held
@pytest.mark.slow
def test_em_with_a_time_invariant_emission():
    """EM with `F`, `Q` held per step and one `H`: the same iterates as with `H`
    given per step and held (a time-varying `F` once made the emission's moments
    per step while their regressor's were summed)."""
    times, ys = irregular_data()
    T = len(times)
    ys = np.nan_to_num(ys)
    build = lambda H: eqx_seq.KalmanFilter.from_continuous(
        A_OSC, H, QC_OSC, R_OSC, np.zeros(2), np.eye(2), times, L=L_OSC
    )
    one, _ = build(H_OSC).fit_em(
        ys, num_iters=2, fixed={"F": True, "Q": True, "H": True}
    )
    per_step, _ = build(np.broadcast_to(H_OSC, (T, 1, 2))).fit_em(
        ys, num_iters=2, fixed={"F": True, "Q": True, "H": True}
    )
    np.testing.assert_allclose(one.R, per_step.R, rtol=1e-10)
    np.testing.assert_allclose(one.m0, per_step.m0, rtol=1e-10, atol=1e-12)
    fitted, lls = build(H_OSC).fit_em(ys, num_iters=3, fixed={"F": True, "Q": True})
    assert np.all(np.diff(np.asarray(lls)) >= -1e-9)
    assert fitted.H.shape == (1, 2) and not np.allclose(fitted.H, H_OSC)


@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    I2, t = np.eye(2), np.array([0.0, 1.0, 2.5])
    args = (A_OSC, H_OSC, QC_OSC, R_OSC, np.zeros(2), I2)
    build = eqx_seq.KalmanFilter.from_continuous
    with pytest.raises(ValueError, match="`A` must be square"):
        build(np.ones((2, 3)), *args[1:], t)
    with pytest.raises(ValueError, match="`A` must be square"):
        eqx_seq.discretize(np.ones(3), QC_OSC, t)
    with pytest.raises(ValueError, match=r"`Qc` must have shape \(1, 1\)"):
        build(A_OSC, H_OSC, I2, *args[3:], t, L=L_OSC)
    with pytest.raises(ValueError, match=r"`Qc` must have shape \(2, 2\)"):
        eqx_seq.discretize(A_OSC, QC_OSC, t)
    with pytest.raises(ValueError, match=r"`L` must have shape \(2, s\)"):
        build(*args, t, L=np.ones((3, 1)))
    with pytest.raises(ValueError, match=r"`times` must have shape \(T,\)"):
        build(*args, t[None], L=L_OSC)
    with pytest.raises(ValueError, match=r"`dts` must have shape \(T,\)"):
        eqx_seq.discretize(A_OSC, QC_OSC, 1.0, L=L_OSC)
    with pytest.raises(ValueError, match="`H` must have shape"):
        build(A_OSC, np.ones((1, 3)), *args[2:], t, L=L_OSC)
    for times in ([0.0, 1.0, 1.0], [0.0, 2.0, 1.0], [0.0, np.nan, 2.0], [np.inf]):
        with pytest.raises(ValueError, match="finite and strictly increasing"):
            build(*args, times, L=L_OSC)
    with pytest.raises(ValueError, match="finite and non-negative"):
        eqx_seq.discretize(A_OSC, QC_OSC, [1.0, -0.5], L=L_OSC)
    with pytest.raises(ValueError, match="finite and non-negative"):
        eqx_seq.discretize(A_OSC, QC_OSC, [np.nan], L=L_OSC)
    with pytest.raises(ValueError, match="needs `prior_time`"):
        build(*args, t, L=L_OSC, prior_at="x0")
    with pytest.raises(ValueError, match=r"`prior_time` and `times` must be"):
        build(*args, t, L=L_OSC, prior_at="x0", prior_time=0.0)
    with pytest.raises(ValueError, match='`prior_time` is for prior_at="x0"'):
        build(*args, t, L=L_OSC, prior_time=-1.0)
    with pytest.raises(ValueError, match="time-varying"):
        build(*args, t, L=L_OSC, initialization="stationary")
    with pytest.raises(ValueError, match="real array"):
        build(*args, np.array([1j, 2j]), L=L_OSC)
    # traced times: the same check, at run time
    with pytest.raises(RuntimeError, match="strictly increasing"):
        jax.jit(lambda t: build(*args, t, L=L_OSC).F)(jnp.array([0.0, 1.0, 1.0]))
