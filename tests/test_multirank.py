"""Two data-parallel ranks update the policy exactly like one rank on the whole batch.

The real ``DeepSpeedLearner`` (ZeRO-2) runs in 2 processes on CPU (torch.multiprocessing spawn, gloo, rendezvous
at 127.0.0.1 on a free port), on a tiny randomly initialised Llama (hidden 32, 2 layers, vocab 64). The batch's
two shards have very different policy-token counts (rank 0: 17, rank 1: 37 plus a zero-weight padding copy).
The optimizer is plain SGD (a DeepSpeed config naming ``torch.optim.SGD``): its step is linear in the gradient,
so the weights show a wrong normalisation (Adam's first step, ~lr * sign(grad), would hide a scale error). PPO's
case trains a critic too (SGD as well): each rank's whole critic, its gradients averaged over the ranks, must end
where the one-rank critic does. LoRA's case trains rank-4 adapters on a frozen base: the adapters must end where one
rank's do, and the base must not move.

Reference: ``TorchLearner`` (one process, the whole batch, SGD). Tolerance: weights within 1e-6 (fp32, no
autocast); the weights move by ~1e-1, and the old per-rank normalisation lands > 1e-3 away (computed here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

HAS_DS = importlib.util.find_spec("deepspeed") is not None
pytestmark = pytest.mark.skipif(not HAS_DS, reason="deepspeed not installed")

TOL = 1e-6
WORLD = 2
# policy tokens per episode; live episodes are sharded interleaved: rank 0 gets 0, 2, 4 (3 + 5 + 9 = 17 tokens),
# rank 1 gets 1, 3 (20 + 17 = 37) and a zero-weight copy of episode 1. Episode 5 is masked (never trained on).
ACTIONS = [[3], [12, 8], [5], [9, 8], [4, 5], [6]]


def _batch():
    import torch

    from core.trajectory import Trajectory

    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, 64, (n,), generator=g).tolist()  # 0-2 are special (2 is the pad id)

    trajs, advs = [], []
    for i, turns in enumerate(ACTIONS):
        t = Trajectory(task_id=i, group_id=i)
        t.start(ids(4 + i))
        for j, n in enumerate(turns):
            if j:
                t.add_env(ids(3))
            t.add_action(ids(n), (-2.0 - torch.rand(n, generator=g)).tolist())  # the rollout's log-probs
        t.masked = i == 5
        trajs.append(t)
        advs.append([(0.5 + 0.3 * i) * (1 if i % 2 else -1) * m for m in t.loss_mask])
    return trajs, advs


CASES = {  # name: (LearnerConfig kwargs, prepare's old_for_reward)
    "token_mean_one_step": (dict(loss_agg="token-mean", kl_coef=0.05), False),
    "seq_mean_two_epochs": (dict(loss_agg="seq-mean", kl_coef=0.05, ppo_epochs=2), True),  # old log-probs prepared
    # PPO: a critic on every rank, its gradients averaged over the ranks (SGD for it too, as for the policy)
    "ppo_critic": (dict(loss_agg="token-mean", kl_coef=0.05, critic=True, critic_lr=0.5, value_clip=10.0), False),
    # LoRA: the frozen base whole on each rank, the adapters' gradients averaged (the KL reference: the base with the
    # adapters off); the learners seed their adapters' init alike (ADAPTER_SEED)
    "lora": (dict(loss_agg="token-mean", kl_coef=0.05, lora="q_proj,v_proj"), False),
}
ADAPTER_SEED = 7


def _returns(trajs):
    """Per-token critic targets of the PPO case (any fixed numbers: the test compares two ways to fit them)."""
    return [[(0.25 * i - 0.5) * m for m in t.loss_mask] for i, t in enumerate(trajs)]


def _sgd_critic(learner):
    import torch

    if learner.critic is not None:
        learner.critic.opt = torch.optim.SGD(learner.critic.net.parameters(), lr=learner.cfg.critic_lr)


def _cfg(kw):
    from runtime.backends.learner import LearnerConfig
    from runtime.backends.lora import LoraSpec

    kw = dict(kw)
    if "lora" in kw:  # rank-4 adapters on the given modules (alpha 8: scale 2)
        kw["lora"] = LoraSpec(4, 8.0, 0.0, tuple(kw["lora"].split(",")))
    return LearnerConfig(lr=0.5, grad_clip=1e9, micro_batch_size=2, bf16_autocast=False, **kw)


def _rank(rank: int, port: int, model_dir: str, ds_config: str, out: str) -> None:
    """One spawned rank: the real DeepSpeedLearner, prepared and updated as the torchrun workers do."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import torch

    torch.set_num_threads(1)
    from runtime.backends.deepspeed_learner import DeepSpeedLearner

    results = {}
    for name, (kw, old_for_reward) in CASES.items():
        torch.manual_seed(ADAPTER_SEED)
        learner = DeepSpeedLearner(model_dir, _cfg(kw), zero_stage=2, config_path=ds_config)
        _sgd_critic(learner)
        trajs, advs = _batch()
        prep = learner.prepare(trajs, old_for_reward=old_for_reward)
        stats = learner.update_shard(trajs, advs, prep, _returns(trajs) if learner.critic is not None else None)
        results[name] = {"prepared": prep, "stats": stats,
                         "weights": {k: v.detach().clone() for k, v in learner.model.state_dict().items()},
                         "critic": None if learner.critic is None else
                         {k: v.detach().clone() for k, v in learner.critic.net.state_dict().items()}}
        learner.close()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.model import resolve_model

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(d)
    AutoTokenizer.from_pretrained(resolve_model("smollm2-135m")).save_pretrained(d)  # pad id 2 < 64
    return str(d)


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory):
    """Both ranks' results per case (rank 0's prepared batch, stats and weights; rank 1's weights)."""
    import torch
    import torch.multiprocessing as mp

    from envs.spawn import free_port

    d = tmp_path_factory.mktemp("ranks")
    ds_config = d / "sgd_zero2.json"
    ds_config.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {}},
                                     "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}))
    mp.spawn(_rank, args=(free_port(), tiny_model, str(ds_config), str(d)), nprocs=WORLD, join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _one_rank(model_dir, kw, trajs, advs, old_for_reward):
    import torch

    from runtime.backends.learner import TorchLearner

    torch.manual_seed(ADAPTER_SEED)
    learner = TorchLearner(model_dir, _cfg(kw))
    learner.opt = torch.optim.SGD([q for q in learner.model.parameters() if q.requires_grad], lr=learner.cfg.lr)
    _sgd_critic(learner)
    prep = learner.prepare(trajs, old_for_reward=old_for_reward)
    stats = learner.update(trajs, advs, prepared=prep,
                           returns=_returns(trajs) if learner.critic is not None else None)
    if learner.critic is not None:
        stats["_critic"] = learner.critic.net.state_dict()
    return prep, stats, learner.model.state_dict()


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow  # 2 spawned ranks import DeepSpeed and build 2 learners each: minutes on a busy 2-core machine
@pytest.mark.parametrize("case", list(CASES))
def test_two_rank_update_equals_one_rank_update(two_ranks, tiny_model, case):
    from runtime.backends.learner import load_causal_lm

    kw, old_for_reward = CASES[case]
    trajs, advs = _batch()
    prep, stats, weights = _one_rank(tiny_model, kw, trajs, advs, old_for_reward)
    r0, r1 = two_ranks[0][case], two_ranks[1][case]
    assert _max_diff(r0["weights"], r1["weights"]) == 0.0  # the ranks agree
    if kw.get("lora"):  # the adapters moved from B = 0; the base stayed
        lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
        assert len(lora_b) == 4 and _max_diff(lora_b, {k: 0 * v for k, v in lora_b.items()}) > 1e-2
        init = {k.replace(".base_layer", ""): v for k, v in load_causal_lm(tiny_model).state_dict().items()}
        base = {k.replace(".base_layer", ""): v for k, v in r0["weights"].items() if "lora_" not in k}
        assert base.keys() == init.keys() and _max_diff(base, init) == 0.0
    else:
        init = load_causal_lm(tiny_model).state_dict()
        assert _max_diff(weights, init) > 1e-2  # the update did move the weights
    assert _max_diff(r0["weights"], weights) < TOL
    for k in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):  # stats are the whole batch's too
        assert r0["stats"][k] == pytest.approx(stats[k], rel=1e-5, abs=1e-7), k
    assert r0["stats"]["sequences_trained"] == 5.0 and r0["stats"]["padded_for_sharding"] == 1.0
    if kw.get("critic"):  # the ranks' critics agree, moved, and took the one-rank critic's step on the whole batch
        from runtime.backends.critic import Critic

        assert _max_diff(r0["critic"], r1["critic"]) == 0.0
        fresh = Critic(tiny_model, 0.5).net.state_dict()
        assert _max_diff(stats["_critic"], fresh) > 1e-2
        assert _max_diff(r0["critic"], stats["_critic"]) < TOL
        assert r0["stats"]["critic_grad_norm"] == pytest.approx(stats["critic_grad_norm"], rel=1e-5)
        assert stats["value_loss"] > 0
        assert r0["stats"]["value_loss"] == pytest.approx(stats["value_loss"], rel=1e-5, abs=1e-7)
    else:
        assert r0["critic"] is None


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_prepare_gathers_the_whole_batch(two_ranks, tiny_model, case):
    """Each rank computed only its share of the old / reference log-probs; gathered, they are the whole batch's."""
    from runtime.backends.learner import TorchLearner

    kw, old_for_reward = CASES[case]
    trajs, _ = _batch()
    want = TorchLearner(tiny_model, _cfg(kw)).prepare(trajs, old_for_reward=old_for_reward)
    for r in range(WORLD):
        got = two_ranks[r][case]["prepared"]
        assert got.live == want.live == [0, 1, 2, 3, 4] and got.seqs == want.seqs
        assert (got.old is None) == (not old_for_reward) == (want.old is None)
        for field in ("old", "ref", "values"):  # PPO: the critic values each rank computed for its share
            a, b = getattr(got, field), getattr(want, field)
            if b is not None:
                assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < TOL, field
        if old_for_reward:
            assert got.stats["logprob_mismatch"] == pytest.approx(want.stats["logprob_mismatch"], rel=1e-6)


