"""``dspark-core simulate --workload multiturn``: prefix caching and the drafter, four ways side by side.

Runs :func:`dspark_core.sim.multiturn.run_multiturn` (conversations sharing a
system prompt, each extending its own history turn after turn) with prefix
caching off, with a cold drafter at the hit boundary, with a replay of a
``K``-token tail, and with the prefix row store, and prints (or, with
``--json``, emits) per variant: target tokens prefilled per request, drafter
context rows at the first round after a hit, acceptance over the first rounds
after a hit and overall, store memory against its budget, and whether the
output equals the target's greedy decoding.

Shares ``--block``, ``--window``, ``--storage``, ``--feature-dim``, ``--seed``,
``--stager``, ``--json`` and ``--quiet`` with the long-context workload, and
``--seqs N`` (the requests of a turn run N at a time: one ``hit_many`` per
batch, one ``publish_many`` for the prompts' blocks and one for the replies',
``draft_many`` each round)
and ``--rows external`` with ``--ring`` (a ``HostRing`` and a
``HostPrefixTable``, or a ``DeviceRing`` and a ``cuda.PrefixTable``); the
options below are its own. The long workload's other options
(``--context``, ``--generate``, ``--deviation``, ``--prefill-chunk``,
``--trained``, ``--absolute-tokens``, ``--fail-every``, ``--check``,
``--plot``) are refused rather than ignored, and this workload's options with
the long one. Exit status: 0, 1 if a variant was not lossless, 2 for a bad
option.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "run", "format_table"]


def _defaults() -> Any:
    from ..sim.multiturn import MultiTurnConfig

    return MultiTurnConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--workload`` switch and the multi-turn workload's options, on ``simulate``'s parser."""
    d = _defaults()
    p.add_argument("--workload", choices=("long", "multiturn"), default="long",
                   help="long: one long-context session, windowed vs absolute staging (default); multiturn: "
                        "multi-turn chats with prefix caching: off, cold drafter, replay of K tokens, prefix row store")
    g = p.add_argument_group("multiturn workload (--workload multiturn)")
    g.add_argument("--conversations", type=int, default=d.conversations, metavar="N",
                   help=f"conversations sharing the system prompt (default {d.conversations})")
    g.add_argument("--turns", type=int, default=d.turns, metavar="N", help=f"turns per conversation (default {d.turns})")
    g.add_argument("--system-tokens", type=int, default=d.system_tokens, metavar="N",
                   help=f"tokens of the shared system prompt (default {d.system_tokens})")
    g.add_argument("--user-tokens", type=int, default=d.user_tokens, metavar="N",
                   help=f"tokens of each user message (default {d.user_tokens})")
    g.add_argument("--reply-tokens", type=int, default=d.generate, metavar="N",
                   help=f"tokens generated per request (default {d.generate})")
    g.add_argument("--block-tokens", type=int, default=d.block_tokens, metavar="N",
                   help=f"tokens per prefix-cache block (default {d.block_tokens})")
    g.add_argument("--budget-mib", type=float, default=d.budget_bytes / 2**20, metavar="MIB",
                   help=f"the row store's byte budget in MiB (default {d.budget_bytes / 2**20:g})")
    g.add_argument("--lookahead", type=int, default=d.lookahead, metavar="N",
                   help=f"how far back the toy drafter reads its context (default {d.lookahead}; below window // 2)")
    g.add_argument("--first-rounds", type=int, default=d.first_rounds, metavar="N",
                   help=f"rounds after a hit whose acceptance is reported separately (default {d.first_rounds})")


