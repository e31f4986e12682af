"""MNIST-1D: sequence classifiers against the benchmark's published baselines.

Each mixer of `--mixers` trains an `eqx_seq.SequenceClassifier` on MNIST-1D
(Greydanus & Kobak, 2024; sequences of length 40, built locally by the `mnist1d`
package), with augmentation in the spirit of how the data were made; the test
accuracies are printed beside the published baselines and the training curves
drawn. docs/examples/train_mnist1d.md walks through it.

    python examples/train_mnist1d.py
    python examples/train_mnist1d.py --mixers mamba --epochs 40
    python examples/train_mnist1d.py --validation 500
"""

# --8<-- [start:setup]
import argparse
import os
import time


MIXERS = ("s5", "lru", "rglru", "mamba")
SEED, BATCH = 0, 64
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument(
    "--mixers", default="s5,lru,rglru", help=f"a comma list of {MIXERS}"
)
parser.add_argument("--epochs", type=int, default=100)
parser.add_argument(
    "--validation",
    type=int,
    default=0,
    help="hold out this many training sequences and report accuracy on them "
    "(for tuning; the test set is only reported)",
)
parser.add_argument("--devices", type=int, default=1, help="CPU devices per batch")
parser.add_argument("--out", default=os.path.join("outputs", "train_mnist1d"))
args = parser.parse_args()
mixers = args.mixers.split(",")
if not set(mixers) <= set(MIXERS):
    parser.error(f"unknown mixer in --mixers {args.mixers!r}; choose from {MIXERS}")
if BATCH % args.devices:
    parser.error(f"--devices must divide the batch of {BATCH}")

import jax


if args.devices > 1:  # JAX fixes its CPU devices when it starts: before any array
    jax.config.update("jax_num_cpu_devices", args.devices)

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import matplotlib


matplotlib.use("Agg")  # files only, no window
import matplotlib.pyplot as plt
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P
from mnist1d.data import get_dataset_args, make_dataset

import eqx_seq


# the mnist1d README's test accuracies
BASELINES = {
    "logistic regression": 0.32,
    "MLP": 0.68,
    "GRU": 0.91,
    "CNN": 0.94,
    "human": 0.96,
}
# --8<-- [end:setup]

# --8<-- [start:data]
data = make_dataset(get_dataset_args())  # built from the templates: no download
x_train, y_train = data["x"].astype(np.float32)[..., None], data["y"].astype(np.int32)
x_test = data["x_test"].astype(np.float32)[..., None]
y_test = data["y_test"].astype(np.int32)
val = None
if args.validation:
    order = np.random.default_rng(SEED).permutation(len(x_train))
    held, kept = order[: args.validation], order[args.validation :]
    val = (x_train[held], y_train[held])
    x_train, y_train = x_train[kept], y_train[kept]
print(
    f"mnist1d: {len(x_train)} training, {args.validation} validation and "
    f"{len(x_test)} test sequences of T={x_train.shape[1]}; batches split over "
    f"{args.devices} {jax.default_backend()} device(s); mixers {', '.join(mixers)}"
)

SHIFT, SCALE, SHEAR, NOISE = 2, 0.2, 0.3, 0.05


def augment(x, key):
    """A random circular shift, scaling, shear and noise of one sequence `(T, 1)`:
    the kinds of change that made the data set from its templates."""
    k_shift, k_scale, k_shear, k_noise = jr.split(key, 4)
    x = jnp.roll(x, jr.randint(k_shift, (), -SHIFT, SHIFT + 1), axis=0)  # circular
    x = x * (1 + SCALE * jr.uniform(k_scale, minval=-1, maxval=1))
    ramp = jnp.linspace(-0.5, 0.5, x.shape[0], dtype=x.dtype)[:, None]
    x = x + SHEAR * jr.uniform(k_shear, minval=-1, maxval=1) * ramp
    return x + NOISE * jr.normal(k_noise, x.shape)


# --8<-- [end:data]


