"""Nonlinear Kalman filters and iterated smoothers: `eqx_seq.NonlinearKalmanFilter`
against dynamax on Särkkä's pendulum.

The model (Särkkä, *Bayesian Filtering and Smoothing*, the pendulum): state
`[angle a, angular velocity w]`, `dt = 0.01`, `f(x) = [a + dt w, w - g dt sin a]`,
`h(x) = sin a`, `Q = qc [[dt^3/3, dt^2/2], [dt^2/2, dt]]` (`qc = 0.01`), `R = 0.1`,
`g = 9.81` (a parameter of `f`), the prior `N([1.5, 0], 0.1 I)` on `x_1` (dynamax's
convention: our `prior_at="x1"`); one sequence drawn from the model.

1. The check, float64, before any timing: our `filter(ys, method=...)` and
   `smooth(ys, method=...)`, extended and unscented (dynamax's unscented parameters
   `alpha = sqrt(3), beta = 2, kappa = 1` are our defaults), against dynamax's
   `extended_kalman_filter` / `unscented_kalman_filter` and their smoothers:
   filtered and smoothed means and covariances and the log-likelihood (dynamax's
   `marginal_loglik`); the largest difference relative to the largest entry of
   dynamax's. The run stops if one exceeds 1e-8. If cuthbert is installed, its
   moments (Taylor) filter, `cuthbert.gaussian.moments` with the Jacobian of the
   mean taken at the previous filtered / the predicted mean (an extended Kalman
   filter in square-root form, the prior on `x_0`) against ours with
   `prior_at="x0"`, likewise.
2. Timing, one sequence, float64 and float32 (each in its own process: without
   x64, dynamax's float32 runs in float32 throughout), T in {1e3, 1e4} (`--long`:
   and 1e5), in one
   interleaved run (`_timing.measure_many`): the log-likelihood of our extended and
   unscented filters (`log_likelihood(ys, method=...)`, jitted) and dynamax's
   (`extended_kalman_filter(params, ys).marginal_loglik`,
   `unscented_kalman_filter(params, ys, UKFHyperParams()).marginal_loglik`, jitted);
   and their gradients: ours `eqx.filter_grad` w.r.t. the whole model (g in `f`,
   the factors of Q, R, P0 and m0), dynamax's `jax.grad` w.r.t. the same (g, Q, R,
   the prior's mean and covariance, with `f` closing over g inside the
   differentiated function). "speed-up" is dynamax's time over ours.
3. The iterated smoothers, float64, T = 1e4 (`--long`: also 1e5, IEKS only): the IEKS
   (`method="extended"`) and the IPLS with cubature points, `smooth(ys,
   iterated=True)` at the default tolerance, on one device sequentially
   (`SequentialScan`), in parallel in time (`AssociativeScan`), and split over the
   two CPU devices (`ShardedScan("seq", SequentialScan())` in `jax.shard_map`, the
   inputs already split). Every variant starts from the same `init`: the one-pass
   smoother of the same method (what the one-device default starts from; its time
   is its own row); the iteration counts from the prior at every step (the split
   default) are reported too. The floor: the linear `eqx_seq.KalmanFilter(2, 1)`
   smoother (every step exact, as each iteration's linear smoother) on the same
   three backends and T. Each length runs in a subprocess with a timeout.

    python benchmarks/bench_nonlinear.py           # about 15 minutes on 2 CPU cores
    python benchmarks/bench_nonlinear.py --long    # and T = 1e5
    python benchmarks/bench_nonlinear.py --quick   # T = 1e3 only, a smoke test
"""

import argparse
import json
import os
import subprocess
import sys

import jax


# two CPU devices for the split runs, set before JAX starts its backend; the other
# programs run on the first
jax.config.update("jax_num_cpu_devices", 2)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_seq  # noqa: E402


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    DASH,
    div,
    faster,
    machine,
    measure_many,
    ms,
    results_path,
    save,
    table,
    times,
    write_reports,
)


DT, G, QC, R_VAR = 0.01, 9.81, 0.01, 0.1
M0, P0_VAR = (1.5, 0.0), 0.1
CHECK_TOL = 1e-8  # float64, relative to the largest entry


