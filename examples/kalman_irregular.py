"""Fit a continuous-time damped oscillator to irregularly sampled data.

A noisy damped oscillator, `dx = A x dt + L dβ`, is observed at random times
(exponential gaps, and one long gap). `eqx_seq.KalmanFilter.from_continuous`
discretises it exactly between the observation times; its frequency, damping and
two noise levels are fitted by gradient ascent on the exact log-likelihood, and the
smoothed path is drawn with its band, through the gap and on to forecasts at
future times. docs/examples/kalman_irregular.md walks through it.

    python examples/kalman_irregular.py
"""

# --8<-- [start:setup]
import argparse
import os

import jax


jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt
import numpy as np
import optax

import eqx_seq


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--num-obs", type=int, default=150)
parser.add_argument("--out", default=os.path.join("outputs", "kalman_irregular"))
args = parser.parse_args()
# --8<-- [end:setup]


# --8<-- [start:model]
def oscillator(omega, zeta):
    """The drift of position and velocity: `x'' = -omega^2 x - 2 zeta omega x'`."""
    return jnp.array([[0.0, 1.0], [-(omega**2), -2 * zeta * omega]])


L = jnp.array([[0.0], [1.0]])  # the noise drives the velocity
H = jnp.array([[1.0, 0.0]])  # the position is observed
truth = dict(omega=1.3, zeta=0.08, q=0.4, r=0.05)
# --8<-- [end:model]

# --8<-- [start:data]
rng = np.random.default_rng(0)
gaps = rng.exponential(0.35, args.num_obs)
gaps[args.num_obs // 2] = 8.0  # a long gap in the middle
times = np.cumsum(gaps)
A_true = oscillator(truth["omega"], truth["zeta"])
true_kf = eqx_seq.KalmanFilter.from_continuous(
    A_true, H, jnp.array([[truth["q"]]]), jnp.array([[truth["r"]]]),
    jnp.zeros(2), jnp.eye(2), times, L=L,
)  # fmt: skip
_, ys = true_kf.sample(jax.random.key(1), len(times))
print(f"{len(times)} observations over t = 0..{times[-1]:.1f}, gaps "
      f"{gaps.min():.2g}..{gaps.max():.2g}")  # fmt: skip
# --8<-- [end:data]


# --8<-- [start:training]
def build(params, times):
    """The filter of the parameters (logs, so that every value is valid)."""
    omega, zeta, q, r = (jnp.exp(params[k]) for k in ("omega", "zeta", "q", "r"))
    return eqx_seq.KalmanFilter.from_continuous(
        oscillator(omega, zeta), H, q[None, None], r[None, None],
        jnp.zeros(2), jnp.eye(2), times, L=L,
    )  # fmt: skip


def loss(params):
    return -build(params, times).log_likelihood(ys)


params = {k: jnp.log(jnp.asarray(v)) for k, v in
          dict(omega=0.8, zeta=0.3, q=1.0, r=0.2).items()}  # fmt: skip
optim = optax.adam(0.05)
opt_state = optim.init(params)


@jax.jit
def step(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(args.steps):
    params, opt_state, value = step(params, opt_state)
    if (i + 1) % max(1, args.steps // 6) == 0:
        print(f"step {i + 1:4d}  negative log-likelihood {float(value):.4f}")
fitted = {k: float(jnp.exp(v)) for k, v in params.items()}
print("fitted: " + ", ".join(f"{k} = {v:.3f} ({truth[k]})" for k, v in fitted.items()))
# --8<-- [end:training]

# --8<-- [start:result]
# a fine grid through the data, the gap and 6 time units past the last
# observation: rows of NaN, so that the smoother interpolates there and, after
# the last observation, forecasts
grid = np.linspace(times[0], times[-1] + 6.0, 600)
all_times = np.union1d(times, grid)
rows = np.searchsorted(all_times, times)
ys_all = np.full((len(all_times), 1), np.nan)
ys_all[rows] = np.asarray(ys)
smoothed = build(params, all_times).smooth(ys_all)
mean = np.asarray(smoothed.means[:, 0])
band = 1.645 * np.sqrt(np.asarray(smoothed.covs[:, 0, 0]))  # 90%, of the state

fig, ax = plt.subplots(figsize=(10, 4.5))
future = all_times > times[-1]
for part, name, colour in [
    (~future, "smoothed position", "tab:blue"),
    (future, "forecast", "tab:orange"),
]:
    t = all_times[part]
    ax.plot(t, mean[part], color=colour, label=name)
    ax.fill_between(t, (mean - band)[part], (mean + band)[part], color=colour,
                    alpha=0.2)  # fmt: skip
ax.plot(times, ys[:, 0], "k.", markersize=4, label="observations")
ax.set(xlabel="time", ylabel="position")
ax.set_title(
    "Damped oscillator at irregular times: "
    + ", ".join(f"{k}={v:.2f}" for k, v in fitted.items())
)
ax.legend(loc="upper left", ncol=3)
ax.set_ylim(-2.0, 2.4)  # room for the legend
fig.tight_layout()
os.makedirs(args.out, exist_ok=True)
path = os.path.join(args.out, "kalman_irregular.png")
fig.savefig(path, dpi=100)
print(f"wrote {path}")
# --8<-- [end:result]
