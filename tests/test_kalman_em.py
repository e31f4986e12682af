"""eqx_seq.KalmanFilter.fit_em against an EM step written here in float64 NumPy (the
textbook RTS smoother of kalman_helpers, the missing entries' conditional moments by
index selection, the M-step's regressions and, for masks, their normal equations
built entry by entry); the log-likelihood trace, masks, batches, bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from kalman_helpers import (
    BACKENDS,
    build,
    filter_reference,
    np_smoother,
    random_model,
    settled,
    simulate,
    STEADY_T,
)

import eqx_seq


# --- the reference: one EM iteration in NumPy ---
def _at(x, t):
    return x[t] if x.ndim == 3 else x


def _sequence_stats(model, ys, us, prior_at):
    """Per-step expected sufficient statistics of one sequence under `model`: the
    prior's (x_0, or x_1 with prior_at="x1"), the transitions' (x_t on
    z_t = [x_{t-1}; u_t]) and the emissions' (y_t on w_t = [x_t; u_t]), missing
    entries of y_t latent."""
    F, H, Q, R = model["F"], model["H"], model["Q"], model["R"]
    m0, P0, B, D = model["m0"], model["P0"], model.get("B"), model.get("D")
    T, p = ys.shape
    n = m0.shape[0]
    u = (lambda t: us[t]) if us is not None else (lambda t: np.zeros(0))
    Bm = B if B is not None else np.zeros((n, 0))
    Dm = D if D is not None else np.zeros((p, 0))
    f = filter_reference(model, ys, us, prior_at)
    ms, Ps, cross = np_smoother(F, f)
    # x_0: one RTS step back from x_1 (no observation at step 0)
    F1, Q1 = _at(F, 0), _at(Q, 0)
    S1 = F1 @ P0 @ F1.T + Q1
    J = P0 @ F1.T @ np.linalg.inv(S1)
    mx0 = m0 + J @ (ms[0] - (F1 @ m0 + Bm @ u(0)))
    Px0 = P0 + J @ (Ps[0] - S1) @ J.T
    C01 = J @ Ps[0]
    Exx = lambda m, P: P + np.outer(m, m)
    prior = dict(y=mx0, yy=Exx(mx0, Px0))
    if prior_at == "x1":
        prior = dict(y=ms[0], yy=Exx(ms[0], Ps[0]))
    trans, emis = [], []
    for t in range(T):
        mp, Pp = (mx0, Px0) if t == 0 else (ms[t - 1], Ps[t - 1])
        Cp = C01 if t == 0 else cross[t - 1]  # Cov[x_{t-1}, x_t]
        ut = u(t)
        if t > 0 or prior_at == "x0":
            trans.append(
                dict(
                    yy=Exx(ms[t], Ps[t]),
                    yz=np.hstack([Cp.T + np.outer(ms[t], mp), np.outer(ms[t], ut)]),
                    zz=np.block(
                        [
                            [Exx(mp, Pp), np.outer(mp, ut)],
                            [np.outer(ut, mp), np.outer(ut, ut)],
                        ]
                    ),
                )
            )
        # y_t given x_t and the observed entries: y = a x + b + noise (cov V)
        Ht, Rt = _at(H, t), _at(R, t)
        o = ~np.isnan(ys[t])
        m = ~o
        a = np.zeros((p, n))
        b = np.zeros(p)
        V = np.zeros((p, p))
        b[o] = ys[t][o]
        if m.any():
            G = Rt[np.ix_(m, o)] @ np.linalg.inv(Rt[np.ix_(o, o)])
            a[m] = Ht[m] - G @ Ht[o]
            b[m] = Dm[m] @ ut + G @ (ys[t][o] - Dm[o] @ ut)
            V[np.ix_(m, m)] = Rt[np.ix_(m, m)] - G @ Rt[np.ix_(o, m)]
        Ey = a @ ms[t] + b
        Eyx = np.outer(Ey, ms[t]) + a @ Ps[t]
        emis.append(
            dict(
                yy=np.outer(Ey, Ey) + a @ Ps[t] @ a.T + V,
                yz=np.hstack([Eyx, np.outer(Ey, ut)]),
                zz=np.block(
                    [
                        [Exx(ms[t], Ps[t]), np.outer(ms[t], ut)],
                        [np.outer(ut, ms[t]), np.outer(ut, ut)],
                    ]
                ),
            )
        )
    return prior, trans, emis, f["ll"].sum()


def _regression(stats, A, cov, free, cov_free):
    """The M-step of y = A_t z + e, e ~ N(0, cov), from per-step statistics: the free
    entries of A (all `A_t`'s fixed entries kept) by their normal equations at the
    current `cov`, built one free entry at a time; then the mean residual
    covariance at the new A."""
    T = len(stats)
    At = lambda t: A[t] if A.ndim == 3 else A
    if free.any():
        Lam = np.linalg.inv(cov)
        idx = np.argwhere(free)

        def grad(A_free):  # sum_t Lam (A_t S_t - C_t) at A_t = fixed + A_free
            return sum(
                Lam @ ((np.where(free, 0, At(t)) + A_free) @ s["zz"] - s["yz"])
                for t, s in enumerate(stats)
            )

        g0 = grad(np.zeros(free.shape))
        M = np.zeros((len(idx), len(idx)))
        for j, (r, c) in enumerate(idx):
            E = np.zeros(free.shape)
            E[r, c] = 1
            M[:, j] = (grad(E) - g0)[free]
        theta = np.linalg.solve(M, -g0[free])
        A_free = np.zeros(free.shape)
        A_free[free] = theta
        A = np.where(free, 0, A) + A_free
    if not cov_free:
        return A, cov
    cov = sum(
        s["yy"] - At(t) @ s["yz"].T - s["yz"] @ At(t).T + At(t) @ s["zz"] @ At(t).T
        for t, s in enumerate(stats)
    )
    return A, cov / T


def np_em_step(model, seqs, fixed=None, prior_at="x0"):
    """One EM iteration on sequences `[(ys, us), ...]`: the new model and the
    log-likelihood of the old one."""
    fixed = fixed or {}
    n, p = model["m0"].shape[0], _at(model["H"], 0).shape[0]
    c = 0 if model.get("B") is None else model["B"].shape[1]
    priors, trans, emis, ll = [], [], [], 0.0
    for ys, us in seqs:
        pr, tr, em, l_seq = _sequence_stats(model, ys, us, prior_at)
        priors.append(dict(yy=pr["yy"], yz=pr["y"][:, None], zz=np.ones((1, 1))))
        trans += tr
        emis += em
        ll += l_seq

    def mask(name, shape):
        f = np.broadcast_to(np.asarray(fixed.get(name, False)), shape)
        return ~f

    new = dict(model)
    m0, new["P0"] = _regression(
        priors, model["m0"][:, None], model["P0"], mask("m0", (n,))[:, None],
        not fixed.get("P0", False),
    )  # fmt: skip
    new["m0"] = m0[:, 0]
    for coef, ctrl, cov, stats, rows in (
        ("F", "B", "Q", trans, n),
        ("H", "D", "R", emis, p),
    ):
        A = model[coef]
        if A.ndim == 3 and coef == "F" and prior_at == "x1":
            A = A[1:]  # no transition into x_1
        free = mask(coef, (rows, n))
        if c:
            Bc = np.broadcast_to(model[ctrl], (*A.shape[:-1], c))
            A = np.concatenate([A, Bc], -1)
            free = np.hstack([free, mask(ctrl, (rows, c))])
        A, new[cov] = _regression(stats, A, model[cov], free, not fixed.get(cov, False))
        if A.ndim == 2:  # a time-varying one is held
            new[coef] = A[:, :n]
        if c:
            new[ctrl] = A[0, :, n:] if A.ndim == 3 else A[:, n:]
    return new, ll


def _params(kf):
    out = dict(F=kf.F, H=kf.H, Q=kf.Q, R=kf.R, m0=kf.m0, P0=kf.P0)
    if kf.B is not None:
        out.update(B=kf.B, D=kf.D)
    return {k: np.asarray(v) for k, v in out.items()}


def _assert_model(kf, model, **tol):
    for k, v in _params(kf).items():
        np.testing.assert_allclose(v, model[k], err_msg=k, **tol)


def _missing(rng, ys, frac=0.15):
    ys = ys.copy()
    ys[rng.random(ys.shape) < frac] = np.nan
    ys[3] = np.nan  # a whole step
    return ys


def _problem(seed, n=3, p=2, T=40, c=0, batch=None):
    """A random true model, data with missing entries, and a different start."""
    rng = np.random.default_rng(seed)
    true = random_model(rng, n, p, c=c)
    start = random_model(rng, n, p, c=c)
    shape = (T,) if batch is None else (batch, T)
    us = rng.normal(size=(*shape, c)) if c else None
    if batch is None:
        ys = _missing(rng, simulate(rng, true, T, us))
    else:
        ys = np.stack(
            [
                _missing(rng, simulate(rng, true, T, None if us is None else us[b]))
                for b in range(batch)
            ]
        )
    return start, ys, us


# --- the M-step ---
@pytest.mark.parametrize(
    "backend,c,prior_at",
    [
        # c = 0 runs in test_the_loop_is_traced_once and the trace tests
        pytest.param("sequential", 0, "x0", marks=pytest.mark.slow),
        # slow tier: test_two_iterations_and_batch_match_hand_formulas checks the
        # sequential backend's iterations with controls and the prior on x_0
        pytest.param("sequential", 2, "x0", marks=pytest.mark.slow),
        # the same EM as the associative backend's, after the smoother
        pytest.param("sequential", 2, "x1", marks=pytest.mark.slow),
        ("associative", 2, "x1"),
    ],
)
def test_one_iteration_matches_hand_formulas(backend, c, prior_at):
    start, ys, us = _problem(0, c=c)
    kf = build(start, BACKENDS[backend], prior_at=prior_at)
    fitted, lls = kf.fit_em(ys, us=us, num_iters=1)
    new, _ = np_em_step(start, [(ys, us)], prior_at=prior_at)
    # rebuilt with the same backend, sizes and structure
    assert fitted.scan == kf.scan and fitted.control_size == c
    assert jax.tree.structure(fitted) == jax.tree.structure(kf)
    _assert_model(fitted, new, rtol=1e-7, atol=1e-9)
    # the trace: the log-likelihood after the iteration
    ll = filter_reference(new, ys, us, prior_at)["ll"].sum()
    np.testing.assert_allclose(lls, [ll], rtol=1e-9)


def test_two_iterations_and_batch_match_hand_formulas():
    start, ys, us = _problem(1, c=1, batch=2, T=25)
    seqs = list(zip(ys, us))
    fitted, lls = build(start, eqx_seq.SequentialScan()).fit_em(ys, us=us, num_iters=2)
    first, _ = np_em_step(start, seqs)
    second, ll1 = np_em_step(first, seqs)
    _assert_model(fitted, second, rtol=1e-7, atol=1e-9)
    ll2 = sum(filter_reference(second, y, u)["ll"].sum() for y, u in seqs)
    np.testing.assert_allclose(lls, [ll1, ll2], rtol=1e-9)


def test_masks_match_hand_normal_equations():
    """Entries of F, B, H, D and m0 fixed (non-diagonal Q and R weigh them), Q and
    P0 fixed as wholes; through a dict and the equivalent filter spec."""
    start, ys, us = _problem(2, c=1)
    rng = np.random.default_rng(3)
    masks = {
        "F": rng.random((3, 3)) < 0.4,
        "B": np.array([[True], [False], [True]]),
        "H": rng.random((2, 3)) < 0.5,
        "D": np.array([[False], [True]]),
        "m0": np.array([True, False, False]),
    }
    fixed = {**masks, "R": False, "P0": True}
    kf = build(start, eqx_seq.SequentialScan())
    fitted, lls = kf.fit_em(ys, us=us, num_iters=1, fixed=fixed)
    new, _ = np_em_step(start, [(ys, us)], fixed)
    _assert_model(fitted, new, rtol=1e-7, atol=1e-9)
    for k, m in masks.items():
        np.testing.assert_array_equal(np.asarray(getattr(fitted, k))[m], start[k][m])
    np.testing.assert_array_equal(fitted.P0_factor, kf.P0_factor)
    # the same as a filter spec (leaf names Q_factor, ...)
    spec = jax.tree.map(lambda _: False, kf)
    spec = eqx.tree_at(
        lambda s: (s.F, s.B, s.H, s.D, s.m0, s.P0_factor),
        spec,
        (*(jnp.asarray(masks[k]) for k in ("F", "B", "H", "D", "m0")), True),
    )
    by_spec, lls_spec = kf.fit_em(ys, us=us, num_iters=1, fixed=spec)
    _assert_model(by_spec, _params(fitted), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lls_spec, lls, rtol=1e-12)


@pytest.mark.parametrize("prior_at", [pytest.param("x0", marks=pytest.mark.slow), "x1"])
def test_time_varying_fixed_matrices_match_hand_formulas(prior_at):
    """F and H vary with time (held fixed); Q, R, B, D, m0, P0 fitted: the
    regressions with per-step fixed coefficients."""
    rng = np.random.default_rng(4)
    T, n, p, c = 30, 3, 2, 1
    tv = random_model(rng, n, p, T=T, c=c)
    start = random_model(rng, n, p, c=c)
    start.update(F=tv["F"], H=tv["H"])
    us = rng.normal(size=(T, c))
    ys = _missing(rng, simulate(rng, start, T, us))
    fixed = {"F": True, "H": True}
    kf = build(start, eqx_seq.SequentialScan(), prior_at=prior_at)
    fitted, _ = kf.fit_em(ys, us=us, num_iters=1, fixed=fixed)
    new, _ = np_em_step(start, [(ys, us)], fixed, prior_at)
    _assert_model(fitted, new, rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(fitted.F, kf.F)


def test_stationary_prior_with_F_and_Q_held():
    """The stationary prior is a function of F and Q: with them held, the rest is
    fitted as with the known prior of the same value; m0, P0 untouched."""
    start, ys, us = _problem(3, c=1)
    kf = build(start, eqx_seq.SequentialScan(), initialization="stationary")
    fixed = {"F": True, "Q": True}
    fitted, lls = kf.fit_em(ys, us=us, num_iters=1, fixed=fixed)
    known = dict(
        start,
        m0=np.zeros(3),
        P0=scipy.linalg.solve_discrete_lyapunov(start["F"], start["Q"]),
    )
    new, _ = np_em_step(known, [(ys, us)], {**fixed, "m0": True, "P0": True})
    for k in ("H", "R", "B", "D"):
        np.testing.assert_allclose(getattr(fitted, k), new[k], rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(fitted.m0, kf.m0)
    np.testing.assert_array_equal(fitted.P0_factor, kf.P0_factor)
    ll = filter_reference(new, ys, us)["ll"].sum()
    np.testing.assert_allclose(lls, [ll], rtol=1e-9)


# --- complete data: the E-step from the steady-state filter ---
# slow tier: test_kalman_stiff.py's test_em_trace_follows_float64[float32] runs
# `fit_em` through the steady-state E-step against NumPy EM iterations
@pytest.mark.slow
@pytest.mark.parametrize("prior_at", ["x0", "x1"])
def test_steady_state_e_step_matches_hand_formulas(prior_at):
    """Complete data, a time-invariant model, long sequences: the smoother's sums
    from the steady-state filter (Lyapunov sums), two sequences with controls."""
    from eqx_seq._kalman._e_step import smoothed_sums_steady
    from eqx_seq._kalman._model import prepare

    rng = np.random.default_rng(15)
    start = random_model(rng, 3, 2, c=1)
    us = rng.normal(size=(2, STEADY_T, 1))
    ys = np.stack(
        [simulate(rng, random_model(rng, 3, 2, c=1), STEADY_T, u) for u in us]
    )
    kf = build(start, eqx_seq.SequentialScan(), prior_at=prior_at)
    assert settled(kf, jnp.asarray(ys[0]), jnp.asarray(us[0]))
    run = eqx.filter_jit(
        lambda kf, y, u: smoothed_sums_steady(prepare(kf._model(), y, u, "complete"))[1]
    )
    assert run(kf, jnp.asarray(ys[0]), jnp.asarray(us[0]))  # its result is used
    fitted, lls = kf.fit_em(ys, us=us, num_iters=1)
    new, _ = np_em_step(start, list(zip(ys, us)), prior_at=prior_at)
    _assert_model(fitted, new, rtol=1e-8, atol=1e-10)
    ll = sum(filter_reference(new, y, u, prior_at)["ll"].sum() for y, u in zip(ys, us))
    np.testing.assert_allclose(lls, [ll], rtol=1e-10)


# slow tier: the E-step falls back to the smoother with every step exact, whose EM
# the fast tests with missing entries (test_one_iteration_matches_hand_formulas)
# check
@pytest.mark.slow
def test_not_settled_e_step_matches_hand_formulas():
    """A covariance still moving after the exact head (barely observed): the E-step
    falls back to the smoother."""
    rng = np.random.default_rng(14)
    c, s = np.cos(0.01), np.sin(0.01)
    start = dict(
        F=0.9995 * np.array([[c, -s], [s, c]]), H=np.array([[0.02, 0.01]]),
        Q=1e-3 * np.eye(2), R=np.eye(1), m0=np.zeros(2), P0=np.eye(2),
    )  # fmt: skip
    ys = simulate(rng, start, STEADY_T)
    kf = build(start, eqx_seq.SequentialScan())
    assert not settled(kf, jnp.asarray(ys))
    fitted, lls = kf.fit_em(ys, num_iters=1)
    new, _ = np_em_step(start, [(ys, None)])
    _assert_model(fitted, new, rtol=1e-7, atol=1e-10)


# slow tier: test_kalman_stiff.py's test_em_trace_follows_float64[float32] checks
# the float32 steady-state E-step against float64 NumPy EM iterations
@pytest.mark.slow
def test_float32_complete_data_matches_float64():
    """The steady-state E-step in float32 (32 exact steps, then settled) against
    three float64 NumPy EM iterations from the same start."""
    start, _, _ = _problem(31, n=4, p=2)
    rng = np.random.default_rng(32)
    ys = simulate(rng, random_model(rng, 4, 2), 500)
    kf = build(start, eqx_seq.SequentialScan(), dtype=jnp.float32)
    assert settled(kf, jnp.asarray(ys, jnp.float32))
    fitted, lls = kf.fit_em(ys.astype(np.float32), num_iters=3)
    model, ref = start, []
    for _ in range(3):
        model, _ = np_em_step(model, [(ys, None)])
        ref.append(filter_reference(model, ys)["ll"].sum())
    np.testing.assert_allclose(lls, ref, rtol=1e-5)
    for k, v in _params(fitted).items():
        np.testing.assert_allclose(v, model[k], rtol=1e-3, atol=1e-3, err_msg=k)


# --- the log-likelihood trace ---
# slow tier: test_two_iterations_and_batch_match_hand_formulas checks each
# iteration's trace value against the NumPy EM with missing entries
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trace_never_decreases_with_missing_entries(seed):
    start, ys, _ = _problem(10 + seed, n=3, p=3, T=60)
    kf = build(start, eqx_seq.SequentialScan())
    fitted, lls = kf.fit_em(ys, num_iters=25)
    lls = np.asarray(lls)
    scale = np.abs(lls).max()
    assert np.all(np.diff(lls) >= -1e-10 * scale), np.diff(lls).min()
    assert lls[0] >= float(kf.log_likelihood(ys)) - 1e-10 * scale
    assert lls[-1] > lls[0] + 1.0  # it did climb
    np.testing.assert_allclose(lls[-1], fitted.log_likelihood(ys), rtol=1e-10)


# slow tier: test_masks_match_hand_normal_equations checks the masked M-step and
# that the fixed entries are kept
@pytest.mark.slow
def test_masked_trace_never_decreases_and_keeps_entries():
    start, ys, _ = _problem(20, n=3, p=3, T=60)
    F_mask = np.eye(3, dtype=bool)
    fixed = {"F": F_mask, "H": np.array([[True, False, False]] * 3), "P0": True}
    kf = build(start, eqx_seq.SequentialScan())
    fitted, lls = kf.fit_em(ys, num_iters=15, fixed=fixed)
    lls = np.asarray(lls)
    assert np.all(np.diff(lls) >= -1e-10 * np.abs(lls).max())
    np.testing.assert_array_equal(np.asarray(fitted.F)[F_mask], start["F"][F_mask])
    np.testing.assert_array_equal(np.asarray(fitted.H)[:, 0], start["H"][:, 0])
    np.testing.assert_array_equal(fitted.P0_factor, kf.P0_factor)


@pytest.mark.slow  # test_two_iterations_and_batch_match_hand_formulas checks the sums
def test_batch_is_the_sum_of_its_sequences():
    """The same sequence twice: the statistics double, so the M-step is the single
    sequence's and the log-likelihood twice its."""
    start, ys, _ = _problem(5, T=30)
    kf = build(start, eqx_seq.SequentialScan())
    one, lls_one = kf.fit_em(ys, num_iters=3)
    two, lls_two = kf.fit_em(np.stack([ys, ys]), num_iters=3)
    _assert_model(two, _params(one), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lls_two, 2 * np.asarray(lls_one), rtol=1e-10)


def _simulate_fast(rng, model, T):
    """`simulate` without controls, the noise drawn at once."""
    n, p = model["H"].shape[1], model["H"].shape[0]
    q = rng.normal(size=(T, n)) @ np.linalg.cholesky(model["Q"]).T
    r = rng.normal(size=(T, p)) @ np.linalg.cholesky(model["R"]).T
    x = model["m0"] + np.linalg.cholesky(model["P0"]) @ rng.normal(size=n)
    xs = []
    for t in range(T):
        x = model["F"] @ x + q[t]
        xs.append(x)
    return np.array(xs) @ model["H"].T + r


# slow tier: a big variant (long data, many iterations); the fast tests check the
# iterations against the NumPy EM
@pytest.mark.slow
def test_recovers_a_known_model():
    """Long simulated data, H held at its true value (which fixes the state's basis):
    F, Q, R and the log-likelihood come back close to the truth."""
    rng = np.random.default_rng(7)
    n, p, T = 2, 3, 4000
    true = dict(
        F=np.array([[0.9, 0.2], [-0.1, 0.7]]),
        H=np.array([[1.0, 0.0], [0.0, 1.0], [0.5, -0.5]]),
        Q=np.array([[0.3, 0.1], [0.1, 0.2]]),
        R=np.diag([0.2, 0.3, 0.25]),
        m0=np.zeros(n),
        P0=np.eye(n),
    )
    ys = _missing(rng, _simulate_fast(rng, true, T), frac=0.1)
    start = dict(true, F=0.5 * np.eye(n), Q=np.eye(n), R=np.eye(p))
    kf = build(start, eqx_seq.SequentialScan())
    fixed = {"H": True, "m0": True, "P0": True}
    fitted, lls = kf.fit_em(ys, num_iters=50, fixed=fixed)
    for k in ("F", "Q", "R"):
        np.testing.assert_allclose(getattr(fitted, k), true[k], atol=0.05, err_msg=k)
    ll_true = float(build(true, eqx_seq.SequentialScan()).log_likelihood(ys))
    assert lls[-1] >= ll_true  # the maximum likelihood beats the truth on its data
    assert lls[-1] - ll_true < 10.0


# slow tier: test_kalman_stiff.py's test_em_trace_follows_float64[float32] runs
# `fit_em` in float32
@pytest.mark.slow
def test_float32_stays_finite_and_climbs():
    start, ys, _ = _problem(30, n=4, p=2, T=200)
    kf = build(start, eqx_seq.SequentialScan(), dtype=jnp.float32)
    fitted, lls = kf.fit_em(ys.astype(np.float32), num_iters=20)
    assert lls.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(lls)))
    assert all(np.all(np.isfinite(v)) for v in _params(fitted).values())
    assert lls[-1] > lls[0]
    np.linalg.cholesky(np.asarray(fitted.Q, np.float64))  # positive definite


