"""Shared-prefix planning for the learner's forward passes (pure: lists in, lists out).

The samples of one group (GRPO, RLOO, ...) start from the same prompt: the system message and the first
observation, often most of a short episode's tokens. A forward pass over each sample recomputes that prompt
once per sample. Run once per group instead (its keys and values then serve every sample, and in the
backward pass the gradients of all samples flow into that one computation), the result is the same
log-probs and the same gradient with fewer FLOPs.

The shared part stops before the first policy token of any row in the group, so no log-prob is ever taken
inside it: the only hidden state of the prefix a row needs is the last one (it predicts the row's first own
token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Block:
    rows: tuple[int, ...]  # row indices of the batch, in batch order
    prefix_len: int  # tokens shared by every row of the block (0: no sharing, a plain forward)


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of ``seqs`` (0 for none or an empty list)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs[1:]):
            return i
    return n


def first_policy_index(mask: Sequence[int]) -> int:
    """Index of the first masked-in (policy) token; ``len(mask)`` when there is none."""
    for i, m in enumerate(mask):
        if m:
            return i
    return len(mask)


def plan_shared_prefixes(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], groups: Sequence[int],
                         min_prefix: int = 16) -> list[Block]:
    """Split a batch into blocks: one per group of >= 2 rows whose shared prefix (cut before the group's first
    policy token) has at least ``min_prefix`` tokens, and one block (``prefix_len`` 0) of all other rows.

    Rows of a shared block each keep at least one token after the prefix. Every row is in exactly one block;
    blocks come in order of their first row, and rows within a block in batch order."""
    if not (len(seqs) == len(masks) == len(groups)):
        raise ValueError(f"{len(seqs)} sequences, {len(masks)} masks, {len(groups)} group ids")
    if min_prefix < 1:
        raise ValueError("min_prefix must be >= 1")
    by_group: dict[int, list[int]] = {}
    for r, g in enumerate(groups):
        by_group.setdefault(g, []).append(r)
    blocks: list[Block] = []
    plain: list[int] = []
    for rows in by_group.values():
        if len(rows) < 2:
            plain += rows
            continue
        n = common_prefix_len([seqs[r] for r in rows])
        n = min([n] + [first_policy_index(masks[r]) for r in rows] + [len(seqs[r]) - 1 for r in rows])
        if n >= min_prefix:
            blocks.append(Block(tuple(rows), n))
        else:
            plain += rows
    if plain:
        blocks.append(Block(tuple(sorted(plain)), 0))
    return sorted(blocks, key=lambda b: b.rows[0])
