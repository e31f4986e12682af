"""The chunked scan (SSD) and the Mamba-2 layer: against our Mamba (the read-out-fused
selective scan) at equal total state, against the paper's minimal SSD written in
JAX here (the quadratic einsum between chunks that ports ship), and the gradient's
cost against the forward, and a `Mamba2` layer on one device against the same
sequence split over two CPU devices (`eqx_seq.ShardedScan`).

float32, one sequence, jitted, samples interleaved round-robin, medians after
warm-up (compilation reported apart). Peak memory is XLA's buffer assignment of
the compiled gradient (`memory_analysis().temp_size_in_bytes`); per device for the split run (arguments,
outputs and temporaries, as `bench_sequence_parallel.py` reports them).

    python benchmarks/bench_ssd.py            # about 6 minutes on 2 CPU cores
    python benchmarks/bench_ssd.py --quick    # T = 1k and 4k, for a smoke test
"""

import argparse
import os
import sys

import jax


# two CPU devices for the split run, set before JAX starts its backend; the other
# programs run on the first
jax.config.update("jax_num_cpu_devices", 2)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402

import eqx_seq  # noqa: E402


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
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
from bench_sequence_parallel import compare, layer_programs as split_programs  # noqa: E402


# --- the anchor: the paper's minimal SSD (Dao & Gu 2024, listing 1), in JAX ---


def _segsum(x):
    """`out[..., i, j] = x[..., j+1] + ... + x[..., i]` for `i >= j`, else -inf."""
    n = x.shape[-1]
    c = jnp.cumsum(x, axis=-1)
    diff = c[..., :, None] - c[..., None, :]
    return jnp.where(jnp.tril(jnp.ones((n, n), bool)), diff, -jnp.inf)


def minimal_ssd(x, dt, A, B, C, chunk):
    """`y` of the SSD with one group, from zero: the intra-chunk products, the chunk
    states, and the states between chunks as one `(K + 1) x (K + 1)` decay matrix
    per head (quadratic in the number of chunks)."""
    T, H, P = x.shape
    K = T // chunk
    X = (x * dt[..., None]).reshape(K, chunk, H, P)
    Ad = (dt * A[None]).reshape(K, chunk, H).transpose(2, 0, 1)  # (H, K, Q)
    Bc = jnp.broadcast_to(B, (T, H, B.shape[-1])).reshape(K, chunk, H, -1)
    Cc = jnp.broadcast_to(C, (T, H, C.shape[-1])).reshape(K, chunk, H, -1)
    A_cum = jnp.cumsum(Ad, axis=-1)
    L = jnp.exp(_segsum(Ad))
    y_diag = jnp.einsum("clhn,cshn,hcls,cshp->clhp", Cc, Bc, L, X)
    decay_states = jnp.exp(A_cum[..., -1:] - A_cum)
    states = jnp.einsum("clhn,hcl,clhp->chpn", Bc, decay_states, X)
    states = jnp.concatenate([jnp.zeros_like(states[:1]), states])
    decay_chunk = jnp.exp(_segsum(jnp.pad(A_cum[..., -1], ((0, 0), (1, 0)))))
    states = jnp.einsum("hzc,chpn->zhpn", decay_chunk, states)[:-1]
    y_off = jnp.einsum("clhn,chpn,hcl->clhp", Cc, states, jnp.exp(A_cum))
    return (y_diag + y_off).reshape(T, H, P)


# --- the programs ---


def loss_of(y):
    return jnp.mean(y**2)


def scan_inputs(T, H, P, N, key):
    k = jr.split(key, 5)
    x = jr.normal(k[0], (T, H, P))
    dt = jax.nn.softplus(jr.normal(k[1], (T, H)) - 3)
    A = -jnp.exp(jr.normal(k[2], (H,)))
    B, C = jr.normal(k[3], (T, 1, N)), jr.normal(k[4], (T, 1, N))
    return x, dt, A, B, C


