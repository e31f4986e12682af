"""The LAPACK-free small-matrix factorisations against NumPy (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_seq._kalman import _linalg as small_linalg


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_cholesky_and_inverse_match_numpy(n):
    rng = np.random.default_rng(n)
    X = rng.normal(size=(3, 4, n, n))
    A = X @ np.swapaxes(X, -1, -2) + n * np.eye(n)
    L = small_linalg.cholesky(jnp.asarray(A))
    np.testing.assert_allclose(L, np.linalg.cholesky(A), rtol=1e-12, atol=1e-12)
    W = small_linalg.tril_inverse(L)
    np.testing.assert_allclose(W, np.linalg.inv(np.linalg.cholesky(A)), rtol=1e-10)
    # the upper triangle of the input is not read
    upper = np.triu(rng.normal(size=(n, n)), 1)
    np.testing.assert_array_equal(small_linalg.cholesky(jnp.asarray(A + upper)), L)


# slow tier: test_inverse_cholesky_rule_matches_finite_differences checks the
# rule's derivative; this adds autodiff through the unrolled factorisations
@pytest.mark.slow
def test_gradient_matches_lapack_on_symmetric_inputs():
    # through a symmetric construction (as in the Kalman whitening), the gradient
    # equals the one through jnp.linalg.cholesky / solve_triangular
    rng = np.random.default_rng(0)
    B = jnp.asarray(rng.normal(size=(6, 5, 5)))

    def via(chol, inv):
        def f(B):
            A = B @ jnp.swapaxes(B, -1, -2) + 5 * jnp.eye(5)[None]
            return jnp.sum(jnp.sin(inv(chol(A))))

        return jax.grad(f)(B)

    eye = jnp.broadcast_to(jnp.eye(5), (6, 5, 5))
    ref = via(
        jnp.linalg.cholesky,
        lambda L: jax.scipy.linalg.solve_triangular(L, eye, lower=True),
    )
    unrolled = via(small_linalg.cholesky, small_linalg.tril_inverse)
    ruled = via(lambda A: A, small_linalg.inverse_cholesky)  # its own JVP rule
    np.testing.assert_allclose(unrolled, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ruled, ref, rtol=1e-10, atol=1e-12)


def test_inverse_cholesky_rule_matches_finite_differences():
    # forward mode on a symmetric direction, and the lower triangle only is read
    rng = np.random.default_rng(1)
    X = rng.normal(size=(4, 6, 6))
    A = jnp.asarray(X @ np.swapaxes(X, -1, -2) + 6 * np.eye(6))
    D = rng.normal(size=(4, 6, 6))
    D = jnp.asarray(D + np.swapaxes(D, -1, -2))
    _, tangent = jax.jvp(small_linalg.inverse_cholesky, (A,), (D,))
    eps = 1e-6
    fd = (
        small_linalg.inverse_cholesky(A + eps * D)
        - small_linalg.inverse_cholesky(A - eps * D)
    ) / (2 * eps)
    np.testing.assert_allclose(tangent, fd, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(
        small_linalg.inverse_cholesky(A),
        np.linalg.inv(np.linalg.cholesky(np.asarray(A))),
        rtol=1e-10,
    )


@pytest.mark.parametrize("n", [2, 17])  # entrywise, and by columns (n > 16)
def test_not_positive_definite_gives_nan(n):
    A = jnp.eye(n).at[0, 1].set(2.0).at[1, 0].set(2.0)[None]
    assert np.isnan(np.asarray(small_linalg.cholesky(A))).any()


# slow tier: test_not_positive_definite_gives_nan[17] runs the factorisation by
# columns fast; this adds its values beyond the entrywise size
@pytest.mark.slow
def test_by_columns_beyond_the_entrywise_size():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(2, 20, 20))
    A = X @ np.swapaxes(X, -1, -2) + 20 * np.eye(20)
    W = small_linalg.inverse_cholesky(jnp.asarray(A))
    np.testing.assert_allclose(W, np.linalg.inv(np.linalg.cholesky(A)), rtol=1e-9)


# --- triangularisation (the square-root Kalman filter's) ---
def _np_tria(A):
    """The reference: NumPy's (Householder) QR of `A^T`, diagonal made positive."""
    R = np.linalg.qr(np.swapaxes(A, -1, -2), mode="r")
    d = np.sign(np.diagonal(R, axis1=-2, axis2=-1))
    return np.swapaxes(R * d[..., :, None], -1, -2)


# slow tier: both forms run fast on (4, 4); the other shapes (a batch, a wide
# matrix) are more sizes of the same steps, which the Kalman tests run batched
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((3, 5, 9), marks=pytest.mark.slow),
        (4, 4),
        pytest.param((6, 13), marks=pytest.mark.slow),
    ],
)
def test_tria_matches_householder(shape, loop):
    rng = np.random.default_rng(len(shape))
    A = rng.normal(size=shape)
    L = small_linalg.tria(jnp.asarray(A), loop=loop)
    np.testing.assert_allclose(L, _np_tria(A), rtol=1e-11, atol=1e-12)
    assert np.all(np.triu(np.asarray(L), 1) == 0)
    # a derivative through the Gram-Schmidt steps, against finite differences
    D = jnp.asarray(rng.normal(size=shape))
    _, tangent = jax.jvp(lambda A: small_linalg.tria(A, loop=loop), (A,), (D,))
    eps = 1e-6
    fd = (_np_tria(A + eps * np.asarray(D)) - _np_tria(A - eps * np.asarray(D))) / (
        2 * eps
    )
    np.testing.assert_allclose(tangent, fd, rtol=1e-6, atol=1e-8)


def test_tria_rows_of_very_different_scales():
    """Row by row accuracy, which the square-root filter relies on: a small row
    projected out of a huge one keeps its relative accuracy (float32)."""
    rng = np.random.default_rng(7)
    big = 1e6 * rng.normal(size=(1, 8))
    small = 1e-3 * rng.normal(size=(2, 8))
    A = np.concatenate([big, small]).astype(np.float32)
    L = np.asarray(small_linalg.tria(jnp.asarray(A)), np.float64)
    ref = _np_tria(A.astype(np.float64))
    np.testing.assert_allclose(L[1:, 1:], ref[1:, 1:], rtol=1e-5)


# slow tier: test_tria_matches_householder checks `tria`'s values and tangents;
# this adds rank-deficient inputs and `tria_gram`, which the Kalman tests run
@pytest.mark.slow
def test_tria_gram_of_a_rank_deficient_matrix():
    """Zero and repeated rows: finite values and derivatives, the right Gramian
    and a tangent of it (`dL L^T + L dL^T = d(A A^T)`), in forward and reverse
    mode."""
    rng = np.random.default_rng(8)
    A = rng.normal(size=(4, 6))
    A[2] = 2 * A[0]  # dependent
    A[3] = 0  # zero
    A, D = jnp.asarray(A), jnp.asarray(rng.normal(size=(4, 6)))
    gram = lambda L: L @ L.T
    L, dL = jax.jvp(small_linalg.tria_gram, (A,), (D,))
    np.testing.assert_allclose(gram(L), A @ A.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dL @ L.T + L @ dL.T, D @ A.T + A @ D.T, atol=1e-12)
    f = lambda A: jnp.sum(jnp.sin(gram(small_linalg.tria_gram(A))))
    g = jax.grad(f)(A)
    np.testing.assert_allclose(g, jax.grad(lambda A: jnp.sum(jnp.sin(A @ A.T)))(A))
    assert np.all(np.isfinite(jax.grad(lambda A: jnp.sum(small_linalg.tria(A)))(A)))
