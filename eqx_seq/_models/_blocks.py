"""The stack of residual blocks inside the models, one kind per `mixer`."""

import math
from typing import Literal

import equinox as eqx
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .._misc import check_positive_int
from .._scan import AbstractScan
from .._ssm._block import S5Block
from .._ssm._hawk import HawkBlock
from .._ssm._lru import LRU
from .._ssm._mamba import Mamba
from .._ssm._mamba_block import MambaBlock
from .._ssm._s5 import S5


MIXERS = ("s5", "lru", "rglru", "mamba")
Mixer = Literal["s5", "lru", "rglru", "mamba"]
Block = S5Block | HawkBlock | MambaBlock


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
) -> tuple[Block, ...]:
    """`depth` residual blocks of width `width`, every recurrence with the backend
    `scan`: [`eqx_seq.S5Block`][]s around S5 or LRU layers,
    [`eqx_seq.HawkBlock`][]s or [`eqx_seq.MambaBlock`][]s (`activation`, `prenorm`
    and `ssm_blocks` are the S5 block's; the selective layers are causal)."""
    check_positive_int("depth", depth)
    if mixer not in MIXERS:
        raise ValueError(f"`mixer` must be one of {MIXERS}, got {mixer!r}.")
    if bidirectional and mixer not in ("s5", "lru"):
        raise ValueError(
            f'`bidirectional=True` is for the "s5" and "lru" mixers; the {mixer!r} '
            "mixer is causal."
        )
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


def run_blocks(blocks: tuple[eqx.Module, ...], x: Array, key: PRNGKeyArray | None):
    keys = [None] * len(blocks) if key is None else list(jr.split(key, len(blocks)))
    for block, k in zip(blocks, keys):
        x = block(x, key=k)
    return x
