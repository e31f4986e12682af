"""The steady-state filter (time-invariant model, complete data, T > K): values and
gradients against the exact filter, and its fallbacks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import directional_fd
from kalman_helpers import (
    assert_filtered,
    build,
    filter_reference,
    random_model,
    reference,
    settled,
    simulate,
    stacked,
    STEADY_T,
    with_private,
)

import eqx_seq


# slow tier: test_steady_state_smoother_matches_reference checks the steady-state
# path under `vmap` over complete sequences
@pytest.mark.slow
def test_vmap_branches_once_for_the_batch():
    """Under `vmap` the complete-data branch is taken for the whole batch or not at
    all (`all_observed` answers for the batch, so the `lax.cond` stays a branch
    instead of a `select` that runs both). A batch with one missing entry runs the
    exact filter for all its sequences: the same numbers, to round-off, as each
    sequence alone (where a complete one settles into the steady state)."""
    from eqx_seq._kalman._model import all_observed

    rng = np.random.default_rng(14)
    model = random_model(rng, 3, 2)
    ys = simulate(rng, model, STEADY_T)
    gappy = ys[::-1].copy()
    gappy[40, 1] = np.nan
    kf = build(model, eqx_seq.SequentialScan())
    assert settled(kf, jnp.asarray(ys))
    obs = ~np.isnan(np.stack([ys, gappy]))
    np.testing.assert_array_equal(jax.vmap(all_observed)(obs), [False] * 2)
    np.testing.assert_array_equal(
        jax.vmap(jax.vmap(all_observed))(np.stack([obs, obs[:1].repeat(2, 0)])),
        [[False] * 2] * 2,
    )
    assert bool(jax.vmap(all_observed)(obs[:1].repeat(3, 0))[0])
    params, static = eqx.partition(kf, eqx.is_inexact_array)

    def ll(params, y):
        return eqx.combine(params, static).log_likelihood(y)

    tol = dict(rtol=1e-9, atol=1e-11)
    for batch in ([ys, gappy], [ys, ys[::-1]]):
        batch = jnp.asarray(np.stack(batch))
        filtered = jax.vmap(kf.filter)(batch)
        values, grads = jax.vmap(jax.value_and_grad(ll), in_axes=(None, 0))(
            params, batch
        )
        for i, y in enumerate(batch):
            alone = kf.filter(y)
            np.testing.assert_allclose(filtered.means[i], alone.means, **tol)
            np.testing.assert_allclose(filtered.covs[i], alone.covs, **tol)
            value, grad = jax.value_and_grad(ll)(params, y)
            np.testing.assert_allclose(values[i], value, **tol)
            for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(grad)):
                np.testing.assert_allclose(g[i], h, **tol)


# slow tier: test_steady_state_smoother_matches_reference checks the filtered
# output of the same path (controls, under `vmap`) against the textbook filter
@pytest.mark.slow
def test_steady_state_filter_matches_reference():
    """After the covariance settles the filter runs the steady-state recursion; its
    means, covariances and log-likelihoods must still be the textbook filter's, also
    under `vmap` over sequences."""
    rng = np.random.default_rng(11)
    model = random_model(rng, 3, 2, c=2)
    us = rng.normal(size=(STEADY_T, 2))
    ys = simulate(rng, model, STEADY_T, us)
    kf = build(model, eqx_seq.SequentialScan())
    assert settled(kf, jnp.asarray(ys), jnp.asarray(us))
    f = filter_reference(model, ys, us)
    batch = jax.vmap(lambda y, u: kf.filter(y, us=u))(
        jnp.stack([ys, ys[::-1]]), jnp.stack([us, us[::-1]])
    )
    out = jax.tree.map(lambda x: x[0], batch)
    tol = dict(rtol=1e-9, atol=1e-11)
    assert_filtered(out, f, **tol)
    np.testing.assert_allclose(kf.log_likelihood(ys, us=us), f["ll"].sum(), **tol)
    rev = kf.filter(ys[::-1], us=us[::-1])
    np.testing.assert_allclose(batch.means[1], rev.means, **tol)


def test_steady_state_smoother_matches_reference():
    """The smoother after the steady-state filter (the tail's elements from its one
    fixed factor): the textbook RTS smoother's means, covariances and
    cross-covariances, under `vmap` over sequences too; its gradient is the one
    through the smoother with every step exact."""
    rng = np.random.default_rng(15)
    model = random_model(rng, 3, 2, c=2)
    us = rng.normal(size=(STEADY_T, 2))
    ys = simulate(rng, model, STEADY_T, us)
    kf = build(model, eqx_seq.SequentialScan())
    assert settled(kf, jnp.asarray(ys), jnp.asarray(us))
    f, sm, sP, cross = reference(model, ys, us)
    batch = jax.vmap(lambda y, u: kf.smooth(y, us=u))(
        jnp.stack([ys, ys[::-1]]), jnp.stack([us, us[::-1]])
    )
    out = jax.tree.map(lambda x: x[0], batch)
    tol = dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(out.means, sm, **tol)
    np.testing.assert_allclose(out.covs, sP, **tol)
    np.testing.assert_allclose(out.cross_covs, cross, **tol)
    assert_filtered(out.filtered, f, **tol)

    loss = lambda q, static: jnp.sum(
        jnp.sin(eqx.combine(q, static).smooth(ys, us=us).means)
    )
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    grads = [
        grad(*eqx.partition(k, eqx.is_inexact_array))
        for k in (kf, with_private(kf, _steady_state=False))
    ]
    for a, b in zip(*map(jax.tree.leaves, grads)):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)


def test_steady_state_float32():
    """State 8 / obs 4 in float32 (settles after the 32 exact steps): within
    float32 round-off of the float64 textbook filter."""
    rng = np.random.default_rng(12)
    model = random_model(rng, 8, 4)
    ys = simulate(rng, model, 200)
    kf = build(model, eqx_seq.SequentialScan(), dtype=jnp.float32)
    ys32 = jnp.asarray(ys, jnp.float32)
    assert settled(kf, ys32)
    f = filter_reference(model, ys)
    out = jax.tree.map(lambda x: np.asarray(x, np.float64), kf.filter(ys32))
    scale = np.abs(f["m"]).max()
    assert np.abs(out.means - f["m"]).max() < 1e-5 * scale
    assert np.abs(out.covs - f["P"]).max() < 1e-5 * np.abs(f["P"]).max()
    assert abs(float(out.log_likelihood) / f["ll"].sum() - 1) < 1e-5


def _steady_gradient_case():
    rng = np.random.default_rng(13)
    model = random_model(rng, 3, 2, c=1)
    us = jnp.asarray(rng.normal(size=(STEADY_T, 1)))
    ys = jnp.asarray(simulate(rng, model, STEADY_T, np.asarray(us)))

    def ll(params, static, ys, us):
        return eqx.combine(params, static).log_likelihood(ys, us=us)

    grad = jax.jit(jax.grad(ll, argnums=(0, 2, 3)), static_argnums=1)
    return rng, model, ys, us, ll, grad


# slow tier: test_steady_state_smoother_matches_reference checks a gradient
# through the steady-state path against the one with every step exact
@pytest.mark.slow
def test_steady_state_gradient():
    """`log_likelihood`'s gradient on the steady-state path (plain autodiff through
    it) equals the exact path's (the same model with a per-step F, which goes
    through Fisher's identity), w.r.t. parameters, observations and controls, and
    finite differences; forward mode works too."""
    rng, model, ys, us, ll, grad = _steady_gradient_case()
    kf = build(model, eqx_seq.SequentialScan())
    kf_tv = build(stacked(model, STEADY_T), eqx_seq.SequentialScan())
    assert settled(kf, ys, us)
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    g_p, g_y, g_u = grad(params, static, ys, us)
    t_p, t_y, t_u = grad(*eqx.partition(kf_tv, eqx.is_inexact_array), ys, us)
    t_p = eqx.tree_at(lambda k: k.F, t_p, t_p.F.sum(0))
    for a, b in zip(jax.tree.leaves((g_p, g_y, g_u)), jax.tree.leaves((t_p, t_y, t_u))):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    loss = jax.jit(lambda p: ll(p, static, ys, us))
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    fd = directional_fd(loss, params, d)
    ad = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(g_p), jax.tree.leaves(d)))
    np.testing.assert_allclose(ad, fd, rtol=1e-6)
    tangent = jax.jit(lambda p, d: jax.jvp(loss, (p,), (d,))[1])(params, d)
    np.testing.assert_allclose(tangent, ad, rtol=1e-9)


@pytest.mark.slow
def test_steady_state_hessian_vector_products():
    """Forward-over-reverse through the steady-state path, against differences of
    gradients (slow: compiling the second-order program takes long)."""
    rng, model, ys, us, ll, grad = _steady_gradient_case()
    params, static = eqx.partition(
        build(model, eqx_seq.SequentialScan()), eqx.is_inexact_array
    )
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    hvp = jax.jit(
        lambda p, d: jax.jvp(lambda q: grad(q, static, ys, us)[0], (p,), (d,))[1]
    )(params, d)
    eps = 1e-5
    plus, minus = (
        grad(jax.tree.map(lambda x, v: x + s * v, params, d), static, ys, us)[0]
        for s in (eps, -eps)
    )
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (hvp, plus, minus))):
        np.testing.assert_allclose(a, (b - c) / (2 * eps), rtol=1e-5, atol=1e-7)


def test_steady_state_not_settled_falls_back():
    """A covariance still moving after the exact head (a slow, barely observed
    state): every step stays exact, and the gradient (Fisher's identity, after the
    steady-state attempt) matches finite differences."""
    rng = np.random.default_rng(14)
    n, p = 2, 1
    c, s = np.cos(0.01), np.sin(0.01)
    model = dict(
        F=0.9995 * np.array([[c, -s], [s, c]]), H=np.array([[0.02, 0.01]]),
        Q=1e-3 * np.eye(n), R=np.eye(p), m0=np.zeros(n), P0=np.eye(n),
    )  # fmt: skip
    ys = simulate(rng, model, STEADY_T)
    kf = build(model, eqx_seq.SequentialScan())
    assert not settled(kf, jnp.asarray(ys))
    f = filter_reference(model, ys)
    out = kf.filter(ys)
    np.testing.assert_allclose(out.means, f["m"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.covs, f["P"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.log_likelihood, f["ll"].sum(), rtol=1e-12)
    _, sm, sP, _ = reference(model, ys)
    out = kf.smooth(ys)  # the smoother falls back to the exact filter too
    np.testing.assert_allclose(out.means, sm, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(out.covs, sP, rtol=1e-8, atol=1e-10)
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    loss = jax.jit(lambda q: eqx.combine(q, static).log_likelihood(ys))
    g = jax.jit(jax.grad(loss))(params)
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    ad = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(d)))
    np.testing.assert_allclose(ad, directional_fd(loss, params, d), rtol=1e-6)
