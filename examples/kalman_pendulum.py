"""Track a noisy pendulum with the nonlinear Kalman filters and smoothers, and learn
its gravity by maximum likelihood.

The pendulum of Sarkka's *Bayesian Filtering and Smoothing* (2013, examples 3.7 and
5.1): the angle and the angular velocity, Euler-discretised with step 0.01 s and
observed through the sine of the angle under noise. An
`eqx_seq.NonlinearKalmanFilter` runs every filter (extended, cubature, unscented),
their Rauch-Tung-Striebel smoothers and the iterated smoothers (IEKS, IPLS) on
simulated data, with and without a gap in the observations; then the gravity `g`
and the observation noise are fitted by gradient descent on the filter's negative
log-likelihood from a wrong start. docs/examples/kalman_pendulum.md walks through it.

    python examples/kalman_pendulum.py
"""

# --8<-- [start:setup]
import argparse
import os
import time

import jax


jax.config.update("jax_enable_x64", True)  # the iterated smoothers' tolerance: ~1e-8

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import matplotlib


matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt
import numpy as np
import optax

import eqx_seq


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=500, help="time steps (of 0.01 s)")
parser.add_argument("--runs", type=int, default=20, help="simulated data sets")
parser.add_argument("--methods", default="extended,cubature,unscented")
parser.add_argument("--fit-steps", type=int, default=150, help="optimiser steps")
parser.add_argument(
    "--fit-method", choices=["extended", "cubature", "unscented"], default="cubature"
)
parser.add_argument("--max-iter", type=int, default=20, help="iterated smoothers")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=os.path.join("outputs", "kalman_pendulum"))
args = parser.parse_args()
LINEARISATIONS = ("extended", "cubature", "unscented")
methods = args.methods.split(",")
assert set(methods) <= set(LINEARISATIONS), f"error: unknown --methods {methods}"
assert args.steps >= 20 and args.runs >= 1 and args.fit_steps >= 1, (
    "error: --steps must be at least 20, --runs and --fit-steps at least 1"
)
start_time = time.perf_counter()
# --8<-- [end:setup]

# --8<-- [start:model]
DT, G, QC, R = 0.01, 9.81, 0.01, 0.1  # step (s), gravity, noise density, variance


class Pendulum(eqx.Module):
    """One Euler step of `alpha'' = -g sin(alpha)`; `g` is learnt, as `log g`."""

    log_g: jax.Array

    def __call__(self, x):
        alpha, omega = x[0], x[1]
        g = jnp.exp(self.log_g)
        return jnp.stack([alpha + DT * omega, omega - g * DT * jnp.sin(alpha)])


def sine_of_angle(x):
    return jnp.sin(x[:1])


def pendulum(g, *, r=R, m0=(1.6, 0.0), p0=0.1):
    """The model with gravity `g` and observation variance `r`, from
    `x_0 ~ N(m0, p0 I)`."""
    Q = QC * jnp.array([[DT**3 / 3, DT**2 / 2], [DT**2 / 2, DT]])
    return eqx_seq.NonlinearKalmanFilter(
        Pendulum(jnp.log(jnp.asarray(g, jnp.float64))),
        sine_of_angle,
        Q=Q,
        R=r * jnp.eye(1),
        m0=jnp.array(m0),
        P0=p0 * jnp.eye(2),
    )


# the data: every run starts from alpha = 1.5 rad at rest (P0 ~ 0: a known start)
truth = pendulum(G, m0=(1.5, 0.0), p0=1e-12)
keys = jr.split(jr.key(args.seed), args.runs)
runs = [truth.sample(k, args.steps) for k in keys]  # compiled once, run N times
states, ys = (jnp.stack(arrays) for arrays in zip(*runs))  # (N, T, 2) and (N, T, 1)
model = pendulum(G)  # what the filters assume: the book's prior N([1.6, 0], 0.1 I)
times = DT * np.arange(1, args.steps + 1)
print(
    f"pendulum: {args.runs} runs of {args.steps} steps ({args.steps * DT:g} s), "
    f"g = {G}, qc = {QC}, R = {R}, x_0 = (1.5, 0)"
)
# --8<-- [end:model]

# --8<-- [start:estimators]
LETTERS = {"extended": "E", "cubature": "C", "unscented": "U"}
METHODS = {m: LETTERS[m] for m in LINEARISATIONS if m in methods}
ITERATED = {"extended": "IEKS", "cubature": "IPLS (cubature)"}
ITERATED["unscented"] = "IPLS (unscented)"


