"""A character language model on Python's own standard library source code.

An `eqx_seq.LanguageModel` (tied `Embedding`, S5 blocks) learns the standard
library's `.py` files byte by byte; the script reports bits per character on
held-out files, saves a checkpoint, and samples a continuation of a prompt in step
mode. docs/examples/train_char_lm.md walks through it.

    python examples/train_char_lm.py
    python examples/train_char_lm.py --steps 5000
"""

# --8<-- [start:setup]
import argparse
import glob
import math
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqx_seq


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--steps", type=int, default=1500)
parser.add_argument("--max-bytes", type=int, default=2_000_000, help="training text")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=os.path.join("outputs", "train_char_lm"))
args = parser.parse_args()
BATCH, LENGTH = 16, 128  # windows of LENGTH bytes
# --8<-- [end:setup]

# --8<-- [start:data]
files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
np.random.default_rng(args.seed).shuffle(files)
held_out_files = files[: max(1, len(files) // 10)]  # split by file, not by byte
train_files = files[len(held_out_files) :]


def read(paths, limit):
    """The files' bytes, joined, as token ids (a 256-symbol vocabulary)."""
    chunks, size = [], 0
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
        if size >= limit:
            break
    return np.frombuffer(b"\n".join(chunks)[:limit], np.uint8).astype(np.int32)


train = read(train_files, args.max_bytes)
held_out = read(held_out_files, args.max_bytes // 10)
print(
    f"standard library source: {len(train):,} training and {len(held_out):,} "
    "held-out bytes"
)


def windows(data, starts):
    """Windows of LENGTH + 1 bytes: the inputs and, one step on, the targets."""
    return np.stack([data[s : s + LENGTH + 1] for s in starts])


# --8<-- [end:data]

# --8<-- [start:model]
model_key, train_key, sample_key = jr.split(jr.key(args.seed), 3)
model = eqx_seq.LanguageModel(
    256, width=128, depth=3, state_size=64, ssm_blocks=4, key=model_key
)
# --8<-- [end:model]


# --8<-- [start:training]
def schedule(peak):
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, args.steps // 20 + 1, args.steps, end_value=peak * 0.05
    )


optim = optax.chain(
    optax.clip_by_global_norm(1.0),
    eqx_seq.s5_optimizer(schedule(3e-3), ssm_learning_rate=schedule(1e-3)),
)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))


def loss_fn(model, batch, key):
    keys = jr.split(key, len(batch))
    logits = jax.vmap(lambda x, k: model(x, key=k))(batch[:, :-1], keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@eqx.filter_jit
def train_step(model, opt_state, batch, key):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch, key)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


rng = np.random.default_rng(args.seed)
start = time.perf_counter()
running = None
for step in range(args.steps):
    batch = windows(train, rng.integers(0, len(train) - LENGTH - 1, BATCH))
    train_key, step_key = jr.split(train_key)
    model, opt_state, loss = train_step(model, opt_state, batch, step_key)
    running = float(loss) if running is None else 0.98 * running + 0.02 * float(loss)
    if (step + 1) % max(1, args.steps // 10) == 0:
        print(f"step {step + 1:5d}  training bits/char {running / math.log(2):.3f}")
elapsed = time.perf_counter() - start
# --8<-- [end:training]


# --8<-- [start:result]
@eqx.filter_jit
def eval_loss(model, batch):
    logits = jax.vmap(eqx.nn.inference_mode(model))(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


starts = np.arange(0, len(held_out) - LENGTH - 1, LENGTH)
if len(starts) > 64:  # whole batches of 64 only: one compiled shape
    starts = starts[: len(starts) // 64 * 64]
losses = [
    float(eval_loss(model, windows(held_out, chunk))) * len(chunk)
    for chunk in np.array_split(starts, max(1, len(starts) // 64))
]
bpc = sum(losses) / len(starts) / math.log(2)
print(f"held-out bits per character: {bpc:.3f} ({elapsed:.0f} s of training)")

os.makedirs(args.out, exist_ok=True)
checkpoint = os.path.join(args.out, "model.eqx")
eqx.tree_serialise_leaves(checkpoint, model)
print(f"wrote {checkpoint}")

# step mode: the blocks' states carried, one character at a time
prompt = jnp.asarray(np.frombuffer(b"def ", np.uint8).astype(np.int32))
generate = eqx.filter_jit(
    lambda m, k: eqx.nn.inference_mode(m).generate(prompt, 300, key=k, temperature=0.7)
)
tokens = generate(model, sample_key)
text = "def " + bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")
print(f"sample (step mode, temperature 0.7):\n---\n{text}\n---")
sample_path = os.path.join(args.out, "sample.txt")
with open(sample_path, "w") as f:
    f.write(text)
print(f"wrote {sample_path}")
# --8<-- [end:result]
