"""Denoise, then classify: Kalman filter and implicit smoother in front of S5 blocks."""

from typing import Literal

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real

from .._kalman import KalmanFilter
from .._misc import real_input
from .._scan import AbstractScan, AutoScan
from .._tridiagonal import TridiagonalImplicit
from ._blocks import Mixer
from ._classifier import SequenceClassifier


class DenoisingClassifier(eqx.Module):
    """Classify noisy, gappy sequences: Kalman filter → implicit smoother → S5 stack.

    Three of the package's layers composed as feature stages:

    1. [`eqx_seq.KalmanFilter`][]: a learned linear-Gaussian state-space model whose
        filtered means are the features. It skips missing observations (NaN
        entries of the input) exactly, so the stages after it never see a NaN.
    2. [`eqx_seq.TridiagonalImplicit`][]: a learned Whittaker smoother over the whole
        sequence (non-causal), one smoothing strength per feature.
    3. [`eqx_seq.SequenceClassifier`][]: blocks of any of its mixers (S5 by
        default), pooling and a head.

    Every stage is trained end to end by gradients through the filter, the
    tridiagonal solve and the recurrences; `scan=` picks the backend of all three.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, jax.random as jr
        import eqx_seq

        model = eqx_seq.DenoisingClassifier(2, 5, width=16, depth=1, key=jr.key(0))
        x = jr.normal(jr.key(1), (50, 2)).at[10:15].set(jnp.nan)   # a gap
        logits = model(x)                                            # (5,)
        ```
    """

    kalman: KalmanFilter
    smoother: TridiagonalImplicit
    classifier: SequenceClassifier

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        kalman_state_size: int = 4,
        width: int = 64,
        depth: int = 2,
        state_size: int = 64,
        mixer: Mixer = "s5",
        pooling: Literal["mean", "last"] = "mean",
        dropout: float = 0.0,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`: features per step of the (noisy) input: the Kalman
            filter's observation size.
        - `num_classes`: the number of classes.
        - `kalman_state_size`: the Kalman filter's state size: the number of
            features passed on.
        - `width`, `depth`, `state_size`, `mixer`, `pooling`, `dropout`: for the
            [`eqx_seq.SequenceClassifier`][].
        - `scan`: the backend of every stage.
        - `dtype`: the parameter dtype.
        - `key`: a `jax.random` key. (Keyword only.)
        """
        kkey, skey, ckey = jr.split(key, 3)
        self.kalman = KalmanFilter(
            kalman_state_size, in_features, scan=scan, dtype=dtype, key=kkey
        )
        self.smoother = TridiagonalImplicit(
            kalman_state_size,
            coupling_range=(0.5, 5.0),
            scan=scan,
            dtype=dtype,
            key=skey,
        )
        self.classifier = SequenceClassifier(
            kalman_state_size,
            num_classes,
            width=width,
            depth=depth,
            state_size=state_size,
            mixer=mixer,
            pooling=pooling,
            dropout=dropout,
            scan=scan,
            dtype=dtype,
            key=ckey,
        )

    def features(self, x: Real[ArrayLike, " T F"]) -> Float[Array, " T N"]:
        """The denoised features the classifier sees, shape `(T, kalman_state_size)`.
        Integer `x` is cast to the parameters' dtype (and has no missing
        entries)."""
        # the Kalman filter itself takes floating observations only (NaN marks a
        # missing entry); this layer's input is `Real`, as every sequence layer's
        x = real_input(x, "DenoisingClassifier", self.kalman.m0.dtype)
        return self.smoother(self.kalman(x))

    @jax.named_scope("eqx_seq.DenoisingClassifier")
    def __call__(
        self,
        x: Real[ArrayLike, " T F"],
        *,
        mask: Bool[ArrayLike, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " C"]:
        """**Arguments:**

        - `x`: one sequence `(T, in_features)`; NaN entries are missing values.
        - `mask`: optional `(T,)` valid-step mask for the pooling, as for
            [`eqx_seq.SequenceClassifier`][]. The smoother is non-causal, so pad
            sequences with NaN (missing, skipped by the Kalman filter) rather than
            with values.
        - `key`: for dropout.

        **Returns:**

        Logits, shape `(num_classes,)`.
        """
        return self.classifier(self.features(x), mask=mask, key=key)