@pytest.mark.slow  # ~20 s of CPU; the pure maths of the same claim is tests/test_losses_norm.py (default tier)
def test_per_rank_normalisation_would_fail(tiny_model):
    """The old behaviour (each rank normalised by its own shard, then the gradients averaged) is, for one SGD
    step, the mean of the one-rank updates on each shard: far outside the tolerance above."""
    from runtime.backends.deepspeed_learner import shard_for_rank

    kw, _ = CASES["token_mean_one_step"]
    trajs, advs = _batch()
    _, _, whole = _one_rank(tiny_model, kw, trajs, advs, False)
    live = [0, 1, 2, 3, 4]
    shards = [shard_for_rank(live, r, WORLD) for r in range(WORLD)]
    assert [sum(trajs[i].num_policy_tokens for i in s) for s in shards] == [17, 37]
    per_rank = [_one_rank(tiny_model, kw, [trajs[i] for i in s], [advs[i] for i in s], False)[2] for s in shards]
    old = {k: (per_rank[0][k] + per_rank[1][k]) / 2 for k in whole}
    assert _max_diff(old, whole) > 1e-3


def test_merge_prepared_puts_the_shares_rows_in_batch_order():
    from runtime.backends.deepspeed_learner import merge_prepared
    from runtime.backends.learner import Prepared

    a = Prepared(live=[1, 5], seqs=[[1], [5]], old=[[-1.0], [-5.0]], ref=None, values=None)
    b = Prepared(live=[3], seqs=[[3]], old=[[-3.0]], ref=None, values=None)
    empty = Prepared(live=[], seqs=[])  # a rank with no live episode of its own
    m = merge_prepared([a, b, empty])
    assert m.live == [1, 3, 5] and m.seqs == [[1], [3], [5]] and m.old == [[-1.0], [-3.0], [-5.0]]
    assert m.ref is None and m.values is None and m.final_values is None
    with pytest.raises(ValueError, match="overlap"):
        merge_prepared([a, a])
    with pytest.raises(ValueError, match="lack 'old'"):
        merge_prepared([a, Prepared(live=[3], seqs=[[3]])])


