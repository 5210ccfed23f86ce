"""The multi-step step benchmark's arithmetic (bench/bench_multistep.py), checked against hand-computed values."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_multistep import (  # noqa: E402
    cpu_info,
    forward_slots,
    later_mean,
    matmul_gflops,
    padding_share,
    step_parts,
    update_flops,
)

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx512f avx512_bf16 avx2

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: other
flags\t\t: fpu amx_bf16
"""


def test_cpu_info_reads_the_first_processor_and_counts_all():
    got = cpu_info(CPUINFO)
    assert got == {"model_name": "AMD EPYC 9R14", "cpu_family": "25", "model": "17", "logical_cpus": 2,
                   "bf16_flags": ["avx512_bf16"]}
    assert cpu_info("") == {"model_name": None, "cpu_family": None, "model": None, "logical_cpus": 0,
                            "bf16_flags": []}


def test_matmul_gflops():
    # 10 matmuls of 1000 x 1000: 10 * 2e9 FLOPs in 2 s = 10 GFLOPS
    assert matmul_gflops(1000, 10, 2.0) == pytest.approx(10.0)
    assert matmul_gflops(1000, 10, 0.0) == 0.0


def test_forward_slots_splits_padding_into_row_and_bucket():
    # rows of 5, 3 and 2 tokens in a forward 8 wide: 24 slots, 10 real; to the longest (5): 15 - 10 = 5;
    # from 5 to 8: 3 rows x 3 = 9
    assert forward_slots([5, 3, 2], 8) == {"slots": 24, "real": 10, "row_pad": 5, "bucket_pad": 9}
    assert forward_slots([4], 4) == {"slots": 4, "real": 4, "row_pad": 0, "bucket_pad": 0}
    with pytest.raises(ValueError):
        forward_slots([9], 8)


def test_padding_share():
    assert padding_share(24, 10) == pytest.approx(14 / 24)
    assert padding_share(0, 0) == 0.0


def test_update_flops():
    # 100 linear weights on 10 slots and a 50-weight head on 4 policy tokens: 6 * (1000 + 200)
    assert update_flops(100, 50, 10, 4) == 7200.0


def test_later_mean_skips_the_first_step_unless_it_is_the_only_one():
    rows = [{"t": {"a": 9.0}, "n": 100}, {"t": {"a": 2.0}, "n": 10}, {"t": {"a": 4.0, "b": 2.0}, "n": 20}]
    assert later_mean(rows) == {"t": {"a": 3.0, "b": 1.0}, "n": 15.0}
    assert later_mean(rows[:1]) == {"t": {"a": 9.0}, "n": 100.0}
    assert later_mean([]) == {}


def test_step_parts_leaves_the_rest_to_other():
    ledger = {"rollout": 50.0, "advantages": 1.0, "update": 30.0, "weight_sync": 2.0, "setup": 0.0}
    probe = {"update.forward": 10.0, "update.backward": 12.0, "update.optimizer": 3.0, "advantages.forward": 0.5}
    got = step_parts(ledger, 90.0, {"generation": 40.0, "env": 20.0, "waiting": 5.0}, probe)
    assert got["step"] == 90.0 and got["rollout"] == 50.0 and got["weight_sync"] == 2.0
    assert got["rollout.generation"] == 40.0 and got["rollout.env"] == 20.0 and got["rollout.waiting"] == 5.0
    assert got["update.other"] == pytest.approx(30.0 - 25.0)
    assert got["other"] == pytest.approx(90.0 - 83.0)
    assert got["advantages.forward"] == 0.5


from tests.test_learning import tiny_model_dir  # noqa: E402,F401  (the tiny policy's fixture)


def test_learner_probe_counts_the_real_tokens_of_maskless_forwards(tiny_model_dir):
    """Right-padded rows run without an attention mask (the learner's causal path): the probe still counts their
    real tokens and the padding apart, from the lengths the learner's _plain_hidden was given."""
    from bench_multistep import LearnerProbe
    from runtime.backends.learner import LearnerConfig, TorchLearner

    learner = TorchLearner(tiny_model_dir, LearnerConfig(kl_coef=0.0, bf16_autocast=False, length_buckets=8,
                                                         share_prefix=False))
    probe = LearnerProbe(learner)
    probe.stage = "update"
    seqs = [list(range(5, 34)), list(range(5, 22))]  # 29 and 17 tokens: one forward 2 x 30 wide (buckets of 8)
    learner.sequence_logprobs(seqs, masks=[[0] * 10 + [1] * (len(x) - 10) for x in seqs])  # the positions-only path
    _, tokens = probe.take()
    assert tokens["update.real"] == 46 and tokens["update.slots"] == 60
    assert tokens["update.row_pad"] == 12 and tokens["update.bucket_pad"] == 2