class Pendulum(eqx.Module):
    """`f`, with the gravity `g` a parameter."""

    g: jax.Array

    def __call__(self, x):
        return jnp.stack([x[0] + DT * x[1], x[1] - self.g * DT * jnp.sin(x[0])])


def observe(x):
    return jnp.sin(x[:1])


def noise_Q(dtype):
    return QC * jnp.array([[DT**3 / 3, DT**2 / 2], [DT**2 / 2, DT]], dtype)


def model(dtype, scan=None, prior_at="x1"):
    return eqx_seq.NonlinearKalmanFilter(
        Pendulum(jnp.asarray(G, dtype)),
        observe,
        Q=noise_Q(dtype),
        R=R_VAR * jnp.eye(1, dtype=dtype),
        m0=jnp.array(M0, dtype),
        P0=P0_VAR * jnp.eye(2, dtype=dtype),
        scan=scan or eqx_seq.SequentialScan(),
        prior_at=prior_at,
        dtype=dtype,
    )


def draw(T, dtype):
    return model(dtype).sample(jr.key(1), T)[1]


# --- the anchors: optional, imported by the children that use them ---------------
def _dynamax():
    try:
        from dynamax.nonlinear_gaussian_ssm import (
            extended_kalman_filter,
            extended_kalman_smoother,
            ParamsNLGSSM,
            UKFHyperParams,
            unscented_kalman_filter,
            unscented_kalman_smoother,
        )
    except ImportError:
        return None
    return {
        "ekf": extended_kalman_filter,
        "eks": extended_kalman_smoother,
        "ukf": unscented_kalman_filter,
        "uks": unscented_kalman_smoother,
        "params": ParamsNLGSSM,
        "ukf_hyper": UKFHyperParams,
    }


def theta_of(dtype):
    """dynamax's parameters as a pytree: what its gradient is taken with respect to."""
    return {
        "g": jnp.asarray(G, dtype),
        "m0": jnp.array(M0, dtype),
        "P0": P0_VAR * jnp.eye(2, dtype=dtype),
        "Q": noise_Q(dtype),
        "R": R_VAR * jnp.eye(1, dtype=dtype),
    }


def dynamax_params(dx, theta):
    """`ParamsNLGSSM` of the pendulum, `f` closing over `theta["g"]`."""
    g = theta["g"]

    def f(x):
        return jnp.stack([x[0] + DT * x[1], x[1] - g * DT * jnp.sin(x[0])])

    return dx["params"](
        initial_mean=theta["m0"],
        initial_covariance=theta["P0"],
        dynamics_function=f,
        dynamics_covariance=theta["Q"],
        emission_function=observe,
        emission_covariance=theta["R"],
    )


def _rel(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
        raise SystemExit(f"check: shapes differ, {ours.shape} vs {theirs.shape}")
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-300))


def _cuthbert_ekf(T):
    """cuthbert's moments filter (extended, square-root, prior on x_0) against ours
    with `prior_at="x0"`; None if cuthbert is not installed."""
    try:
        import cuthbert
        from cuthbert.gaussian import moments
    except ImportError:
        return None
    dtype = jnp.float64
    ys = draw(T, dtype)
    L_Q = jnp.linalg.cholesky(noise_Q(dtype))
    L_R = jnp.sqrt(R_VAR) * jnp.eye(1, dtype=dtype)
    pend = Pendulum(jnp.asarray(G, dtype))

    def dynamics(state, inputs):
        return (lambda x: (pend(x), L_Q)), state.mean

    def observation(state, inputs):
        return (lambda x: (observe(x), L_R)), state.mean, inputs["y"]

    filt = moments.build_filter(
        jnp.array(M0, dtype),
        jnp.sqrt(P0_VAR) * jnp.eye(2, dtype=dtype),
        dynamics,
        observation,
    )

    smoother = moments.build_smoother(dynamics)

    @jax.jit
    def run(ys):
        states = cuthbert.filter(filt, {"y": ys}, filt.init_prepare())
        smoothed = cuthbert.smoother(smoother, states)
        return (
            (states.mean[1:], states.chol_cov[1:]),
            (smoothed.mean[1:], smoothed.chol_cov[1:]),
            states.log_normalizing_constant[-1],
        )

    gram = lambda L: jnp.einsum("tij,tkj->tik", L, L)
    (fm, fL), (sm, sL), ll = run(ys)
    ours = model(dtype, prior_at="x0")
    ours_f = ours.filter(ys, method="extended")
    ours_s = ours.smooth(ys, method="extended")
    return {
        "filtered means": _rel(ours_f.means, fm),
        "filtered covs": _rel(ours_f.covs, gram(fL)),
        "log-likelihood": _rel(ours_f.log_likelihood, ll),
        "smoothed means": _rel(ours_s.means, sm),
        "smoothed covs": _rel(ours_s.covs, gram(sL)),
    }