def test_ppo_config_on_several_ranks_and_nodes():
    """PPO's critic trains on every rank (its gradients averaged): the config takes algo.estimator=ppo with
    learner.ranks > 1 and learner.nodes > 1."""
    from flows.config import build_config

    base = ["learner.engine=deepspeed", "algo.estimator=ppo", "rollout.backend=vllm"]
    assert build_config("babyai", "tiny", base + ["learner.ranks=2"]).learner.ranks == 2
    cfg = build_config("babyai", "tiny", base + ["learner.nodes=2", "learner.master_addr=10.0.0.5"])
    assert (cfg.learner.nodes, cfg.algo.estimator) == (2, "ppo")


@pytest.mark.slow  # one in-process DeepSpeed rank, three learners on the tiny model: ~1 min on a busy 2-core machine
def test_lora_on_deepspeed_checkpoint_resumes_exactly(tiny_model, tmp_path):
    """One DeepSpeed rank (ZeRO-2, the stock config's client AdamW) with LoRA: its checkpoint is an adapter folder
    (PEFT's files and the base record, no full weights) with DeepSpeed's state of the adapters alone (the frozen base
    left out), a learner resumed from it takes the next step as the uninterrupted one does (AdamW's moments
    restored), and ``save_weights`` writes the policy with the adapters merged."""
    import torch

    from runtime.backends.deepspeed_learner import DeepSpeedLearner
    from runtime.backends.learner import load_causal_lm
    from runtime.backends.lora import is_adapter_dir, merged_entries

    kw, _ = CASES["lora"]
    cfg = dataclasses.replace(_cfg(kw), lr=1e-2)
    trajs, advs = _batch()
    advs2 = [[-a for a in row] for row in advs]  # the second step: another batch's advantages
    torch.manual_seed(ADAPTER_SEED)
    a = DeepSpeedLearner(tiny_model, cfg, zero_stage=2)
    a.update(trajs, advs)
    ck = tmp_path / "ck"
    a.save(ck, {"phase_step": 1})
    a.update(trajs, advs2)
    want = {k: v.detach().clone() for k, v in a.model.state_dict().items() if "lora_" in k}
    a.close()
    assert is_adapter_dir(ck) and not (ck / "model.safetensors").exists()
    (states,) = (ck / "deepspeed" / "state").glob("*model_states.pt")
    module = torch.load(states, weights_only=False, map_location="cpu")["module"]
    assert module and all("lora_" in k for k in module)  # the base is not in DeepSpeed's checkpoint
    assert json.loads((ck / "deepspeed" / "layout.json").read_text()) == {"world_size": 1, "zero_stage": 2,
                                                                          "lora": True}
    b = DeepSpeedLearner(str(ck), cfg, reference_path=tiny_model, zero_stage=2)
    assert b.load_training_state(ck)["phase_step"] == 1
    b.update(trajs, advs2)
    got = {k: v for k, v in b.model.state_dict().items() if "lora_" in k}
    assert got.keys() == want.keys() and _max_diff(got, want) < TOL
    moved = {k: v for k, v in got.items() if "lora_B" in k}
    assert _max_diff(moved, {k: 0 * v for k, v in moved.items()}) > 1e-3
    b.save_weights(tmp_path / "merged")
    saved = load_causal_lm(str(tmp_path / "merged")).state_dict()
    merged = {n: fetch() for n, _, fetch in merged_entries(b.model)}
    assert _max_diff(merged, saved) < TOL and _max_diff(merged, load_causal_lm(tiny_model).state_dict()) > 1e-4
    b.close()


