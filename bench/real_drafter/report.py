"""Stage 5: the tables and the plot, each figure with a bootstrap interval over documents.

A figure is a ratio over every round of a depth bucket (``[kT, (k+1)T)``, by the
round's start): drafts accepted over drafts proposed (the acceptance rate), accepted
drafts over verifies. Its interval resamples the *documents* (``BOOT`` resamples, the
2.5th and 97.5th percentiles), since rounds of one document are not independent; a
difference between two modes resamples the same documents for both (paired).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

__all__ = ["Sums", "ratio", "difference", "fmt_ci", "BOOT", "plot"]

#: Bootstrap resamples.
BOOT = 2000
#: Seed of the resampling (the report is deterministic).
BOOT_SEED = 12345


@dataclass
class Sums:
    """Per document and depth bucket: a numerator and a denominator ``(n_docs, n_buckets)``."""

    num: np.ndarray
    den: np.ndarray

    @classmethod
    def of(cls, per_doc: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], T: int, n_buckets: int) -> "Sums":
        """From ``(depth, num, den)`` arrays of the rounds of each document."""
        nums, dens = [], []
        for depth, num, den in per_doc:
            b = np.minimum(np.asarray(depth) // T, n_buckets - 1)
            nums.append(np.bincount(b, weights=num, minlength=n_buckets)[:n_buckets])
            dens.append(np.bincount(b, weights=den, minlength=n_buckets)[:n_buckets])
        return cls(np.asarray(nums, float), np.asarray(dens, float))


def _resamples(n_docs: int) -> np.ndarray:
    return np.random.default_rng(BOOT_SEED).integers(0, n_docs, (BOOT, n_docs))


def ratio(s: Sums, bucket: int) -> tuple[float, float, float]:
    """``(point, lo, hi)`` of ``sum(num) / sum(den)`` in ``bucket`` (nan where no round)."""
    num, den = s.num[:, bucket], s.den[:, bucket]
    if den.sum() == 0:
        return (float("nan"),) * 3
    idx = _resamples(len(num))
    with np.errstate(invalid="ignore", divide="ignore"):
        boots = num[idx].sum(1) / den[idx].sum(1)
    lo, hi = np.nanpercentile(boots, [2.5, 97.5])
    return float(num.sum() / den.sum()), float(lo), float(hi)


def difference(a: Sums, a_bucket: int, b: Sums, b_bucket: int) -> tuple[float, float, float]:
    """``(point, lo, hi)`` of ratio(a) - ratio(b), the same documents resampled for both."""
    if a.den[:, a_bucket].sum() == 0 or b.den[:, b_bucket].sum() == 0:
        return (float("nan"),) * 3
    idx = _resamples(a.num.shape[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        ra = a.num[idx, a_bucket].sum(1) / a.den[idx, a_bucket].sum(1)
        rb = b.num[idx, b_bucket].sum(1) / b.den[idx, b_bucket].sum(1)
    lo, hi = np.nanpercentile(ra - rb, [2.5, 97.5])
    point = a.num[:, a_bucket].sum() / a.den[:, a_bucket].sum() - b.num[:, b_bucket].sum() / b.den[:, b_bucket].sum()
    return float(point), float(lo), float(hi)


def fmt_ci(v: tuple[float, float, float], pct: bool = True, sign: bool = False) -> str:
    """``33.0% [30.1, 35.8]`` (points of a percentage) or ``1.23 [1.10, 1.35]``."""
    p, lo, hi = v
    if not np.isfinite(p):
        return "-"
    k = 100.0 if pct else 1.0
    f = "+.1f" if sign else ".1f"
    if not pct:
        f = "+.2f" if sign else ".2f"
    unit = "%" if pct and not sign else (" pt" if pct else "")
    return f"{k * p:{f}}{unit} [{k * lo:{f}}, {k * hi:{f}}]"


def plot(path: str, T: int, curves: Sequence[tuple[str, np.ndarray, np.ndarray, np.ndarray]],
         live: Sequence[tuple[str, np.ndarray, np.ndarray]], title: str, n_ctx_train: int) -> None:
    """Acceptance against depth: one line per mode (``(label, point, lo, hi)`` per bucket, a band
    for the interval), the live loop's buckets as markers (``(label, bucket centres, point)``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, p, lo, hi in curves:
        x = (np.arange(len(p)) + 0.5) * T
        (line,) = ax.plot(x, 100 * p, marker=".", label=f"{label} (offline)")
        ax.fill_between(x, 100 * lo, 100 * hi, color=line.get_color(), alpha=0.15)
    for label, x, p in live:
        ax.plot(x, 100 * p, linestyle="none", marker="o", markerfacecolor="none", markersize=8, label=f"{label} (live)")
    ax.axvline(n_ctx_train, color="grey", linestyle=":", linewidth=1)
    ax.text(n_ctx_train, ax.get_ylim()[1] * 0.97, " trained range T", color="grey", fontsize=8, va="top")
    ax.set_xlabel("depth (target position of the round)")
    ax.set_ylabel("acceptance rate (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