def test_the_loop_is_traced_once(monkeypatch):
    """All iterations are one compiled program: the M-step is traced once, and a
    second fit of the same shapes traces nothing."""
    from eqx_seq._kalman import _em

    traced = []
    m_step = _em.m_step
    monkeypatch.setattr(_em, "m_step", lambda *a: traced.append(1) or m_step(*a))
    start, ys, _ = _problem(40, n=2, p=1, T=7)
    kf = build(start, eqx_seq.SequentialScan())
    kf.fit_em(ys, num_iters=6)
    kf.fit_em(ys + 1.0, num_iters=6)
    assert len(traced) == 1


# --- degenerate data: the floor on new covariances, all-zero observations ---
def test_duplicate_sensors_keep_R_positive_definite():
    """Two identical sensors (duplicate columns of `ys`), float64: the maximum-
    likelihood `R` is singular (no residual along `y_1 - y_2`), and its factor was
    left to the rounding of a Cholesky factorisation (here NaN parameters after 11
    iterations, and drops of 60-140 nats in the trace before). The floor keeps the
    second sensor's variance not explained by the first at `256 eps` of its
    variance: finite, `R` positive definite, `H`'s two rows equal; with missing
    entries too (whose steps refactor `R`)."""
    rng = np.random.default_rng(7)
    true, start = random_model(rng, 3, 2), random_model(rng, 3, 2)
    ys = simulate(rng, true, 200)
    ys[:, 1] = ys[:, 0]
    missing = ys.copy()
    missing[rng.random(ys.shape) < 0.1] = np.nan
    kf = build(start, eqx_seq.SequentialScan())
    eps = np.finfo(np.float64).eps
    for data in (ys, missing):
        fitted, lls = kf.fit_em(data, num_iters=25)
        assert np.all(np.isfinite(lls))
        assert all(np.all(np.isfinite(v)) for v in _params(fitted).values())
        L = np.asarray(eqx_seq._kalman._linalg.factor(fitted.R_factor))
        # the floor: L_22^2 = 256 eps (L_21^2 + L_22^2), by the definition
        np.testing.assert_allclose(L[1, 1] ** 2 / (L[1] @ L[1]), 256 * eps, rtol=1e-6)
        assert L[0, 0] > 0.1
        np.testing.assert_allclose(fitted.H[1], fitted.H[0], rtol=1e-12)
        np.testing.assert_allclose(lls[-1], fitted.log_likelihood(data), rtol=1e-10)


