"""The simulator's results as a table a person reads: one row per policy (trace replay) or per
deployment (scenario), the columns that decide between them. `--json` keeps the raw numbers."""
from __future__ import annotations

from typing import Any

TRACE_COLUMNS = (("requests", "requests", "{:,}"), ("rejected", "rejected", "{:,}"),
                 ("prefix hit", "prefix_cache_hit_ratio", "{:.1%}"), ("TTFT p50 ms", "ttft_p50_ms", "{:,.0f}"),
                 ("TTFT p90 ms", "ttft_p90_ms", "{:,.0f}"), ("TTFT p99 ms", "ttft_p99_ms", "{:,.0f}"),
                 ("TBT p99 ms", "tbt_p99_ms", "{:,.1f}"), ("SLO met", "slo_attainment", "{:.1%}"),
                 ("goodput req/s", "goodput_rps", "{:.2f}"), ("prefill GPU-s", "prefill_gpu_seconds", "{:,.0f}"))
SCENARIO_COLUMNS = (("TTFT mean ms", "ttft_mean_ms", "{:g}"), ("TTFT p99 ms", "ttft_p99_ms", "{:g}"),
                    ("TTFT max ms", "ttft_max_ms", "{:g}"), ("TPOT mean ms", "tpot_mean_ms", "{:g}"),
                    ("TPOT p99 ms", "tpot_p99_ms", "{:g}"))


def _cell(row: dict, key: str, form: str) -> str:
    value = row.get(key)
    return "-" if value is None else form.format(value)


def table(rows: dict[str, dict], columns: tuple, first: str) -> str:
    """A plain-text table, aligned, the first column named `first`."""
    header = [first] + [title for title, _, _ in columns]
    body = [[name] + [_cell(row, key, form) for _, key, form in columns] for name, row in rows.items()]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """Trace results ({policy: metrics, "infinite_cache_hit_ratio": x}) or scenario results."""
    if "infinite_cache_hit_ratio" in results:
        rows = {name: metrics for name, metrics in results.items() if isinstance(metrics, dict)}
        return (table(rows, TRACE_COLUMNS, "policy")
                + f"\n\nprefix hit ratio with an infinite cache: {results['infinite_cache_hit_ratio']:.1%}")
    return table(results, SCENARIO_COLUMNS, "deployment")
