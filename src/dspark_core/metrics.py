"""The Stager's metrics in the Prometheus text format (exposition format 0.0.4).

``prometheus_text(stager)`` renders ``Stager.totals()`` as text a server can
return as is from its ``/metrics`` endpoint, with ``CONTENT_TYPE`` as the
response's content type::

    from dspark_core.metrics import CONTENT_TYPE, prometheus_text

    body = prometheus_text(stager, labels={"model": "llama-3-8b"})

What it exports (``namespace`` ``dspark`` by default):

* a counter ``<ns>_<field>_total`` for every counter of ``stats()`` (rounds,
  commits, failures, rebases, staged and restaged rows, trims, trimmed rows);
  skips as one counter ``<ns>_skips_total`` with a ``reason`` label (the
  reasons sum to ``stats()["skips"]``);
* a histogram ``<ns>_accepted_drafts`` of accepted drafts per verified round,
  one bucket per count ``0..block_size`` (``_count`` and ``_sum`` are
  ``verified_rounds`` and ``accepted_tokens``);
* gauges for the rows and bytes the sequences hold now (``rows``,
  ``live_rows``, ``bytes``, ``reserved_bytes``), the peaks any sequence
  reached (``peak_rows``, ``peak_bytes``) and ``<ns>_sequences_started``.

``per_sequence=True`` adds the same counters and histogram per started
sequence (``<ns>_sequence_*`` with a ``seq`` label, from ``stats(seq)`` and
``accepted(seq)``); sequences handed over to the device step are left out
until ``to_host``. The Stager-wide counters never go back: the Stager keeps
the counts of sequences whose stats reset (``StagerTotals``). A per-sequence
series counts the request on that slot since its ``begin``: it restarts when a
new request takes the slot (Prometheus reads a drop as a counter reset).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .errors import StateError
from .stager._args import as_flag, as_seq_ids
from .stager.totals import COUNTERS, GAUGES, PEAKS

__all__ = ["CONTENT_TYPE", "prometheus_text", "METRIC_HELP"]

#: The content type of ``prometheus_text``'s answer (exposition format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: What each exported stats field means (its HELP line).
METRIC_HELP: dict[str, str] = {
    "rounds": "Drafting rounds opened.",
    "commits": "Rounds whose drafter decode and crop succeeded.",
    "failures": "Rounds whose drafter decode or crop failed.",
    "rebases": "Rounds that restaged the window onto the newest rows.",
    "staged_rows": "Context rows staged into the drafter.",
    "restaged_rows": "Context rows staged by rebases.",
    "skips": "Drafts skipped, by reason.",
    "trims": "Head drops of rows below the horizon.",
    "trimmed_rows": "Rows dropped below the horizon.",
    "live_rows": "Rows that can still be staged, over the sequences holding rows.",
    "rows": "Rows held, over the sequences holding rows.",
    "peak_rows": "The most rows one sequence has held.",
    "bytes": "Ring memory written, over the sequences holding rows.",
    "peak_bytes": "The most ring memory one sequence has written.",
    "reserved_bytes": "Ring address space reserved, over the sequences holding rows.",
    "accepted_drafts": "Accepted drafts per verified round.",
    "sequences_started": "Sequences holding rows.",
}

#: The stats fields the exporter folds into others: the per-reason skips into
#: ``skips_total{reason}``, the histogram's count and sum into ``accepted_drafts``.
_FOLDED = ("skips", "verified_rounds", "accepted_tokens")
_SKIP_PREFIX = "skips_"

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _escape(value: str) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label_text(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _check_labels(labels: Mapping[str, Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (labels or {}).items():
        if not isinstance(key, str) or not _LABEL.match(key) or key.startswith("__"):
            raise ValueError(f"label name {key!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                             "not starting with '__')")
        if key in ("le", "reason", "seq", "request"):
            raise ValueError(f"label name {key!r} is the exporter's own: choose another")
        out[key] = _label_value(key, value)
    return out


def _label_value(key: str, value: Any) -> str:
    """A label's value as text; the exposition is UTF-8, so a lone surrogate is a ValueError
    here rather than a failure of the server's encode."""
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"label {key!r}: its value {text!r} is not encodable as UTF-8") from None
    return text


def _listed(seqs: Any) -> list[Any]:
    """``seqs`` (any iterable: a generator, an array) as a list, or a TypeError naming it."""
    if isinstance(seqs, (str, bytes)):
        raise TypeError(f"prometheus_text: seqs must be integers, got {type(seqs).__name__}")
    try:
        return list(seqs)
    except TypeError:
        raise TypeError(f"prometheus_text: seqs must be an iterable of integers, got {type(seqs).__name__}") from None