def reference(ys, method):
    """The filter and RTS smoother in NumPy's extended precision (`longdouble`,
    80-bit on x86), covariance form as in Särkkä's book, prior on `x_1`: filtered
    and smoothed means and covariances, and the log-likelihood."""
    X = np.longdouble
    dt, g, two = X(DT), X(G), 2
    Q = X(QC) * np.array([[dt**3 / 3, dt**2 / 2], [dt**2 / 2, dt]], dtype=X)
    f = lambda x: np.array([x[0] + dt * x[1], x[1] - g * dt * np.sin(x[0])], dtype=X)
    h = lambda x: np.array([np.sin(x[0])], dtype=X)
    jac = {
        f: lambda x: np.array([[1, dt], [-g * dt * np.cos(x[0]), 1]], dtype=X),
        h: lambda x: np.array([[np.cos(x[0]), 0]], dtype=X),
    }
    # the unscented transform, dynamax's (and our default) parameters
    alpha, beta, kappa = np.sqrt(X(3)), X(2), X(1)
    lam = alpha**2 * (two + kappa) - two
    w_m = np.array([lam / (two + lam)] + [1 / (2 * (two + lam))] * 4, dtype=X)
    w_c = w_m.copy()
    w_c[0] += 1 - alpha**2 + beta

    def chol(P):
        a = np.sqrt(P[0, 0])
        b = P[1, 0] / a
        return np.array([[a, 0], [b, np.sqrt(P[1, 1] - b * b)]], dtype=X)

    def moments(fn, m, P):
        """`E[fn(x)]`, `Cov[fn(x)]`, `Cov[x, fn(x)]` under `N(m, P)`."""
        if method == "extended":
            J = jac[fn](m)
            return fn(m), J @ P @ J.T, P @ J.T
        L = np.sqrt(two + lam) * chol(P)
        pts = [m] + [m + L[:, i] for i in range(2)] + [m - L[:, i] for i in range(2)]
        Y = np.array([fn(x) for x in pts])
        ybar = w_m @ Y
        dY, dX = Y - ybar, np.array(pts) - m
        return ybar, (w_c[:, None] * dY).T @ dY, (w_c[:, None] * dX).T @ dY

    m, P = np.array(M0, dtype=X), X(P0_VAR) * np.eye(2, dtype=X)
    fm, fP, ll = [], [], X(0)
    for t in range(len(ys)):
        if t > 0:
            m, P, _ = moments(f, m, P)
            P = P + Q
        yb, S, C = moments(h, m, P)
        S = S[0, 0] + X(R_VAR)
        v = X(ys[t, 0]) - yb[0]
        ll -= (np.log(2 * np.pi * S) + v * v / S) / 2
        K = C[:, 0] / S
        m, P = m + K * v, P - np.outer(K, K) * S
        fm.append(m)
        fP.append(P)
    sm, sP = [fm[-1]], [fP[-1]]
    for t in range(len(ys) - 2, -1, -1):
        mp, Sp, C = moments(f, fm[t], fP[t])
        Sp = Sp + Q
        det = Sp[0, 0] * Sp[1, 1] - Sp[0, 1] * Sp[1, 0]
        inv = np.array([[Sp[1, 1], -Sp[0, 1]], [-Sp[1, 0], Sp[0, 0]]], dtype=X) / det
        G_ = C @ inv
        sm.append(fm[t] + G_ @ (sm[-1] - mp))
        sP.append(fP[t] + G_ @ (sP[-1] - Sp) @ G_.T)
    out = {
        "filtered means": fm,
        "filtered covs": fP,
        "log-likelihood": ll,
        "smoothed means": sm[::-1],
        "smoothed covs": sP[::-1],
    }
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def _unboosted(dx, key, params, ys, extra):
    """dynamax's filter and smoother with `psd_solve(..., diagonal_boost=0)`."""
    import functools

    import dynamax.nonlinear_gaussian_ssm.inference_ekf as ekf
    import dynamax.nonlinear_gaussian_ssm.inference_ukf as ukf
    import dynamax.utils.utils as utils

    unboosted = functools.partial(utils.psd_solve, diagonal_boost=0.0)
    saved = ekf.psd_solve, ukf.psd_solve
    ekf.psd_solve = ukf.psd_solve = unboosted
    try:
        tf = dx[key + "f"](params, ys, *extra)
        ts = dx[key + "s"](params, ys, *extra)
    finally:
        ekf.psd_solve, ukf.psd_solve = saved
    return (tf.filtered_means, tf.filtered_covariances, tf.marginal_loglik,
            ts.smoothed_means, ts.smoothed_covariances)  # fmt: skip


