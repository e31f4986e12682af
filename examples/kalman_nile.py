"""Fit the local-level model to the Nile river flow by maximum likelihood.

An `eqx_seq.KalmanFilter`'s two noise variances are fitted to the annual flow of
the Nile (1871-1970) by gradient ascent on the exact log-likelihood; the fit is
printed beside Durbin & Koopman's, and the filtered and smoothed levels drawn.
docs/examples/kalman_nile.md walks through it.

    python examples/kalman_nile.py
"""

# --8<-- [start:setup]
import argparse
import os

import jax


jax.config.update("jax_enable_x64", True)  # the flows are ~1e3, the variances ~1e4

import equinox as eqx
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt
import numpy as np
import optax
from statsmodels.datasets import nile

import eqx_seq


SCANS = {
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--scan", choices=list(SCANS), default="sequential")
parser.add_argument("--out", default=os.path.join("outputs", "kalman_nile"))
args = parser.parse_args()
# --8<-- [end:setup]

# --8<-- [start:data]
data = nile.load_pandas().data
years, flow = data["year"].to_numpy(), data["volume"].to_numpy(np.float64)
ys = jnp.asarray(flow)[:, None]  # (T, 1): one observation per year
print(f"Nile flow at Aswan: {len(flow)} years, {years[0]:.0f}-{years[-1]:.0f}")
# --8<-- [end:data]

# --8<-- [start:model]
one = jnp.ones((1, 1))
start = float(np.var(np.diff(flow))) / 2  # the changes' variance, split evenly
kf = eqx_seq.KalmanFilter.from_matrices(
    F=one,  # the level is a random walk ...
    H=one,  # ... observed directly, under noise
    Q=start * one,
    R=start * one,
    m0=jnp.array([flow[0]]),
    P0=1e7 * one,  # vague, as a diffuse prior
    scan=SCANS[args.scan],
)
# only the two noise factors are trained; F, H, m0 and P0 stay as given
trainable = eqx.tree_at(
    lambda k: (k.Q_factor, k.R_factor), jax.tree.map(lambda _: False, kf), (True, True)
)
params, static = eqx.partition(kf, trainable)
# --8<-- [end:model]


# --8<-- [start:training]
def loss(params):
    model = eqx.combine(params, static)
    # the diffuse likelihood: the first observation's term is left out
    return -jnp.sum(model.filter(ys).log_likelihoods[1:])


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
kf = eqx.combine(params, static)
# --8<-- [end:training]

# --8<-- [start:result]
sigma2_eps, sigma2_eta = float(kf.R[0, 0]), float(kf.Q[0, 0])
print(
    f"sigma2_eps = {sigma2_eps:.0f} (Durbin & Koopman: 15099), "
    f"sigma2_eta = {sigma2_eta:.1f} (1469.1); log-likelihood {-float(loss(params)):.4f}"
)

fig, ax = plt.subplots(figsize=(9, 4.5))
ax.plot(years, flow, "k.", label="flow")
for result, name, colour in [
    (kf.filter(ys), "filtered level", "tab:blue"),
    (kf.smooth(ys), "smoothed level", "tab:red"),
]:
    mean = np.asarray(result.means[:, 0])
    band = 1.645 * np.sqrt(np.asarray(result.covs[:, 0, 0]))  # 90%
    ax.plot(years, mean, color=colour, label=name)
    ax.fill_between(years, mean - band, mean + band, color=colour, alpha=0.15)
ax.set(xlabel="year", ylabel="flow (10^8 m^3)", ylim=(400, 1500))
ax.set_title(
    f"Nile, local level: sigma2_eps={sigma2_eps:.0f}, sigma2_eta={sigma2_eta:.0f}"
)
ax.legend(loc="upper right")
fig.tight_layout()
os.makedirs(args.out, exist_ok=True)
path = os.path.join(args.out, "nile.png")
fig.savefig(path, dpi=100)
print(f"wrote {path}")
# --8<-- [end:result]
