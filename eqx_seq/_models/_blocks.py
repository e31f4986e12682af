"""The stack of residual blocks inside the models, one kind per `mixer`."""

import math
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._delta._layer import GatedDeltaNet, GatedDeltaNetBlock
from .._misc import check_positive_int, check_real
from .._scan import AbstractScan
from .._ssm._block import S5Block
from .._ssm._hawk import HawkBlock
from .._ssm._lru import LRU
from .._ssm._mamba import Mamba
from .._ssm._mamba2 import Mamba2
from .._ssm._mamba_block import Mamba2Block, MambaBlock
from .._ssm._recurrent import AbstractRecurrentLayer
from .._ssm._s5 import S5


MIXERS = ("s5", "lru", "rglru", "mamba", "mamba2", "gated_deltanet")
# a mixer of the library by name, or a user's: a function that makes one block
Mixer = (
    Literal["s5", "lru", "rglru", "mamba", "mamba2", "gated_deltanet"]
    | Callable[[PRNGKeyArray], AbstractRecurrentLayer]
)

# The block arguments that only some mixers have: the mixers they apply to, their
# default (the models' signatures' default), and why the other mixers have none.
# Given to another mixer, a value other than the default is refused: ignoring it
# would train a different model from the one asked for.
BLOCK_ARGUMENTS = {
    "state_size": (
        ("s5", "lru", "mamba", "mamba2", "gated_deltanet"),
        64,
        "the RG-LRU's state is as wide as the model",
    ),
    "ssm_blocks": (("s5",), 1, "it sets the HiPPO blocks of S5's initialisation"),
    "activation": (
        ("s5", "lru"),
        "half_glu1",
        "it is the S5 block's; Hawk and Mamba blocks have their own gates",
    ),
    "norm": (
        ("s5", "lru", "mamba", "mamba2", "gated_deltanet"),
        "layer",
        "Hawk blocks have their own RMSNorms",
    ),
    "prenorm": (
        ("s5", "lru"),
        True,
        "Hawk and Mamba blocks always normalise their input",
    ),
    "dropout": (
        ("s5", "lru", "mamba", "mamba2", "gated_deltanet"),
        0.0,
        "Hawk blocks have no dropout",
    ),
}


def _is_default(value: object, default: object) -> bool:
    """`value` is `default` (a number equal to a float default counts, a bool or
    an array never stands for a number)."""
    if isinstance(default, float):
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value == default
        )
    return type(value) is type(default) and value == default


def check_block_arguments(mixer: object, **arguments: object) -> None:
    """A `ValueError` for an unknown `mixer`, for an argument of
    `BLOCK_ARGUMENTS` given to a mixer it does not apply to (a value other than
    its default), and for an invalid value of one that applies (those the blocks
    do not check themselves)."""
    own = not isinstance(mixer, str) and callable(mixer)
    if not own and (not isinstance(mixer, str) or mixer not in MIXERS):
        raise ValueError(
            f"`mixer` must be one of {MIXERS} or a function `key -> "
            f"eqx_seq.AbstractRecurrentLayer` that makes one block, got {mixer!r}."
        )
    for name, value in arguments.items():
        mixers, default, why = BLOCK_ARGUMENTS[name]
        if own:
            if not _is_default(value, default):
                raise ValueError(
                    f"`{name}` is an argument of the library's blocks "
                    f"(mixer={' or '.join(map(repr, mixers))}), got `{name}={value!r}` "
                    "with a mixer of your own, which builds its blocks itself: leave "
                    f"it at its default, {default!r}."
                )
        elif mixer not in mixers:
            if not _is_default(value, default):
                raise ValueError(
                    f"`{name}` applies to mixer={' or '.join(map(repr, mixers))} "
                    f"only ({why}), got `{name}={value!r}` with mixer={mixer!r}: "
                    f"leave it at its default, {default!r}."
                )
        elif name in ("state_size", "ssm_blocks"):
            check_positive_int(name, value)
        elif name == "prenorm" and not isinstance(value, bool):
            raise ValueError(f"`prenorm` must be a bool, got {value!r}.")
        elif name == "dropout" and not 0 <= check_real("dropout", value) < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {value!r}.")


