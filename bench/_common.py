"""Shared helpers of the benchmark scripts (timing, statistics, machine info, markdown).

Not a benchmark itself and not a test: nothing in bench/ is collected by pytest.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def import_dspark() -> Any:
    """Import dspark_core; fall back to the in-place dev build under ``src/``."""
    try:
        import dspark_core
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
        import dspark_core  # noqa: F401
    return sys.modules["dspark_core"]


# -- sizes -------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"128k"`` -> 131072, ``"4096"`` -> 4096, ``"1M"`` -> 1048576, ``"25_600"`` -> 25600."""
    t = text.strip().lower().replace("_", "").replace(",", "")
    mult = 1
    if t.endswith("k"):
        mult, t = 1 << 10, t[:-1]
    elif t.endswith("m"):
        mult, t = 1 << 20, t[:-1]
    return int(t) * mult


def parse_list(text: str) -> list[int]:
    """Comma-separated sizes, e.g. ``"1k,8k,32k,128k"`` (commas inside numbers are not allowed)."""
    return [parse_size(x) for x in text.split(",") if x.strip()]


def fmt_size(n: int) -> str:
    """131072 -> ``"128k"``, 25600 -> ``"25,600"``."""
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return f"{n:,}"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_us(ns: float | None) -> str:
    """Nanoseconds as microseconds with sensible precision; ``-`` for None."""
    if ns is None or not np.isfinite(ns):
        return "-"
    us = ns / 1e3
    if us >= 1e4:
        return f"{us:,.0f}"
    if us >= 100:
        return f"{us:.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.2f}"


def fmt_x(v: float | None, digits: int = 1) -> str:
    if v is None or not np.isfinite(v):
        return "-"
    if v >= 100:
        return f"{v:,.0f}x"
    return f"{v:.{digits}f}x"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "**MISS**")


# -- statistics --------------------------------------------------------------


def median(xs: Sequence[float]) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def p90(xs: Sequence[float]) -> float | None:
    return float(np.percentile(xs, 90)) if len(xs) else None


def time_ns(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[int]:
    """Per-call wall times (perf_counter_ns) of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """np.copyto between two preallocated float32 arrays of ``nbytes``: GB/s (1e9) of the median."""
    n = max(1, nbytes // 4)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    t = median(time_ns(lambda: np.copyto(dst, src), repeats, warmup=2))
    return src.nbytes / t if t else float("nan")  # bytes/ns == GB/s


# -- machine / header ----------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def simd_path() -> str:
    try:
        from dspark_core import formats

        return f"{formats.active_simd_path()} (supported: {', '.join(formats.simd_paths())})"
    except Exception as exc:  # noqa: BLE001 - older builds may lack it
        return f"unknown ({type(exc).__name__})"


REPO = Path(__file__).resolve().parent.parent


def display_path(p: str | os.PathLike[str]) -> str:
    """A path as reports show it: relative inside the repository, else ``.../`` and its last two
    parts, so a committed report names no machine's folders."""
    path = Path(p)
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return ".../" + "/".join(path.parts[-2:]) if len(path.parts) > 3 else path.as_posix()


def command_line() -> str:
    args = [display_path(a) if os.path.isabs(a) else a for a in sys.argv]
    return " ".join(["python"] + [a if " " not in a else repr(a) for a in args])


def machine_line() -> str:
    ram = ram_gib()
    ram_s = f", {ram:.0f} GiB RAM" if ram else ""
    return f"{cpu_model()}, {os.cpu_count()} logical cores{ram_s}; {platform.platform()}"


def header_lines(title: str, extra: Iterable[str] = ()) -> list[str]:
    ds = sys.modules.get("dspark_core")
    version = getattr(ds, "__version__", "?")
    lines = [
        f"## {title}",
        "",
        f"- command: `{command_line()}`",
        f"- machine: {machine_line()}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- dspark_core {version} ({display_path(Path(ds.__file__).parent) if ds else '?'}), numpy {np.__version__}, "
        f"Python {platform.python_version()}",
        f"- active SIMD path: {simd_path()}",
    ]
    lines += [f"- {e}" for e in extra]
    lines.append("")
    return lines


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> list[str]:
    """A markdown table; ``align`` is one char per column: ``l`` or ``r`` (default: first l, rest r)."""
    align = align or ("l" + "r" * (len(header) - 1))
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return out


def write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=float))


def emit(lines: list[str], out_path: str | None) -> None:
    text = "\n".join(lines).rstrip() + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()
    if out_path:
        Path(out_path).write_text(text)
