"""The public jaxtyping annotations describe what the functions really take and return.

Each public callable runs under `jaxtyping.jaxtyped(typechecker=beartype)` on valid
inputs of several shapes and dtypes; a wrong annotation makes the call fail here.
"""

import beartype
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jaxtyping import Array, Inexact, jaxtyped, TypeCheckError

import eqx_seq


def checked(fn):
    return jaxtyped(typechecker=beartype.beartype)(fn)


def checked_jit(fn):
    """`checked` under `eqx.filter_jit`: the same checks, on tracers of the same
    shapes and dtypes, for one compile instead of many op-by-op dispatches."""
    return eqx.filter_jit(checked(fn))


INPUTS = [
    (np.float32(0.9), jnp.ones((5,), jnp.float32), None),
    (jnp.full((3,), 0.5), jnp.ones((4, 3)), jnp.zeros(3)),
    (jnp.full((4, 2, 3), 0.5 + 0.1j), jnp.ones((4, 2, 3), jnp.complex128), 1.0),
]


@pytest.mark.parametrize("a,b,h0", INPUTS)
def test_linear_recurrence_annotations(a, b, h0):
    out = checked(eqx_seq.linear_recurrence)(a, b, h0, scan=eqx_seq.SequentialScan())
    assert out.shape == b.shape


@pytest.mark.parametrize("a,b,h0", INPUTS[:2])
def test_recurrence_jacobians_annotations(a, b, h0):
    jac = checked(eqx_seq.recurrence_jacobians)(a, b, h0)
    assert jac.wrt_a.shape == jac.wrt_h0.shape == jac.states.shape == b.shape


@pytest.mark.parametrize(
    "scan", [eqx_seq.SequentialScan(), eqx_seq.AssociativeScan(), eqx_seq.AutoScan()]
)
def test_scan_annotations(scan):
    b = jnp.ones((6, 2))
    for a in [jnp.full((2,), 0.5), jnp.full((6, 2), 0.5)]:
        for h0 in [None, jnp.ones(2)]:
            out = checked(type(scan).recurrence)(scan, a, b, h0, reverse=True)
            assert out.shape == b.shape


def test_annotations_reject_wrong_shapes():
    # the checker is live, eagerly and under `checked_jit` (on tracers): a
    # return-shape mismatch against `b` is caught
    def bad(b: Inexact[Array, " T *S"]) -> Inexact[Array, " T *S"]:
        return b[1:]

    for wrap in (checked, checked_jit):
        with pytest.raises(TypeCheckError, match="return value"):
            wrap(bad)(jnp.ones((3, 2)))


@pytest.mark.parametrize("shape", [(), (4,), (2, 3)])
def test_embedding_annotations(shape):
    emb = eqx_seq.Embedding.from_pretrained(
        jnp.ones((5, 3), jnp.float32), out_of_range="clip"
    )
    out = checked(type(emb).__call__)(emb, jnp.zeros(shape, jnp.int32))
    assert out.shape == (*shape, 3)
    logits = checked(type(emb).attend)(emb, jnp.ones((*shape, 3), jnp.float32))
    assert logits.shape == (*shape, 5)


@pytest.mark.parametrize("kind", ["s5", "lru"])
def test_ssm_annotations(kind):
    import jax.random as jr

    if kind == "s5":
        layer = eqx_seq.S5(3, 8, key=jr.key(0))
    else:
        layer = eqx_seq.LRU(3, 4, key=jr.key(0))
    cls = type(layer)
    u = jnp.ones((6, 3), jnp.float32)
    dt = jnp.ones(6, jnp.float32) if kind == "s5" else None
    assert checked_jit(cls.__call__)(layer, u, dt=dt).shape == (6, 3)
    state = checked_jit(cls.init_state)(layer)
    state = checked_jit(cls.final_state)(layer, u, dt=dt, h0=state)
    state, y = checked_jit(cls.step)(layer, state, u[0])
    assert state.shape == (4,) and y.shape == (3,)
    jac = checked_jit(cls.parameter_jacobians)(layer, u, dt=dt)
    assert jac.wrt_B.shape == (6, 4, 3)
    block = eqx_seq.S5Block(layer, key=jr.key(1))
    assert checked_jit(eqx_seq.S5Block.__call__)(block, u).shape == (6, 3)
    state, y = checked_jit(eqx_seq.S5Block.step)(block, block.init_state(), u[0])
    assert y.shape == (3,)
    labels = checked(eqx_seq.ssm_param_labels)(block)
    assert labels.ssm.B == "ssm"


