"""Shared by the benchmark scripts (not part of the package): timing, the machine's
record, and the markdown of the results (each script formats its own tables from its
JSON, for the terminal and for `results/<machine>/<name>.md` alike)."""

import json
import os
import platform
import re
import statistics
import subprocess
import time

import jax


# a run's wall time goes with its results (`run_s`), so that the next run can be
# planned; it counts from the script's import of this module
_START = time.perf_counter()


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


def machine_slug(info: dict) -> str:
    """A short name for the machine of `machine()`'s record, the folder of its
    results: the CPU model and core count on CPU (`amd-epyc-2core`, so that two CPU
    models never share a folder, whatever the number of forced devices), the
    accelerator's device kind otherwise (`h100`, `h100-x8` for several).
    """
    if info["platform"] == "cpu":
        cpu = re.sub(r"\((r|tm)\)|@|\b\d+-core\b", " ", info["cpu"].lower())
        words = re.findall(r"[a-z0-9._]+", cpu)
        words = [w for w in words if w not in {"cpu", "processor"}]
        return "-".join(words + [f"{info['cores']}core"])
    words = re.findall(r"[a-z0-9]+", info["device_kind"].lower())
    words = [w for w in words if w not in _VENDOR_WORDS] or [info["platform"]]
    # up to the first word with a digit: "h100" (80gb hbm3 dropped), "tpu-v4"
    end = next((i for i, w in enumerate(words) if any(c.isdigit() for c in w)), 0)
    slug = "-".join(words[: end + 1])
    return slug if len(info["devices"]) == 1 else f"{slug}-x{len(info['devices'])}"


def results_path(name: str) -> str:
    """The default JSON of a script: `benchmarks/results/<machine slug>/<name>.json`."""
    return os.path.join(RESULTS, machine()["slug"], f"{name}.json")


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:  # Linux: the model's name, where platform.processor() gives the ISA
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
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # glibc's allocator settings change CPU timings of large arrays (see
        # docs/faq.md), so they go with the numbers
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "commit": commit,
    }
    return {**info, "slug": machine_slug(info)}


def allocator_line(info: dict) -> str:
    """One line naming the glibc allocator settings of the run (from `machine()`)."""
    env = info.get("malloc_env") or {}
    if not env:
        return "allocator: glibc defaults (large freed buffers go back to the OS)"
    return "allocator: " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def hlo_instructions(text: str) -> int:
    """The instructions of an optimised HLO module (`compiled.as_text()`): its lines
    that assign a value, the module's header, comments and the root tuple left
    out."""
    return sum(
        1
        for line in text.splitlines()
        if " = " in line
        and not line.strip().startswith(("HloModule", "//", "ROOT %tuple"))
    )


# --- the results' markdown -----------------------------------------------------------
DASH = "–"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ms(x):
    """A time in ms with three significant digits or so."""
    if x is None:
        return DASH
    for bound, digits in ((100, 0), (10, 1), (1, 2)):
        if x >= bound:
            return f"{x:.{digits}f}"
    return f"{x:.3f}"


def times(x):
    """A ratio, `1.23×`; large ones with fewer digits."""
    if x is None:
        return DASH
    if x >= 100:
        return f"{x:.0f}×"
    if x >= 10:
        return f"{x:.1f}×"
    if x >= 0.1:
        return f"{x:.2f}×"
    return f"{x:.2g}×"


def div(a, b):
    return None if a is None or b is None else a / b


def table(headers, rows, left=1):
    """Markdown table; `headers` one string, "a | b | c"; the first `left` columns
    left-aligned, the others right-aligned."""
    headers = headers.split(" | ")
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join([":---"] * left + ["---:"] * (len(headers) - left)) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def span(values, fmt=times):
    values = [v for v in values if v is not None]
    if not values:
        return DASH
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)[:-1]}–{fmt(hi)}"


def faster(values):
    """Speed-ups in words: `2.1–4.1× faster`, `87–640× slower`."""
    values = [v for v in values if v is not None]
    if all(v >= 1 for v in values):
        return span(values) + " faster"
    if all(v < 1 for v in values):
        return span([1 / v for v in values]) + " slower"
    return "speed-up " + span(values)


def measured_on(m: dict) -> str:
    """One sentence: the machine, software and settings of `machine()`'s record."""
    env = m.get("malloc_env")
    if env is None:
        alloc = "not recorded"
    elif env:
        alloc = " ".join(f"`{k}={v}`" for k, v in sorted(env.items()))
    else:
        alloc = "glibc defaults"
    device = m["platform"]
    if m["platform"] != "cpu":
        device += f" ({m.get('device_kind') or ', '.join(m['devices'])})"
    if len(m["devices"]) > 1:
        device += f" ({len(m['devices'])} devices)"
    flags = f"`{m['xla_flags']}`" if m["xla_flags"] else "default"
    return (
        f"Measured on {m['cpu']} ({m['cores']} cores), {device}, jax {m['jax']}, "
        f"Python {m['python']}, commit `{m['commit']}`; XLA flags: {flags}; "
        f"allocator: {alloc}."
    )


def markdown(path: str, payload: dict, report) -> str:
    """The markdown of a results file: where and on what it was measured, then a
    script's formatter `report = (headline, tables)` applied to the payload: its
    headline (none for runs without one, e.g. `--quick`) and its tables' lines."""
    headline_of, tables = report
    out = [measured_on(payload["machine"])]
    if path is not None:
        where = os.path.abspath(path)
        if where.startswith(ROOT + os.sep):
            where = os.path.relpath(where, ROOT)
        out[0] += f" From `{where}`."
    if "run_s" in payload:
        out[0] += f" The whole run took {payload['run_s'] / 60:.0f} min."
    out.append("")
    try:
        out += [f"**Headline:** {headline_of(payload)}.", ""]
    except (KeyError, ValueError):  # a quick run: no anchor to quote
        pass
    return "\n".join(out + tables(payload)).rstrip() + "\n"


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def md_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".md"


def save(path, payload: dict, report) -> None:
    """Print the tables of `payload`; unless `path` is None, write its JSON there
    and the same tables beside it (`.md`)."""
    payload["run_s"] = time.perf_counter() - _START
    if path is not None:
        write_json(path, payload)
    text = markdown(path, payload, report)
    print("\n" + text)
    if path is not None:
        with open(md_path(path), "w") as f:
            f.write(text)
        print(f"wrote {md_path(path)}")


def write_reports(reports: dict, paths) -> None:
    """`--report`: the `.md` of stored results, from their JSON, without measuring.
    `reports` maps a results name (`kalman_em`) to the script's formatter."""
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            payload = json.load(f)
        with open(md_path(path), "w") as f:
            f.write(markdown(path, payload, reports[name]))
        print(f"wrote {md_path(path)}")
