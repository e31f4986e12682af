"""Sequential digit classification: an S5 classifier reads 8x8 digits pixel by pixel.

An `eqx_seq.SequenceClassifier` learns scikit-learn's handwritten digits from their
64 pixels read in raster order, with the S5 recipe (`eqx_seq.s5_optimizer`); the
test accuracy is printed, the model saved, reloaded and evaluated again, and the
training curves drawn. docs/examples/train_digits.md walks through it.

    python examples/train_digits.py
    python examples/train_digits.py --mixer lru
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
from sklearn.datasets import load_digits

import eqx_seq


parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--mixer", choices=["s5", "lru"], default="s5")
parser.add_argument("--limit", type=int, help="use only this many training images")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=os.path.join("outputs", "train_digits"))
args = parser.parse_args()
BATCH = 32
# --8<-- [end:setup]

# --8<-- [start:data]
digits = load_digits()
x = digits.images.reshape(-1, 64, 1).astype(np.float32) / 16.0  # (N, T=64, 1)
y = digits.target.astype(np.int32)
order = np.random.default_rng(args.seed).permutation(len(x))
n_test = round(0.2 * len(x))
test, train = order[:n_test], order[n_test:]
x = (x - x[train].mean()) / x[train].std()  # the training set's statistics
x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
if args.limit:
    x_train, y_train = x_train[: args.limit], y_train[: args.limit]
print(
    f"digits: {len(x_train)} training and {len(x_test)} test sequences of "
    f"T={x_train.shape[1]} pixels; on {jax.default_backend()}, "
    f"{eqx_seq.AutoScan().select()!r}"
)
# --8<-- [end:data]


# --8<-- [start:model]
def make_model(key):
    return eqx_seq.SequenceClassifier(
        1,  # one input channel: the pixel's intensity
        10,  # ten classes
        width=64,
        depth=3,
        state_size=64,
        ssm_blocks=4,  # the 64 states in 4 HiPPO blocks
        mixer=args.mixer,
        pooling="mean",
        dropout=0.1,
        key=key,
    )


model_key, train_key = jr.split(jr.key(args.seed))
model = make_model(model_key)
# --8<-- [end:model]

# --8<-- [start:training]
steps_per_epoch = max(1, len(x_train) // BATCH)
total = args.epochs * steps_per_epoch


def schedule(peak):
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, min(total // 10 + 1, total), total, end_value=peak * 1e-2
    )


# the SSM parameters at their own learning rate, without weight decay
optim = eqx_seq.s5_optimizer(
    schedule(4e-3), ssm_learning_rate=schedule(2e-3), weight_decay=0.05
)
opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))


def cross_entropy(model, x, y, key):
    logits = jax.vmap(lambda x, k: model(x, key=k))(x, jr.split(key, len(x)))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == y)


@eqx.filter_jit
def train_step(model, opt_state, x, y, key):
    (loss, acc), grads = eqx.filter_value_and_grad(cross_entropy, has_aux=True)(
        model, x, y, key
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optim.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss, acc


@eqx.filter_jit
def predict(model, x):
    return jnp.argmax(jax.vmap(eqx.nn.inference_mode(model))(x), -1)


def accuracy(model, x, y):
    return float(np.mean(np.asarray(predict(model, x)) == y))


history = {"loss": [], "train_acc": [], "test_acc": []}
rng = np.random.default_rng(args.seed)
start = time.perf_counter()
for epoch in range(1, args.epochs + 1):
    order = rng.permutation(len(x_train))
    losses, accs = [], []
    for i in range(steps_per_epoch):
        idx = order[i * BATCH : (i + 1) * BATCH]
        train_key, step_key = jr.split(train_key)
        model, opt_state, loss, acc = train_step(
            model, opt_state, x_train[idx], y_train[idx], step_key
        )
        losses.append(float(loss))
        accs.append(float(acc))
    history["loss"].append(np.mean(losses))
    history["train_acc"].append(np.mean(accs))
    history["test_acc"].append(accuracy(model, x_test, y_test))
    print(
        f"epoch {epoch:3d}  loss {np.mean(losses):.4f}  train acc {np.mean(accs):.4f}"
        f"  test acc {history['test_acc'][-1]:.4f}  "
        f"({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
# --8<-- [end:training]

# --8<-- [start:result]
elapsed = time.perf_counter() - start
final = accuracy(model, x_test, y_test)
print(f"final test accuracy: {final:.4f} ({len(x_test)} images, {elapsed:.0f} s)")

os.makedirs(args.out, exist_ok=True)
checkpoint = os.path.join(args.out, "model.eqx")
eqx.tree_serialise_leaves(checkpoint, model)
# a model of the same shapes (other weights) to load into
reloaded = eqx.tree_deserialise_leaves(checkpoint, make_model(jr.key(args.seed + 1)))
again = accuracy(reloaded, x_test, y_test)
print(f"reloaded checkpoint {checkpoint}: test accuracy {again:.4f}")
if again != final:
    raise SystemExit("the reloaded model does not reproduce the test accuracy")

epochs = range(1, args.epochs + 1)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
ax1.plot(epochs, history["loss"])
ax1.set(xlabel="epoch", ylabel="training loss", yscale="log")
ax2.plot(epochs, history["train_acc"], label="train")
ax2.plot(epochs, history["test_acc"], label="test")
ax2.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1))
ax2.legend()
fig.suptitle("S5 on 8x8 digits read pixel by pixel (T=64)")
fig.tight_layout()
figure = os.path.join(args.out, "training_curves.png")
fig.savefig(figure, dpi=100)
print(f"wrote {figure}")
# --8<-- [end:result]
