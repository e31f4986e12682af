"""Multi-query associative recall (MQAR): which mixers can look a value up by its key.

A sequence starts with key-value pairs; later, the keys come back one at a time in
a random order, and at each the model must output the value that followed it
earlier (Arora et al., "Zoology: Measuring and Improving Recall in Efficient
Language Models", 2023). A layer whose state is a fixed filter of its input (S5)
cannot choose what to store; a selective one can, and Mamba-2's larger state per
head holds more pairs; Gated DeltaNet, at the same state as Mamba-2's, writes it
with the delta rule. CPU-sized slices of Zoology's grid (by default 64 tokens with
4 pairs and 128 tokens with 8; `--slices` adds 256 with 16), each mixer at the
same width over a sweep of learning rates (recurrent models train in a narrow
window), the best rate's held-out accuracy in one table. docs/examples/mqar.md
walks through it.

    python examples/mqar.py
    python examples/mqar.py --mixers mamba2,gated_deltanet --slices 128:8,256:16
    python examples/mqar.py --mixers mamba2 --learning-rates 3e-3 --steps 1000
    python examples/mqar.py --mixers gated_deltanet --slices 256:16 --seed 1
    python examples/mqar.py --mixers mamba2,gated_deltanet --decay-init stratified
"""

# --8<-- [start:setup]
import argparse
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib


matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt
import numpy as np
import optax

import eqx_seq


MIXERS = ("mamba2", "gated_deltanet", "mamba", "rglru", "s5")
BATCH, WIDTH, DEPTH, VOCAB = 32, 64, 2, 256
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument(
    "--mixers", default=",".join(MIXERS), help=f"a comma list of {MIXERS}"
)
parser.add_argument(
    "--slices",
    default="64:4,128:8",
    help="slices of Zoology's grid, length:pairs (commas), e.g. 128:8,256:16",
)
parser.add_argument(
    "--learning-rates", default="1e-2,3e-2", help="peak rates to sweep (commas)"
)
parser.add_argument("--steps", type=int, default=1200)
parser.add_argument(
    "--seed",
    type=int,
    default=0,
    help="draws the models, the training sequences and the held-out ones",
)
parser.add_argument(
    "--decay-init",
    default="independent",
    choices=("independent", "stratified"),
    help="Mamba-2's and Gated DeltaNet's `decay_init`",
)
parser.add_argument("--out", default=os.path.join("outputs", "mqar"))
args = parser.parse_args()
SEED = args.seed
mixers = args.mixers.split(",")
rates = [float(r) for r in args.learning_rates.split(",") if r]
try:  # (sequence length, key-value pairs)
    SLICES = tuple(tuple(map(int, s.split(":"))) for s in args.slices.split(","))
except ValueError:
    SLICES = ()
# each slice needs distinct keys (fewer than VOCAB/2) and an even offset after the
# pairs for every key's second appearance (length >= 4 pairs); one slice per length
if not (
    SLICES
    and all(len(s) == 2 and 0 < 4 * s[1] <= s[0] for s in SLICES)
    and max(p for _, p in SLICES) < VOCAB // 2
    and len({n for n, _ in SLICES}) == len(SLICES)
):
    parser.error(
        f"--slices must be length:pairs with 1 <= pairs < {VOCAB // 2} and "
        f"length >= 4 pairs, one per length; got {args.slices!r}"
    )
if not set(mixers) <= set(MIXERS) or not rates or min(rates) <= 0 or SEED < 0:
    parser.error(
        f"--mixers must name mixers of {MIXERS}; --learning-rates, positive rates; "
        "--seed, a non-negative integer"
    )