def estimates(ys):
    """Every estimator's means, covariances, iterations and convergence, each with a
    leading runs axis: {name: (means, covs, iterations, converged)}."""
    out = {}
    for kind in ("filter", "RTS", "iterated"):
        for method, letter in METHODS.items():
            if kind == "iterated":
                name = ITERATED[method]
                run = lambda y, m=method: model.smooth(  # noqa: E731
                    y, method=m, iterated=True, max_iter=args.max_iter
                )
            else:
                name = f"{letter}KF" if kind == "filter" else f"{letter}RTSS"
                run = lambda y, m=method: model.smooth(y, method=m)  # noqa: E731
            s = jax.vmap(run)(ys)
            if kind == "filter":  # the one-pass smoother's forward pass
                out[name] = (s.filtered.means, s.filtered.covs, None, None)
            else:
                out[name] = (s.means, s.covs, s.num_iterations, s.converged)
    return out


def rmse(means, where=slice(None)):
    """The angle's root-mean-square error of each run, over the steps `where`."""
    err = means[:, where, 0] - states[:, where, 0]
    return np.sqrt(np.mean(np.asarray(err) ** 2, axis=1))


def table(results, gap=None):
    head = "| estimator | pass | angle RMSE (rad) | ± s.e. |"
    head += " in the gap |" if gap is not None else ""
    head += " iterations (mean, max) | converged |"
    print(head)
    print("|" + "---|" * head.count(" |"))
    for name, (means, _, k, done) in results.items():
        if k is None:
            kind, its, conv = "filter", "", ""
        else:
            kind = "iterated" if name in ITERATED.values() else "one-pass"
            k, done = np.asarray(k), np.asarray(done)
            its = f"{k.mean():.1f}, {k.max()}"
            conv = f"{done.sum()}/{done.size}"
        e = rmse(means)
        row = f"| {name} | {kind} | {e.mean():.4f} | {e.std() / np.sqrt(e.size):.4f} |"
        if gap is not None:
            row += f" {rmse(means, gap).mean():.4f} |"
        print(row + f" {its} | {conv} |")
    pairs = []
    for method, letter in METHODS.items():  # paired: the same runs' data
        d = rmse(results[ITERATED[method]][0]) - rmse(results[f"{letter}RTSS"][0])
        se = d.std() / np.sqrt(d.size)
        pairs.append(f"{ITERATED[method]} - {letter}RTSS {d.mean():+.4f} ± {se:.4f}")
    print("\niterated minus one-pass RMSE, paired over runs: " + "; ".join(pairs))


results = estimates(ys)
print(f"\nall observations, mean over {args.runs} runs:\n")
table(results)

