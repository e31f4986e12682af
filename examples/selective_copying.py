"""Selective copying (Gu & Dao 2023, appendix E.1): Mamba remembers, S5 cannot choose.

Each sequence has a context of L tokens: 16 data tokens (from a vocabulary of 16)
at random positions, blanks everywhere else; then 16 marker tokens. At the markers
a causal model must output the 16 data tokens in their order. Where the data sit
changes from sequence to sequence, so a layer whose decay does not depend on the
input (S5, LRU) cannot know what to keep; a selective one (Mamba) can decide, token
by token, to take a data token in and to let a blank pass.

An `eqx_seq.LanguageModel` (Embedding, 2 blocks, tied read-out) per mixer is trained
on fresh batches from a seeded NumPy generator, the loss the cross-entropy at the 16
answer positions; the metric is the token accuracy there, on held-out sequences
(another seed). Each trained model is then evaluated at the longer contexts of
`--eval-lengths` (no retraining). A table is printed at the end, beside the
paper's numbers (its Table 1, at L = 4096), and the curves are drawn to a PNG.

    python examples/selective_copying.py             # mamba and s5 at L=64: ~15 min
    python examples/selective_copying.py --mixers mamba --lengths 128 --steps 10000
    python examples/selective_copying.py --mixers mamba --eval-lengths 256,1024
"""

import argparse
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


MIXERS = ("s5", "lru", "rglru", "mamba")
DEFAULT_MIXERS = "mamba,rglru,s5"
NUM_DATA = 16  # data tokens per sequence (the paper's 16)
VOCAB = 16  # data symbols (the paper's 16)
BLANK, MARKER = VOCAB, VOCAB + 1  # ids 0..15 are data; two more ids
PAPER = {"S4 (time-invariant)": 0.183, "Mamba": 0.998}  # Table 1, L = 4096


def make_batch(rng: np.random.Generator, batch: int, length: int):
    """`batch` sequences of `length + NUM_DATA` token ids and their `NUM_DATA`
    answers: the data tokens, in order, at sorted random positions of the context,
    blanks elsewhere, then the markers."""
    if length < NUM_DATA:
        raise ValueError(f"the context must hold {NUM_DATA} tokens, got L={length}")
    data = rng.integers(0, VOCAB, (batch, NUM_DATA))
    # NUM_DATA distinct positions per row: the smallest of L random keys
    keys = rng.random((batch, length))
    positions = np.sort(np.argpartition(keys, NUM_DATA - 1, axis=1)[:, :NUM_DATA], 1)
    ids = np.full((batch, length + NUM_DATA), BLANK, np.int32)
    ids[:, length:] = MARKER
    np.put_along_axis(ids, positions, data, axis=1)
    return ids, data.astype(np.int32)


def make_model(mixer: str, args, key):
    # Hawk blocks' state is as wide as the model: `state_size` is not theirs
    size = {} if mixer == "rglru" else {"state_size": args.state_size}
    model = eqx_seq.LanguageModel(
        VOCAB + 2, width=args.width, depth=args.depth, mixer=mixer, key=key, **size
    )
    if mixer == "mamba":
        # the same blocks with shorter chunks between stored states: on a CPU the
        # selective scan's gradient is faster when a chunk's states stay in cache
        blocks = tuple(
            eqx_seq.MambaBlock(
                eqx_seq.Mamba(
                    args.width,
                    state_size=args.state_size,
                    chunk_size=args.chunk_size,
                    key=k,
                ),
                norm="layer",
            )
            for k in jr.split(jr.fold_in(key, 1), args.depth)
        )
        model = eqx.tree_at(lambda m: m.blocks, model, blocks)
    return model


def answer_logits(model, ids):
    """The logits at the `NUM_DATA` marker positions, `(batch, NUM_DATA, V)`."""
    return jax.vmap(model)(ids)[:, -NUM_DATA:]


def loss_fn(model, ids, answers):
    logits = answer_logits(model, ids)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == answers)


@eqx.filter_jit
def train_step(model, opt_state, optim, ids, answers):
    (loss, acc), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
        model, ids, answers
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss, acc


@eqx.filter_jit
def hits(model, ids, answers):
    logits = answer_logits(eqx.nn.inference_mode(model), ids)
    return jnp.sum(jnp.argmax(logits, -1) == answers)


def accuracy(model, data) -> float:
    """Token accuracy on held-out batches `[(ids, answers), ...]`."""
    total = sum(int(hits(model, ids, answers)) for ids, answers in data)
    return total / sum(answers.size for _, answers in data)


