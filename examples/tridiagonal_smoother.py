"""The tridiagonal implicit layer learns how strongly to smooth, from noisy data only.

An `eqx_seq.TridiagonalImplicit` (a Whittaker smoother with one learned roughness
penalty `kappa` per channel) is trained by Noise2Noise on three channels of
different noise; the learned `kappa` are checked against a grid search of the true
error. docs/examples/tridiagonal_smoother.md walks through it.

    python examples/tridiagonal_smoother.py
"""

# --8<-- [start:setup]
import argparse
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib


matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt
import numpy as np
import optax

import eqx_seq


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=os.path.join("outputs", "tridiagonal_smoother"))
args = parser.parse_args()
BATCH, LENGTH = 32, 256
# --8<-- [end:setup]

# --8<-- [start:data]
NOISE = np.array([0.1, 0.3, 1.0], np.float32)  # one noise level per channel


def smooth_signals(key, num):
    """Random smooth signals `(num, LENGTH, 3)`: a few sinusoids per channel."""
    kf, kp, ka = jr.split(key, 3)
    t = jnp.linspace(0, 1, LENGTH)[None, :, None, None]
    freq = jr.uniform(kf, (num, 1, 3, 4), minval=0.5, maxval=6.0)
    phase = jr.uniform(kp, (num, 1, 3, 4), maxval=2 * jnp.pi)
    amp = jr.normal(ka, (num, 1, 3, 4)) / 2
    return jnp.sum(amp * jnp.sin(2 * jnp.pi * freq * t + phase), -1)


def noisy(key, clean):
    return clean + jnp.asarray(NOISE) * jr.normal(key, clean.shape)


# --8<-- [end:data]

# --8<-- [start:model]
init_key, data_key, test_key = jr.split(jr.key(args.seed), 3)
layer = eqx_seq.TridiagonalImplicit(3, coupling_range=(1.0, 1.0), key=init_key)
# --8<-- [end:model]


# --8<-- [start:training]
def loss(layer, x, target):
    return jnp.mean((jax.vmap(layer)(x) - target) ** 2)


optim = optax.adam(0.3)
opt_state = optim.init(eqx.filter(layer, eqx.is_inexact_array))


@eqx.filter_jit
def step(layer, opt_state, key):
    k1, k2, k3 = jr.split(key, 3)
    clean = smooth_signals(k1, BATCH)
    # Noise2Noise: the input and the target are two noisy copies of the same signal
    value, grads = eqx.filter_value_and_grad(loss)(
        layer, noisy(k2, clean), noisy(k3, clean)
    )
    updates, opt_state = optim.update(grads, opt_state, layer)
    return eqx.apply_updates(layer, updates), opt_state, value


def kappa(layer):
    return np.asarray(jax.nn.softplus(layer.coupling_logit))


for i, key in enumerate(jr.split(data_key, args.steps)):
    layer, opt_state, value = step(layer, opt_state, key)
    if (i + 1) % max(1, args.steps // 5) == 0:
        print(
            f"step {i + 1:4d}  Noise2Noise loss {float(value):.4f}  kappa "
            + ", ".join(f"{k:.2f}" for k in kappa(layer))
        )
learned = kappa(layer)
# --8<-- [end:training]

# --8<-- [start:result]
k1, k2 = jr.split(test_key)
clean = smooth_signals(k1, 64)  # held-out signals, and their truth
x = noisy(k2, clean)


def error(kappa):
    """The error to the truth, per channel, for a fixed `kappa` per channel."""
    logit = kappa + jnp.log(-jnp.expm1(-kappa))  # softplus's inverse
    fixed = eqx.tree_at(lambda l: l.coupling_logit, layer, logit)
    return np.asarray(jnp.mean((jax.vmap(fixed)(x) - clean) ** 2, axis=(0, 1)))


grid = np.geomspace(0.01, 1000, 61).astype(np.float32)
errors = np.stack([error(jnp.full(3, k)) for k in grid])  # (grid, 3)
best = grid[np.argmin(errors, 0)]
ours = error(jnp.asarray(learned))
print("channel  noise  learned kappa  best kappa (grid)  error: noisy  smoothed  best")
for c in range(3):
    print(
        f"{c:7d}  {NOISE[c]:5.1f}  {learned[c]:13.2f}  {best[c]:17.2f}  "
        f"{NOISE[c] ** 2:12.4f}  {ours[c]:8.4f}  {errors[:, c].min():.4f}"
    )
print("smoothed error / noisy error: " + ", ".join(f"{r:.2f}" for r in ours / NOISE**2))

os.makedirs(args.out, exist_ok=True)
checkpoint = os.path.join(args.out, "layer.eqx")
eqx.tree_serialise_leaves(checkpoint, layer)
print(f"wrote {checkpoint}")

y = np.asarray(layer(x[0]))
fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
for c, ax in enumerate(axes):
    ax.plot(np.asarray(x[0, :, c]), ".", color="0.6", ms=3, label="noisy")
    ax.plot(np.asarray(clean[0, :, c]), "k", lw=1, label="truth")
    ax.plot(y[:, c], "tab:red", lw=1.5, label="smoothed")
    ax.set_title(f"noise sigma {NOISE[c]}, learned kappa {learned[c]:.1f}", fontsize=9)
axes[0].legend(loc="upper right", fontsize=8)
axes[-1].set_xlabel("t")
fig.tight_layout()
path = os.path.join(args.out, "smoothing.png")
fig.savefig(path, dpi=100)
print(f"wrote {path}")
# --8<-- [end:result]