def scan_programs(T, H, P, N, chunks, key):
    """name -> (fn, args): ours at each chunk length, and the minimal SSD."""
    x, dt, A, B, C = scan_inputs(T, H, P, N, key)
    progs = {}
    for Q in chunks:
        f = lambda x, dt, B, C, Q=Q: eqx_seq.ssd_scan(x, dt, A, B, C, chunk_size=Q)
        progs[("ours", Q, "forward")] = (jax.jit(f), (x, dt, B, C))
        g = jax.grad(lambda *a, f=f: loss_of(f(*a)), range(4))
        progs[("ours", Q, "grad")] = (jax.jit(g), (x, dt, B, C))
        m = lambda x, dt, B, C, Q=Q: minimal_ssd(x, dt, A, B, C, Q)
        progs[("minimal SSD", Q, "forward")] = (jax.jit(m), (x, dt, B, C))
        gm = jax.grad(lambda *a, m=m: loss_of(m(*a)), range(4))
        progs[("minimal SSD", Q, "grad")] = (jax.jit(gm), (x, dt, B, C))
    return progs


def layer_programs(T, width, N, head_dim, chunk, key):
    """Mamba and Mamba2 at equal total state (`2 width` channels by `N` states),
    forward and gradient with respect to the parameters."""
    layers = {
        "Mamba (S6)": eqx_seq.Mamba(width, state_size=N, key=key),
        "Mamba2 (SSD)": eqx_seq.Mamba2(
            width, state_size=N, head_dim=head_dim, chunk_size=chunk, key=key
        ),
    }
    x = jr.normal(jr.key(1), (T, width))
    progs = {}
    for name, layer in layers.items():
        params, static = eqx.partition(layer, eqx.is_inexact_array)
        f = lambda p, x, static=static: eqx.combine(p, static)(x)
        progs[(name, "forward")] = (jax.jit(f), (params, x))
        g = jax.grad(lambda p, x, f=f: loss_of(f(p, x)))
        progs[(name, "grad")] = (jax.jit(g), (params, x))
    return progs


def mamba2_split_programs(T):
    """A `Mamba2` layer (16 features, heads of 16, 16 states) on one device and
    split over two: forward, and the gradient of a weighted sum of the outputs with
    respect to the parameters and the input."""
    make = lambda scan: eqx_seq.Mamba2(
        16, state_size=16, head_dim=16, scan=scan, dtype=jnp.float32, key=jr.key(0)
    )
    return split_programs(make, T, 16, 2, seed=5)


