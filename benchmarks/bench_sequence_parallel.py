"""Sequence parallelism: one long sequence on one device against the same sequence
split over the devices along time (`eqx_seq.ShardedScan` in `jax.shard_map`).

float32, one sequence. In one interleaved run (`_timing.measure_many`) per workload:
the one-device program (the inner backend alone) and the sharded one, forward and
gradient (a sum of the states weighted by a fixed array, w.r.t. every input):

- `linear_recurrence`, T = 10^6, state 64, a time-varying decay and `h0`;
- an `S5` layer (8 features, 64 states), T = 2 * 10^5, gradient w.r.t. its
  parameters and the input;
- a `Mamba` layer (16 features), T = 10^5, the same;
- `KalmanFilter.log_likelihood` (state 4, 2 observations), T = 10^6, and its
  gradient w.r.t. every parameter: complete data (one device takes the
  steady-state shortcut) and one entry in 97 missing (every step exact). One
  device's gradient uses Fisher's identity, the split one plain autodiff.

"speed-up" is the one-device time over the sharded one. The recurrence streams its
inputs and states through memory, so the run first measures the ceiling: an
elementwise pass over 512 MiB (read and written) on one device and split over the
devices. "MiB/device" is XLA's
memory analysis of the compiled program (arguments, outputs and temporaries of one
device). With `--devices 8`, the recurrence on 1, 2, 4 and 8 forced CPU devices (on
a 2-core machine the devices share the cores: the column is how the exchange
scales, not a speed-up), with each of `ShardedScan`'s exchanges (`all_gather`,
`ppermute`): forward, gradient, the exchange alone (one step per device), and the
bytes each device receives per exchange (`D * 2|S|` numbers by the gather,
`ceil(log2 D) * 2|S|` by the ppermute scan).

    python benchmarks/bench_sequence_parallel.py               # 1 vs 2 devices
    python benchmarks/bench_sequence_parallel.py --devices 8   # the exchanges
    python benchmarks/bench_sequence_parallel.py --quick       # runs?
    python benchmarks/bench_sequence_parallel.py --devices 8 --quick
"""

import argparse
import math
import os
import sys


def _devices_from_argv() -> int:
    # the device count must be set before JAX starts its backend
    if "--devices" in sys.argv:
        return int(sys.argv[sys.argv.index("--devices") + 1])
    return 2


import jax  # noqa: E402


jax.config.update("jax_num_cpu_devices", _devices_from_argv())

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import eqx_seq  # noqa: E402


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    faster,
    machine,
    measure_many,
    ms,
    results_path,
    save,
    span,
    table,
    times,
    write_reports,
)


def _mib(fn, *args) -> float:
    m = fn.lower(*args).compile().memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return total / 2**20


def _put(mesh: Mesh, specs, arrays):
    return tuple(
        jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, specs)
    )


def recurrence_programs(T: int, S: int, num_devices: int, exchange: str = "all_gather"):
    """`(name -> (fn, args))` of the recurrence, one device and `num_devices`."""
    k = jr.split(jr.key(0), 4)
    a = jr.uniform(k[0], (T, S), jnp.float32, 0.9, 0.999)
    b = jr.normal(k[1], (T, S), jnp.float32)
    h0 = jr.normal(k[2], (S,), jnp.float32)
    w = jr.normal(k[3], (T, S), jnp.float32)
    inner = eqx_seq.SequentialScan()
    one = lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=inner)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("seq",))
    scan = eqx_seq.ShardedScan("seq", inner, exchange=exchange)
    sharded = jax.shard_map(
        lambda a, b, h0: eqx_seq.linear_recurrence(a, b, h0, scan=scan),
        mesh=mesh,
        in_specs=(P("seq"), P("seq"), P()),
        out_specs=P("seq"),
    )
    grad = lambda f, w: jax.grad(lambda *x: jnp.sum(f(*x) * w), argnums=(0, 1, 2))
    args = (a, b, h0)
    # the sharded programs get their inputs already split, as a pipeline would
    split = _put(mesh, (P("seq"), P("seq"), P(), P("seq")), (a, b, h0, w))
    return {
        "one device: forward": (jax.jit(one), args),
        "sharded: forward": (jax.jit(sharded), split[:3]),
        "one device: grad": (jax.jit(grad(one, w)), args),
        "sharded: grad": (jax.jit(grad(sharded, split[3])), split[:3]),
    }


