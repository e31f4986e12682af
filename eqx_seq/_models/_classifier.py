"""A sequence classifier: linear encoder, a stack of recurrent blocks, pooling, head."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray, Real

from .._misc import check_positive_int, check_sequence, error_if_any
from .._recurrence import linear_recurrence
from .._scan import AbstractScan, AutoScan, check_scan
from .._ssm._recurrent import AbstractRecurrentLayer
from ._blocks import make_blocks, Mixer, run_blocks


class SequenceClassifier(eqx.Module):
    """Classify a sequence: linear encoder → recurrent blocks → pooling → linear head.

    The model of the S5 paper's classification tasks (Smith et al., 2023), built
    from [`eqx_seq.S5`][] (or [`eqx_seq.LRU`][]) inside [`eqx_seq.S5Block`][]s, or
    from the selective layers: [`eqx_seq.HawkBlock`][]s (`mixer="rglru"`),
    [`eqx_seq.MambaBlock`][]s (`mixer="mamba"`), [`eqx_seq.Mamba2Block`][]s
    (`mixer="mamba2"`, heads of `gcd(2 * width, 64)` channels) or
    [`eqx_seq.GatedDeltaNetBlock`][]s (`mixer="gated_deltanet"`, `width //
    state_size` heads of `state_size` key channels, the state of the Mamba-2
    blocks when `state_size` divides `width`). The backend is chosen once,
    `scan=`, and reaches every layer. Train it with
    `eqx_seq.s5_optimizer` (SSM parameters at their own learning rate, without
    weight decay).

    The arguments of the blocks that only some mixers have:

    | argument        | s5 | lru | rglru | mamba | mamba2 | gated_deltanet |
    |-----------------|:--:|:---:|:-----:|:-----:|:------:|:--------------:|
    | `state_size`    | ✓  |  ✓  |       |   ✓   |   ✓    |       ✓        |
    | `ssm_blocks`    | ✓  |     |       |       |        |                |
    | `bidirectional` | ✓  |  ✓  |       |       |        |                |
    | `activation`    | ✓  |  ✓  |       |       |        |                |
    | `norm`          | ✓  |  ✓  |       |   ✓   |   ✓    |       ✓        |
    | `prenorm`       | ✓  |  ✓  |       |       |        |                |
    | `dropout`       | ✓  |  ✓  |       |   ✓   |   ✓    |       ✓        |

    One given a value other than its default with a mixer that has no such
    argument is refused (`ValueError`) rather than ignored. A mixer of your own
    (an [`eqx_seq.AbstractRecurrentLayer`][] per block) builds its blocks itself,
    so it takes none of them.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, jax.random as jr
        import eqx_seq

        model = eqx_seq.SequenceClassifier(1, 10, width=32, depth=2, key=jr.key(0))
        logits = jax.vmap(model)(jnp.ones((4, 64, 1)))      # (4, 10)
        ```
    """

    encoder: eqx.nn.Linear
    blocks: tuple[AbstractRecurrentLayer, ...]
    head: eqx.nn.Linear
    pooling: str = eqx.field(static=True)
    scan: AbstractScan

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        width: int = 64,
        depth: int = 4,
        state_size: int = 64,
        mixer: Mixer = "s5",
        ssm_blocks: int = 1,
        bidirectional: bool = False,
        pooling: Literal["mean", "last"] = "mean",
        activation: str = "half_glu1",
        norm: Literal["layer", "rms"] = "layer",
        prenorm: bool = True,
        dropout: float = 0.0,
        scan: AbstractScan = AutoScan(),
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`: features per time step of the input.
        - `num_classes`: the number of classes (logits).
        - `width`: the model width `H` (features inside the blocks).
        - `depth`: the number of blocks.
        - `state_size`: each SSM's `state_size` (for Mamba, the states per
            channel; for Gated DeltaNet, the key channels per head, which are the
            states per value channel). Not for `mixer="rglru"`: the RG-LRU's
            state is the width.
        - `mixer`: `"s5"`, `"lru"`, `"rglru"`, `"mamba"`, `"mamba2"` or
            `"gated_deltanet"`; or a
            mixer of your own, a function `key -> eqx_seq.AbstractRecurrentLayer`
            that makes one block from `(T, width)` to `(T, width)` (the model
            stacks `depth` of them; the block arguments below keep their
            defaults).
        - `ssm_blocks`: S5's `blocks` (HiPPO blocks of the initialisation);
            `mixer="s5"` only.
        - `bidirectional`: non-causal SSMs (a backward recurrence too; S5 and LRU
            only).
        - `pooling`: `"mean"` over (valid) steps or the `"last"` (valid) step.
        - `activation`, `prenorm`: for every [`eqx_seq.S5Block`][] (`"s5"` and
            `"lru"` only).
        - `norm`: `"layer"` or `"rms"`, the norm of every [`eqx_seq.S5Block`][],
            [`eqx_seq.MambaBlock`][] or [`eqx_seq.GatedDeltaNetBlock`][] (not
            `"rglru"`: a
            [`eqx_seq.HawkBlock`][] has its own RMSNorms).
        - `dropout`: in `[0, 1)`, in every [`eqx_seq.S5Block`][],
            [`eqx_seq.MambaBlock`][] or [`eqx_seq.GatedDeltaNetBlock`][] (not
            `"rglru"`: a [`eqx_seq.HawkBlock`][] has no dropout).
        - `scan`: the recurrence backend of every layer. With
            [`eqx_seq.ShardedScan`][], the sequence's time axis
            is split over devices inside `jax.shard_map`: the pooling sums over
            them, and every device returns the logits of the whole sequence.
        - `dtype`: the parameter dtype.
        - `key`: a `jax.random` key. (Keyword only.)
        """
        check_positive_int("in_features", in_features)
        check_positive_int("num_classes", num_classes)
        check_positive_int("width", width)
        if pooling not in ("mean", "last"):
            raise ValueError(f'`pooling` must be "mean" or "last", got {pooling!r}.')
        # a time split over devices pools through `scan.sum_over_blocks`
        check_scan(scan, name="eqx_seq.SequenceClassifier", splits_time=True)
        ekey, bkey, hkey = jr.split(key, 3)
        self.encoder = eqx.nn.Linear(in_features, width, dtype=dtype, key=ekey)
        self.blocks = make_blocks(
            width,
            depth,
            state_size,
            mixer=mixer,
            ssm_blocks=ssm_blocks,
            bidirectional=bidirectional,
            activation=activation,
            norm=norm,
            prenorm=prenorm,
            dropout=dropout,
            scan=scan,
            dtype=dtype,
            key=bkey,
        )
        self.head = eqx.nn.Linear(width, num_classes, dtype=dtype, key=hkey)
        self.pooling = pooling
        self.scan = scan

    @jax.named_scope("eqx_seq.SequenceClassifier")
    def __call__(
        self,
        x: Real[ArrayLike, " T F"],
        *,
        mask: Bool[ArrayLike, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " C"]:
        """**Arguments:**

        - `x`: one sequence, shape `(T, in_features)`.
        - `mask`: optional `(T,)` booleans, `True` at valid steps, for sequences
            padded at the end to a common length: the masked steps are read as
            zeros (whatever they hold) and pooling uses valid steps only, so with
            causal SSMs the logits are those of the unpadded sequence. A mask
            without any valid step raises at run time (`eqx.error_if`).
        - `key`: for dropout.

        **Returns:**

        Logits, shape `(num_classes,)`.
        """
        dtype = self.encoder.weight.dtype
        x = check_sequence(
            x, self.encoder.in_features, "SequenceClassifier", "in_features", dtype
        )
        x = x.astype(dtype)  # computed in the parameters' dtype
        scan = self.scan.select()
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.shape != (x.shape[0],) or mask.dtype != jnp.bool_:
                raise ValueError(
                    f"`mask` must be booleans of shape (T,) = ({x.shape[0]},), got "
                    f"{mask.dtype} of shape {mask.shape}."
                )
            x = error_if_any(
                x,
                scan.sum_over_blocks(jnp.sum(mask)) == 0,
                "eqx_seq.SequenceClassifier: the `mask` has no valid step, so there "
                "is nothing to pool.",
            )
            # zeros at the masked steps, so that nothing they hold (NaN included)
            # reaches the logits or the gradients
            x = jnp.where(mask[:, None], x, jnp.zeros((), x.dtype))
        z = run_blocks(self.blocks, jax.vmap(self.encoder)(x), key)
        valid = jnp.ones(z.shape[0], jnp.bool_) if mask is None else mask
        if self.pooling == "last":
            # the valid step with no valid step after it, in the whole sequence:
            # counted by a recurrence, which crosses devices as the layers' do
            count = valid.astype(z.dtype)
            count = linear_recurrence(
                jnp.ones((), z.dtype), count, scan=scan, reverse=True
            )
            valid = valid & (count < 1.5)
        total = jnp.sum(jnp.where(valid[:, None], z, jnp.zeros((), z.dtype)), axis=0)
        pooled = scan.sum_over_blocks(total) / scan.sum_over_blocks(
            jnp.sum(valid).astype(z.dtype)
        )
        return self.head(pooled)
