"""Shared timing helpers for the benchmark scripts (not part of the package)."""

import json
import os
import platform
import re
import statistics
import subprocess
import time

import jax


def measure_many(
    programs: dict, *, repeats: int = 7, min_time: float = 0.0, slow=()
) -> dict:
    """Time several programs with their samples interleaved, round-robin.

    The machines we run on are shared: a slow spell hits whichever program is being
    timed. Taking sample `r` of every program before sample `r + 1` of any spreads
    such spells over all of them, so ratios within one run stay meaningful.

    `programs` maps a name to `(fn, args)`. Each sample of a fast program follows
    one untimed call; names in `slow` get a single timed call per sample instead
    (`min_time` does not apply). Returns, per name, the first-call time
    (compilation included) and the median per-call time, in seconds.
    """
    first = {}
    for name, (fn, args) in programs.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first[name] = time.perf_counter() - start
        jax.block_until_ready(fn(*args))  # warm-up after compilation
    samples = {name: [] for name in programs}
    for _ in range(repeats):
        for name, (fn, args) in programs.items():
            if name not in slow:
                # untimed: after a memory-hungry neighbour the first call pays for
                # fresh pages, which is not this program's cost
                jax.block_until_ready(fn(*args))
            calls = 0
            start = time.perf_counter()
            while True:
                jax.block_until_ready(fn(*args))
                calls += 1
                elapsed = time.perf_counter() - start
                if name in slow or elapsed >= min_time:
                    break
            samples[name].append(elapsed / calls)
    return {
        name: {
            "first_call_s": first[name],
            "median_ms": 1e3 * statistics.median(samples[name]),
        }
        for name in programs
    }


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# words of a device kind that name the vendor or the line, not the model
_VENDOR_WORDS = {"nvidia", "amd", "tesla", "geforce", "quadro", "radeon", "instinct"}


def machine_slug() -> str:
    """A short name for the machine, the folder of its results: `cpu-2core` (CPU,
    by core count), `h100` (from the accelerator's device kind), `h100-x8` (several).
    """
    devices = jax.devices()
    if devices[0].platform == "cpu":
        return f"cpu-{os.cpu_count()}core"
    words = re.findall(r"[a-z0-9]+", devices[0].device_kind.lower())
    words = [w for w in words if w not in _VENDOR_WORDS] or [devices[0].platform]
    # up to the first word with a digit: "h100" (80gb hbm3 dropped), "tpu-v4"
    end = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)), 0)
    slug = "-".join(words[: end + 1])
    return slug if len(devices) == 1 else f"{slug}-x{len(devices)}"


def results_path(name: str) -> str:
    """The default JSON of a script: `benchmarks/results/<machine_slug()>/<name>.json`."""
    return os.path.join(RESULTS, machine_slug(), f"{name}.json")


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "slug": machine_slug(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # glibc's allocator settings change CPU timings of large arrays (see
        # docs/faq.md), so they go with the numbers
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "commit": commit,
    }


def allocator_line(info: dict) -> str:
    """One line naming the glibc allocator settings of the run (from `machine()`)."""
    env = info.get("malloc_env") or {}
    if not env:
        return "allocator: glibc defaults (large freed buffers go back to the OS)"
    return "allocator: " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
