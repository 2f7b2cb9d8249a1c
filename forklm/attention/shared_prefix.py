"""Which decode rows share which KV blocks: a compressed trie over the rows' block tables.

Pure Python over block ids (no tensors), so it is tested on its own. Rows whose block tables
start with the same full blocks share those blocks' KV (a system prompt cached for every
request, a request's prompt shared by its samples, ...). The trie has one node per run of
blocks shared by the same set of rows; a row's path from the root is its list of shared
segments, most shared first, and whatever follows (its own blocks, its partial last block) is
its tail. Each segment is read once per step for all its rows (docs/design.md "Attention over
segments": one product with all their query rows), and the partial results are merged exactly.

Only full blocks are shared: a partial block belongs to one sequence (the engine copies a
prompt's partial last block for each sample), so a shared block's tokens all precede every
sharing row's current position (no query sees a key after its own position).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedSegment:
    rows: tuple[int, ...]  # decode rows (>= 2) that share these blocks, in ascending order
    blocks: tuple[int, ...]  # full blocks, in token order
    start_block: int  # index of the first block in each row's block table


def shared_segments(full_blocks: Sequence[Sequence[int]]) -> tuple[list[SharedSegment], list[int]]:
    """Segments shared by >= 2 rows, and each row's tail start (in blocks).

    full_blocks[r]: row r's full blocks in token order (the partial last block excluded).
    Returns (segments, tail_start) where tail_start[r] is the first block index of row r not
    covered by a shared segment; row r's segments are those listing r, and they tile
    blocks [0, tail_start[r]) of its table without gaps, in increasing start_block.
    """
    tables = [tuple(t) for t in full_blocks]
    order = sorted(range(len(tables)), key=lambda r: tables[r])
    segments: list[SharedSegment] = []
    tail_start = [0] * len(tables)

    def descend(rows: list[int], depth: int) -> None:  # rows sorted by table; all share blocks [0, depth)
        if len(rows) == 1:
            tail_start[rows[0]] = depth
            return
        first, last = tables[rows[0]], tables[rows[-1]]
        end = depth
        limit = min(len(first), len(last))
        while end < limit and first[end] == last[end]:
            end += 1
        if end > depth:
            segments.append(SharedSegment(tuple(sorted(rows)), first[depth:end], depth))
        for key, group in itertools.groupby(rows, key=lambda r: tables[r][end] if len(tables[r]) > end else None):
            group = list(group)
            if key is None:
                for r in group:
                    tail_start[r] = end
            else:
                descend(group, end)

    if tables:
        descend(order, 0)
    segments.sort(key=lambda s: (s.start_block, s.rows))
    return segments, tail_start
