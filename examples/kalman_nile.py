"""Fit the local-level model to the Nile river flow by maximum likelihood.

The data are the annual flow of the Nile at Aswan, 1871-1970, bundled with
statsmodels (`statsmodels.datasets.nile`; nothing downloaded). The model is the
local level (random walk plus noise) of Durbin & Koopman, "Time Series Analysis by
State Space Methods" (2012), chapter 2:

    level_t = level_{t-1} + eta_t,   eta_t ~ N(0, sigma2_eta)
    flow_t  = level_t + eps_t,       eps_t ~ N(0, sigma2_eps)

An `eqx_seq.KalmanFilter` holds it; its two noise variances (unconstrained Cholesky
parameters, so always valid) are fitted by maximising the exact log-likelihood with
optax. The prior on the first level is vague (variance 1e7, as a diffuse prior), and
the first observation's term is left out of the likelihood, as for the diffuse
likelihood of Durbin & Koopman. Their maximum-likelihood values are
sigma2_eps = 15099 and sigma2_eta = 1469.1. The script prints the fit and saves a
PNG of the data, the filtered and the smoothed level with 90% bands.

    python examples/kalman_nile.py
"""

import argparse
import os
import time

import jax


jax.config.update("jax_enable_x64", True)  # the flows are ~1e3, the variances ~1e4

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax

import eqx_seq


def load_nile():
    from statsmodels.datasets import nile

    data = nile.load_pandas().data
    return data["year"].to_numpy(), data["volume"].to_numpy(np.float64)


def local_level(sigma2_eps, sigma2_eta, first, scan):
    one = jnp.ones((1, 1))
    return eqx_seq.KalmanFilter.from_matrices(
        F=one,
        H=one,
        Q=sigma2_eta * one,
        R=sigma2_eps * one,
        m0=jnp.array([first]),
        P0=1e7 * one,
        scan=scan,
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--scan", choices=["sequential", "associative"], default="sequential"
    )
    parser.add_argument("--out", default=os.path.join("outputs", "kalman_nile"))
    args = parser.parse_args()
    scan = {
        "sequential": eqx_seq.SequentialScan(),
        "associative": eqx_seq.AssociativeScan(),
    }[args.scan]

    years, flow = load_nile()
    ys = jnp.asarray(flow)[:, None]
    print(f"Nile flow at Aswan: {len(flow)} years, {years[0]:.0f}-{years[-1]:.0f}")
    # start from the sample variance split evenly between the two noises
    start = float(np.var(np.diff(flow))) / 2
    kf = local_level(start, start, flow[0], scan)
    # only the two noise factors are trained; F, H, m0 and P0 stay as given
    trainable = eqx.tree_at(
        lambda k: (k.Q_factor, k.R_factor),
        jax.tree.map(lambda _: False, kf),
        (True, True),
    )

    def loss(params, static):
        model = eqx.combine(params, static)
        # the diffuse likelihood: leave out the first observation's term
        per_step = model.filter(ys).log_likelihoods
        return -jnp.sum(per_step[1:])

    params, static = eqx.partition(kf, trainable)
    optim = optax.adam(args.lr)
    opt_state = optim.init(params)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, static)
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    begin = time.perf_counter()
    for i in range(args.steps):
        params, opt_state, value = step(params, opt_state)
        if (i + 1) % max(1, args.steps // 6) == 0:
            print(f"step {i + 1:4d}  negative log-likelihood {float(value):.4f}")
    elapsed = time.perf_counter() - begin
    kf = eqx.combine(params, static)
    sigma2_eps, sigma2_eta = float(kf.R[0, 0]), float(kf.Q[0, 0])
    print(
        f"fitted in {elapsed:.1f} s: sigma2_eps = {sigma2_eps:.0f} (Durbin & Koopman: "
        f"15099), sigma2_eta = {sigma2_eta:.1f} (1469.1); log-likelihood "
        f"{-float(loss(params, static)):.4f}"
    )

    filtered = kf.filter(ys)
    smoothed = kf.smooth(ys)
    os.makedirs(args.out, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[examples]')")
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(years, flow, "k.", label="flow")
    for result, name, colour in [
        (filtered, "filtered level", "tab:blue"),
        (smoothed, "smoothed level", "tab:red"),
    ]:
        mean = np.asarray(result.means[:, 0])
        sd = np.sqrt(np.asarray(result.covs[:, 0, 0]))
        ax.plot(years, mean, color=colour, label=name)
        ax.fill_between(
            years, mean - 1.645 * sd, mean + 1.645 * sd, color=colour, alpha=0.15
        )
    ax.set(xlabel="year", ylabel="flow (10^8 m^3)", ylim=(400, 1500))
    ax.set_title(
        f"Nile, local level: sigma2_eps={sigma2_eps:.0f}, sigma2_eta={sigma2_eta:.0f}"
    )
    ax.legend(loc="upper right")
    fig.tight_layout()
    path = os.path.join(args.out, "nile.png")
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