# the states per channel (Mamba, S5) or per head channel (Mamba-2): Mamba's usual
# 16, Mamba-2's larger state (its reference uses 128); the RG-LRU's state is as
# wide as the model. Gated DeltaNet's entry is its key channels per head, in
# GDN_HEADS = 4 heads with values of 2 * 32 = 64 channels, so that both layers hold
# 8,192 numbers per layer: Mamba-2's 8 heads x 16 channels x 64 states (expand 2:
# 128 channels), Gated DeltaNet's 4 heads x 32 keys x 64 values (and both
# convolutions keep 3 steps of their channels). Several heads rather than one of
# 64 x 128: each head's gate starts at one random decay, and one head whose decay
# forgets within the gap must first unlearn it.
STATE_SIZES = {"mamba2": 64, "gated_deltanet": 32, "mamba": 16, "s5": 64}
GDN_HEADS = 4
CHUNK = 64  # Gated DeltaNet's steps per chunk
PAD = max(map(len, mixers))  # the mixers' names aligned in the lines printed
print(
    f"MQAR: slices {SLICES} (length, pairs), vocabulary {VOCAB}; {DEPTH}-layer "
    f"models of width {WIDTH}, state sizes {STATE_SIZES}; {args.steps} steps of "
    f"{BATCH} fresh sequences per rate in {rates}, seed {SEED}, decay init "
    f"{args.decay_init}; on "
    f"{jax.default_backend()}"
)
# --8<-- [end:setup]


# --8<-- [start:data]
def make_batch(rng, length, pairs, batch=BATCH):
    """Zoology's MQAR sequences: `pairs` distinct keys (ids 1 to VOCAB/2 - 1), each
    followed by its value (ids VOCAB/2 and up), then the rest of the sequence zeros
    with each key once more at an even offset, its gap drawn from Zoology's power
    law (short gaps likelier). Returns the ids `(batch, length)`, the value to
    output at every position, and where there is one (the keys' second
    appearances)."""
    half, context = VOCAB // 2, 2 * pairs
    keys = np.stack(
        [rng.choice(np.arange(1, half), pairs, replace=False) for _ in range(batch)]
    )
    values = rng.integers(half, VOCAB, (batch, pairs))
    ids = np.zeros((batch, length), np.int32)
    ids[:, 0:context:2], ids[:, 1:context:2] = keys, values
    slots = (length - context) // 2  # even offsets after the pairs
    weights = np.arange(1, slots + 1) ** (0.01 - 1.0)  # Zoology's power_a = 0.01
    gaps = np.stack(
        [
            rng.choice(slots, pairs, replace=False, p=weights / weights.sum())
            for _ in range(batch)
        ]
    )
    where = context + 2 * gaps
    np.put_along_axis(ids, where, keys, axis=1)
    targets = np.zeros((batch, length), np.int32)
    np.put_along_axis(targets, where, values, axis=1)
    asked = np.zeros((batch, length), bool)
    np.put_along_axis(asked, where, True, axis=1)
    return ids, targets, asked


def held_out(length, pairs, sequences=512):
    rng = np.random.default_rng([SEED, 1, length])  # apart from the training stream
    return make_batch(rng, length, pairs, sequences)


# --8<-- [end:data]


# --8<-- [start:model]
def make_model(mixer, key):
    """A language model over the vocabulary; Mamba-2's heads are of 16 channels
    (8 heads at this width), its chunks of 16 steps; Gated DeltaNet's heads of
    STATE_SIZES key channels and twice as many value channels (GDN_HEADS heads:
    the state of Mamba-2's), its chunks of CHUNK steps."""
    if mixer == "mamba2":

        def block(key):
            layer = eqx_seq.Mamba2(
                WIDTH,
                state_size=STATE_SIZES[mixer],
                head_dim=16,
                chunk_size=16,
                decay_init=args.decay_init,
                key=key,
            )
            return eqx_seq.Mamba2Block(layer)

        return eqx_seq.LanguageModel(
            VOCAB, width=WIDTH, depth=DEPTH, mixer=block, key=key
        )
    if mixer == "gated_deltanet":

        def block(key):
            layer = eqx_seq.GatedDeltaNet(
                WIDTH,
                num_heads=GDN_HEADS,
                head_dim=STATE_SIZES[mixer],
                expand_v=2,
                chunk_size=CHUNK,
                decay_init=args.decay_init,
                key=key,
            )
            return eqx_seq.GatedDeltaNetBlock(layer)

        return eqx_seq.LanguageModel(
            VOCAB, width=WIDTH, depth=DEPTH, mixer=block, key=key
        )
    size = {} if mixer == "rglru" else {"state_size": STATE_SIZES[mixer]}
    return eqx_seq.LanguageModel(
        VOCAB, width=WIDTH, depth=DEPTH, mixer=mixer, key=key, **size
    )


