"""core.prefix: which rows of a batch share a prompt forward (hand-computed cases)."""

import pytest

from core.prefix import Block, common_prefix_len, first_policy_index, plan_shared_prefixes


def test_common_prefix_and_first_policy_index():
    assert common_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix_len([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix_len([[7], [8]]) == 0
    assert common_prefix_len([]) == 0
    assert first_policy_index([0, 0, 1, 1, 0, 1]) == 2
    assert first_policy_index([0, 0]) == 2


def test_plan_groups_cut_before_the_first_policy_token():
    P = list(range(100, 120))  # a 20-token prompt
    seqs = [P + [1, 2, 3], P + [1, 2, 9, 9], P + [5], [9] * 10 + [1], P + [1, 2]]
    masks = [[0] * 20 + [1] * 3, [0] * 20 + [1] * 4, [0] * 20 + [1], [0] * 10 + [1], [0] * 20 + [1, 1]]
    groups = [0, 0, 1, 2, 1]
    blocks = plan_shared_prefixes(seqs, masks, groups, min_prefix=16)
    # group 0: the common prefix is 22 tokens (the first two actions agree) but sharing stops at the prompt
    # group 1: rows 2 and 4 share the prompt; group 2 is a single row: no sharing
    assert blocks == [Block((0, 1), 20), Block((2, 4), 20), Block((3,), 0)]


def test_plan_short_or_no_common_prefix_runs_plain():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7], [8, 7]]
    masks = [[0, 0, 0, 1], [0, 0, 0, 1], [0, 1], [0, 1]]
    assert plan_shared_prefixes(seqs, masks, [0, 0, 1, 1], min_prefix=4) == [Block((0, 1, 2, 3), 0)]
    assert plan_shared_prefixes(seqs, masks, [0, 0, 1, 1], min_prefix=3) == [Block((0, 1), 3), Block((2, 3), 0)]


def test_plan_leaves_every_row_a_token_after_the_prefix():
    # identical sequences whose only policy token is the last: the prefix stops one short of it
    seqs = [[1, 2, 3, 4, 5]] * 3
    masks = [[0, 0, 0, 0, 1]] * 3
    assert plan_shared_prefixes(seqs, masks, [4, 4, 4], min_prefix=2) == [Block((0, 1, 2), 4)]


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="group ids"):
        plan_shared_prefixes([[1]], [[1]], [0, 1])
    with pytest.raises(ValueError, match="min_prefix"):
        plan_shared_prefixes([[1]], [[1]], [0], min_prefix=0)