QUANTITIES = (
    "filtered means",
    "filtered covs",
    "log-likelihood",
    "smoothed means",
    "smoothed covs",
)


def check_child(T):
    """Float64: ours against dynamax, cuthbert and the extended-precision
    reference, the largest differences relative to the largest entry; exits with
    an error if ours is off the reference by more than `CHECK_TOL`, or off dynamax
    by more than that where dynamax itself is within it of the reference."""
    jax.config.update("jax_enable_x64", True)
    dtype = jnp.float64
    ys = draw(T, dtype)
    dx = _dynamax()
    rows = {}
    for method in ("extended", "unscented"):
        ours_model = model(dtype)
        f, sm = (
            ours_model.filter(ys, method=method),
            ours_model.smooth(ys, method=method),
        )
        ours = dict(
            zip(QUANTITIES, (f.means, f.covs, f.log_likelihood, sm.means, sm.covs))
        )
        ref = reference(np.asarray(ys), method)
        row = {q: {"ours vs reference": _rel(ours[q], ref[q])} for q in QUANTITIES}
        if dx is not None:
            params = dynamax_params(dx, theta_of(dtype))
            key, extra = (
                ("ek", ()) if method == "extended" else ("uk", (dx["ukf_hyper"](),))
            )
            tf = dx[key + "f"](params, ys, *extra)
            ts = dx[key + "s"](params, ys, *extra)
            theirs = (tf.filtered_means, tf.filtered_covariances, tf.marginal_loglik,
                      ts.smoothed_means, ts.smoothed_covariances)  # fmt: skip
            for q, v in zip(QUANTITIES, theirs):
                row[q]["ours vs dynamax"] = _rel(ours[q], v)
                row[q]["dynamax vs reference"] = _rel(v, ref[q])
            # dynamax's solves add 1e-9 to the diagonal (`psd_solve`'s
            # `diagonal_boost`): without it, how far from the reference?
            for q, v in zip(QUANTITIES, _unboosted(dx, key, params, ys, extra)):
                row[q]["dynamax without boost vs reference"] = _rel(v, ref[q])
        rows[method] = row
    out = {"T": T, "tol": CHECK_TOL, "dynamax": dx is not None, "rows": rows}
    out["cuthbert"] = _cuthbert_ekf(T)
    bad = []
    for method, row in rows.items():
        for q, d in row.items():
            if not d["ours vs reference"] <= CHECK_TOL:
                bad.append(
                    f"{method} {q}: ours vs reference {d['ours vs reference']:.2e}"
                )
            if "ours vs dynamax" in d and not (
                d["ours vs dynamax"] <= CHECK_TOL
                or d["dynamax vs reference"] > CHECK_TOL
            ):
                bad.append(f"{method} {q}: ours vs dynamax {d['ours vs dynamax']:.2e}")
    for q, v in (out["cuthbert"] or {}).items():
        if not v <= CHECK_TOL:
            bad.append(f"extended {q}: ours vs cuthbert {v:.2e}")
    for line in check_lines(out):
        print(line, file=sys.stderr)
    if bad:
        raise SystemExit(
            f"check FAILED beyond {CHECK_TOL:g} (relative): " + "; ".join(bad)
        )
    return out