def test_all_zero_observations_raise():
    """Every observed entry zero: `R`'s maximum-likelihood value is zero (the
    log-likelihood grows without bound), which gave NaN parameters after the first
    iteration. A `ValueError` names the cause (missing entries too); held fixed,
    `R` fits."""
    start, _, _ = _problem(40, n=2, p=1, T=7)
    kf = build(start, eqx_seq.SequentialScan())
    zeros = np.zeros((7, 1))
    for ys in (zeros, np.where(np.arange(7)[:, None] % 3 == 0, np.nan, zeros)):
        with pytest.raises(ValueError, match="every observed entry of `ys` is zero"):
            kf.fit_em(ys, num_iters=2)
    fitted, lls = kf.fit_em(zeros, num_iters=2, fixed={"R": True})
    assert np.all(np.isfinite(lls)) and np.all(np.isfinite(fitted.H))
    np.testing.assert_array_equal(fitted.R_factor, kf.R_factor)


def test_all_zero_observations_raise_when_traced():
    """Traced observations cannot be checked before the fit: the M-step's check
    raises at run time, naming the cause, where `R` would come out zero."""
    start, _, _ = _problem(40, n=2, p=1, T=7)
    kf = build(start, eqx_seq.SequentialScan())
    fit = jax.jit(lambda ys: kf.fit_em(ys, num_iters=2)[1])
    with pytest.raises(RuntimeError, match="new `R` is zero: every residual"):
        jax.block_until_ready(fit(jnp.zeros((7, 1))))