@pytest.mark.parametrize(
    "shapes,axis",
    [([(5,)] * 4, 0), ([(5, 1), (5, 1), (5, 1), (5, 3)], 0), ([(3,), (2, 3)] * 2, -1)],
)
def test_tridiagonal_solve_annotations(shapes, axis):
    args = [jnp.full(s, v) for s, v in zip(shapes, [0.5, 3.0, 0.5, 1.0])]
    out = checked(eqx_seq.tridiagonal_solve)(*args, axis=axis)
    assert out.shape == jnp.broadcast_shapes(*shapes)


@pytest.mark.parametrize("input_dependent", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_tridiagonal_implicit_annotations(input_dependent, T):
    layer = eqx_seq.TridiagonalImplicit(
        3, input_dependent=input_dependent, key=jr.key(0)
    )
    x = jnp.ones((T, 3), jnp.float32)
    assert checked(type(layer).__call__)(layer, x).shape == (T, 3)
    lower, diag, upper = checked(type(layer).diagonals)(layer, x)
    assert lower.shape == diag.shape == upper.shape == (T, 3)
    assert checked(type(layer).couplings)(layer, x).shape == (T - 1, 3)


@pytest.mark.parametrize("missing", [False, True])
def test_kalman_annotations(missing):
    import jax.random as jr

    kf = eqx_seq.KalmanFilter(3, 2, control_size=1, key=jr.key(0))
    ys = jnp.ones((5, 2))
    ys = ys.at[1, 0].set(jnp.nan) if missing else ys
    us = jnp.ones((5, 1))
    assert checked_jit(type(kf).__call__)(kf, ys, us=us).shape == (5, 3)
    out = checked_jit(type(kf).filter)(kf, ys, us=us)
    assert out.covs.shape == (5, 3, 3) and out.log_likelihood.shape == ()
    assert checked_jit(type(kf).log_likelihood)(kf, ys, us=us).shape == ()
    assert checked_jit(type(kf).smooth)(kf, ys, us=us).cross_covs.shape == (4, 3, 3)
    xs, obs = checked_jit(type(kf).sample)(kf, jr.key(1), 5, us=us)
    assert xs.shape == (5, 3) and obs.shape == (5, 2)
    made = checked_jit(eqx_seq.KalmanFilter.from_matrices)(
        kf.F, kf.H, kf.Q, kf.R, kf.m0, kf.P0, B=kf.B, D=kf.D
    )
    assert made.control_size == 1


def test_model_annotations():
    import jax.random as jr

    x = jnp.ones((6, 2), jnp.float32)
    clf = eqx_seq.SequenceClassifier(
        2, 3, width=4, depth=1, state_size=4, key=jr.key(0)
    )
    assert checked_jit(type(clf).__call__)(clf, x, mask=jnp.ones(6, bool)).shape == (3,)
    den = eqx_seq.DenoisingClassifier(2, 3, width=4, depth=1, key=jr.key(0))
    assert checked_jit(type(den).__call__)(den, x).shape == (3,)
    assert checked_jit(type(den).features)(den, x).shape == (6, 4)
    lm = eqx_seq.LanguageModel(7, width=4, depth=1, state_size=4, key=jr.key(0))
    ids = jnp.arange(5)
    assert checked_jit(type(lm).__call__)(lm, ids).shape == (5, 7)
    state, logits = checked_jit(type(lm).step)(lm, lm.init_state(), ids[0])
    assert logits.shape == (7,)
    out = checked_jit(type(lm).generate)(lm, ids, 3, key=jr.key(1))
    assert out.shape == (3,)


def test_selective_annotations():
    T, D, N = 7, 4, 3
    k = jr.split(jr.key(0), 3)
    u, delta = jr.normal(k[0], (T, D)), jnp.full((T, D), 0.1)
    A, B, C = -jnp.ones((D, N)), jr.normal(k[1], (T, N)), jr.normal(k[2], (T, N))
    y = checked(eqx_seq.selective_scan)(u, delta, A, B, C, jnp.ones(D), z=u)
    assert y.shape == (T, D)
    y, h = checked(eqx_seq.selective_scan)(u, delta, A, B, C, return_last_state=True)
    assert h.shape == (D, N)
    layer = eqx_seq.Mamba(D, state_size=N, key=jr.key(1))
    block = eqx_seq.MambaBlock(layer)
    for module in (layer, block):
        cls = type(module)
        assert checked_jit(cls.__call__)(module, u).shape == (T, D)
        state = checked(cls.final_state)(module, u)
        state, y_t = checked_jit(cls.step)(module, state, u[0])
        assert y_t.shape == (D,) and checked(cls.init_state)(module)[1].shape == (8, N)