def check_lines(c):
    lines = []
    for method, row in c["rows"].items():
        for q, d in row.items():
            diffs = ", ".join(f"{k} {v:.1e}" for k, v in d.items())
            lines.append(f"check: {method}, {q}: {diffs}")
    cb = c["cuthbert"]
    if cb is None:
        lines.append("check: cuthbert not installed, skipped")
    else:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in cb.items())
        lines.append(f"check: ours vs cuthbert extended (prior on x_0): {diffs}")
    return lines


def check_table(c):
    cb = c["cuthbert"] or {}
    rows = []
    for method, row in c["rows"].items():
        for q, d in row.items():
            e = lambda x: DASH if x is None else f"{x:.1e}"
            rows.append(
                [
                    method,
                    q,
                    e(d.get("ours vs dynamax")),
                    e(d.get("dynamax vs reference")),
                    e(d.get("dynamax without boost vs reference")),
                    e(d["ours vs reference"]),
                    e(cb.get(q)) if method == "extended" else DASH,
                ]
            )
    out = [
        f"Value check, float64, T = {c['T']}: the largest difference relative to the "
        "largest entry of the second; reference: the same filter and RTS smoother in "
        "NumPy's 80-bit `longdouble` (covariance form); cuthbert: its moments filter "
        "and smoother (extended, square-root), prior on x_0, against ours with "
        '`prior_at="x0"`. The run stops if ours is off the reference by more than '
        f"{c['tol']:g}, or off dynamax by more where dynamax is within it of the "
        "reference. dynamax's solves add 1e-9 to the diagonal (`psd_solve`, "
        '`diagonal_boost=1e-9`); "no boost": dynamax with `diagonal_boost=0`.',
        "",
    ]
    return out + table(
        "method | quantity | ours vs dynamax | dynamax vs reference | "
        "dynamax, no boost, vs reference | ours vs reference | ours vs cuthbert",
        rows,
        left=2,
    )


# --- 2. the filters' timing ------------------------------------------------------
METHODS = (("extended", "EKF", "ekf"), ("unscented", "UKF", "ukf"))


def timing_programs(T, dtype, dx):
    ys = draw(T, dtype)
    ours = model(dtype)
    progs, lls = {}, {}
    for method, label, key in METHODS:
        ll = lambda m, ys, method=method: m.log_likelihood(ys, method=method)
        progs[f"ours: {label}"] = (eqx.filter_jit(ll), (ours, ys))
        progs[f"ours: {label} grad"] = (
            eqx.filter_jit(eqx.filter_grad(ll)),
            (ours, ys),
        )
        lls[f"ours: {label}"] = float(ll(ours, ys))
        if dx is None:
            continue
        extra = (dx["ukf_hyper"](),) if key == "ukf" else ()

        def dll(theta, ys, key=key, extra=extra):
            return dx[key](dynamax_params(dx, theta), ys, *extra).marginal_loglik

        theta = theta_of(dtype)
        progs[f"dynamax: {label}"] = (jax.jit(dll), (theta, ys))
        progs[f"dynamax: {label} grad"] = (jax.jit(jax.grad(dll)), (theta, ys))
        lls[f"dynamax: {label}"] = float(dll(theta, ys))
    return progs, lls


def timing_child(dtype_name, lengths, repeats):
    if dtype_name == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(dtype_name)
    dx = _dynamax()
    runs = {}
    for T in lengths:
        print(f"measuring: filters, {dtype_name}, T={T}", file=sys.stderr)
        progs, lls = timing_programs(T, dtype, dx)
        big = T >= 100_000
        res = measure_many(
            progs,
            repeats=max(1, repeats // 2) if big else repeats,
            slow=tuple(progs) if big else (),
        )
        runs[str(T)] = {"times": res, "loglik": lls}
    return {"dtype": dtype_name, "dynamax": dx is not None, "runs": runs}


# --- 3. the iterated smoothers ---------------------------------------------------
ITER_METHODS = (("extended", "IEKS"), ("cubature", "IPLS (cubature)"))
BACKENDS = ("seq", "par", "split")


def _put(mesh, specs, arrays):
    return tuple(
        jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, specs)
    )


def _scan(label):
    return {
        "seq": eqx_seq.SequentialScan(),
        "par": eqx_seq.AssociativeScan(),
        "split": eqx_seq.ShardedScan("seq", eqx_seq.SequentialScan()),
    }[label]