def _long_only() -> list[tuple[str, str, Any]]:
    """(option, dest, default) of the long workload's options that the multi-turn workload has no use for."""
    from .simulate_setup import DEFAULTS

    return [("--context", "context", DEFAULTS["context"]), ("--generate", "generate", DEFAULTS["generate"]),
            ("--deviation", "deviation", DEFAULTS["deviation"]),
            ("--prefill-chunk", "prefill_chunk", DEFAULTS["prefill_chunk"]), ("--trained", "trained", None),
            ("--absolute-tokens", "absolute_tokens", DEFAULTS["absolute_tokens"]), ("--fail-every", "fail_every", 0),
            ("--check", "check", False), ("--plot", "plot", None), ("--only", "only", "both"),
            ("--drafter", "drafter", DEFAULTS["drafter"])]


def _multiturn_only() -> list[tuple[str, str, Any]]:
    """(option, dest, default) of the multi-turn workload's own options."""
    d = _defaults()
    return [("--conversations", "conversations", d.conversations), ("--turns", "turns", d.turns),
            ("--system-tokens", "system_tokens", d.system_tokens), ("--user-tokens", "user_tokens", d.user_tokens),
            ("--reply-tokens", "reply_tokens", d.generate), ("--block-tokens", "block_tokens", d.block_tokens),
            ("--budget-mib", "budget_mib", d.budget_bytes / 2**20), ("--lookahead", "lookahead", d.lookahead),
            ("--first-rounds", "first_rounds", d.first_rounds)]


def _set(args: argparse.Namespace, options: list[tuple[str, str, Any]]) -> list[str]:
    return [opt for opt, dest, default in options if getattr(args, dest, default) != default]


def refused_options(args: argparse.Namespace) -> str | None:
    """The error for options the chosen workload would ignore (None: there are none)."""
    if getattr(args, "workload", "long") == "multiturn":
        bad = _set(args, _long_only())
        if bad:
            return (f"{', '.join(bad)}: not used by --workload multiturn (its prompts and replies: --system-tokens, "
                    "--user-tokens, --reply-tokens; see --help)")
        return None
    bad = _set(args, _multiturn_only())
    if bad:
        return f"{', '.join(bad)}: only used by --workload multiturn"
    return None


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


_LABELS = {"off": "prefix caching off", "cold": "cold start", "replay": "replay K tail", "store": "row store"}


