"""MNIST-1D: sequence classifiers against the benchmark's published baselines.

MNIST-1D (Greydanus & Kobak, 2024; PyPI `mnist1d`) turns ten 1-D digit templates
into 5000 sequences of length 40 (random padding, dilation, scaling, circular
translation, correlated noise, shear): 4000 to train on, 1000 to test. The data are
built here with `mnist1d.data.make_dataset` (nothing downloaded). Each mixer of
`--mixers` trains an `eqx_seq.SequenceClassifier` (linear encoder, bidirectional
blocks, mean pooling, linear head) with the S5 recipe (`eqx_seq.s5_optimizer`),
with augmentation in the spirit of how the data were made: a random circular
shift, scaling, shear and noise of each training sequence. The script prints one
line per epoch, then the test accuracy of each mixer beside the published
baselines, and draws the training curves.

    python examples/train_mnist1d.py                     # a few minutes per mixer
    python examples/train_mnist1d.py --mixers s5         # one mixer
    python examples/train_mnist1d.py --validation 500    # tune on held-out train data
"""

import argparse
import os
import sys


# the mixers trained by default (`--mixers`); Mamba at these sizes takes hours on
# a CPU, so it is run on its own at a smaller size (see the docs page)
DEFAULT_MIXERS = "s5,lru,rglru"
MIXERS = ("s5", "lru", "rglru", "mamba")
# the mnist1d README's test accuracies
BASELINES = {
    "logistic regression": 0.32,
    "MLP": 0.68,
    "GRU": 0.91,
    "CNN": 0.94,
    "human": 0.96,
}


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mixers",
        default=DEFAULT_MIXERS,
        help=f"comma-separated, from {', '.join(MIXERS)}",
    )
    parser.add_argument(
        "--mixer", choices=MIXERS, default=None, help="one mixer (overrides --mixers)"
    )
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--state-size", type=int, default=32)
    parser.add_argument("--ssm-blocks", type=int, default=1)
    parser.add_argument(
        "--causal",
        action="store_true",
        help="causal S5/LRU blocks (default bidirectional; rglru and mamba are causal)",
    )
    parser.add_argument("--pooling", choices=["mean", "last"], default="mean")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=4e-3, help="regular parameters")
    parser.add_argument("--ssm-lr", type=float, default=2e-3, help="SSM parameters")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument(
        "--shift", type=int, default=2, help="largest random circular shift (steps)"
    )
    parser.add_argument(
        "--scale", type=float, default=0.2, help="random scaling by 1 ± this"
    )
    parser.add_argument(
        "--shear", type=float, default=0.3, help="largest added ramp, end to end"
    )
    parser.add_argument(
        "--noise", type=float, default=0.05, help="std of added white noise"
    )
    parser.add_argument(
        "--no-augment", action="store_true", help="train on the sequences as they are"
    )
    parser.add_argument(
        "--validation",
        type=int,
        default=0,
        help="hold out this many training sequences and report accuracy on them "
        "(for tuning; the test set is only reported)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="CPU devices to split each batch over (jax_num_cpu_devices)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--limit", type=int, default=None, help="use only this many training sequences"
    )
    parser.add_argument(
        "--out", default=os.path.join("outputs", "train_mnist1d"), help="output folder"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar, even on a terminal"
    )
    args = parser.parse_args()
    args.mixers = [args.mixer] if args.mixer else args.mixers.split(",")
    for mixer in args.mixers:
        if mixer not in MIXERS:
            parser.error(f"unknown mixer {mixer!r} in --mixers (from {MIXERS})")
    return args


args = parse_args()
# JAX reads the number of CPU devices when it starts: set it before any use of jax
import jax


if args.devices > 1:
    jax.config.update("jax_num_cpu_devices", args.devices)

import time

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


def load_data(validation: int, seed: int):
    # built locally from the package's templates; `get_dataset` would download
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())
    x, y = data["x"].astype(np.float32)[..., None], data["y"].astype(np.int32)
    x_test = data["x_test"].astype(np.float32)[..., None]
    y_test = data["y_test"].astype(np.int32)
    if validation:
        order = np.random.default_rng(seed).permutation(len(x))
        val, train = order[:validation], order[validation:]
        return (x[train], y[train]), (x[val], y[val]), (x_test, y_test)
    return (x, y), None, (x_test, y_test)


def augment(x, key, args):
    """A random circular shift, scaling, shear and noise of one sequence `(T, 1)`:
    the kinds of change that made the data set from its templates."""
    if args.no_augment:
        return x
    k_shift, k_scale, k_shear, k_noise = jr.split(key, 4)
    # the data's translation is circular
    x = jnp.roll(x, jr.randint(k_shift, (), -args.shift, args.shift + 1), axis=0)
    x = x * (1 + args.scale * jr.uniform(k_scale, minval=-1, maxval=1))
    ramp = jnp.linspace(-0.5, 0.5, x.shape[0], dtype=x.dtype)[:, None]
    x = x + args.shear * jr.uniform(k_shear, minval=-1, maxval=1) * ramp
    return x + args.noise * jr.normal(k_noise, x.shape)


def make_model(mixer, args, key):
    # Hawk blocks have a state as wide as the model and no dropout
    block = {} if mixer == "rglru" else {"state_size": args.state_size}
    if mixer != "rglru":
        block["dropout"] = args.dropout
    return eqx_seq.SequenceClassifier(
        1,
        10,
        width=args.width,
        depth=args.depth,
        mixer=mixer,
        ssm_blocks=args.ssm_blocks,
        # the selective layers are causal
        bidirectional=not args.causal and mixer in ("s5", "lru"),
        pooling=args.pooling,
        key=key,
        **block,
    )


