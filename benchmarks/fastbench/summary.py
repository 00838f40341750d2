"""The run in one line, for someone who has not read the tables: fastbert's real-token/s ratio to each other provider
(the range over the cases, and how many cases it was slower in), whether every output matched HF, and what makes the
numbers less trustworthy (a busy machine, a smoke run). Also the grouping of rows into cases that the plot uses.

Rows are results.csv rows: this run's (numbers) or read back from a file (strings), failed rows included.
"""

from __future__ import annotations

from collections import Counter

from .providers import BASELINE

SUBJECT = "fastbert"  # the provider the verdict speaks for; where it did not run, the first fastbert-* that did
BUSY_PCT = 5.0  # other_cpu_pct above which a CPU timing is inflated by other processes (README: "a few %")
MIN_REPS = 5  # fewer timed calls than this: a smoke run (the run warms about it too)


def number(value) -> float | None:
    """A CSV cell or a row value as a float; None for blanks."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def case_key(row: dict) -> tuple:
    return tuple(str(row.get(k, "")) for k in ("model", "dtype", "device", "device_name", "threads", "batch",
                                                 "seq_len", "length_dist"))


def case_groups(rows: list[dict]) -> list[list[dict]]:
    """The rows of each case, in order. A run writes the rows of a case together; a provider seen twice in a row of
    the same case starts a new group (the same case appended again by a later run)."""
    groups: list[list[dict]] = []
    for row in rows:
        last = groups[-1] if groups else None
        if last is None or case_key(last[0]) != case_key(row) or any(r["provider"] == row["provider"] for r in last):
            groups.append([row])
        else:
            last.append(row)
    return groups


def timed(row: dict) -> bool:
    return row.get("status") == "ok" and number(row.get("real_tokens_per_s")) is not None


def ratio_text(ratios: list[float]) -> str:
    """'1.14x-3.39x' (or '1.50x' for one value); three decimals where two would round a slower case up to 1.00."""
    def one(r):
        return f"{r:.3f}x" if round(r, 2) == 1.0 and r != 1.0 else f"{r:.2f}x"

    lo, hi = min(ratios), max(ratios)
    return one(lo) if lo == hi else f"{one(lo)}-{one(hi)}"


def subject(providers: list[str]) -> str:
    """Who the verdict speaks for: fastbert, or where only its variants ran (``--providers fastbert-int8,...``), the
    first of them."""
    if SUBJECT in providers:
        return SUBJECT
    return next((p for p in providers if p.startswith(SUBJECT + "-")), SUBJECT)


def _speed(groups: list[list[dict]], providers: list[str], who: str) -> list[str]:
    others = [BASELINE] + [p for p in providers if p not in (BASELINE, who)]
    ratios: dict[str, list[float]] = {p: [] for p in others}
    for group in groups:
        rate = {r["provider"]: number(r["real_tokens_per_s"]) for r in group if timed(r)}
        if who in rate:
            for p in others:
                if p in rate:
                    ratios[p].append(rate[who] / rate[p])
    parts = []
    for p in others:
        rs = ratios[p]
        if not rs:
            continue
        slower = sum(r < 1.0 for r in rs)
        if not parts:
            parts.append(f"{who} vs {p} {ratio_text(rs)} real tok/s, slower in {slower} of {len(rs)} cases")
        else:
            parts.append(f"vs {p} {ratio_text(rs)}, slower in {slower} of {len(rs)}")
    return parts


def _rss(groups: list[list[dict]], who: str) -> str | None:
    """'RSS growth over 20 new shapes: fastbert +1.2 MB, hf-sdpa +0.3 MB' from the varied-shapes cases, or None."""
    varied = [g for g in groups if str(g[0].get("length_dist", "")).startswith("varied:")]
    growth: dict[str, list[float]] = {who: [], BASELINE: []}
    calls = set()
    for group in varied:
        for r in group:
            if r["provider"] in growth and timed(r) and number(r.get("rss_growth_mb")) is not None:
                growth[r["provider"]].append(number(r["rss_growth_mb"]))
                calls.add(int(number(r["reps"]) or 0))
    if not growth[who]:
        return None
    most = "up to " if len(varied) > 1 else ""
    shapes = max(calls)
    return f"RSS growth over {shapes} new shapes: " + ", ".join(
        f"{p} {most}{max(v):+.1f} MB" for p, v in growth.items() if v)


def _outputs(rows: list[dict]) -> str:
    failed = Counter()
    for r in rows:
        if r.get("status") != "ok":
            kind = "output mismatch vs HF" if str(r.get("status")).startswith("mismatch") else "error"
            failed[(r["provider"], kind)] += 1
    if failed:
        what = ", ".join(f"{p} {kind} in {n} case{'s' if n > 1 else ''}" for (p, kind), n in failed.items())
        return f"FAILED: {what} (not timed; see the status column)"
    if any(r["provider"] != BASELINE for r in rows):
        return "outputs checked against HF"
    return f"no output checked (only {BASELINE} ran)"


def verdict(rows: list[dict]) -> str:
    """The verdict line (see the module docstring); starts with 'verdict: '."""
    groups = case_groups(rows)
    if not groups:
        return "verdict: nothing was measured"
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    who = subject(providers)
    parts = _speed(groups, providers, who)
    if not parts:
        parts = [f"{who} was not timed in any case" if who in providers else f"{who} did not run (see the notes)"]
    rss = _rss(groups, who)
    if rss:
        parts.append(rss)
    parts.append(_outputs(rows))
    busy = sum(any((number(r.get("other_cpu_pct")) or 0.0) > BUSY_PCT for r in g) for g in groups)
    if busy:
        parts.append(f"{busy} of {len(groups)} cases timed while other processes used > {BUSY_PCT:g}% of the CPU "
                     "(noisy: re-run them)")
    reps = [number(r.get("reps")) for r in rows if timed(r) and number(r.get("reps")) is not None]
    if reps and min(reps) < MIN_REPS:
        parts.append(f"{int(min(reps))} timed call(s) per provider: a smoke run, not a measurement")
    return "verdict: " + "; ".join(parts)