def format_table(result: dict[str, Any]) -> str:
    """The human-readable comparison of :func:`run_multiturn`'s result."""
    c = result["config"]
    vs = result["variants"]
    names = list(vs)
    head = (
        f"dspark-core simulate --workload multiturn: {c['conversations']} conversations x {c['turns']} turns "
        f"({c['requests']} requests), {c['system_tokens']}-token system prompt, {c['user_tokens']}-token user "
        f"messages, {c['generate']}-token replies; B={c['block']}, W={c['window']} (K={c['w_keep']}), storage "
        f"{c['storage']} ({c['row_bytes']} B/row), prefix blocks of {c['block_tokens']} tokens, toy drafter reading "
        f"{c['lookahead']} rows back; {c.get('seqs', 1)} sequence(s) per batch; Stager: {result.get('stager', '?')}"
        + (f", external rows ({c.get('ring', 'host')} ring)" if c.get("rows") == "external" else "")
    )
    first = c["first_rounds"]

    def cell(v: str, key: str, fmt: Any) -> str:
        return fmt(vs[v][key]) if key in vs[v] else "-"

    rows = [
        ("target tokens prefilled / request", [cell(v, "prefilled_per_request", lambda x: f"{x:.1f}") for v in names]),
        ("  / request after a hit", [cell(v, "prefilled_per_hit_request", lambda x: f"{x:.1f}") for v in names]),
        ("  of which re-prefilled for the drafter", [f"{vs[v]['replayed_tokens'] / max(1, vs[v]['hit_requests']):.1f}"
                                                     for v in names]),
        ("drafter context rows, 1st round after a hit",
         [cell(v, "first_round_context_rows", lambda x: f"{x:.1f}") for v in names]),
        ("  fewest", [cell(v, "first_round_context_rows_min", str) for v in names]),
        (f"acceptance, first {first} rounds after a hit", [cell(v, "acceptance_after_hit", _pct) for v in names]),
        ("acceptance overall", [cell(v, "acceptance", _pct) for v in names]),
        ("store memory (peak) / budget",
         [f"{_mib(vs[v]['store_peak_bytes'])} / {_mib(vs[v]['store_budget_bytes'])}" if "store_bytes" in vs[v]
          else "-" for v in names]),
        ("lossless (== target greedy)", ["yes" if vs[v]["lossless"] else "NO" for v in names]),
    ]
    cols = [_LABELS.get(v, v) for v in names]
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(cols[i]), *(len(r[1][i]) for r in rows)) for i in range(len(names))]
    lines = [head, "", " " * w0 + "  " + "  ".join(cols[i].rjust(ws[i]) for i in range(len(names))),
             "-" * (w0 + sum(w + 2 for w in ws))]
    lines += [n.ljust(w0) + "  " + "  ".join(vals[i].rjust(ws[i]) for i in range(len(names))) for n, vals in rows]
    if "store" in vs and "off" in vs:
        s, o = vs["store"], vs["off"]
        lines += ["", (
            f"row store: prefills {s['prefilled_per_hit_request']:.1f} tokens per request after a hit "
            f"(caching off: {o['prefilled_per_hit_request']:.1f}), stages {s['first_round_context_rows']:.0f} context "
            f"rows at the first round (K = {c['w_keep']}), acceptance {_pct(s['acceptance_after_hit'])} after a hit "
            f"and {_pct(s['acceptance'])} overall (caching off: {_pct(o['acceptance_after_hit'])}, "
            f"{_pct(o['acceptance'])}); {s['store_full_hits']} of {s['store_hits']} hits found every row.")]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``simulate --workload multiturn``; returns the exit status."""
    from ..errors import ConfigError
    from ..sim.multiturn import MultiTurnConfig, run_multiturn
    from .simulate_setup import make_stager, ring_owner

    refused = refused_options(args)
    if refused:
        print(f"dspark-core simulate: {refused}", file=sys.stderr)
        return 2
    try:
        cfg = MultiTurnConfig(
            conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
            user_tokens=args.user_tokens, generate=args.reply_tokens, block=args.block, window=args.window,
            storage=args.storage, feature_dim=args.feature_dim, lookahead=args.lookahead,
            block_tokens=args.block_tokens, budget_bytes=int(args.budget_mib * 2**20),
            first_rounds=args.first_rounds, seed=args.seed, seqs=args.seqs, rows=args.rows,
        )
        if min(cfg.conversations, cfg.turns, cfg.user_tokens, cfg.generate, cfg.system_tokens, cfg.seqs) < 1:
            raise ValueError("--conversations, --turns, --system-tokens, --user-tokens, --reply-tokens and --seqs "
                             "must be >= 1")
        owner = ring_owner(args.ring) if cfg.rows == "external" else None
        from ..sim.blas_threads import single_blas_thread

        def make_ring(st: Any) -> Any:
            if owner == "device":
                from ..cuda import DeviceRing

                return DeviceRing(st)  # RuntimeError without a usable CUDA device
            from ..rows.host_ring import HostRing

            return HostRing(st)

        with single_blas_thread():  # the toy's skinny products, as the long workload runs them
            result = run_multiturn(cfg, make_stager=lambda c: make_stager(args.stager, c), make_ring=make_ring)
        result["config"]["ring"] = owner
    except (ConfigError, ValueError) as exc:
        print(f"dspark-core simulate: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # --ring device without a device, --stager core without the core
        print(f"dspark-core simulate: {exc}", file=sys.stderr)
        return 2
    except AssertionError as exc:  # a staging bug caught by the toy drafter
        print(f"dspark-core simulate: check failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(result))
    if not result["lossless"]:
        print("dspark-core simulate: output differs from the target's greedy decoding", file=sys.stderr)
        return 1
    return 0
