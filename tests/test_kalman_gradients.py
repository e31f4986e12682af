"""The gradient of eqx_seq.KalmanFilter.log_likelihood (Fisher's identity) against
plain autodiff through the filter and finite differences."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import directional_fd
from kalman_helpers import BACKENDS, build, case, random_model

import eqx_seq


@pytest.mark.parametrize(
    "backend,name",
    [
        # slow tier: the associative backend runs this check fast; the sequential
        # backend's gradient runs fast in
        # test_fisher_gradient_forward_mode_and_second_order
        pytest.param("sequential", "all", marks=pytest.mark.slow),
        ("associative", "all"),
        pytest.param("sequential", "missing", marks=pytest.mark.slow),
    ],
)
def test_gradient_matches_finite_differences(backend, name):
    """`log_likelihood` (Fisher's identity) plus a weighted sum of the filtered means.

    The means' gradient is plain autodiff through the filter; the same loss with
    `filter(...).log_likelihood` (plain autodiff) must give the same gradient, with
    respect to the parameters, the observations and the controls.
    """
    model, ys, us = case(name, seed=3)
    kf = build(model, BACKENDS[backend])
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    ys_j = jnp.asarray(ys)
    us_j = None if us is None else jnp.asarray(us)
    obs = ~np.isnan(ys)
    w = np.random.default_rng(1).normal(size=(ys.shape[0], 3)) / ys.shape[0]

    @ft.partial(jax.jit, static_argnames="fisher")
    def loss(params, ys, us, fisher=True):
        kf = eqx.combine(params, static)
        out = kf.filter(ys, us=us)
        ll = kf.log_likelihood(ys, us=us) if fisher else out.log_likelihood
        return ll + jnp.sum(w * out.means)

    @jax.jit
    def grads(params, ys, us):
        g = jax.grad(loss, argnums=(0, 1, 2))
        return g(params, ys, us), g(params, ys, us, fisher=False)

    (grad_p, grad_y, grad_u), plain = grads(params, ys_j, us_j)
    for a, b in zip(jax.tree.leaves((grad_p, grad_y, grad_u)), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)
    assert np.all(np.asarray(grad_y)[~obs] == 0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        direction = jax.tree.map(
            lambda x: jnp.asarray(rng.normal(size=x.shape)), params
        )
        fd = directional_fd(lambda q: loss(q, ys_j, us_j), params, direction)
        ad = sum(
            jnp.vdot(g, d)
            for g, d in zip(jax.tree.leaves(grad_p), jax.tree.leaves(direction))
        )
        np.testing.assert_allclose(ad, fd, rtol=1e-6)
    # every parameter matters, and gets its own check
    for leaf, g in zip(jax.tree.leaves(params), jax.tree.leaves(grad_p)):
        assert g.shape == leaf.shape and np.all(np.isfinite(g))
    y_dir = np.where(obs, rng.normal(size=ys.shape), 0)
    fd_y = directional_fd(lambda y: loss(params, y, us_j), ys_j, jnp.asarray(y_dir))
    np.testing.assert_allclose(jnp.vdot(grad_y, y_dir), fd_y, rtol=1e-6)
    if us is not None:
        u_dir = jnp.asarray(rng.normal(size=us.shape))
        fd_u = directional_fd(lambda u: loss(params, ys_j, u), us_j, u_dir)
        np.testing.assert_allclose(jnp.vdot(grad_u, u_dir), fd_u, rtol=1e-6)


def test_fisher_gradient_forward_mode_and_second_order():
    """The custom JVP: forward mode, and Hessian-vector products (through the
    smoother's statistics), equal plain autodiff through the filter."""
    model, ys, _ = case("missing", seed=4)
    kf = build(model, eqx_seq.SequentialScan())
    params, static = eqx.partition(kf, eqx.is_inexact_array)

    def fisher(p):
        return eqx.combine(p, static).log_likelihood(ys)

    def plain(p):
        return eqx.combine(p, static).filter(ys).log_likelihood

    rng = np.random.default_rng(5)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)

    @jax.jit
    def run(params, direction):
        out = {}
        for name, f in (("fisher", fisher), ("plain", plain)):
            out[name] = (
                jax.jvp(f, (params,), (direction,)),
                jax.jvp(jax.grad(f), (params,), (direction,))[1],
            )
        return out

    out = run(params, direction)
    (v_f, t_f), hvp_f = out["fisher"]
    (v_p, t_p), hvp_p = out["plain"]
    np.testing.assert_allclose(v_f, v_p, rtol=1e-12)
    np.testing.assert_allclose(t_f, t_p, rtol=1e-9)
    for a, b in zip(jax.tree.leaves(hvp_f), jax.tree.leaves(hvp_p)):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)


# slow tier: a big variant (T = 100k); float32 on long stiff sequences is checked
# fast in test_kalman_stiff.py (test_float32_matches_float64)
@pytest.mark.slow
def test_float32_long_run_agrees_with_float64():
    """T=100k in float32: finite, log-likelihood within 1e-3 relative of float64,
    and its gradient (Fisher's identity) within 5e-3 of float64's, leaf by leaf."""
    rng = np.random.default_rng(7)
    model = random_model(rng, 4, 2)
    kf64 = build(model, eqx_seq.SequentialScan())
    _, ys = kf64.sample(jr.key(0), 100_000)
    kf32 = build(model, eqx_seq.SequentialScan(), dtype=jnp.float32)

    @eqx.filter_jit
    def run(kf, ys):
        out = kf.filter(ys)
        return out, eqx.filter_grad(lambda kf: kf.log_likelihood(ys))(kf)

    out32, g32 = run(kf32, ys.astype(jnp.float32))
    out64, g64 = run(kf64, ys)
    assert np.all(np.isfinite(out32.means)) and np.all(np.isfinite(out32.covs))
    rel = float(out32.log_likelihood) / float(out64.log_likelihood) - 1
    assert abs(rel) < 1e-3
    # as plain autodiff in float32 does; the largest error is the R factor's, whose
    # gradient is a small sum of 1e5 terms
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g64)):
        assert np.all(np.isfinite(a))
        err = np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
        assert err < 5e-3, err


# slow tier: a big variant (state 16, long sequences) of the gradient with missing
# data that test_fisher_gradient_forward_mode_and_second_order and
# test_gradient_matches_finite_differences[associative-all] check
@pytest.mark.slow
def test_gradient_with_missing_data_does_not_hang():
    """Regression: with missing observations the per-step whitening factored a
    Cholesky per step with batched LAPACK; two such calls scheduled at once by
    XLA:CPU deadlocked on a machine with few cores (state 16 / obs 8, long
    sequences). The LAPACK-free factorisations of `eqx_seq._kalman._linalg` replaced
    them. Run in a subprocess so that a hang fails the test instead of stalling the
    worker."""
    import os
    import subprocess
    import sys

    script = (
        "import jax, jax.numpy as jnp, jax.random as jr, equinox as eqx, eqx_seq\n"
        "scan = eqx_seq.SequentialScan()\n"
        "kf = eqx_seq.KalmanFilter(16, 8, scan=scan, key=jr.key(0))\n"
        "_, ys = kf.sample(jr.key(1), 3000)\n"
        "ys = ys.at[5, 0].set(jnp.nan)\n"
        "grad = eqx.filter_jit(eqx.filter_grad(lambda kf: kf.log_likelihood(ys)))\n"
        "for _ in range(5):\n"
        "    g = jax.block_until_ready(grad(kf))\n"
        "ok = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))\n"
        "print('finite' if ok else 'not finite')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root, capture_output=True, text=True, timeout=240,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("finite") and "not" not in out.stdout
