"""The tridiagonal implicit layer learns how strongly to smooth, from noisy data only.

`eqx_seq.TridiagonalImplicit` solves `(I + L_kappa) y = x` along time: a Whittaker
smoother whose roughness penalty `kappa >= 0` is a parameter per channel. Here it
sees three channels of smooth random signals under noise of different strengths
(sigma = 0.1, 0.3, 1.0), and learns one `kappa` per channel by Noise2Noise
(Lehtinen et al., ICML 2018): the target is a second, independent noisy copy of
the same signal, so no clean data is needed; in expectation the loss is the error
to the clean signal plus a constant. Noisier channels should learn stronger
smoothing. The script checks each learned `kappa` against a grid search of the
true error (which does use the clean signals), prints the errors, and saves a PNG
of noisy vs smoothed vs truth on a held-out signal.

    python examples/tridiagonal_smoother.py
"""

import argparse
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqx_seq


NOISE = np.array([0.1, 0.3, 1.0], np.float32)


def smooth_signals(key, num, length):
    """Random smooth signals: a few random sinusoids per channel, unit scale."""
    kf, kp, ka = jr.split(key, 3)
    t = jnp.linspace(0, 1, length)[None, :, None, None]
    freq = jr.uniform(kf, (num, 1, 3, 4), minval=0.5, maxval=6.0)
    phase = jr.uniform(kp, (num, 1, 3, 4), maxval=2 * jnp.pi)
    amp = jr.normal(ka, (num, 1, 3, 4)) / 2
    return jnp.sum(amp * jnp.sin(2 * jnp.pi * freq * t + phase), -1)  # (num, T, 3)


def noisy(key, clean):
    return clean + jnp.asarray(NOISE) * jr.normal(key, clean.shape)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=os.path.join("outputs", "tridiagonal_smoother")
    )
    args = parser.parse_args()

    key = jr.key(args.seed)
    init_key, data_key, test_key = jr.split(key, 3)
    layer = eqx_seq.TridiagonalImplicit(3, coupling_range=(1.0, 1.0), key=init_key)
    optim = optax.adam(args.lr)
    opt_state = optim.init(eqx.filter(layer, eqx.is_inexact_array))

    def loss(layer, x, target):
        return jnp.mean((jax.vmap(layer)(x) - target) ** 2)

    @eqx.filter_jit
    def step(layer, opt_state, key):
        k1, k2, k3 = jr.split(key, 3)
        clean = smooth_signals(k1, args.batch_size, args.length)
        x, target = noisy(k2, clean), noisy(k3, clean)  # two noisy copies
        value, grads = eqx.filter_value_and_grad(loss)(layer, x, target)
        updates, opt_state = optim.update(grads, opt_state, layer)
        return eqx.apply_updates(layer, updates), opt_state, value

    for i, k in enumerate(jr.split(data_key, args.steps)):
        layer, opt_state, value = step(layer, opt_state, k)
        if (i + 1) % max(1, args.steps // 5) == 0:
            kappa = np.asarray(jax.nn.softplus(layer.coupling_logit))
            print(
                f"step {i + 1:4d}  Noise2Noise loss {float(value):.4f}  kappa "
                + ", ".join(f"{k:.2f}" for k in kappa)
            )
    learned = np.asarray(jax.nn.softplus(layer.coupling_logit))

    # held-out signals: the error to the clean truth, learned vs a grid of kappa
    k1, k2 = jr.split(test_key)
    clean = smooth_signals(k1, 64, args.length)
    x = noisy(k2, clean)

    def error(kappa):  # per channel, for a fixed kappa per channel
        fixed = eqx.tree_at(
            lambda l: l.coupling_logit, layer, kappa + jnp.log(-jnp.expm1(-kappa))
        )
        return jnp.mean((jax.vmap(fixed)(x) - clean) ** 2, axis=(0, 1))

    grid = np.geomspace(0.01, 1000, 61).astype(np.float32)
    errors = np.stack([np.asarray(error(jnp.full(3, k))) for k in grid])  # (grid, 3)
    best = grid[np.argmin(errors, 0)]
    ours = np.asarray(error(jnp.asarray(learned)))
    print(
        "channel  noise  learned kappa  best kappa (grid)  error: noisy  smoothed  best"
    )
    for c in range(3):
        print(
            f"{c:7d}  {NOISE[c]:5.1f}  {learned[c]:13.2f}  {best[c]:17.2f}  "
            f"{NOISE[c] ** 2:12.4f}  {ours[c]:8.4f}  {errors[:, c].min():.4f}"
        )
    print(
        "smoothed error / noisy error: "
        + ", ".join(f"{ours[c] / NOISE[c] ** 2:.2f}" for c in range(3))
    )

    os.makedirs(args.out, exist_ok=True)
    checkpoint = os.path.join(args.out, "layer.eqx")
    eqx.tree_serialise_leaves(checkpoint, layer)
    print(f"wrote {checkpoint}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[examples]')")
        return
    y = np.asarray(layer(x[0]))
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for c, ax in enumerate(axes):
        ax.plot(np.asarray(x[0, :, c]), ".", color="0.6", ms=3, label="noisy")
        ax.plot(np.asarray(clean[0, :, c]), "k", lw=1, label="truth")
        ax.plot(y[:, c], "tab:red", lw=1.5, label="smoothed")
        title = f"noise sigma {NOISE[c]}, learned kappa {learned[c]:.1f}"
        ax.set_title(title, fontsize=9)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("t")
    fig.tight_layout()
    path = os.path.join(args.out, "smoothing.png")
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
