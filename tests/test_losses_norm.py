"""Loss normalisation across data-parallel ranks (core.losses), on a hand-computed case.

Two ranks. Rank 0 holds sequence A (per-token losses [2]), B ([1, 1, 7]) and a zero-weight padding copy (no
policy token); rank 1 holds C ([3, 7]). The whole mini-batch:
  token-mean = (2 + 9 + 10) / 6 = 3.5        seq-mean = (2/1 + 9/3 + 10/2) / 3 = 10/3
The engine averages the two ranks' (gradients of their) losses.
"""

from __future__ import annotations

import pytest

from core.losses import batch_totals, micro_batches, sequence_weights

SHARDS = [[[2.0], [1.0, 1.0, 7.0], []], [[3.0, 7.0]]]  # per rank, per sequence, per policy token


def _counts(shard):
    return [len(seq) for seq in shard]


def _rank_loss(shard, weights):
    return sum(w * sum(seq) for w, seq in zip(weights, shard))


def test_batch_totals_by_hand():
    assert batch_totals([1, 3, 0]) == (4, 2) and batch_totals([2]) == (2, 1) and batch_totals([]) == (0, 0)
    with pytest.raises(ValueError, match="negative"):
        batch_totals([1, -1])


@pytest.mark.parametrize("mode, whole", [("token-mean", 3.5), ("seq-mean", 10 / 3)])
def test_all_reduced_totals_give_the_whole_batch_mean_after_rank_averaging(mode, whole):
    t0, t1 = batch_totals(_counts(SHARDS[0])), batch_totals(_counts(SHARDS[1]))
    totals = (t0[0] + t1[0], t0[1] + t1[1])  # the all-reduce
    assert totals == (6, 3)
    weights = [sequence_weights(_counts(s), mode, totals=totals, ranks=2) for s in SHARDS]
    if mode == "token-mean":
        assert weights == [pytest.approx([2 / 6, 2 / 6, 0.0]), pytest.approx([2 / 6])]
    else:
        assert weights == [pytest.approx([2 / 3, 2 / 9, 0.0]), pytest.approx([1 / 3])]
    averaged = sum(_rank_loss(s, w) for s, w in zip(SHARDS, weights)) / 2
    assert averaged == pytest.approx(whole, abs=1e-12)


@pytest.mark.parametrize("mode, old", [("token-mean", (11 / 4 + 10 / 2) / 2), ("seq-mean", ((2 + 3) / 2 + 5) / 2)])
def test_per_rank_normalisation_is_not_the_whole_batch_mean(mode, old):
    """The old way: each rank normalised by its own shard, then the ranks were averaged: 3.875 and 3.75."""
    averaged = sum(_rank_loss(s, sequence_weights(_counts(s), mode)) for s in SHARDS) / 2
    assert averaged == pytest.approx(old, abs=1e-12)
    assert abs(averaged - {"token-mean": 3.5, "seq-mean": 10 / 3}[mode]) > 0.3


def test_one_rank_defaults_are_the_shards_own_totals():
    assert sequence_weights([1, 3, 0], "token-mean") == sequence_weights([1, 3, 0], "token-mean", (4, 2), 1)
    assert sequence_weights([2, 4], "seq-mean") == pytest.approx([1 / 4, 1 / 8])


def test_bad_totals_and_ranks_are_refused():
    with pytest.raises(ValueError, match="smaller than this shard"):
        sequence_weights([1, 3], "token-mean", totals=(3, 2), ranks=2)
    with pytest.raises(ValueError, match="ranks"):
        sequence_weights([1], "token-mean", ranks=0)
    with pytest.raises(ValueError, match="no policy tokens"):
        sequence_weights([0], "token-mean", totals=(0, 0), ranks=2)


def test_micro_batches_by_count_and_padded_tokens():
    # count only: 4 at a time, in order
    assert micro_batches([5] * 10, 4) == [(0, 4), (4, 8), (8, 10)]
    # padded size = sequences x the longest: 100+300 -> 2x300 = 600 <= 700; adding 200 -> 3x300 = 900 > 700
    assert micro_batches([100, 300, 200, 50], 4, 700) == [(0, 2), (2, 4)]
    # a sequence longer than the cap goes alone; the next starts a new micro-batch
    assert micro_batches([10, 2000, 10, 10], 4, 1000) == [(0, 1), (1, 2), (2, 4)]
    # the cap binds before the count: 4 x 2048 padded is 8192 > 4096 -> pairs
    assert micro_batches([2048, 1500, 2048, 900], 4, 4096) == [(0, 2), (2, 4)]
    assert micro_batches([], 4, 100) == []
    with pytest.raises(ValueError):
        micro_batches([1], 0)
    with pytest.raises(ValueError):
        micro_batches([1], 2, 0)

