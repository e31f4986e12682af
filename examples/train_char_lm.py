"""A character language model on Python's own standard library source code.

The text ships with Python itself: the `.py` files of the standard library
(`os.path.dirname(os.__file__)`), read as bytes (a 256-symbol vocabulary, no
tokenizer, nothing downloaded). Files are split, by name, into training and
held-out text. An `eqx_seq.LanguageModel` (tied `Embedding`, S5 blocks) is trained
on random windows; the script reports bits per character on held-out text, saves
a checkpoint, and samples a continuation of a prompt in step mode (state carried,
one character at a time).

    python examples/train_char_lm.py                 # a few minutes on CPU
    python examples/train_char_lm.py --steps 5000 --width 256 --depth 4
"""

import argparse
import glob
import math
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqx_seq


def load_text(max_bytes: int, seed: int):
    """Training and held-out byte arrays from the standard library's sources."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    rng = np.random.default_rng(seed)
    rng.shuffle(files)
    held_out = files[: max(1, len(files) // 10)]
    train = files[len(held_out) :]

    def read(paths, limit):
        chunks, size = [], 0
        for path in paths:
            with open(path, "rb") as f:
                data = f.read()
            chunks.append(data)
            size += len(data)
            if size >= limit:
                break
        return np.frombuffer(b"\n".join(chunks)[:limit], np.uint8).astype(np.int32)

    return read(train, max_bytes), read(held_out, max_bytes // 10)


def windows(data, starts, length):
    return np.stack([data[s : s + length + 1] for s in starts])


def loss_fn(model, batch, key):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    keys = jr.split(key, len(batch))
    logits = jax.vmap(lambda x, k: model(x, key=k))(inputs, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@eqx.filter_jit
def train_step(model, opt_state, optim, batch, key):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch, key)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


@eqx.filter_jit
def eval_loss(model, batch):
    model = eqx.nn.inference_mode(model)
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def bits_per_char(model, data, length, batch_size):
    starts = np.arange(0, len(data) - length - 1, length)
    if len(starts) > batch_size:  # whole batches only: one compiled shape
        starts = starts[: len(starts) // batch_size * batch_size]
    total = []
    for i in range(0, len(starts), batch_size):
        chunk = windows(data, starts[i : i + batch_size], length)
        total.append(float(eval_loss(model, chunk)) * len(chunk))
    return sum(total) / len(starts) / math.log(2)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=128, help="training window")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--state-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ssm-lr", type=float, default=1e-3)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--sample", type=int, default=300, help="characters to sample")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("outputs", "train_char_lm"))
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar, even on a terminal"
    )
    args = parser.parse_args()

    train, held_out = load_text(args.max_bytes, args.seed)
    print(
        f"standard library source: {len(train):,} training and {len(held_out):,} "
        "held-out bytes"
    )
    key = jr.key(args.seed)
    model_key, train_key, sample_key = jr.split(key, 3)
    model = eqx_seq.LanguageModel(
        256,
        width=args.width,
        depth=args.depth,
        state_size=args.state_size,
        ssm_blocks=4,
        key=model_key,
    )

    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, args.steps // 20 + 1, args.steps, end_value=peak * 0.05
        )

    optim = optax.chain(
        optax.clip_by_global_norm(1.0),
        eqx_seq.s5_optimizer(
            schedule(args.lr), ssm_learning_rate=schedule(args.ssm_lr)
        ),
    )
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    try:
        from tqdm import trange
    except ImportError:
        trange = None
    steps = range(args.steps)
    # a bar only on a terminal: in a log file the redraws pile up, so a log gets ten
    # progress lines instead
    if trange is not None and not args.no_progress and sys.stderr.isatty():
        steps = trange(args.steps, desc="training")
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    running = None
    for step in steps:
        batch = windows(
            train,
            rng.integers(0, len(train) - args.length - 1, args.batch_size),
            args.length,
        )
        train_key, step_key = jr.split(train_key)
        model, opt_state, loss = train_step(model, opt_state, optim, batch, step_key)
        loss = float(loss)
        running = loss if running is None else 0.98 * running + 0.02 * loss
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(bpc=f"{running / math.log(2):.3f}")
        elif (step + 1) % max(1, args.steps // 10) == 0:
            print(f"step {step + 1:5d}  training bits/char {running / math.log(2):.3f}")
    elapsed = time.perf_counter() - start
    bpc = bits_per_char(model, held_out, args.length, 64)
    print(f"held-out bits per character: {bpc:.3f} ({elapsed:.0f} s of training)")

    os.makedirs(args.out, exist_ok=True)
    checkpoint = os.path.join(args.out, "model.eqx")
    eqx.tree_serialise_leaves(checkpoint, model)
    print(f"wrote {checkpoint}")

    prompt = np.frombuffer(b"def ", np.uint8).astype(np.int32)
    tokens = eqx.filter_jit(
        lambda m, p, k: eqx.nn.inference_mode(m).generate(
            p, args.sample, key=k, temperature=args.temperature
        )
    )(model, jnp.asarray(prompt), sample_key)
    text = bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")
    print(f"sample (step mode, temperature {args.temperature}):\n---\ndef {text}\n---")
    sample_path = os.path.join(args.out, "sample.txt")
    with open(sample_path, "w") as f:
        f.write("def " + text)
    print(f"wrote {sample_path}")


if __name__ == "__main__":
    main()