def layer_programs(make, T: int, features: int, num_devices: int, seed: int):
    """A layer `make(scan)` on one sequence of `T` steps: forward, and the gradient
    of a weighted sum of its outputs w.r.t. its parameters and the input."""
    x = jr.normal(jr.key(seed), (T, features), jnp.float32)
    w = jr.normal(jr.key(seed + 1), (T, features), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("seq",))
    progs = {}
    for label, scan in (
        ("one device", eqx_seq.SequentialScan()),
        ("sharded", eqx_seq.ShardedScan("seq", eqx_seq.SequentialScan())),
    ):
        params, static = eqx.partition(make(scan), eqx.is_inexact_array)
        run = lambda p, x, static=static: eqx.combine(p, static)(x)
        args, w_ = (params, x), w
        if label == "sharded":
            run = jax.shard_map(
                run, mesh=mesh, in_specs=(P(), P("seq")), out_specs=P("seq")
            )
            *args, w_ = _put(mesh, (P(), P("seq"), P("seq")), (params, x, w))
        loss = lambda p, x, run=run, w=w_: jnp.sum(run(p, x) * w)
        progs[f"{label}: forward"] = (jax.jit(run), tuple(args))
        progs[f"{label}: grad"] = (jax.jit(jax.grad(loss, argnums=(0, 1))), tuple(args))
    return progs


def s5_programs(T: int, num_devices: int):
    """An `S5` layer (8 features, 64 states)."""
    make = lambda scan: eqx_seq.S5(8, 64, scan=scan, dtype=jnp.float32, key=jr.key(0))
    return layer_programs(make, T, 8, num_devices, seed=1)


def mamba_programs(T: int, num_devices: int):
    """A `Mamba` layer (16 features, 16 states per channel, expand 2)."""
    make = lambda scan: eqx_seq.Mamba(16, scan=scan, dtype=jnp.float32, key=jr.key(0))
    return layer_programs(make, T, 16, num_devices, seed=3)


def kalman_programs(T: int, num_devices: int, *, missing: bool):
    """`KalmanFilter.log_likelihood` (state 4, 2 observations) and its gradient
    with respect to every parameter; with `missing`, one entry in 97 is NaN, so
    that one device runs every step exactly (no steady state)."""
    kf = eqx_seq.KalmanFilter(
        4, 2, scan=eqx_seq.SequentialScan(), dtype=jnp.float32, key=jr.key(0)
    )
    ys = kf.sample(jr.key(1), T)[1]
    if missing:
        ys = ys.at[::97, 0].set(jnp.nan)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("seq",))
    progs = {}
    for label, scan in (
        ("one device", eqx_seq.SequentialScan()),
        ("sharded", eqx_seq.ShardedScan("seq", eqx_seq.SequentialScan())),
    ):
        params, static = eqx.partition(
            eqx.tree_at(lambda k: k.scan, kf, scan), eqx.is_inexact_array
        )
        ll = lambda p, ys, static=static: eqx.combine(p, static).log_likelihood(ys)
        args = (params, ys)
        if label == "sharded":
            ll = jax.shard_map(ll, mesh=mesh, in_specs=(P(), P("seq")), out_specs=P())
            args = _put(mesh, (P(), P("seq")), args)
        progs[f"{label}: forward"] = (jax.jit(ll), args)
        progs[f"{label}: grad"] = (jax.jit(jax.grad(ll)), args)
    return progs