def temp_bytes(fn, args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


# --- the report ---


def tables(p):
    out = [
        f"Layers at equal total state: width {p['width']}, {2 * p['width']} channels "
        f"x N = {p['N']} states (Mamba2: heads of {p['head_dim']}, chunks of "
        f"{p['layer_chunk']}); forward and gradient with respect to the parameters.",
        "",
    ]
    rows = []
    for T, r in p["layers"].items():
        m1, m2 = r["Mamba (S6)"], r["Mamba2 (SSD)"]
        rows.append(
            [
                T,
                ms(m1["forward_ms"]),
                ms(m2["forward_ms"]),
                times(m1["forward_ms"] / m2["forward_ms"]),
                ms(m1["grad_ms"]),
                ms(m2["grad_ms"]),
                times(m1["grad_ms"] / m2["grad_ms"]),
                times(
                    (m1["forward_ms"] + m1["grad_ms"])
                    / (m2["forward_ms"] + m2["grad_ms"])
                ),
            ]
        )
    out += table(
        "T | Mamba fwd ms | Mamba2 fwd ms | fwd speed-up | Mamba grad ms | "
        "Mamba2 grad ms | grad speed-up | fwd + grad speed-up",
        rows,
    )
    H, P, N = p["scan"]["H"], p["scan"]["P"], p["scan"]["N"]
    out += [
        "",
        f"`ssd_scan` against the minimal SSD (H = {H}, P = {P}, N = {N}, one "
        "group), by chunk length; gradient of `mean(y**2)` with respect to "
        "`x, dt, B, C`; temp memory of the compiled gradient.",
        "",
    ]
    rows = []
    for T, by_chunk in p["scan"]["runs"].items():
        for Q, r in by_chunk.items():
            ours, anchor = r["ours"], r["minimal SSD"]
            rows.append(
                [
                    T,
                    Q,
                    ms(ours["forward_ms"]),
                    ms(ours["grad_ms"]),
                    f"{ours['grad_ms'] / ours['forward_ms']:.1f}",
                    ms(anchor["forward_ms"]),
                    ms(anchor["grad_ms"]),
                    times(
                        (anchor["forward_ms"] + anchor["grad_ms"])
                        / (ours["forward_ms"] + ours["grad_ms"])
                    ),
                    f"{ours['grad_temp_mib']:.0f} / {anchor['grad_temp_mib']:.0f}",
                ]
            )
    out += table(
        "T | chunk | ours fwd ms | ours grad ms | grad / fwd | minimal fwd ms | "
        "minimal grad ms | fwd + grad speed-up | grad temp MiB ours / minimal",
        rows,
    )
    if "split" in p:
        T, r = p["split"]["T"], p["split"]["runs"]
        out += [
            "",
            f"A `Mamba2` layer (16 features, heads of 16, 16 states), T = {T}: one "
            "device against the sequence split over two CPU devices "
            "(`ShardedScan` in `shard_map`, inputs already split); memory per device "
            "(arguments, outputs, temporaries).",
            "",
        ]
        rows = [
            [
                what,
                ms(r[what]["one device"]["median_ms"]),
                ms(r[what]["sharded"]["median_ms"]),
                times(r[what]["speed_up"]),
                f"{r[what]['mib_per_device']['one device']:.0f}",
                f"{r[what]['mib_per_device']['sharded']:.0f}",
            ]
            for what in ("forward", "grad")
        ]
        out += table(
            "program | one device ms | two devices ms | speed-up | MiB/device, one "
            "| MiB/device, two",
            rows,
        )
    return out


def headline(p):
    layer = [
        (r["Mamba (S6)"]["forward_ms"] + r["Mamba (S6)"]["grad_ms"])
        / (r["Mamba2 (SSD)"]["forward_ms"] + r["Mamba2 (SSD)"]["grad_ms"])
        for r in p["layers"].values()
    ]
    anchor = [
        (r["minimal SSD"]["forward_ms"] + r["minimal SSD"]["grad_ms"])
        / (r["ours"]["forward_ms"] + r["ours"]["grad_ms"])
        for by_chunk in p["scan"]["runs"].values()
        for r in by_chunk.values()
    ]
    line = (
        f"Mamba2 vs Mamba at equal state, forward + gradient: {span(layer)}; "
        f"`ssd_scan` vs the minimal SSD: {span(anchor)} (speed-up)"
    )
    if "split" in p:
        r = p["split"]["runs"]["grad"]
        line += f"; `Mamba2` gradient split over two devices: {times(r['speed_up'])}"
    return line


REPORTS = {"ssd": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--json",
        default=results_path("ssd"),
        help="default: results/<machine>/ssd.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    info = machine()
    print(f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
          f"jax {info['jax']}")  # fmt: skip
    print(allocator_line(info))
    width, N, head_dim, layer_chunk = 64, 16, 64, 64
    layer_lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    H, P, Ns = 2, 64, 16
    scan_lengths = [1024, 4096] if args.quick else [1024, 4096, 16384, 65536]
    chunks = [32, 64] if args.quick else [16, 32, 64, 128, 256]
    payload = {
        "machine": info, "width": width, "N": N, "head_dim": head_dim,
        "layer_chunk": layer_chunk, "layers": {},
        "scan": {"H": H, "P": P, "N": Ns, "runs": {}},
    }  # fmt: skip
    for T in layer_lengths:
        progs = layer_programs(T, width, N, head_dim, layer_chunk, jr.key(0))
        res = measure_many(progs, repeats=args.repeats, min_time=0.05)
        payload["layers"][T] = {
            name: {
                "forward_ms": res[(name, "forward")]["median_ms"],
                "grad_ms": res[(name, "grad")]["median_ms"],
                "first_call_s": res[(name, "grad")]["first_call_s"],
            }
            for name in ("Mamba (S6)", "Mamba2 (SSD)")
        }
        print(f"layers T={T} done", flush=True)
    for T in scan_lengths:
        progs = scan_programs(T, H, P, Ns, chunks, jr.key(0))
        res = measure_many(progs, repeats=args.repeats, min_time=0.05)
        payload["scan"]["runs"][T] = {
            Q: {
                name: {
                    "forward_ms": res[(name, Q, "forward")]["median_ms"],
                    "grad_ms": res[(name, Q, "grad")]["median_ms"],
                    "grad_temp_mib": temp_bytes(*progs[(name, Q, "grad")]) / 2**20,
                }
                for name in ("ours", "minimal SSD")
            }
            for Q in chunks
        }
        print(f"scan T={T} done", flush=True)
    T = 8192 if args.quick else 100_000
    title = f"Mamba2 (16 features), T = {T}, float32: 1 vs 2 devices"
    split = compare(title, mamba2_split_programs(T), args.repeats)
    payload["split"] = {"T": T, "runs": split}
    save(args.json, payload, REPORTS["ssd"])


if __name__ == "__main__":
    main()