def iterated_programs(T, methods):
    """Per method and backend, `smooth(iterated=True)` from a given `init`: the
    smoothed means and the number of passes; and the one-pass smoother."""
    dtype = jnp.float64
    ys = draw(T, dtype)
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    prior = (
        jnp.broadcast_to(jnp.array(M0, dtype), (T, 2)),
        jnp.broadcast_to(P0_VAR * jnp.eye(2, dtype=dtype), (T, 2, 2)),
    )
    progs, inits = {}, {}
    for method, label in methods:
        once = eqx.filter_jit(lambda m, ys, method=method: m.smooth(ys, method=method))
        progs[f"{label}: one-pass smoother"] = (
            lambda m, ys, once=once: once(m, ys).means,
            (model(dtype), ys),
        )
        first = once(model(dtype), ys)
        inits[label] = {"smoother": (first.means, first.covs), "prior": prior}
        for backend in BACKENDS:
            params, static = eqx.partition(
                model(dtype, _scan(backend)), eqx.is_inexact_array
            )

            def run(p, ys, init, static=static, method=method):
                out = eqx.combine(p, static).smooth(
                    ys, method=method, iterated=True, init=init
                )
                return out.means, out.num_iterations[None], out.converged[None]

            args = (params, ys, inits[label]["smoother"])
            if backend == "split":
                run = jax.shard_map(
                    run,
                    mesh=mesh,
                    in_specs=(P(), P("seq"), P("seq")),
                    out_specs=(P("seq"), P("seq"), P("seq")),
                )
                args = _put(mesh, (P(), P("seq"), P("seq")), args)
            progs[f"{label}: {backend}"] = (jax.jit(run), args)
    return progs, inits, mesh


def floor_programs(T, mesh):
    """The linear smoother each iteration runs: `KalmanFilter(2, 1)`, every step
    exact, on the three backends."""
    progs = {}
    kf = eqx_seq.KalmanFilter(2, 1, dtype=jnp.float64, key=jr.key(0))
    ys = kf.sample(jr.key(1), T)[1]
    for backend in BACKENDS:
        params, static = eqx.partition(
            eqx_seq.KalmanFilter(
                2,
                1,
                scan=_scan(backend),
                dtype=jnp.float64,
                key=jr.key(0),
                _steady_state=False,
            ),
            eqx.is_inexact_array,
        )
        run = lambda p, ys, static=static: eqx.combine(p, static).smooth(ys).means
        args = (params, ys)
        if backend == "split":
            run = jax.shard_map(
                run, mesh=mesh, in_specs=(P(), P("seq")), out_specs=P("seq")
            )
            args = _put(mesh, (P(), P("seq")), args)
        progs[f"linear smoother: {backend}"] = (jax.jit(run), args)
    # the ceiling of any split: the sequential smoother on the two halves as two
    # independent sequences, one per device, nothing exchanged
    params, static = eqx.partition(
        eqx_seq.KalmanFilter(
            2, 1, scan=eqx_seq.SequentialScan(), dtype=jnp.float64, key=jr.key(0),
            _steady_state=False,
        ),
        eqx.is_inexact_array,
    )  # fmt: skip
    run = lambda p, ys: eqx.combine(p, static).smooth(ys).means
    run = jax.shard_map(run, mesh=mesh, in_specs=(P(), P("seq")), out_specs=P("seq"))
    args = _put(mesh, (P(), P("seq")), (params, ys))
    progs["linear smoother: halves"] = (jax.jit(run), args)
    return progs


