"""The Kalman filter tests' reference: a textbook float64 NumPy filter and RTS
smoother, random models, and how the tests build filters from them."""

import equinox as eqx
import numpy as np

import eqx_seq


BACKENDS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


# --- the reference: a textbook Kalman filter and RTS smoother in NumPy, float64 ---
def _at(x, t):
    return x[t] if x.ndim == 3 else x


def np_filter(F, H, Q, R, m0, P0, ys, B=None, D=None, us=None, prior_at="x0"):
    """Predict, then condition on the observed entries of y_t (missing ones dropped).
    With `prior_at="x1"`, `(m0, P0)` is the prediction of step 1."""
    T, p = ys.shape
    m, P = m0, P0
    out = {k: [] for k in ("m", "P", "mp", "Pp", "ll")}
    for t in range(T):
        Ft = _at(F, t)
        mp = Ft @ m + (B @ us[t] if B is not None else 0)
        Pp = Ft @ P @ Ft.T + _at(Q, t)
        if t == 0 and prior_at == "x1":
            mp, Pp = m0, P0
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


def filter_reference(model, ys, us=None, prior_at="x0"):
    return np_filter(
        model["F"], model["H"], model["Q"], model["R"], model["m0"], model["P0"], ys,
        model.get("B"), model.get("D"), us, prior_at,
    )  # fmt: skip


def reference(model, ys, us=None, prior_at="x0"):
    f = filter_reference(model, ys, us, prior_at)
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


def with_private(kf, **private):
    """`kf` with the layer's private switches (`_square_root`, `_steady_state`)
    set, for the comparisons of the tests."""
    return kf._with_private(**private)


def build(model, scan, dtype=None, **options):
    return eqx_seq.KalmanFilter.from_matrices(
        model["F"], model["H"], model["Q"], model["R"], model["m0"], model["P0"],
        B=model.get("B"), D=model.get("D"), scan=scan, dtype=dtype, **options,
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


def settled(kf, ys, us=None):
    """Whether the steady-state path is taken (white-box: the filter's own test)."""
    from eqx_seq._kalman._filter import filter_steady
    from eqx_seq._kalman._model import prepare

    def run(kf, ys, us):
        problem = prepare(kf._model(), ys, us, "complete")
        return filter_steady(problem, exact_fallback=False)[1]

    return bool(eqx.filter_jit(run)(kf, ys, us))


def stacked(model, T):
    """The same model with F given per step: time-varying, so every step is exact."""
    return {**model, "F": np.broadcast_to(model["F"], (T, *model["F"].shape))}


STEADY_T = 300  # > 128 + 1 exact steps (float64)
