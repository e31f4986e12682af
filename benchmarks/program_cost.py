"""What one program costs from a fresh process: trace and lower, XLA compile, the
optimised HLO instruction count, and the run time (median after warm-up), for
`ssd_scan` and a `Mamba2` layer, forward or gradient (float32, the sequential
backend, chunks of 64). One JSON line per call.

Nothing is cached between calls, so a before/after comparison of two revisions runs
this on each checkout alternately (each call its own process) and compares medians:

    for i in 1 2 3; do for tree in /path/to/before /path/to/after; do
        PYTHONPATH=$tree python benchmarks/program_cost.py ssd --grad
    done; done
"""

import argparse
import json
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _timing import hlo_instructions

import eqx_seq


def program(which: str, T: int, grad: bool):
    k = jr.split(jr.key(0), 6)
    scan = eqx_seq.SequentialScan()
    if which == "ssd":
        H, P, N = 2, 64, 16
        args = (
            jr.normal(k[0], (T, H, P)),
            jr.normal(k[1], (T, H)),
            -jnp.arange(1.0, H + 1),
            jr.normal(k[2], (T, 1, N)),
            jr.normal(k[3], (T, 1, N)),
        )

        def f(*a):
            y = eqx_seq.ssd_scan(*a, dt_softplus=True, chunk_size=64, scan=scan)
            return jnp.sum(y**2)

        return (jax.grad(f, range(5)) if grad else f), args
    layer = eqx_seq.Mamba2(
        64, state_size=16, head_dim=64, chunk_size=64, scan=scan, key=k[4]
    )
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def g(params, x):
        return jnp.sum(eqx.combine(params, static)(x) ** 2)

    return (jax.grad(g) if grad else g), (params, jr.normal(k[5], (T, 64)))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("program", choices=["ssd", "mamba2"])
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    fn, inputs = program(args.program, args.T, args.grad)
    fn = jax.jit(fn)
    t0 = time.perf_counter()
    lowered = fn.lower(*inputs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    instructions = hlo_instructions(text)
    jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            dict(
                program=args.program,
                mode="grad" if args.grad else "fwd",
                T=args.T,
                lower_s=t1 - t0,
                compile_s=t2 - t1,
                hlo_instructions=instructions,
                run_ms=1e3 * float(np.median(times[3:])),
            )
        )
    )


if __name__ == "__main__":
    main()
