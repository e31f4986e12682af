"""Formatting helpers of the docs' benchmarks page (`make_docs_page.py`)."""

DASH = "–"


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