def stream_ceiling(num_devices: int, repeats: int) -> dict:
    """An elementwise pass over 512 MiB, read and written: one device against the
    array split over `num_devices`. Bounds what splitting a memory-bound loop gains."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("seq",))
    x = jnp.ones((2 * 10**6, 64), jnp.float32)
    fn = lambda x: x * 1.5 + 1.0
    progs = {
        "one device": (jax.jit(fn), (x,)),
        "sharded": (
            jax.jit(
                jax.shard_map(fn, mesh=mesh, in_specs=P("seq"), out_specs=P("seq"))
            ),
            _put(mesh, (P("seq"),), (x,)),
        ),
    }
    res = measure_many(progs, repeats=repeats)
    gb = 2 * x.nbytes / 1e9
    rates = {k: gb / (r["median_ms"] / 1e3) for k, r in res.items()}
    speed_up = res["one device"]["median_ms"] / res["sharded"]["median_ms"]
    return {"runs": res, "gb_per_s": rates, "speed_up": speed_up}


def compare(title: str, progs: dict, repeats: int) -> dict:
    print(f"measuring: {title}")
    res = measure_many(progs, repeats=repeats)
    out = {}
    for what in ("forward", "grad"):
        one, shd = res[f"one device: {what}"], res[f"sharded: {what}"]
        mib = [
            _mib(progs[key][0], *progs[key][1])
            for key in (f"one device: {what}", f"sharded: {what}")
        ]
        speed_up = one["median_ms"] / shd["median_ms"]
        out[what] = {
            "one device": one,
            "sharded": shd,
            "speed_up": speed_up,
            "mib_per_device": {"one device": mib[0], "sharded": mib[1]},
        }
    return out


def scaling(T: int, S: int, repeats: int) -> dict:
    """The sharded recurrence on 1, 2, 4, ... devices (forced CPU devices), with
    each exchange: the forward pass, the gradient, and the exchange alone (the
    recurrence with one step per device, so that the blocks cost next to nothing)."""
    out = {}
    n = 1
    while n <= jax.device_count():
        for exchange in ("all_gather", "ppermute"):
            print(f"measuring: {n} devices, {exchange}")
            progs = recurrence_programs(T, S, n, exchange)
            progs = {k: v for k, v in progs.items() if k.startswith("sharded")}
            alone = recurrence_programs(n, S, n, exchange)["sharded: forward"]
            progs["exchange alone"] = alone
            res = measure_many(progs, repeats=repeats, min_time=0.05)
            # received per device, per exchange: all D maps (2 |S| each) by the
            # gather, one map per round by the ppermute scan; the gradient adds the
            # tangent's and the adjoint's exchanges and the boundary states passed
            # to a neighbour
            item = 4
            maps = n if exchange == "all_gather" else math.ceil(math.log2(n))
            fwd_bytes = maps * 2 * S * item
            grad_bytes = 3 * fwd_bytes + (2 * S * item if n > 1 else 0)
            f, g, e = (
                res[k] for k in ("sharded: forward", "sharded: grad", "exchange alone")
            )
            out[f"{n} {exchange}"] = {
                "forward": f,
                "grad": g,
                "exchange": e,
                "bytes_forward": fwd_bytes,
                "bytes_grad": grad_bytes,
            }
        n *= 2
    return out


# --- the reports: printed, and written beside the JSON -----------------------------
# the workloads' labels; a payload's "T" (absent from runs before it was recorded:
# the defaults) gives their lengths
_SP_WORK = {
    "recurrence": ("`linear_recurrence`, T = {}, state 64", 10**6),
    "s5": ("`S5`, T = {}", 200_000),
    "mamba": ("`Mamba` (16 features), T = {}", 100_000),
    "kalman": ("Kalman log-likelihood, state 4, T = {}", 10**6),
    "kalman_missing": ("the same, 1 entry in 97 missing", None),
}


def _power(T: int) -> str:
    """`10^6`, `2·10^5`, or the digits."""
    digits = str(T).rstrip("0")
    zeros = len(str(T)) - len(digits)
    if len(digits) > 1 or zeros < 3:
        return str(T)
    return f"10^{zeros}" if digits == "1" else f"{digits}·10^{zeros}"


def tables(p):
    """The markdown of a 1-against-2-devices payload: the ceiling, the workloads."""
    rows = []
    for work, (label, T) in _SP_WORK.items():
        label = label.format(_power(p.get("T", {}).get(work, T) or 0))
        for what, r in p.get(work, {}).items():
            mib = r["mib_per_device"]
            rows.append(
                [
                    label,
                    what,
                    ms(r["one device"]["median_ms"]),
                    ms(r["sharded"]["median_ms"]),
                    times(r["speed_up"]),
                    f"{mib['one device']:.0f}",
                    f"{mib['sharded']:.0f}",
                    times(mib["sharded"] / mib["one device"]),
                ]
            )
    out = [
        "float32, one sequence: one device against the same sequence split along "
        "time over two CPU devices (`ShardedScan` in `shard_map`, inputs already "
        "split); memory per device from XLA's analysis of the compiled program "
        "(arguments, outputs, temporaries).",
        "",
    ]
    if "stream" in p:
        rate = p["stream"]["gb_per_s"]
        out += [
            "The ceiling, an elementwise pass over 512 MiB (read and written): "
            f"{rate['one device']:.1f} GB/s on one device, {rate['sharded']:.1f} GB/s "
            f"on two, a speed-up of {times(p['stream']['speed_up'])}.",
            "",
        ]
    return out + table(
        "workload | program | one device ms | two devices ms | speed-up | "
        "MiB/device, one | MiB/device, two | memory, two / one",
        rows,
        left=2,
    )


def headline(p):
    runs = [r for work in _SP_WORK for r in p.get(work, {}).values()]
    if not runs:
        raise KeyError("no workloads")
    mem = [
        r["mib_per_device"]["sharded"] / r["mib_per_device"]["one device"] for r in runs
    ]
    return (
        f"two CPU devices against one: {faster([r['speed_up'] for r in runs])}, "
        f"{span(mem)} the memory per device"
    )


def scaling_tables(p):
    """The markdown of a `--devices` payload: the exchanges."""
    rows = [
        [
            *key.split(" "),
            ms(r["forward"]["median_ms"]),
            ms(r["grad"]["median_ms"]),
            f"{r['exchange']['median_ms']:.3f}",
            r["bytes_forward"],
        ]
        for key, r in p["scaling"].items()
    ]
    T, S = p.get("T", 10**6), p.get("state", 64)
    out = [
        f"`linear_recurrence` with `ShardedScan`, T = {_power(T)}, state {S}, float32, on "
        "forced CPU devices that share the machine's two cores (how the exchange "
        "scales, not a speed-up), with each `exchange`; 'exchange ms': the "
        "recurrence with one step per device (the exchange alone); bytes: what one "
        "device receives per exchange in the forward pass, from the collectives' "
        "shapes.",
        "",
    ]
    return out + table(
        "devices | exchange | forward ms | gradient ms | exchange ms | "
        "received bytes/device",
        rows,
        left=2,
    )


def scaling_headline(p):
    runs = p["scaling"]
    last = max({int(k.split(" ")[0]) for k in runs})
    one = runs["1 all_gather"]["forward"]["median_ms"]
    return (
        f"forward {ms(one)} ms on 1 device, on {last}: "
        f"{ms(runs[f'{last} all_gather']['forward']['median_ms'])} ms (all_gather), "
        f"{ms(runs[f'{last} ppermute']['forward']['median_ms'])} ms (ppermute)"
    )


SCALING = "sequence_parallel_scaling"
REPORTS = {
    "sequence_parallel": (headline, tables),
    SCALING: (scaling_headline, scaling_tables),
}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="default: results/<machine>/...json")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short sequences (with --devices 8, and one repeat), to check that "
        "it runs (JSON only to --json)",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), jax {info['jax']}, "
        f"{jax.device_count()} CPU devices"
    )
    print(allocator_line(info))
    if args.devices != 2:
        # --quick: short, one repeat; recorded results are not overwritten
        T, S, repeats = (4096, 8, 1) if args.quick else (10**6, 64, args.repeats)
        payload = {"machine": info, "T": T, "state": S}
        payload["scaling"] = scaling(T, S, repeats)
        path = args.json or (None if args.quick else results_path(SCALING))
        save(path, payload, REPORTS[SCALING])
        return
    # --quick: short sequences, to check that the script runs
    size = (lambda n: max(n // 1000, 512)) if args.quick else (lambda n: n)
    payload = {"machine": info, "stream": stream_ceiling(2, args.repeats)}
    payload["T"] = {k: size(T) for k, (_, T) in _SP_WORK.items() if T}
    workloads = {
        "recurrence": (
            f"linear_recurrence, T = {size(10**6)}, state 64",
            recurrence_programs(size(10**6), 64, 2),
        ),
        "s5": (
            f"S5 (8 features, 64 states), T = {size(200_000)}",
            s5_programs(size(200_000), 2),
        ),
        "mamba": (
            f"Mamba (16 features, 16 states, expand 2), T = {size(100_000)}",
            mamba_programs(size(100_000), 2),
        ),
        "kalman": (
            f"Kalman log-likelihood (state 4, 2 obs), T = {size(10**6)}",
            kalman_programs(size(10**6), 2, missing=False),
        ),
        "kalman_missing": (
            f"Kalman log-likelihood (state 4, 2 obs, 1 entry in 97 missing), "
            f"T = {size(10**6)}",
            kalman_programs(size(10**6), 2, missing=True),
        ),
    }
    for key, (title, progs) in workloads.items():
        payload[key] = compare(f"{title}, float32: 1 vs 2 devices", progs, args.repeats)
    # recorded results are not overwritten by --quick
    path = args.json or (None if args.quick else results_path("sequence_parallel"))
    save(path, payload, REPORTS["sequence_parallel"])


if __name__ == "__main__":
    main()
