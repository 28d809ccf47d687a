"""Tree verification in the reference stager: ``process_tree``, ``accept_path`` and its batch.

The rules (docs/design.md 2.11), spelled out for :class:`ReferenceStager`:

* A tree verify batch is the rows of a draft tree's nodes: node 0 is the
  root (the token ``last`` at ``n_past``, the sequence's end), ``parents[0]
  == -1`` and ``0 <= parents[i] < i``, node ``i`` at position ``n_past +
  depth(i)``; 1 to ``B + 1`` nodes, the first rows after a round's draft or
  accept (``accept_open`` and no tentative row).
* Its rows are the round's tentative rows, node ``i`` where position
  ``n_past + i`` would be (one ring slot each), so every bound of a linear
  verify batch holds as it is. Until ``accept_path`` the sequence holds the
  tree (``_Seq.tree``) and every READY call on it is a StateError.
* ``accept_path(nodes)`` keeps the path's rows at ``n_past .. n_past + k - 1``:
  row ``j`` of the path is copied from node ``nodes[j]``'s slot, in increasing
  ``j`` (a node's depth is at most its index, so no copy overwrites a row still
  to be read), then the sequence is what ``accept(k - 1)`` leaves after a
  linear batch of the path's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import arguments as arg
from ..errors import StateError
from ..rows.slot_moves import SlotMoves
from .seq import READY, TREE, _Seq

if TYPE_CHECKING:
    from .stager import ReferenceStager

__all__ = ["TreeVerifyMixin"]


class TreeVerifyMixin:
    """``process_tree`` / ``accept_path`` / ``accept_path_many`` of :class:`ReferenceStager`."""

    def process_tree(self, seq: int, n_past: int, parents: Any, rows: Any = None,
                     tokens: Any = None) -> np.ndarray | None:
        """Buffer a tree verify batch (the module's rules). External-row mode: returns each node's slot.
        ``tokens``: a chain drafter's ids, one per node."""
        ref = cast("ReferenceStager", self)
        i, st = ref._closed(seq)
        root = arg.integer("n_past", n_past)
        arg.rows_given(ref._external, rows, "process_tree")
        par = arg.integers("parents", parents)
        arr = None
        if not ref._external:
            arr = arg.rows(rows, ref.config.feature_dim)
            if arr.shape[0] != len(par):
                raise ValueError(f"{len(par)} parents for {arr.shape[0]} rows")
        ids = arg.tokens("", tokens, len(par))
        pos = self._check_tree(i, st, root, par)
        arg.check_tokens("", ref._chain, ids, len(par))
        slots = ref._append(i, st, root, None if arr is None else ref._encode(i, pos, arr), len(pos), ids)
        st.tree = par.tolist()
        return np.array(slots, np.int64) if ref._external else None

    def check_process_tree(self, seq: int, n_past: int, parents: Any, tokens: Any = None) -> None:
        """What ``process_tree(seq, n_past, parents, ...)`` checks of its sequence, root and parents, changing nothing."""
        ref = cast("ReferenceStager", self)
        i, st = ref._closed(seq)
        root = arg.integer("n_past", n_past)
        par = arg.integers("parents", parents)
        ids = arg.tokens("", tokens, len(par))
        self._check_tree(i, st, root, par)
        arg.check_tokens("", ref._chain, ids, len(par))

    def process_tree_many(self, seqs: Any, cu_seqlens: Any, n_pasts: Any, parents: Any,
                          rows: Any = None, tokens: Any = None) -> np.ndarray | None:
        """``process_tree`` for several sequences (checked whole): the tree of ``seqs[i]`` is
        ``parents[cu_seqlens[i]:cu_seqlens[i + 1]]`` rooted at ``n_pasts[i]``. External-row
        mode: returns the flat slots, one per node."""
        ref = cast("ReferenceStager", self)
        call = "process_tree_many"
        ids = arg.seq_ids(call, seqs)
        cu, roots, par, arr = ref._converted(call, ids, READY, self._trees_args, call, ref._external,
                                             ref.config.feature_dim, len(ids), cu_seqlens, n_pasts, parents, rows)
        flat = ref._converted(call, ids, READY, arg.tokens, call, tokens, len(par))
        states = ref._check_batch(call, ids, READY)
        arg.unique(call, ids)
        arg.offsets(call, cu, len(par))
        spans = [(int(cu[k]), int(cu[k + 1])) for k in range(len(ids))]
        positions = []
        for k, (s, st, (a, b)) in enumerate(zip(ids.tolist(), states, spans)):
            with arg.in_batch(call, k, s):
                positions.append(self._check_tree(s, st, int(roots[k]), par[a:b]))
        arg.check_tokens(call, ref._chain, flat, len(par))
        encoded: list[np.ndarray | None] = [None] * len(ids)
        if arr is not None:  # the rows' contents last, every sequence's before any change
            for k, (s, (a, b)) in enumerate(zip(ids.tolist(), spans)):
                with arg.in_batch(call, k, s):
                    encoded[k] = ref._encode(s, positions[k], arr[a:b])
        slots: list[int] = []
        for k, (s, st, (a, b)) in enumerate(zip(ids.tolist(), states, spans)):
            slots += ref._append(s, st, int(roots[k]), encoded[k], b - a, None if flat is None else flat[a:b])
            st.tree = par[a:b].tolist()
        return np.array(slots, np.int64) if ref._external else None

    @staticmethod
    def _trees_args(call: str, external: bool, feature_dim: int, n: int, cu_seqlens: Any, n_pasts: Any,
                    parents: Any, rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        arg.rows_given(external, rows, call)
        cu = arg.integers(f"{call}: cu_seqlens", cu_seqlens)
        if len(cu) != n + 1:
            raise ValueError(f"{call}: cu_seqlens must have {n + 1} entries (one more than seqs), got {len(cu)}")
        roots = arg.batch_ints(call, "n_pasts", n_pasts, n)
        par = arg.integers(f"{call}: parents", parents)
        if external:
            return cu, roots, par, None
        arr = arg.rows(rows, feature_dim)
        if arr.shape[0] != len(par):
            raise ValueError(f"{call}: {len(par)} parents for {arr.shape[0]} rows")
        return cu, roots, par, arr

    def _check_tree(self, i: int, st: _Seq, root: int, par: np.ndarray) -> np.ndarray:
        """The sequence takes a tree now, its size, the root's position, the parents; returns the rows' positions."""
        ref = cast("ReferenceStager", self)
        if not st.started or not st.accept_open or st.tentative != 0:
            why = ("its rows are final: no draft since (an accept closes a round), or a rollback, shift or more than "
                   "block_size + 1 rows since"
                   if not st.started or not st.accept_open else f"{st.tentative} rows arrived since")
            raise StateError(f"sequence {i} takes a tree verify batch only as the first rows after a round's "
                             f"draft ({why})")
        cap = ref.config.block_size + 1
        if not 1 <= len(par) <= cap:
            raise ValueError(f"a tree verify batch holds 1 to {cap} nodes (the root and at most block_size drafts), "
                             f"got {len(par)}")
        if root != st.end:
            raise ValueError(f"sequence {i}: the tree's root must stand at the sequence's end {st.end} (n_past), "
                             f"got {root}")
        if par[0] != -1:
            raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {par[0]}")
        for k in range(1, len(par)):
            if not 0 <= par[k] < k:
                raise ValueError(f"parents[{k}] = {par[k]}: a node's parent is an earlier node (0 <= parents[i] < i)")
        pos = np.arange(root, root + len(par), dtype=np.int64)
        ref._check_positions(i, st, pos)  # the range rule of every row
        return pos

    def accept_path(self, seq: int, nodes: Any) -> SlotMoves:
        """Keep the accepted root-to-node path ``nodes`` at consecutive positions; returns the copies."""
        ref = cast("ReferenceStager", self)
        st = ref._get(seq)
        i = arg.integer("seq", seq)
        ref._need(i, st, TREE)
        path = arg.integers("nodes", nodes).tolist()
        self._check_path(st, path)
        moves = self._accept_path_checked(i, st, path)
        return ref._issue(np.array(moves, np.int64).reshape(len(moves), 3), "accept_path", i)

    def accept_path_many(self, seqs: Any, cu_seqlens: Any, nodes: Any) -> SlotMoves:
        """``accept_path`` for several sequences (checked whole); the path of ``seqs[i]`` is
        ``nodes[cu_seqlens[i]:cu_seqlens[i + 1]]``. The copies of all of them, in batch order."""
        ref = cast("ReferenceStager", self)
        call = "accept_path_many"
        ids = arg.seq_ids(call, seqs)
        cu, flat = ref._converted(call, ids, TREE, self._paths_args, call, len(ids), cu_seqlens, nodes)
        states = ref._check_batch(call, ids, TREE)
        arg.unique(call, ids)
        arg.offsets(call, cu, len(flat))
        paths = [flat[cu[k]:cu[k + 1]].tolist() for k in range(len(ids))]
        for k, (s, st, path) in enumerate(zip(ids.tolist(), states, paths)):
            with arg.in_batch(call, k, s):
                self._check_path(st, path)
        moves: list[list[int]] = []
        moved: list[int] = []
        for s, st, path in zip(ids.tolist(), states, paths):
            mine = self._accept_path_checked(s, st, path)
            if mine:
                moved.append(s)
            moves += mine
        return ref._issue(np.array(moves, np.int64).reshape(len(moves), 3), call, *moved)

    @staticmethod
    def _paths_args(call: str, n: int, cu_seqlens: Any, nodes: Any) -> tuple[np.ndarray, np.ndarray]:
        cu = arg.integers(f"{call}: cu_seqlens", cu_seqlens)
        if len(cu) != n + 1:
            raise ValueError(f"{call}: cu_seqlens must have {n + 1} entries (one more than seqs), got {len(cu)}")
        return cu, arg.integers(f"{call}: nodes", nodes)

    @staticmethod
    def _check_path(st: _Seq, path: list[int]) -> None:
        tree = st.tree
        assert tree is not None  # the state check came first
        t = len(tree)
        if not 1 <= len(path) <= t:
            raise ValueError(f"a path of the tree holds 1 to {t} nodes, got {len(path)}")
        if path[0] != 0:
            raise ValueError(f"nodes[0] must be 0 (a path starts at the root), got {path[0]}")
        for k in range(1, len(path)):
            v = path[k]
            if not 0 <= v < t:
                raise ValueError(f"nodes[{k}] = {v} is not a node of the tree (0 to {t - 1})")
            if tree[v] != path[k - 1]:
                raise ValueError(f"nodes[{k}] = {v} is not a child of nodes[{k - 1}] = {path[k - 1]} "
                                 f"(its parent is node {tree[v]}): a path goes down from the root")

    def _accept_path_checked(self, i: int, st: _Seq, path: list[int]) -> list[list[int]]:
        """Compact the path onto the first tentative slots; returns the copies as ``[src, dst, count]``."""
        ref = cast("ReferenceStager", self)
        root, keep, base = st.end - st.tentative, len(path), i * ref._ring_rows  # root: the first tentative row
        moves: list[list[int]] = []
        for k in range(1, keep):
            frm, to = root + path[k], root + k
            if frm == to:
                continue
            if frm in st.rows:
                st.rows[to] = st.rows[frm]
            if frm in st.tokens:  # a chain drafter's ids move with their rows
                st.tokens[to] = st.tokens[frm]
            src, dst = base + st.ring.index(frm), base + st.ring.index(to)
            last = moves[-1] if moves else None
            # Merged while the run stays no longer than the distance it moves (no overlap).
            if last is not None and last[0] + last[2] == src and last[1] + last[2] == dst and last[2] < src - dst:
                last[2] += 1
            else:
                moves.append([src, dst, 1])
        st.tree = None
        ref._keep_tentative(st, keep)  # then as accept(keep - 1) after a linear batch
        return moves
