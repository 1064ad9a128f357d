"""Output shared by the benchmarks: fixed-width tables, strict JSON written atomically, headless PNG figures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tapetrain import atomic_io
from tapetrain.atomic_io import save_figure


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str], numeric: Sequence[bool]) -> str:
        padded = (v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True))
        return "  ".join(padded).rstrip()

    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]
    out = [line(list(headers), numeric), line(["-" * w for w in widths], numeric)]
    out += [line(r, numeric) for r in cells]
    return "\n".join(out)


def _is_number(value: Any) -> bool:
    return value is None or isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return str(value)


def fmt_pct(value: float | None) -> str:
    """0.412 -> '41.2%'; None -> '-'."""
    return "-" if value is None else f"{value:.1%}"


def finite_or_none(value: float | None) -> float | None:
    """NaN/inf -> None (JSON null)."""
    return value if value is not None and math.isfinite(value) else None


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> null (strict JSON), tuples -> lists."""
    if isinstance(obj, float):
        return finite_or_none(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj: dict) -> Path:
    """The benchmarks' JSON convention (strict: NaN/inf -> null, indent 2) written through atomic_io."""
    return atomic_io.write_json(path, _json_safe(obj), allow_nan=False, parents=True)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported on first use (only plots need matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: benchmarks run on servers
    import matplotlib.pyplot as plt

    return plt


def title_suffix(result: dict) -> str:
    """'device, dtype' of a result, for figure titles."""
    return f"{result['device']}, {result['dtype']}"


def bar_chart(labels: list[str], values: list[float], title: str, path: str | Path, ylabel: str) -> Path:
    """One labelled bar per value, saved as PNG at `path`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(labels) + 2), 4))
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    out = save_figure(fig, path)
    plt.close(fig)
    return out


def noise_warning(results: Sequence[dict]) -> list[str]:
    """A hint when step times swing wildly: another process competes for the CPU (OpenMP threads then stall)."""
    spreads = [max(r["step_times_s"]) / min(r["step_times_s"]) for r in results if r.get("step_times_s")]
    if spreads and max(spreads) > 3:
        return [
            f"warning: step times vary up to {max(spreads):.0f}x within a run: the machine is busy; use more --steps "
            "(and --threads 1 on a shared CPU)"
        ]
    return []
