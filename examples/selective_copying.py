"""Selective copying (Gu & Dao 2023, appendix E.1): Mamba and Mamba-2 remember, S5
cannot choose.

A context of L tokens holds 16 data tokens at random positions, blanks elsewhere;
at the 16 markers that follow, a causal model must output the data tokens in
order. A small `eqx_seq.LanguageModel` per mixer is trained on fresh sequences,
evaluated on held-out ones at L and at the longer contexts of `--eval-lengths`, and
the results printed beside the paper's. docs/examples/selective_copying.md walks
through it.

    python examples/selective_copying.py
    python examples/selective_copying.py --mixers mamba --length 128 --steps 10000
    python examples/selective_copying.py --mixers mamba --eval-lengths 256,1024
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


NUM_DATA, VOCAB = 16, 16  # data tokens per sequence and data symbols: the paper's
BLANK, MARKER = VOCAB, VOCAB + 1  # ids 0..15 are data; two more ids
MIXERS = ("s5", "lru", "rglru", "mamba", "mamba2")
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument(
    "--mixers", default="mamba,mamba2,rglru,s5", help=f"a comma list of {MIXERS}"
)
parser.add_argument("--length", type=int, default=64, help="the context L to train at")
parser.add_argument(
    "--eval-lengths", default="128,256", help="longer contexts to evaluate at (commas)"
)
parser.add_argument("--steps", type=int, default=6000)
parser.add_argument("--out", default=os.path.join("outputs", "selective_copying"))
args = parser.parse_args()
mixers = args.mixers.split(",")
eval_lengths = [int(n) for n in args.eval_lengths.split(",") if n]
if not set(mixers) <= set(MIXERS):
    parser.error(f"unknown mixer in --mixers {args.mixers!r}; choose from {MIXERS}")
if min([args.length, *eval_lengths]) < NUM_DATA:
    parser.error(f"every context length must hold the {NUM_DATA} data tokens")
SEED, BATCH, WIDTH, DEPTH, STATE_SIZE = 0, 32, 32, 2, 16
print(
    f"selective copying: {NUM_DATA} data tokens (vocabulary {VOCAB}) in a context "
    f"of L tokens, then {NUM_DATA} markers; {DEPTH}-layer models of width {WIDTH}, "
    f"state size {STATE_SIZE}; {args.steps} steps of {BATCH} fresh sequences; "
    f"on {jax.default_backend()}"
)
# --8<-- [end:setup]


# --8<-- [start:data]
def make_batch(rng, length):
    """`BATCH` sequences of `length + NUM_DATA` token ids and their `NUM_DATA`
    answers: the data tokens, in order, at sorted random positions of the context,
    blanks elsewhere, then the markers."""
    data = rng.integers(0, VOCAB, (BATCH, NUM_DATA))
    # NUM_DATA distinct positions per row: the smallest of L random keys
    keys = rng.random((BATCH, length))
    positions = np.sort(np.argpartition(keys, NUM_DATA - 1, axis=1)[:, :NUM_DATA], 1)
    ids = np.full((BATCH, length + NUM_DATA), BLANK, np.int32)
    ids[:, length:] = MARKER
    np.put_along_axis(ids, positions, data, axis=1)
    return ids, data.astype(np.int32)


def held_out(length, sequences=512):
    rng = np.random.default_rng([SEED, 1, length])  # apart from the training stream
    return [make_batch(rng, length) for _ in range(max(1, sequences // BATCH))]


# --8<-- [end:data]


# --8<-- [start:model]
def make_model(mixer, key):
    # Hawk blocks' state is as wide as the model: `state_size` is not theirs
    size = {} if mixer == "rglru" else {"state_size": STATE_SIZE}
    model = eqx_seq.LanguageModel(
        VOCAB + 2, width=WIDTH, depth=DEPTH, mixer=mixer, key=key, **size
    )
    if mixer == "mamba":
        # the same blocks with shorter chunks between stored states: on a CPU the
        # selective scan's gradient is faster when a chunk's states stay in cache
        blocks = tuple(
            eqx_seq.MambaBlock(
                eqx_seq.Mamba(WIDTH, state_size=STATE_SIZE, chunk_size=16, key=k),
                norm="layer",
            )
            for k in jr.split(jr.fold_in(key, 1), DEPTH)
        )
        model = eqx.tree_at(lambda m: m.blocks, model, blocks)
    if mixer == "mamba2":
        # heads of 16 channels (4 at this width) and chunks of 16 steps, which suit
        # short sequences on a CPU
        blocks = tuple(
            eqx_seq.Mamba2Block(
                eqx_seq.Mamba2(
                    WIDTH, state_size=STATE_SIZE, head_dim=16, chunk_size=16, key=k
                ),
                norm="layer",
            )
            for k in jr.split(jr.fold_in(key, 1), DEPTH)
        )
        model = eqx.tree_at(lambda m: m.blocks, model, blocks)
    return model


# --8<-- [end:model]


# --8<-- [start:training]
def answer_logits(model, ids):
    """The logits at the `NUM_DATA` marker positions, `(batch, NUM_DATA, V)`."""
    return jax.vmap(model)(ids)[:, -NUM_DATA:]


def loss_fn(model, ids, answers):
    logits = answer_logits(model, ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()


@eqx.filter_jit
def train_step(model, opt_state, optim, ids, answers):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ids, answers)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


@eqx.filter_jit
def hits(model, ids, answers):
    logits = answer_logits(eqx.nn.inference_mode(model), ids)
    return jnp.sum(jnp.argmax(logits, -1) == answers)


def accuracy(model, batches):
    """Token accuracy on held-out batches `[(ids, answers), ...]`."""
    total = sum(int(hits(model, ids, answers)) for ids, answers in batches)
    return total / sum(answers.size for _, answers in batches)


def schedule(peak):
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, args.steps // 10 + 1, args.steps, end_value=peak * 0.01
    )


def train(mixer):
    if mixer in ("s5", "lru"):  # the S5 recipe: SSM parameters slower, no decay
        inner = eqx_seq.s5_optimizer(
            schedule(1e-2), ssm_learning_rate=schedule(5e-3), weight_decay=0.01
        )
    else:
        inner = optax.adamw(schedule(1e-2), weight_decay=0.01)
    optim = optax.chain(optax.clip_by_global_norm(1.0), inner)
    model = make_model(mixer, jr.key(SEED))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng([SEED, 0, args.length])
    test = held_out(args.length)
    curve = {"step": [], "loss": [], "acc": []}
    running = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, answers = make_batch(rng, args.length)
        model, opt_state, loss = train_step(model, opt_state, optim, ids, answers)
        loss = float(loss)
        running = loss if running is None else 0.95 * running + 0.05 * loss
        if step % max(1, args.steps // 20) == 0 or step == args.steps:
            curve["step"].append(step)
            curve["loss"].append(running)
            curve["acc"].append(accuracy(model, test))
            print(
                f"{mixer:>6} L={args.length:<5} step {step:5d}  loss {running:.4f}  "
                f"held-out acc {curve['acc'][-1]:.4f}  "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return model, curve, time.perf_counter() - start


# --8<-- [end:training]

# --8<-- [start:result]
rows, curves = [], {}
for mixer in mixers:
    model, curves[mixer], elapsed = train(mixer)
    acc = curves[mixer]["acc"][-1]
    rows.append((mixer, args.length, acc, f"{elapsed:.0f} s"))
    for longer in eval_lengths:  # the same model, no retraining
        rows.append((mixer, longer, accuracy(model, held_out(longer)), "(same model)"))
    print(f"{mixer} trained at L={args.length}: held-out token accuracy {acc:.4f}")

print("\n| mixer | trained at L | evaluated at L | token accuracy | training time |")
print("|---|---|---|---|---|")
for mixer, length, acc, elapsed in rows:
    print(f"| {mixer} | {args.length} | {length} | {acc:.4f} | {elapsed} |")
# the paper's Table 1, at L = 4096
for name, acc in {"S4 (time-invariant)": 0.183, "Mamba": 0.998}.items():
    print(f"| paper: {name} | 4096 | 4096 | {acc:.3f} | |")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
for mixer, curve in curves.items():
    label = f"{mixer}, L={args.length}"
    ax1.plot(curve["step"], curve["loss"], label=label)
    ax2.plot(curve["step"], curve["acc"], label=label)
ax1.set(xlabel="step", ylabel="training loss (smoothed)", yscale="log")
ax2.axhline(1 / VOCAB, color="gray", ls=":", lw=1, label="chance")
ax2.set(xlabel="step", ylabel="held-out token accuracy", ylim=(0, 1.02))
ax2.legend()
fig.suptitle(f"Selective copying: {NUM_DATA} tokens in a context of L")
fig.tight_layout()
os.makedirs(args.out, exist_ok=True)
figure = os.path.join(args.out, "selective_copying.png")
fig.savefig(figure, dpi=100)
print(f"wrote {figure}")
# --8<-- [end:result]