def held_out(seed: int, length: int, sequences: int, batch: int):
    # a stream of its own, apart from the training batches'
    rng = np.random.default_rng([seed, 1, length])
    return [make_batch(rng, batch, length) for _ in range(max(1, sequences // batch))]


def make_optimizer(mixer: str, args):
    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, args.steps // 10 + 1, args.steps, end_value=peak * 0.01
        )

    if mixer in ("s5", "lru"):  # the S5 recipe: SSM parameters slower, no decay
        inner = eqx_seq.s5_optimizer(
            schedule(args.lr),
            ssm_learning_rate=schedule(args.lr / 2),
            weight_decay=args.weight_decay,
        )
    else:
        inner = optax.adamw(schedule(args.lr), weight_decay=args.weight_decay)
    return optax.chain(optax.clip_by_global_norm(1.0), inner)


def train(mixer: str, length: int, args, show_bar: bool):
    model = make_model(mixer, args, jr.key(args.seed))
    optim = make_optimizer(mixer, args)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng([args.seed, 0, length])
    test = held_out(args.seed, length, args.eval_sequences, args.batch_size)
    steps = range(1, args.steps + 1)
    if show_bar:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"{mixer} L={length}", leave=False)
    curve = {"step": [], "loss": [], "acc": []}
    every = max(1, args.steps // 20)
    running = None
    start = time.perf_counter()
    for step in steps:
        ids, answers = make_batch(rng, args.batch_size, length)
        model, opt_state, loss, _ = train_step(model, opt_state, optim, ids, answers)
        loss = float(loss)
        running = loss if running is None else 0.95 * running + 0.05 * loss
        if show_bar:
            steps.set_postfix(loss=f"{running:.3f}")
        if step % every == 0 or step == args.steps:
            curve["step"].append(step)
            curve["loss"].append(running)
            curve["acc"].append(accuracy(model, test))
            if not show_bar:
                print(
                    f"{mixer:>6} L={length:<5} step {step:5d}  loss {running:.4f}  "
                    f"held-out acc {curve['acc'][-1]:.4f}  "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    elapsed = time.perf_counter() - start
    return model, curve, elapsed, curve["acc"][-1]


def parse_list(text: str, kind=str):
    return [kind(item) for item in text.split(",") if item.strip()]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mixers", default=DEFAULT_MIXERS, help=f"comma list from {MIXERS}"
    )
    parser.add_argument(
        "--lengths", default="64", help="context lengths L to train at (comma list)"
    )
    parser.add_argument(
        "--eval-lengths",
        default="128,256",
        help="longer contexts to evaluate each trained model at (comma list)",
    )
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--state-size", type=int, default=16)
    parser.add_argument(
        "--chunk-size", type=int, default=16, help="Mamba's steps between stored states"
    )
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-sequences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("outputs", "selective_copying"))
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar, even on a terminal"
    )
    args = parser.parse_args()
    mixers = parse_list(args.mixers)
    for mixer in mixers:
        if mixer not in MIXERS:
            parser.error(f"unknown mixer {mixer!r}; choose from {MIXERS}")
    lengths = parse_list(args.lengths, int)
    eval_lengths = parse_list(args.eval_lengths, int)
    if not lengths or min(lengths + eval_lengths) < NUM_DATA:
        parser.error(f"every context length must hold the {NUM_DATA} data tokens")
    try:
        import tqdm  # noqa: F401
    except ImportError:  # the examples extra brings tqdm; run without a bar if absent
        have_tqdm = False
    else:
        have_tqdm = True
    # a bar only on a terminal: in a log file the redraws pile up, and the lines
    # printed instead say what a log needs
    show_bar = have_tqdm and not args.no_progress and sys.stderr.isatty()
    print(
        f"selective copying: {NUM_DATA} data tokens (vocabulary {VOCAB}) in a context "
        f"of L tokens, then {NUM_DATA} markers; {args.depth}-layer models of width "
        f"{args.width}, state size {args.state_size}; {args.steps} steps of "
        f"{args.batch_size} fresh sequences; on {jax.default_backend()}"
    )

    rows, curves = [], {}
    for length in lengths:
        for mixer in mixers:
            model, curve, elapsed, acc = train(mixer, length, args, show_bar)
            curves[(mixer, length)] = curve
            rows.append((mixer, length, length, acc, elapsed))
            for longer in eval_lengths:
                test = held_out(args.seed, longer, args.eval_sequences, args.batch_size)
                rows.append((mixer, length, longer, accuracy(model, test), None))
            print(
                f"{mixer} trained at L={length}: held-out token accuracy {acc:.4f} "
                f"({elapsed:.0f} s)",
                flush=True,
            )

    print()
    print("| mixer | trained at L | evaluated at L | token accuracy | training time |")
    print("|---|---|---|---|---|")
    for mixer, length, longer, acc, elapsed in rows:
        time_text = f"{elapsed:.0f} s" if elapsed is not None else "(same model)"
        print(f"| {mixer} | {length} | {longer} | {acc:.4f} | {time_text} |")
    for name, acc in PAPER.items():
        print(f"| paper: {name} | 4096 | 4096 | {acc:.3f} | |")

    os.makedirs(args.out, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[examples]')")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for (mixer, length), curve in curves.items():
        label = f"{mixer}, L={length}"
        ax1.plot(curve["step"], curve["loss"], label=label)
        ax2.plot(curve["step"], curve["acc"], label=label)
    ax1.set(xlabel="step", ylabel="training loss (smoothed)", yscale="log")
    ax2.axhline(1 / VOCAB, color="gray", ls=":", lw=1, label="chance")
    ax2.set(xlabel="step", ylabel="held-out token accuracy", ylim=(0, 1.02))
    ax2.legend()
    fig.suptitle(f"Selective copying: {NUM_DATA} tokens in a context of L")
    fig.tight_layout()
    figure = os.path.join(args.out, "selective_copying.png")
    fig.savefig(figure, dpi=100)
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
