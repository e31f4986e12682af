"""The S5 layer: forward, gradient, memory and parameter Jacobians vs a plain S5.

The anchor is S5 written as in the reference implementation (lindermanlab/S5,
`s5/ssm.py`): zero-order hold, the decay broadcast to `(T, P)`, `B̄ u` by a complex
matmul, `lax.associative_scan` with the operator `(a_j a_i, a_j b_i + b_j)`, output
`2 Re(C̃ x) + D u`, and gradients by plain autodiff through all of it. It is written
here, independently of eqx_seq, and run on the *same parameters* as our layer (the
script checks that both give the same outputs before timing).

Setting of the issue: H=128 features, state_size 64 (`conj_sym`: 32 complex states,
as the reference's P=64), batch 8 by `jax.vmap`, float32, T in {1k, 4k, 16k}. Loss:
the mean square of the outputs. Peak memory: `temp_size_in_bytes` (plus argument and
output bytes) of the compiled program (`jax.jit(f).lower(...).compile()
.memory_analysis()`). Medians of interleaved repeats after a warm-up, with
`block_until_ready`; ratios against anchors measured in the same run.

    python benchmarks/bench_s5.py            # full run
    python benchmarks/bench_s5.py --quick    # T=256 only, for a smoke test
"""

import argparse
import os
import sys
import time

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr

import eqx_seq