def iterated_child(T, repeats, extended_only):
    jax.config.update("jax_enable_x64", True)
    methods = ITER_METHODS[:1] if extended_only else ITER_METHODS
    print(f"measuring: iterated smoothers, T={T}", file=sys.stderr)
    progs, inits, mesh = iterated_programs(T, methods)
    progs.update(floor_programs(T, mesh))
    # passes and convergence, from the one-pass smoother and from the prior
    passes = {}
    for method, label in methods:
        ref = None
        for backend in BACKENDS:
            fn, args = progs[f"{label}: {backend}"]
            row = {}
            for start in ("smoother", "prior"):
                init = inits[label][start]
                if backend == "split":
                    init = _put(mesh, (P("seq"), P("seq")), init)
                means, k, done = fn(args[0], args[1], init)
                row[start] = {"passes": int(k[0]), "converged": bool(done[0])}
                if start == "smoother":
                    means = np.asarray(means)
                    ref = means if ref is None else ref
                    row["means_max_diff_vs_seq"] = float(np.max(np.abs(means - ref)))
            passes[f"{label}: {backend}"] = row
            print(f"  {label}, {backend}: {row}", file=sys.stderr)
    big = T >= 100_000
    res = measure_many(
        progs,
        repeats=1 if big else repeats,
        slow=tuple(progs) if big else tuple(k for k in progs if "linear" not in k),
    )
    return {"T": T, "times": res, "passes": passes}