class _Writer:
    """One exposition: its metric families in order of first use, each with its HELP and
    TYPE once and all its samples together (the format forbids interleaving families)."""

    def __init__(self, namespace: str, labels: dict[str, str]) -> None:
        self.ns = namespace
        self.labels = labels
        self.families: dict[str, list[str]] = {}
        self.current: list[str] = []

    def family(self, name: str, kind: str, help_key: str) -> str:
        full = f"{self.ns}_{name}"
        if full not in self.families:
            self.families[full] = [f"# HELP {full} {METRIC_HELP.get(help_key, help_key)}", f"# TYPE {full} {kind}"]
        self.current = self.families[full]
        return full

    def text(self) -> str:
        return "".join(line + "\n" for lines in self.families.values() for line in lines)

    def sample(self, name: str, value: int, **extra: str) -> None:
        self.current.append(f"{name}{_label_text({**self.labels, **extra})} {int(value)}")

    def histogram(self, name: str, accepted: np.ndarray, **extra: str) -> None:
        full = self.family(name, "histogram", "accepted_drafts")
        cumulative = np.cumsum(np.asarray(accepted, np.int64))
        for k, c in enumerate(cumulative.tolist()):
            self.sample(full + "_bucket", c, **extra, le=str(k))
        total = int(cumulative[-1]) if len(cumulative) else 0
        self.sample(full + "_bucket", total, **extra, le="+Inf")
        self.sample(full + "_sum", int(np.dot(np.arange(len(accepted)), accepted)), **extra)
        self.sample(full + "_count", total, **extra)

    def counters(self, prefix: str, stats: Mapping[str, int], **extra: str) -> None:
        for field in COUNTERS:
            if field in _FOLDED or field.startswith(_SKIP_PREFIX):
                continue
            self.sample(self.family(f"{prefix}{field}_total", "counter", field), stats[field], **extra)
        skips = self.family(f"{prefix}skips_total", "counter", "skips")
        for field in COUNTERS:
            if field.startswith(_SKIP_PREFIX):
                self.sample(skips, stats[field], **extra, reason=field[len(_SKIP_PREFIX):])


def _request_labels(request_ids: Mapping[int, Any]) -> dict[int, str]:
    """``{seq: request id}`` as label values: integer sequences (as the Stager's ids), ids as text."""
    if not isinstance(request_ids, Mapping):
        raise TypeError(f"prometheus_text: request_ids must be a mapping {{seq: request id}}, got "
                        f"{type(request_ids).__name__}")
    keys = as_seq_ids("prometheus_text: request_ids", _listed(list(request_ids))).tolist()
    out = {}
    for seq, rid in zip(keys, request_ids.values()):
        out[int(seq)] = _label_value("request", rid)
    return out


def prometheus_text(stager: Any, *, namespace: str = "dspark", labels: Mapping[str, Any] | None = None,
                    per_sequence: bool = False, seqs: Iterable[int] | None = None,
                    request_ids: Mapping[int, Any] | None = None) -> str:
    """The Stager's metrics in the Prometheus text format (see the module).

    stager: a ``Stager`` or ``ReferenceStager``. namespace: the metric names'
    prefix. labels: constant labels on every sample (``{"model": ...}``).
    per_sequence: also each started sequence's counters and histogram (those
    in ``seqs`` when given, else every one), ``<namespace>_sequence_*`` with a
    ``seq`` label: integers (numpy integers too; a float, bool or string is a
    TypeError, as the Stager's own batch calls refuse them). request_ids: the
    server's request id of each sequence (``{seq: id}``): its series carry a
    ``request`` label beside ``seq``, so a slot reused by the next request starts
    new series instead of resetting the old ones' counters; with it, only the
    sequences it names are written. A sequence handed over to the device step
    is written live, from its step state.

    Raises:
        ValueError: a bad namespace, label name or label value (not UTF-8), or ``seqs``
            not 1-D.
        TypeError: ``per_sequence`` is not a bool, or ``seqs`` are not integers.
    """
    if not isinstance(namespace, str) or not _NAME.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)")
    w = _Writer(namespace, _check_labels(labels))
    per_sequence = as_flag("prometheus_text: per_sequence", per_sequence)
    # Converted before any read, as the Stager's batch calls convert their ids (1.9 is no sequence 1).
    wanted = None if seqs is None else as_seq_ids("prometheus_text", _listed(seqs)).tolist()
    totals = stager.totals()
    w.counters("", totals.stats)
    w.histogram("accepted_drafts", totals.accepted)
    for field in GAUGES + PEAKS:
        if field in totals.stats:  # the reference twin keeps no byte counts
            w.sample(w.family(field, "gauge", field), totals.stats[field])
    w.sample(w.family("sequences_started", "gauge", "sequences_started"), totals.started)
    requests = None if request_ids is None else _request_labels(request_ids)
    if per_sequence:
        ids = range(stager.config.max_seqs) if wanted is None else dict.fromkeys(wanted)
        for seq in ids:  # each once: a series appears once in an exposition
            if requests is not None and seq not in requests:
                continue
            try:
                if not (stager.on_device(seq) or stager.state(seq)["started"]):
                    continue
                stats, accepted = stager.stats(seq), stager.accepted(seq)
            except StateError:  # handed over to the device step just now: its state() refused
                continue
            extra = {"seq": str(seq)} if requests is None else {"seq": str(seq), "request": requests[seq]}
            w.counters("sequence_", stats, **extra)
            w.histogram("sequence_accepted_drafts", accepted, **extra)
    return w.text()
