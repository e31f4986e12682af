"""Sequential digit classification: an S5 classifier reads 8x8 digits pixel by pixel.

The data are scikit-learn's bundled handwritten digits (1797 images of 8x8 pixels,
no download): each image becomes a sequence of T=64 pixel intensities, read in
raster order, and an `eqx_seq.SequenceClassifier` (linear encoder, S5 blocks, mean
pooling, linear head) learns the digit from the sequence alone, trained with the S5
recipe (`eqx_seq.s5_optimizer`). A seeded 80/20 train/test split; the test
accuracy is printed at the end, the model saved with `eqx.tree_serialise_leaves`,
reloaded and re-evaluated (the same accuracy, bit for bit), and the training curves
drawn to a PNG.

    python examples/train_digits.py                  # default: a few minutes on CPU
    python examples/train_digits.py --epochs 60 --width 96 --depth 4   # bigger
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


SCANS = {
    "auto": eqx_seq.AutoScan(),
    "sequential": eqx_seq.SequentialScan(),
    "associative": eqx_seq.AssociativeScan(),
}


def load_data(seed: int, test_fraction: float = 0.2):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images.reshape(len(digits.images), 64, 1).astype(np.float32) / 16.0
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(test_fraction * len(x)))
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])


def make_model(args, key):
    return eqx_seq.SequenceClassifier(
        1,
        10,
        width=args.width,
        depth=args.depth,
        state_size=args.state_size,
        ssm_blocks=args.ssm_blocks,
        mixer=args.mixer,
        pooling="mean",
        dropout=args.dropout,
        scan=SCANS[args.scan],
        key=key,
    )


def cross_entropy(model, x, y, key):
    keys = jr.split(key, len(x))
    logits = jax.vmap(lambda x, k: model(x, key=k))(x, keys)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)


@eqx.filter_jit
def train_step(model, opt_state, optim, x, y, key):
    (loss, acc), grads = eqx.filter_value_and_grad(cross_entropy, has_aux=True)(
        model, x, y, key
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss, acc


@eqx.filter_jit
def predict(model, x):
    return jnp.argmax(jax.vmap(eqx.nn.inference_mode(model))(x), -1)


def accuracy(model, x, y, batch=512):
    hits = sum(
        int(jnp.sum(predict(model, x[i : i + batch]) == y[i : i + batch]))
        for i in range(0, len(x), batch)
    )
    return hits / len(x)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--state-size", type=int, default=64)
    parser.add_argument("--ssm-blocks", type=int, default=4)
    parser.add_argument("--mixer", choices=["s5", "lru"], default="s5")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=4e-3, help="regular parameters")
    parser.add_argument("--ssm-lr", type=float, default=2e-3, help="SSM parameters")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--scan", choices=list(SCANS), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit", type=int, default=None, help="use only this many training images"
    )
    parser.add_argument(
        "--out", default=os.path.join("outputs", "train_digits"), help="output folder"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar, even on a terminal"
    )
    args = parser.parse_args()

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    if args.limit:
        x_train, y_train = x_train[: args.limit], y_train[: args.limit]
    print(
        f"digits: {len(x_train)} training and {len(x_test)} test sequences of "
        f"T={x_train.shape[1]} pixels; backend {SCANS[args.scan]!r} "
        f"(on {jax.default_backend()}: {eqx_seq.AutoScan().select()!r} for auto)"
    )
    key = jr.key(args.seed)
    model_key, train_key = jr.split(key)
    model = make_model(args, model_key)
    steps_per_epoch = max(1, len(x_train) // args.batch_size)
    total = args.epochs * steps_per_epoch

    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, min(total // 10 + 1, total), total, end_value=peak * 1e-2
        )

    optim = eqx_seq.s5_optimizer(
        schedule(args.lr),
        ssm_learning_rate=schedule(args.ssm_lr),
        weight_decay=args.weight_decay,
    )
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    try:
        from tqdm import tqdm
    except ImportError:  # the examples extra brings tqdm; run without a bar if absent
        tqdm = None
    # a bar only on a terminal: in a log file the redraws pile up, and the line per
    # epoch below says what a log needs
    show_bar = tqdm is not None and not args.no_progress and sys.stderr.isatty()

    history = {"epoch": [], "loss": [], "train_acc": [], "test_acc": []}
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        batches = range(steps_per_epoch)
        bar = None
        if show_bar:
            bar = tqdm(batches, desc=f"epoch {epoch}/{args.epochs}", leave=False)
            batches = bar
        losses, accs = [], []
        for i in batches:
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            train_key, step_key = jr.split(train_key)
            model, opt_state, loss, acc = train_step(
                model, opt_state, optim, x_train[idx], y_train[idx], step_key
            )
            losses.append(float(loss))
            accs.append(float(acc))
            if bar is not None:
                bar.set_postfix(
                    loss=f"{np.mean(losses):.3f}", acc=f"{np.mean(accs):.3f}"
                )
        if bar is not None:
            bar.close()
        test_acc = accuracy(model, x_test, y_test)
        history["epoch"].append(epoch)
        history["loss"].append(float(np.mean(losses)))
        history["train_acc"].append(float(np.mean(accs)))
        history["test_acc"].append(test_acc)
        print(
            f"epoch {epoch:3d}  loss {np.mean(losses):.4f}  train acc "
            f"{np.mean(accs):.4f}  test acc {test_acc:.4f}  "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    elapsed = time.perf_counter() - start
    final = accuracy(model, x_test, y_test)
    print(f"final test accuracy: {final:.4f} ({len(x_test)} images, {elapsed:.0f} s)")

    os.makedirs(args.out, exist_ok=True)
    checkpoint = os.path.join(args.out, "model.eqx")
    eqx.tree_serialise_leaves(checkpoint, model)
    skeleton = make_model(args, jr.key(args.seed + 1))  # other weights, same shapes
    reloaded = eqx.tree_deserialise_leaves(checkpoint, skeleton)
    again = accuracy(reloaded, x_test, y_test)
    print(f"reloaded checkpoint {checkpoint}: test accuracy {again:.4f}")
    if again != final:
        raise SystemExit("the reloaded model does not reproduce the test accuracy")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[examples]')")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(history["epoch"], history["loss"])
    ax1.set(xlabel="epoch", ylabel="training loss", yscale="log")
    ax2.plot(history["epoch"], history["train_acc"], label="train")
    ax2.plot(history["epoch"], history["test_acc"], label="test")
    ax2.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1))
    ax2.legend()
    fig.suptitle("S5 on 8x8 digits read pixel by pixel (T=64)")
    fig.tight_layout()
    figure = os.path.join(args.out, "training_curves.png")
    fig.savefig(figure, dpi=100)
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