def make_train_step(mesh, args):
    """A JIT'd training step; with a mesh, each device runs its share of the batch."""

    def logits_of(params, static, x, keys):
        model = eqx.combine(params, static)

        def one(x, key):
            k_aug, k_drop = jr.split(key)
            return model(augment(x, k_aug, args), key=k_drop)

        return jax.vmap(one)(x, keys)

    if mesh is not None:
        per_device = logits_of

        def logits_of(params, static, x, keys):
            # the static part (Python flags, no arrays) is closed over, not sharded
            return jax.shard_map(
                lambda params, x, keys: per_device(params, static, x, keys),
                mesh=mesh,
                in_specs=(P(), P("batch"), P("batch")),
                out_specs=P("batch"),
            )(params, x, keys)

    def loss_fn(params, static, x, y, key):
        logits = logits_of(params, static, x, jr.split(key, len(x)))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y)

    @eqx.filter_jit
    def train_step(model, opt_state, optim, x, y, key):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        # the gradient outside the shard_map: JAX sums a shared parameter's over devices
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, static, x, y, key
        )
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss, acc

    return train_step


@eqx.filter_jit
def predict(model, x):
    return jnp.argmax(jax.vmap(eqx.nn.inference_mode(model))(x), -1)


def accuracy(model, x, y, batch=500):
    hits = sum(
        int(jnp.sum(predict(model, x[i : i + batch]) == y[i : i + batch]))
        for i in range(0, len(x), batch)
    )
    return hits / len(x)


def train(mixer, args, data, train_step, show_bar):
    (x_train, y_train), val, (x_test, y_test) = data
    model_key, train_key = jr.split(jr.key(args.seed))
    model = make_model(mixer, args, model_key)
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
    history = {"epoch": [], "loss": [], "train_acc": [], "val_acc": [], "test_acc": []}
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        batches = range(steps_per_epoch)
        bar = None
        if show_bar:
            from tqdm import tqdm

            bar = tqdm(batches, desc=f"{mixer} {epoch}/{args.epochs}", leave=False)
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
        line = (
            f"{mixer:6s} epoch {epoch:3d}  loss {np.mean(losses):.4f}  train acc "
            f"{np.mean(accs):.4f}  "
        )
        if val is not None:
            history["val_acc"].append(accuracy(model, *val))
            line += f"val acc {history['val_acc'][-1]:.4f}  "
        print(
            line + f"test acc {test_acc:.4f}  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    history["time"] = time.perf_counter() - start
    history["params"] = sum(
        x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    )
    history["final"] = accuracy(model, x_test, y_test)
    return model, history


def main():
    data = load_data(args.validation, args.seed)
    if args.limit:
        data = ((data[0][0][: args.limit], data[0][1][: args.limit]), *data[1:])
    (x_train, _), val, (x_test, _) = data
    mesh = None
    if args.devices > 1:
        if args.batch_size % args.devices:
            raise SystemExit("--batch-size must be a multiple of --devices")
        mesh = Mesh(np.array(jax.devices()[: args.devices]), ("batch",))
    print(
        f"mnist1d: {len(x_train)} training, {0 if val is None else len(val[0])} "
        f"validation and {len(x_test)} test sequences of T={x_train.shape[1]}; "
        f"{len(jax.devices())} {jax.default_backend()} device(s), batch split over "
        f"{args.devices}; mixers {', '.join(args.mixers)}"
    )
    try:
        import tqdm  # noqa: F401
    except ImportError:  # the examples extra brings tqdm; run without a bar if absent
        tqdm = None
    # a bar only on a terminal: in a log file the redraws pile up, and the line per
    # epoch says what a log needs
    show_bar = tqdm is not None and not args.no_progress and sys.stderr.isatty()
    train_step = make_train_step(mesh, args)

    histories = {}
    os.makedirs(args.out, exist_ok=True)
    for mixer in args.mixers:
        model, histories[mixer] = train(mixer, args, data, train_step, show_bar)
        eqx.tree_serialise_leaves(os.path.join(args.out, f"{mixer}.eqx"), model)

    rows = [(f"{name} (published)", acc, "", "") for name, acc in BASELINES.items()]
    rows += [
        (
            f"{mixer} (ours)",
            h["final"],
            f"{h['params']:,}",
            f"{h['time']:.0f} s",
        )
        for mixer, h in histories.items()
    ]
    rows.sort(key=lambda row: row[1])
    print(f"\n{'model':32s} {'test acc':>8s} {'params':>8s} {'train time':>10s}")
    for name, acc, params, elapsed in rows:
        print(f"{name:32s} {acc:8.3f} {params:>8s} {elapsed:>10s}".rstrip())
    best = max(histories, key=lambda m: histories[m]["final"])
    print(f"best mixer: {best}, test accuracy {histories[best]['final']:.4f}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[examples]')")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mixer, h in histories.items():
        (line,) = ax1.plot(h["epoch"], h["loss"], label=mixer)
        ax2.plot(h["epoch"], h["test_acc"], color=line.get_color(), label=mixer)
    for name in ("GRU", "CNN", "human"):
        ax2.axhline(BASELINES[name], color="gray", lw=0.8, ls=":")
        ax2.annotate(name, (1, BASELINES[name]), fontsize=8, color="gray")
    ax1.set(xlabel="epoch", ylabel="training loss (augmented)", yscale="log")
    ax2.set(xlabel="epoch", ylabel="test accuracy", ylim=(0.5, 1))
    ax1.legend()
    ax2.legend(loc="lower right")
    fig.suptitle("MNIST-1D (T=40): sequence classifiers beside the published baselines")
    fig.tight_layout()
    figure = os.path.join(args.out, "mnist1d_curves.png")
    fig.savefig(figure, dpi=100)
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