@pytest.mark.slow  # torchrun with 2 ranks importing DeepSpeed: ~1 min on a busy 2-core machine
def test_lora_under_torchrun_writes_the_adapter_and_the_merged_policy(tiny_model, tmp_path):
    """The run's path for LoRA on several ranks: ``DeepSpeedRemoteLearner`` sends the learner's config (its LoRA
    spec included) to 2 torchrun ranks, which train the adapters; its checkpoint is the adapter folder and
    ``save_weights`` (how a vLLM engine gets the policy from ranks in other processes) the base with the adapters
    merged, which moved away from the base."""
    from runtime.backends.deepspeed_learner import DeepSpeedRemoteLearner
    from runtime.backends.learner import load_causal_lm
    from runtime.backends.lora import is_adapter_dir, load_merged_causal_lm

    kw, _ = CASES["lora"]
    learner = DeepSpeedRemoteLearner(tiny_model, _cfg(kw), ranks=2, zero_stage=2, log_path=str(tmp_path / "r.log"))
    try:
        trajs, advs = _batch()
        st = learner.update(trajs, advs, prepared=learner.prepare(trajs))
        assert st["optimizer_steps"] == 1.0 and st["grad_norm"] > 0
        learner.save(tmp_path / "ck", {"phase_step": 1})
        learner.save_weights(tmp_path / "merged")
    finally:
        learner.close()
    assert is_adapter_dir(tmp_path / "ck") and not (tmp_path / "ck" / "model.safetensors").exists()
    merged = load_causal_lm(str(tmp_path / "merged")).state_dict()
    assert _max_diff(merged, load_merged_causal_lm(str(tmp_path / "ck")).state_dict()) < TOL
    assert _max_diff(merged, load_causal_lm(tiny_model).state_dict()) > 1e-3