gap = slice(2 * args.steps // 5, 3 * args.steps // 5)  # 2-3 s with the defaults
ys_gap = ys.at[:, gap].set(jnp.nan)  # NaN: missing, skipped by every estimator
results_gap = estimates(ys_gap)
print(
    f"\nobservations {times[gap.start] - DT:g}-{times[gap.stop - 1]:g} s missing, "
    f"mean over {args.runs} runs:\n"
)
table(results_gap, gap)
# --8<-- [end:estimators]


# --8<-- [start:fit]
def loss(params, static, y):
    return -eqx.combine(params, static).log_likelihood(y, method=args.fit_method)


start = pendulum(5.0, r=0.5)  # wrong gravity (5 instead of 9.81), wrong noise
trainable = jax.tree.map(lambda _: False, start)
trainable = eqx.tree_at(
    lambda m: (m.transition.log_g, m.R_factor), trainable, (True, True)
)
params, static = eqx.partition(start, trainable)
optim = optax.adam(0.05)


def step(params, opt_state, y):
    value, grads = jax.value_and_grad(loss)(params, static, y)
    updates, opt_state = optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


# one fit per run, all at once: the parameters get a leading runs axis
params = jax.tree.map(lambda x: jnp.broadcast_to(x, (args.runs, *x.shape)), params)
opt_state = jax.vmap(optim.init)(params)
step = jax.jit(jax.vmap(step))


def current(params):
    """g and R of every run's fit."""
    fitted = eqx.combine(params, static)
    return np.exp(fitted.transition.log_g), np.exp(2 * fitted.R_factor[:, 0, 0])


print(
    f"\nfit g and R by Adam (lr 0.05) on the {args.fit_method} filter's negative "
    f"log-likelihood, from g = 5, R = 0.5; the first run:\n"
)
print("| step | g | R | negative log-likelihood |")
print("|---|---|---|---|")
trace = [current(params)]
for i in range(args.fit_steps):
    params, opt_state, values = step(params, opt_state, ys)
    trace.append(current(params))
    if i % max(1, args.fit_steps // 6) == 0 or i == args.fit_steps - 1:
        g_i, r_i = trace[i]  # the values `values` were computed at
        print(f"| {i} | {g_i[0]:.4f} | {r_i[0]:.4f} | {float(values[0]):.3f} |")
gs, rs = trace[-1]
g_fit, r_fit = float(gs[0]), float(rs[0])
moved = np.abs(trace[-1][0] - trace[-11 if args.fit_steps > 10 else 0][0])
print(
    f"\nover the {args.runs} runs: g = {gs.mean():.3f} (sd {gs.std():.3f}, true {G}), "
    f"R = {rs.mean():.4f} (sd {rs.std():.4f}, true {R}); the largest change of g "
    f"in the last 10 steps {moved.max():.1e}"
)

# the first run's profile: the negative log-likelihood over g, R at its fit
grid = np.linspace(4.0, 16.0, 121)
profiles = {}
for method in METHODS:
    nll = jax.vmap(
        lambda g, m=method: -pendulum(g, r=r_fit).log_likelihood(ys[0], method=m)
    )(jnp.asarray(grid))
    profiles[method] = np.asarray(nll)
print(
    f"first run: fitted g = {g_fit:.3f}, R = {r_fit:.4f}; the profile over g is "
    "least on a 0.1 grid at "
    + ", ".join(f"{grid[np.argmin(v)]:.1f} ({m})" for m, v in profiles.items())
)
# --8<-- [end:fit]

# --8<-- [start:figure]
fig = plt.figure(figsize=(10, 10))
grid_spec = fig.add_gridspec(3, 2)
panels = [
    (fig.add_subplot(grid_spec[0, :]), results, "(a) all observations"),
    (fig.add_subplot(grid_spec[1, :]), results_gap, "(b) a gap in the observations"),
]
for ax, res, title in panels:
    ax.plot(times, states[0, :, 0], "k", lw=1.5, label="true angle")
    for name, colour in [("EKF", "tab:blue"), ("IEKS", "tab:red")]:
        mean = np.asarray(res[name][0][0, :, 0])
        band = 2 * np.sqrt(np.asarray(res[name][1][0, :, 0, 0]))
        ax.plot(times, mean, color=colour, lw=1, label=f"{name} mean, 2 sd")
        ax.fill_between(times, mean - band, mean + band, color=colour, alpha=0.15)
    ax.set(xlabel="time (s)", ylabel="angle (rad)", ylim=(-2.5, 2.5), title=title)
    ax.legend(loc="lower left", ncol=3, fontsize=8)
panels[1][0].axvspan(
    times[gap.start] - DT, times[gap.stop - 1], color="0.85", label="no data"
)
ax = fig.add_subplot(grid_spec[2, 0])
for method, nll in profiles.items():
    ax.plot(grid, nll - nll.min(), label=method)
ax.axvline(G, color="k", ls=":", label=f"true g = {G}")
ax.axvline(g_fit, color="tab:red", ls="--", label=f"fitted g = {g_fit:.2f}")
ax.set(xlabel="g (m/s^2)", ylabel="negative log-lik. - its minimum", yscale="symlog")
ax.set_ylim(bottom=0)
ax.set_title(f"(c) profile over g (first run, R = {r_fit:.3f})")
ax.legend(fontsize=8)
ax = fig.add_subplot(grid_spec[2, 1])
ax.plot([g for g, _ in trace], color="tab:red", lw=0.8, alpha=0.6)
ax.axhline(G, color="k", ls=":")
ax.set(xlabel="Adam step", ylabel="g (m/s^2)")
ax.set_title(f"(d) the estimate of g, each of the {args.runs} runs")
fig.tight_layout()
os.makedirs(args.out, exist_ok=True)
path = os.path.join(args.out, "kalman_pendulum.png")
fig.savefig(path, dpi=100)
print(f"wrote {path}; {time.perf_counter() - start_time:.0f} s")
# --8<-- [end:figure]