# --8<-- [end:model]


# --8<-- [start:training]
def loss_fn(model, ids, targets, asked):
    logits = jax.vmap(model)(ids)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(jnp.where(asked, losses, 0.0)) / jnp.sum(asked)


@eqx.filter_jit
def train_step(model, opt_state, optim, ids, targets, asked):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ids, targets, asked)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


@eqx.filter_jit
def accuracy(model, ids, targets, asked):
    """The share of the keys asked for whose value is the most likely token."""
    right = jnp.argmax(jax.vmap(model)(ids), -1) == targets
    return jnp.sum(right & asked) / jnp.sum(asked)


def train(mixer, length, pairs, rate):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, rate, args.steps // 10 + 1, args.steps, end_value=rate * 0.01
    )
    optim = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1)
    )
    model = make_model(mixer, jr.key(SEED))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng([SEED, 0, length])
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = make_batch(rng, length, pairs)
        model, opt_state, loss = train_step(model, opt_state, optim, *batch)
    acc = float(accuracy(model, *held_out(length, pairs)))
    elapsed = time.perf_counter() - start
    print(
        f"{mixer:>{PAD}} T={length:<4} pairs={pairs} rate {rate:g}: "
        f"loss {float(loss):.3f}  held-out accuracy {acc:.3f}  ({elapsed:.0f} s)",
        flush=True,
    )
    return acc, elapsed


# --8<-- [end:training]

# --8<-- [start:result]
results = {}  # (mixer, length) -> [(rate, accuracy, seconds)]
for mixer in mixers:
    for length, pairs in SLICES:
        results[mixer, length] = [(r, *train(mixer, length, pairs, r)) for r in rates]

head = " | ".join(f"T = {n}, {p} pairs" for n, p in SLICES)
print(f"\n| mixer (width {WIDTH}) | {head} | learning rates: accuracies |")
print("|---|" + "---|" * len(SLICES) + "---|")
for mixer in mixers:
    best = [max(results[mixer, n], key=lambda r: r[1]) for n, _ in SLICES]
    cells = " | ".join(f"{acc:.3f} (rate {r:g})" for r, acc, _ in best)
    sweep = "; ".join(
        f"T={n}: " + ", ".join(f"{acc:.2f}" for _, acc, _ in results[mixer, n])
        for n, _ in SLICES
    )
    print(f"| {mixer} | {cells} | {sweep} |")

fig, axes = plt.subplots(
    1, len(SLICES), figsize=(5 * len(SLICES), 4), sharey=True, squeeze=False
)
axes = axes[0]
for ax, (length, pairs) in zip(axes, SLICES):
    for mixer in mixers:
        runs = results[mixer, length]
        ax.plot([r for r, *_ in runs], [a for _, a, _ in runs], "o-", label=mixer)
    ax.set(
        xscale="log", xlabel="peak learning rate", title=f"T = {length}, {pairs} pairs"
    )
axes[0].set(ylabel="held-out accuracy", ylim=(0, 1.02))
axes[0].legend()
fig.suptitle(f"Multi-query associative recall, width {WIDTH}")
fig.tight_layout()
os.makedirs(args.out, exist_ok=True)
figure = os.path.join(args.out, "mqar.png")
fig.savefig(figure, dpi=100)
print(f"wrote {figure}")
# --8<-- [end:result]