# --- the children ----------------------------------------------------------------
def child(spec, timeout):
    """Run one part in a subprocess (its own dtype setting; a stall or a crash of
    one part does not take the others with it): its JSON, or a status."""
    cmd = [sys.executable, __file__, "--child", spec]
    try:
        out = subprocess.run(
            cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        if spec.startswith("check"):
            raise SystemExit(f"the check failed ({spec}); see above")
        return {"status": f"failed (exit {out.returncode})"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(spec):
    kind, *rest = spec.split(",")
    if kind == "check":
        result = check_child(int(rest[0]))
    elif kind == "time":
        dtype, repeats, *lengths = rest
        result = timing_child(dtype, [int(T) for T in lengths], int(repeats))
    else:
        T, repeats, extended_only = map(int, rest)
        result = iterated_child(T, repeats, bool(extended_only))
    print(json.dumps(result))


# --- the reports: printed, and written beside the JSON ---------------------------
def _t(res, name):
    r = res.get(name)
    return None if r is None else r["median_ms"]


def filter_tables(p):
    out = []
    rows = []
    for dtype, part in p["timing"].items():
        if "status" in part:
            rows.append([dtype, part["status"]] + [DASH] * 9)
            continue
        for T, run in part["runs"].items():
            t = run["times"]
            for _, label, _ in METHODS:
                f, g = _t(t, f"ours: {label}"), _t(t, f"ours: {label} grad")
                df, dg = _t(t, f"dynamax: {label}"), _t(t, f"dynamax: {label} grad")
                both = div(
                    None if df is None else df + dg, f + g if df is not None else None
                )
                rows.append(
                    [
                        dtype,
                        T,
                        label,
                        ms(f),
                        ms(df),
                        times(div(df, f)),
                        ms(g),
                        ms(dg),
                        times(div(dg, g)),
                        times(both),
                        f"{t[f'ours: {label} grad']['first_call_s']:.1f}",
                    ]
                )
    out += [
        "One sequence, the log-likelihood (forward) and its gradient (ours w.r.t. "
        "the whole model, g in `f` included; dynamax's w.r.t. g, Q, R and its prior); "
        'ms; "speed-up": dynamax\'s time over ours; "fwd + grad": the sum of both '
        "programs' times; compile: our gradient's first call, compilation included.",
        "",
    ]
    out += table(
        "dtype | T | filter | ours fwd ms | dynamax fwd ms | fwd speed-up | "
        "ours grad ms | dynamax grad ms | grad speed-up | fwd + grad speed-up | "
        "ours grad compile s",
        rows,
        left=3,
    )
    return out


def iterated_tables(p):
    out = [
        "Iterated smoothers, float64, default tolerance: ms per call, every "
        "variant from the same `init` (the one-pass smoother of the method; its own "
        "time in the first column); passes: smoothing passes to converge from that "
        "init / from the prior at every step (* = not converged by `max_iter = 20`); "
        "split: `ShardedScan(SequentialScan())` in `shard_map` over 2 CPU devices; "
        '"split vs seq": the sequential time over the split one. The load '
        f"average of the machine (2 cores) was {p['load_at_start'][0]:.1f} at the "
        f"start of the run and {p['load_at_end'][0]:.1f} at its end (other jobs).",
        "",
    ]
    rows, floor = [], []
    for T, part in p["iterated"].items():
        if "status" in part:
            rows.append([T, part["status"]] + [DASH] * 7)
            continue
        t = part["times"]
        for _, label in ITER_METHODS:
            if f"{label}: seq" not in t:
                continue
            ps = part["passes"]

            def passes(backend, ps=ps, label=label):
                row = ps[f"{label}: {backend}"]
                return "/".join(
                    f"{row[s]['passes']}{'' if row[s]['converged'] else '*'}"
                    for s in ("smoother", "prior")
                )

            seq, par, split = (_t(t, f"{label}: {b}") for b in BACKENDS)
            rows.append(
                [
                    T,
                    label,
                    ms(_t(t, f"{label}: one-pass smoother")),
                    ms(seq),
                    ms(par),
                    ms(split),
                    times(div(seq, par)),
                    times(div(seq, split)),
                    " ".join(passes(b) for b in BACKENDS),
                ]
            )
        lin = [_t(t, f"linear smoother: {b}") for b in BACKENDS]
        halves = _t(t, "linear smoother: halves")
        floor.append(
            [T]
            + [ms(x) for x in lin]
            + [ms(halves)]
            + [times(div(lin[0], x)) for x in (lin[1], lin[2], halves)]
        )
    out += table(
        "T | smoother | one-pass ms | seq ms | par ms | split ms | par vs seq | "
        "split vs seq | passes seq par split",
        rows,
        left=2,
    )
    out += [
        "The floor: one linear smoother pass (`KalmanFilter(2, 1)`, every step "
        'exact, what each iteration runs after linearising), ms; "halves": the '
        "sequential smoother on the two halves as independent sequences, one per "
        "device, nothing exchanged: the ceiling of any split of this loop on this "
        "machine:",
        "",
    ]
    out += table(
        "T | seq ms | par ms | split ms | halves ms | par vs seq | split vs seq | "
        "halves vs seq",
        floor,
    )
    return out


def tables(p):
    return check_table(p["check"]) + filter_tables(p) + iterated_tables(p)


def headline(p):
    grads = []
    for dtype, part in p["timing"].items():
        run = part["runs"].get("10000")
        if run is None or not part.get("dynamax"):
            raise KeyError("no anchor")
        t = run["times"]
        for _, label, _ in METHODS:
            ours = _t(t, f"ours: {label}") + _t(t, f"ours: {label} grad")
            theirs = _t(t, f"dynamax: {label}") + _t(t, f"dynamax: {label} grad")
            grads.append(theirs / ours)
    it = p["iterated"].get("10000", {}).get("times", {})
    split = [
        div(_t(it, f"{lb}: seq"), _t(it, f"{lb}: split")) for _, lb in ITER_METHODS
    ]
    return (
        "vs dynamax at T = 1e4, forward + gradient, EKF and UKF, float64 and float32: "
        f"{faster(grads)}; iterated smoothers (IEKS, IPLS) split over two CPU "
        f"devices vs sequential on one at T = 1e4: {faster(split)}"
    )


REPORTS = {"nonlinear": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T = 1e3 only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--long", action="store_true", help="also T = 1e5 (IEKS only when iterated)"
    )
    parser.add_argument("--timeout", type=float, default=1200, help="per part, s")
    parser.add_argument("--json", help="default: results/<machine>/nonlinear.json")
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    if args.child:
        run_child(args.child)
        return
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
        f"{len(info['devices'])} devices, jax {info['jax']}"
    )
    print(allocator_line(info))
    print(f"load average at the start: {os.getloadavg()}")
    lengths = [1000] if args.quick else [1000, 10_000] + [100_000] * args.long
    payload = {"machine": info, "load_at_start": os.getloadavg()}
    payload["check"] = child(f"check,{200 if args.quick else 1000}", args.timeout)
    payload["timing"] = {
        dtype: child(
            f"time,{dtype},{args.repeats}," + ",".join(map(str, lengths)),
            args.timeout,
        )
        for dtype in ("float64", "float32")
    }
    iterated = [(1000, 0)] if args.quick else [(10_000, 0)] + [(100_000, 1)] * args.long
    payload["iterated"] = {
        str(T): child(f"iterated,{T},{max(1, args.repeats // 2)},{only}", args.timeout)
        for T, only in iterated
    }
    payload["load_at_end"] = os.getloadavg()
    save(args.json or results_path("nonlinear"), payload, REPORTS["nonlinear"])


if __name__ == "__main__":
    main()