# --- bad input ---
@pytest.mark.usefixtures("unchecked_annotations")
def test_bad_input():
    start, ys, _ = _problem(8, T=10)
    kf = build(start, eqx_seq.SequentialScan())
    fit = lambda **kw: kf.fit_em(ys, **{"num_iters": 1, **kw})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_iters"):
            fit(num_iters=bad)
    with pytest.raises(ValueError, match="unknown names"):
        fit(fixed={"G": True})
    with pytest.raises(ValueError, match="no controls"):
        fit(fixed={"B": True})
    with pytest.raises(ValueError, match="shape"):
        fit(fixed={"F": np.ones((2, 2), bool)})
    with pytest.raises(ValueError, match="boolean"):
        fit(fixed={"F": np.ones((3, 3))})
    with pytest.raises(ValueError, match="as a whole"):
        fit(fixed={"Q": np.eye(3, dtype=bool)})
    with pytest.raises(ValueError, match="filter spec"):
        fit(fixed=[True])
    controlled = build(random_model(np.random.default_rng(0), 3, 2, c=1), kf.scan)
    spec = jax.tree.map(lambda _: False, kf)  # no B, D
    with pytest.raises(ValueError, match="does not match"):
        controlled.fit_em(ys, us=np.zeros((10, 1)), num_iters=1, fixed=spec)
    with pytest.raises(ValueError, match="ys"):
        kf.fit_em(ys[0], num_iters=1)
    with pytest.raises(ValueError, match="ys"):
        kf.fit_em(ys[None, None], num_iters=1)
    with pytest.raises(ValueError, match="obs_size"):
        kf.fit_em(np.stack([ys[:, :1]] * 2), num_iters=1)
    with pytest.raises(ValueError, match="controls"):
        fit(us=np.zeros((10, 1)))
    with pytest.raises(ValueError, match="us"):
        controlled.fit_em(np.stack([ys] * 2), us=np.zeros((10, 1)), num_iters=1)