def make_blocks(
    width: int,
    depth: int,
    state_size: int,
    *,
    mixer: Mixer,
    ssm_blocks: int,
    bidirectional: bool,
    activation: str,
    norm: str,
    prenorm: bool,
    dropout: float,
    scan: AbstractScan,
    dtype,
    key: PRNGKeyArray,
) -> tuple[AbstractRecurrentLayer, ...]:
    """`depth` residual blocks of width `width`, every recurrence with the backend
    `scan`: [`eqx_seq.S5Block`][]s around S5 or LRU layers,
    [`eqx_seq.HawkBlock`][]s, [`eqx_seq.MambaBlock`][]s,
    [`eqx_seq.Mamba2Block`][]s or [`eqx_seq.GatedDeltaNetBlock`][]s (heads of
    `state_size` key channels: the state of Mamba-2's at `expand = 2` when
    `state_size` divides `width`), or the blocks a user's
    `mixer` makes. An argument that the mixer's blocks do not have
    (`BLOCK_ARGUMENTS`; `bidirectional=True` for the causal selective layers) is
    refused."""
    check_positive_int("depth", depth)
    check_block_arguments(
        mixer,
        state_size=state_size,
        ssm_blocks=ssm_blocks,
        activation=activation,
        norm=norm,
        prenorm=prenorm,
        dropout=dropout,
    )
    if not isinstance(bidirectional, bool):
        raise ValueError(f"`bidirectional` must be a bool, got {bidirectional!r}.")
    if bidirectional and mixer not in ("s5", "lru"):
        raise ValueError(
            f'`bidirectional=True` is for the "s5" and "lru" mixers; the {mixer!r} '
            "mixer is causal."
        )
    if not isinstance(mixer, str):
        return tuple(_own_block(mixer, width, dtype, k) for k in jr.split(key, depth))
    blocks = []
    for k in jr.split(key, depth):
        ssm_key, block_key = jr.split(k)
        if mixer == "rglru":
            blocks.append(HawkBlock(width, scan=scan, dtype=dtype, key=ssm_key))
            continue
        if mixer == "mamba":
            layer = Mamba(
                width, state_size=state_size, scan=scan, dtype=dtype, key=ssm_key
            )
            blocks.append(MambaBlock(layer, norm=norm, dropout=dropout))
            continue
        if mixer == "mamba2":
            layer = Mamba2(
                width,
                state_size=state_size,
                head_dim=mamba2_head_dim(width),
                scan=scan,
                dtype=dtype,
                key=ssm_key,
            )
            blocks.append(Mamba2Block(layer, norm=norm, dropout=dropout))
            continue
        if mixer == "gated_deltanet":
            layer = GatedDeltaNet(
                width,
                num_heads=max(1, width // state_size),
                head_dim=state_size,
                scan=scan,
                dtype=dtype,
                key=ssm_key,
            )
            blocks.append(GatedDeltaNetBlock(layer, norm=norm, dropout=dropout))
            continue
        if mixer == "s5":
            ssm = S5(
                width,
                state_size,
                blocks=ssm_blocks,
                bidirectional=bidirectional,
                scan=scan,
                dtype=dtype,
                key=ssm_key,
            )
        else:
            ssm = LRU(
                width,
                state_size,
                r_min=0.9,
                max_phase=math.pi / 10,
                bidirectional=bidirectional,
                scan=scan,
                dtype=dtype,
                key=ssm_key,
            )
        blocks.append(
            S5Block(
                ssm,
                norm=norm,
                prenorm=prenorm,
                activation=activation,
                dropout=dropout,
                key=block_key,
            )
        )
    return tuple(blocks)


def mamba2_head_dim(width: int) -> int:
    """The channels per head of the models' Mamba-2 layers: Mamba-2's 64 where
    they divide the layer's `2 * width` channels, else the largest divisor of
    both."""
    return math.gcd(2 * width, 64)


def _own_block(mixer: Callable, width: int, dtype, key: PRNGKeyArray):
    """`mixer(key)`, checked: a recurrent layer from `(T, width)` to `(T, width)`."""
    block = mixer(key)
    if not isinstance(block, AbstractRecurrentLayer):
        raise ValueError(
            "A `mixer` of your own must return an `eqx_seq.AbstractRecurrentLayer` "
            f"(one block of the model), got {type(block).__name__}."
        )
    x = jax.ShapeDtypeStruct((2, width), dtype or jax.dtypes.canonicalize_dtype(float))
    y = eqx.filter_eval_shape(block, x)
    if not isinstance(y, jax.ShapeDtypeStruct) or y.shape != x.shape:
        raise ValueError(
            f"A `mixer` of your own makes blocks that map a sequence of shape "
            f"(T, width) = (T, {width}) to one of the same shape; "
            f"`{type(block).__name__}` gives {getattr(y, 'shape', y)} for (2, {width})."
        )
    return block


def run_blocks(blocks: tuple[eqx.Module, ...], x: Array, key: PRNGKeyArray | None):
    keys = [None] * len(blocks) if key is None else list(jr.split(key, len(blocks)))
    for block, k in zip(blocks, keys):
        x = block(x, key=k)
    return x