# --8<-- [start:model]
def make_model(mixer, key):
    # Hawk blocks have a state as wide as the model and no dropout. A Mamba layer
    # holds `state_size` states for each of its channels, so it runs smaller.
    block = {"state_size": 8 if mixer == "mamba" else 32, "dropout": 0.1}
    return eqx_seq.SequenceClassifier(
        1,
        10,
        width=32 if mixer == "mamba" else 64,
        depth=4,
        mixer=mixer,
        ssm_blocks=1,
        # the selective layers are causal; S5 and LRU read both ways
        bidirectional=mixer in ("s5", "lru"),
        pooling="mean",
        key=key,
        **({} if mixer == "rglru" else block),
    )


# --8<-- [end:model]


# --8<-- [start:training]
def logits_of(params, static, x, keys):
    model = eqx.combine(params, static)

    def one(x, key):
        k_aug, k_drop = jr.split(key)
        return model(augment(x, k_aug), key=k_drop)

    return jax.vmap(one)(x, keys)


if args.devices > 1:  # each device runs its share of the batch
    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("batch",))
    one_device = logits_of

    def logits_of(params, static, x, keys):
        # the static part (Python flags, no arrays) is closed over, not sharded
        return jax.shard_map(
            lambda params, x, keys: one_device(params, static, x, keys),
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


@eqx.filter_jit
def predict(model, x):
    return jnp.argmax(jax.vmap(eqx.nn.inference_mode(model))(x), -1)


def accuracy(model, x, y):
    return float(np.mean(np.asarray(predict(model, x)) == y))


def train(mixer):
    model_key, train_key = jr.split(jr.key(SEED))
    model = make_model(mixer, model_key)
    steps_per_epoch = len(x_train) // BATCH
    total = args.epochs * steps_per_epoch

    def schedule(peak):
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, min(total // 10 + 1, total), total, end_value=peak * 1e-2
        )

    # the S5 recipe: the SSM parameters slower, without weight decay
    optim = eqx_seq.s5_optimizer(
        schedule(4e-3), ssm_learning_rate=schedule(2e-3), weight_decay=0.05
    )
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    history = {"loss": [], "test_acc": []}
    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        losses, accs = [], []
        for i in range(steps_per_epoch):
            idx = order[i * BATCH : (i + 1) * BATCH]
            train_key, step_key = jr.split(train_key)
            model, opt_state, loss, acc = train_step(
                model, opt_state, optim, x_train[idx], y_train[idx], step_key
            )
            losses.append(float(loss))
            accs.append(float(acc))
        history["loss"].append(np.mean(losses))
        history["test_acc"].append(accuracy(model, x_test, y_test))
        line = f"{mixer:6s} epoch {epoch:3d}  loss {np.mean(losses):.4f}  "
        line += f"train acc {np.mean(accs):.4f}  "
        if val is not None:
            line += f"val acc {accuracy(model, *val):.4f}  "
        line += f"test acc {history['test_acc'][-1]:.4f}  "
        print(line + f"({time.perf_counter() - start:.0f} s)", flush=True)
    history["time"] = time.perf_counter() - start
    return model, history


# --8<-- [end:training]

# --8<-- [start:result]
os.makedirs(args.out, exist_ok=True)
rows = [(f"{name} (published)", acc, "", "") for name, acc in BASELINES.items()]
histories = {}
for mixer in mixers:
    model, h = train(mixer)
    eqx.tree_serialise_leaves(os.path.join(args.out, f"{mixer}.eqx"), model)
    params = sum(
        x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    )
    rows.append(
        (f"{mixer} (ours)", h["test_acc"][-1], f"{params:,}", f"{h['time']:.0f} s")
    )
    histories[mixer] = h

print(f"\n{'model':32s} {'test acc':>8s} {'params':>8s} {'train time':>10s}")
for name, acc, params, elapsed in sorted(rows, key=lambda row: row[1]):
    print(f"{name:32s} {acc:8.3f} {params:>8s} {elapsed:>10s}".rstrip())
best = max(histories, key=lambda m: histories[m]["test_acc"][-1])
print(f"best mixer: {best}, test accuracy {histories[best]['test_acc'][-1]:.4f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
for mixer, h in histories.items():
    epochs = range(1, len(h["loss"]) + 1)
    (line,) = ax1.plot(epochs, h["loss"], label=mixer)
    ax2.plot(epochs, h["test_acc"], color=line.get_color(), label=mixer)
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
# --8<-- [end:result]