def test_prior_options_that_do_not_fit():
    start, ys, _ = _problem(8, T=10)
    model = tuple(start[k] for k in ("F", "H", "Q", "R", "m0", "P0"))
    make = lambda **kw: eqx_seq.KalmanFilter.from_matrices(*model, **kw)
    with pytest.raises(NotImplementedError, match="diffuse"):
        make(initialization="diffuse").fit_em(ys, num_iters=1)
    with pytest.raises(ValueError, match="stationary"):
        make(initialization="stationary").fit_em(ys, num_iters=1, fixed={"F": True})
    with pytest.raises(ValueError, match="one step"):
        make(prior_at="x1").fit_em(ys[:1], num_iters=1, fixed={"F": True})


def test_time_varying_parameters_must_be_fixed():
    rng = np.random.default_rng(9)
    model = random_model(rng, 3, 2, T=10)
    ys = simulate(rng, model, 10)
    kf = build(model, eqx_seq.SequentialScan())
    with pytest.raises(ValueError, match="`F` varies with time"):
        kf.fit_em(ys, num_iters=1, fixed={"H": True, "Q": True, "R": True})
    with pytest.raises(ValueError, match="`Q` varies with time"):
        kf.fit_em(ys, num_iters=1, fixed={"H": True, "R": True, "F": True})
    with pytest.raises(ValueError, match="`Q` varies with time, so F"):
        constant_F = build(dict(model, F=model["F"][0]), kf.scan)
        constant_F.fit_em(ys, num_iters=1, fixed={"H": True, "Q": True, "R": True})