sys.path.insert(0, os.path.dirname(__file__))
from _timing import (  # noqa: E402
    allocator_line,
    div,
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


# --- the anchor: S5 as the reference implementation writes it --------------------
def plain_s5(params, u):
    """y for one sequence u (T, H); params = (lambda_re, lambda_im, log_step, B, C, D)."""
    lambda_re, lambda_im, log_step, B, C, D = params
    lam = lambda_re + 1j * lambda_im
    step = jnp.exp(log_step)
    lam_bar = jnp.exp(lam * step)
    B_bar = ((lam_bar - 1) / lam)[:, None] * (B[..., 0] + 1j * B[..., 1])
    C_tilde = C[..., 0] + 1j * C[..., 1]
    elements = lam_bar * jnp.ones((u.shape[0], lam_bar.shape[0]), lam_bar.dtype)
    bu = jax.vmap(lambda u_t: B_bar @ u_t.astype(B_bar.dtype))(u)
    op = lambda x, y: (y[0] * x[0], y[0] * x[1] + y[1])
    _, xs = lax.associative_scan(op, (elements, bu))
    y = jax.vmap(lambda x: 2 * (C_tilde @ x).real)(xs)
    return y + D * u, xs


def layer_params(layer):
    return (layer.lambda_re, layer.lambda_im, layer.log_step, layer.B, layer.C, layer.D)


def with_params(layer, params):
    return eqx.tree_at(layer_params, layer, params)


def loss_of(y):
    return jnp.mean(y**2)


def compiled(fn, args):
    """`(compiled program, compile seconds, peak MiB)`; peak = temporaries + arguments
    + output of the compiled program, from XLA's memory analysis."""
    start = time.perf_counter()
    program = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    m = program.memory_analysis()
    peak = float("nan")
    if m is not None:
        peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    return program, seconds, peak / 2**20


def measure(progs, repeats, slow=()):
    """Compile each program once (timed), then time the compiled programs."""
    stats = {name: compiled(fn, args) for name, (fn, args) in progs.items()}
    res = measure_many(
        {name: (stats[name][0], progs[name][1]) for name in progs},
        repeats=repeats,
        slow=slow,
    )
    for name, (_, seconds, peak) in stats.items():
        res[name].update(compile_s=seconds, peak_mb=peak)
    return res


def programs(T, H, P, batch, key):
    """`({name: (fn, args)}, check)` for one length; `check()` compares outputs."""
    lkey, ukey = jr.split(key)
    us = jr.normal(ukey, (batch, T, H), jnp.float32)
    out = {}
    base = eqx_seq.S5(H, P, blocks=4, key=lkey)
    params = layer_params(base)

    def plain_forward(params, us):
        return jax.vmap(lambda u: plain_s5(params, u)[0])(us)

    def plain_loss(params, us):
        return loss_of(plain_forward(params, us))

    out["plain S5: forward"] = (plain_forward, (params, us))
    out["plain S5: grad"] = (jax.grad(plain_loss), (params, us))

    for name, scan in [
        ("sequential", eqx_seq.SequentialScan()),
        ("associative", eqx_seq.AssociativeScan()),
    ]:
        layer = eqx.tree_at(lambda l: l.scan, base, scan)

        def forward(params, us, layer=layer):
            return jax.vmap(with_params(layer, params))(us)

        def loss(params, us, layer=layer):
            # `layer` passed on: a bare `forward(params, us)` would find the loop's
            # last `forward` when called, and time the associative layer's gradient
            # in the "sequential" row (as every run before 2026-11-22 did)
            return loss_of(forward(params, us, layer))

        out[f"{name}: forward"] = (forward, (params, us))
        out[f"{name}: grad"] = (jax.grad(loss), (params, us))

    def check():  # after the timings, so that compile times are first compiles
        reference = jax.jit(plain_forward)(params, us)
        for name in ["sequential", "associative"]:
            fn, args = out[f"{name}: forward"]
            ours = jax.jit(fn)(*args)
            err = float(
                jnp.max(jnp.abs(ours - reference)) / jnp.max(jnp.abs(reference))
            )
            assert err < 1e-4, f"{name} disagrees with the plain S5: {err:.2e}"
            print(f"check: {name} forward = plain S5 forward (max rel. err {err:.1e})")
        plain_grads = jax.jit(jax.grad(plain_loss))(params, us)
        for name in ["sequential", "associative"]:
            fn, args = out[f"{name}: grad"]
            err = max(
                float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
                for a, b in zip(jax.jit(fn)(*args), plain_grads)
            )
            assert err < 1e-3, f"{name} gradient disagrees with the plain S5: {err:.2e}"
            print(
                f"check: {name} grad = plain S5 grad (max rel. err {err:.1e}, by leaf)"
            )

    return out, check


def jacobian_programs(T, H, P, key):
    """Final-state parameter Jacobians of one sequence: ours vs jacrev of the anchor."""
    lkey, ukey = jr.split(key)
    u = jr.normal(ukey, (T, H), jnp.float32)
    base = eqx_seq.S5(H, P, blocks=4, key=lkey)
    params = layer_params(base)

    def plain_final(ssm_params, u):
        lambda_re, lambda_im, log_step, B = ssm_params
        _, xs = plain_s5((lambda_re, lambda_im, log_step, B, base.C, base.D), u)
        return jnp.stack([xs[-1].real, xs[-1].imag])

    ssm = params[:4]
    out = {
        "plain S5: jacrev h_T wrt (Λ, log_step, B)": (jax.jacrev(plain_final), (ssm, u))
    }
    for name, scan in [
        ("sequential", eqx_seq.SequentialScan()),
        ("associative", eqx_seq.AssociativeScan()),
    ]:
        layer = eqx.tree_at(lambda l: l.scan, base, scan)

        def jac(params, u, layer=layer):
            j = with_params(layer, params).parameter_jacobians(u, final=True)
            return j.wrt, j.wrt_B

        def forward(params, u, layer=layer):
            return with_params(layer, params)(u)

        out[f"{name}: forward (1 sequence)"] = (forward, (params, u))
        out[f"{name}: parameter_jacobians(final=True)"] = (jac, (params, u))

    def check():  # ours against the anchor's jacrev: d h_T[p] / d lambda_re[p], B
        plain = jax.jit(jax.jacrev(plain_final))(ssm, u)
        dense = plain[0][0] + 1j * plain[0][1]  # (P, P) w.r.t. lambda_re
        dense_B = jnp.einsum("pphc->phc", plain[3][0] + 1j * plain[3][1])[..., 0]
        for name in ["sequential", "associative"]:
            fn, args = out[f"{name}: parameter_jacobians(final=True)"]
            wrt, wrt_B = jax.jit(fn)(*args)
            err = jnp.max(jnp.abs(jnp.diagonal(dense) - wrt["lambda_re"]))
            rel = float(err / jnp.max(jnp.abs(wrt["lambda_re"])))
            rel_B = float(jnp.max(jnp.abs(dense_B - wrt_B)) / jnp.max(jnp.abs(wrt_B)))
            assert rel < 1e-3 and rel_B < 1e-3, f"{name}: {rel}, {rel_B}"
            print(
                f"check: {name} Jacobians = jacrev of the plain S5 (max rel. err "
                f"{rel:.1e} for lambda_re, {rel_B:.1e} for B)"
            )

    return out, check


def run(T, H, P, batch, repeats, key):
    progs, check = programs(T, H, P, batch, key)
    slow = [n for n in progs if n.startswith("plain") and T >= 16384]
    res = measure(progs, repeats, slow)
    check()
    return res


# --- the report: printed, and written beside the JSON ------------------------------
S5_KINDS = ("plain S5", "sequential", "associative")


def tables(p):
    """The markdown of a results payload: the layers' table, the Jacobians'."""
    rows = []
    for T, res in p["runs"].items():
        plain = res["plain S5: grad"]
        for k in S5_KINDS:
            f, g = res[f"{k}: forward"], res[f"{k}: grad"]
            rows.append(
                [
                    T,
                    k,
                    ms(f["median_ms"]),
                    ms(g["median_ms"]),
                    times(g["median_ms"] / f["median_ms"]),
                    times(plain["median_ms"] / g["median_ms"]),
                    f"{g['peak_mb']:.0f}",
                    times(g["peak_mb"] / plain["peak_mb"]),
                    f"{g['compile_s']:.2f}",
                ]
            )
    out = [
        f"H={p['H']} features, `state_size` {p['state_size']} (`conj_sym`), batch "
        f"{p['batch']} by `jax.vmap`, float32; loss: mean square of the outputs. "
        "Peak: XLA's memory analysis of the compiled gradient.",
        "",
    ]
    out += table(
        "T | layer | fwd ms | grad ms | grad x fwd | grad vs plain | grad peak MB | "
        "peak x plain | grad compile s",
        rows,
    )
    rows = []
    for T, res in p.get("jacobians", {}).items():
        anchor = next(v for k, v in res.items() if k.startswith("plain S5"))
        for name, r in res.items():
            kind = name.split(": ")[0]
            fwd = res.get(f"{kind}: forward (1 sequence)", {}).get("median_ms")
            rows.append(
                [
                    T,
                    f"`{name}`",
                    ms(r["median_ms"]),
                    times(div(r["median_ms"], fwd)),
                    times(anchor["median_ms"] / r["median_ms"]),
                    f"{r['compile_s']:.2f}",
                ]
            )
    if rows:
        out += ["Final-state parameter Jacobians, one sequence:", ""]
        out += table("T | method | ms | x fwd | speed-up vs jacrev | compile s", rows)
    return out


def headline(p):
    parts = []
    for k in S5_KINDS[1:]:
        su = [
            r["plain S5: grad"]["median_ms"] / r[f"{k}: grad"]["median_ms"]
            for r in p["runs"].values()
        ]
        mem = [
            r[f"{k}: grad"]["peak_mb"] / r["plain S5: grad"]["peak_mb"]
            for r in p["runs"].values()
        ]
        parts.append(f"{k} {faster(su)} at {span(mem)} the peak memory")
    Ts = "/".join(p["runs"])
    return f"gradient vs the plain S5 (T={Ts}): " + "; ".join(parts)


REPORTS = {"s5": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T=256 only (smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--json",
        default=results_path("s5"),
        help="default: results/<machine>/s5.json",
    )
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    H, P, batch = 128, 64, 8
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
        f"jax {info['jax']}"
    )
    print(allocator_line(info))
    payload = {"machine": info, "H": H, "state_size": P, "batch": batch, "runs": {}}
    lengths = [256] if args.quick else [1024, 4096, 16384]
    key = jr.key(0)
    for T in lengths:
        print(
            f"\n== S5, float32, T={T}, H={H}, state_size={P} (32 complex states), "
            f"batch {batch} (vmap) =="
        )
        res = run(T, H, P, batch, args.repeats, key)
        payload["runs"][str(T)] = res
    jac_lengths = [256] if args.quick else [1024, 4096]
    payload["jacobians"] = {}
    for T in jac_lengths:
        print(
            f"\n== final-state parameter Jacobians (Λ, log_step, B), one sequence, "
            f"T={T}; speed-up vs jax.jacrev through the plain S5 =="
        )
        progs, check = jacobian_programs(T, H, P, key)
        res = measure(progs, args.repeats)
        check()
        payload["jacobians"][str(T)] = res
    save(args.json, payload, REPORTS["s5"])


if __name__ == "__main__":
    main()
