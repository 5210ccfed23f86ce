"""model.lora (issue 48): adapters on a frozen base, the KL reference with the adapters off, checkpoints that hold the
adapter and refuse another base, exports that transformers (and vLLM: tests/test_lora_engine.py) load, the PPO critic
with adapters, the config and the dry run's memory plan.

Tiny random Llamas with SmolLM2's tokenizer (two of them: the second is "another base"); the learner runs in fp32
(bf16 autocast off) unless a test says otherwise, so log-probs compare to float rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.trajectory import Trajectory
from runtime.backends.learner import LearnerConfig, TorchLearner
from runtime.backends.lora import LoraSpec, WrongBaseModel

SPEC = LoraSpec(rank=8, alpha=16.0)


def make_base(d: Path, seed: int) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=True,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return (make_base(tmp_path_factory.mktemp("base-a"), 7), make_base(tmp_path_factory.mktemp("base-b"), 8))


def learner(path: str, reference: str | None = None, spec: LoraSpec | None = SPEC, **kw) -> TorchLearner:
    torch.manual_seed(0)
    opts = dict(lr=0.05, kl_coef=0.01, micro_batch_size=2, bf16_autocast=False, lora=spec)
    opts.update(kw)
    return TorchLearner(path, LearnerConfig(**opts), reference_path=reference)


def sequence(tok) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": "You see a red door and a blue key. Go."},
                                   {"role": "assistant", "content": "Action: pick up the blue key"}])
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def batch(seq: list[int], n: int = 4) -> tuple[list[Trajectory], list[list[float]]]:
    """``n`` copies of ``seq`` (its last 8 tokens the policy's reply), alternately pushed up and down, one more up."""
    trajs, advs = [], []
    for i in range(n):
        t = Trajectory(task_id=0, group_id=0)
        t.start(seq[:-8])
        t.add_action(seq[-8:], [-1.0] * 8)
        trajs.append(t)
        advs.append([(1.0 if i % 2 == 0 else -0.5) * m for m in t.loss_mask])
    return trajs, advs


def maxdiff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# --- the learner -------------------------------------------------------------------------------------------------
def test_only_the_adapters_are_trainable_and_move(bases):
    lr = learner(bases[0], bases[0])
    trainable = [n for n, p in lr.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert lr.ref is None and lr.has_reference  # no second model: the reference is the base, adapters off
    opt_params = [p for g in lr.opt.param_groups for p in g["params"]]
    assert len(opt_params) == len(trainable) and all(p.requires_grad for p in opt_params)
    before = {n: p.detach().clone() for n, p in lr.model.named_parameters()}
    trajs, advs = batch(sequence(lr.tokenizer))
    for _ in range(2):  # the first step moves B (from 0), the second A too
        lr.update(trajs, advs)
    moved = {n for n, p in lr.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(trainable)  # every adapter tensor moved, no base weight did


def test_kl_reference_is_the_base_with_adapters_off(bases):
    seq = None
    for bf16 in (False, True):
        lr = learner(bases[0], bases[0], bf16_autocast=bf16)
        full = learner(bases[0], spec=None, kl_coef=0.0, bf16_autocast=bf16)  # the base itself, no adapters
        seq = sequence(lr.tokenizer)
        base_lp = full.sequence_logprobs([seq])[0]
        assert maxdiff(lr.sequence_logprobs([seq])[0], base_lp) < 1e-5  # fresh adapters (B = 0): the base
        trajs, advs = batch(seq)
        lr.update(trajs, advs)
        assert maxdiff(lr.sequence_logprobs([seq])[0], base_lp) > 1e-2  # the policy moved
        ref = lr.sequence_logprobs([seq], reference=True)[0]
        assert maxdiff(ref, base_lp) < (1e-6 if not bf16 else 1e-4), bf16
        prep = lr.prepare(trajs)  # the reference rows the loss uses: policy tokens, the group's prompt shared
        want = full.sequence_logprobs([t.token_ids for t in trajs], masks=[t.loss_mask for t in trajs],
                                      groups=[t.group_id for t in trajs])
        assert prep.ref is not None and all(maxdiff(a, b) < 1e-6 for a, b in zip(prep.ref, want))
        if bf16:  # the frozen linear layers are stored in bf16 (the values autocast runs them at)
            dtypes = {p.dtype for n, p in lr.model.named_parameters() if "base_layer" in n}
            assert dtypes == {torch.bfloat16}


def test_expert_term_8bit_adamw_and_bf16_gradients_train_the_adapters(bases):
    lr = learner(bases[0], bases[0], grad_dtype="bf16", optimizer="adamw8bit")
    seq = sequence(lr.tokenizer)
    trajs, advs = batch(seq)
    before = {n: p.detach().clone() for n, p in lr.model.named_parameters()}
    mask = [0] * (len(seq) - 8) + [1] * 8
    out = lr.update(trajs, [[0.0] * len(seq)] * 4, expert=([(seq, mask, 0)], 1.0))
    assert out["expert_samples"] == 1.0
    moved = {n for n, p in lr.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved)


def test_activation_checkpointing_gives_the_same_adapter_gradients(bases):
    grads = []
    for every in (0, 1):
        lr = learner(bases[0], bases[0], activation_checkpointing=every)
        with torch.no_grad():  # B != 0, so A's gradient is not 0 either
            for n, p in lr.model.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        got, release = {}, lr._release_grads

        def keep(lr=lr, got=got, release=release):  # the update's gradients, read before it frees them
            got.update({n: p.grad.clone() for n, p in lr.model.named_parameters() if p.grad is not None})
            release()

        lr._release_grads = keep
        lr.update(*batch(sequence(lr.tokenizer)))
        grads.append(got)
    assert len(grads[0]) == 28 and grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_checkpoint_holds_the_adapter_and_resumes_exactly(bases, tmp_path):
    a = learner(bases[0], bases[0])
    seq = sequence(a.tokenizer)
    trajs, advs = batch(seq)
    a.update(trajs, advs)
    ck = tmp_path / "ck"
    a.save(ck, {"global_step": 1})
    names = sorted(p.name for p in ck.iterdir())
    assert "adapter_model.safetensors" in names and "lora_base.json" in names
    assert not any(n.startswith("model") for n in names)  # no base weights
    assert (ck / "adapter_model.safetensors").stat().st_size < 100_000
    rec = json.loads((ck / "lora_base.json").read_text())
    assert rec["base_sha256"] == a.base_sha256 and rec["base_dir"] == bases[0]

    b = learner(str(ck), bases[0])  # as a resumed phase opens it: the checkpoint, the base as reference
    assert b.load_training_state(ck, weights=False)["global_step"] == 1
    assert maxdiff(b.sequence_logprobs([seq])[0], a.sequence_logprobs([seq])[0]) == 0.0
    a.update(trajs, advs)
    b.update(trajs, advs)
    for (n, p), (m, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert n == m and torch.equal(p, q), n  # the next update is bit-identical

    c = learner(bases[0], bases[0])  # weights=True: the adapter loads into a running learner
    c.load_training_state(ck)
    assert maxdiff(c.sequence_logprobs([seq])[0], learner(str(ck), bases[0]).sequence_logprobs([seq])[0]) == 0.0


def test_an_adapter_on_another_base_is_refused(bases, tmp_path):
    a = learner(bases[0], bases[0])
    a.save(tmp_path / "ck", {})
    with pytest.raises(WrongBaseModel, match="sha256"):
        learner(str(tmp_path / "ck"), bases[1])
    other = learner(bases[1], bases[1])
    with pytest.raises(WrongBaseModel, match="trained on the base model"):
        other.load_training_state(tmp_path / "ck")
    with pytest.raises(ValueError, match="rank"):  # the same base, another rank: a clear error too
        learner(str(tmp_path / "ck"), bases[0], spec=LoraSpec(rank=4, alpha=8.0))


def test_export_adapter_and_merged_load_in_transformers(bases, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from runtime.backends.learner import load_causal_lm
    from runtime.backends.lora import export_checkpoint

    a = learner(bases[0], bases[0])
    seq = sequence(a.tokenizer)
    a.update(*batch(seq))
    want = a.sequence_logprobs([seq])[0]
    a.save(tmp_path / "ck", {"global_step": 1})

    def logprobs(model) -> list[float]:
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
        return [0.0] + lg.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()

    info = export_checkpoint(tmp_path / "ck", tmp_path / "adapter")
    assert info["kind"] == "adapter" and "optimizer.pt" not in info["files"] and "rng.pt" not in info["files"]
    assert maxdiff(logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")), want) < 1e-5
    base = AutoModelForCausalLM.from_pretrained(bases[0])
    assert maxdiff(logprobs(PeftModel.from_pretrained(base, tmp_path / "adapter")), want) < 1e-5
    assert maxdiff(logprobs(load_causal_lm(str(tmp_path / "adapter"))), want) < 1e-5  # what evaluation loads

    info = export_checkpoint(tmp_path / "ck", tmp_path / "merged", merge=True)
    assert info["kind"] == "merged" and "config.json" in info["files"] and "adapter_config.json" not in info["files"]
    assert maxdiff(logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")), want) < 1e-5
    with pytest.raises(FileExistsError):
        export_checkpoint(tmp_path / "ck", tmp_path / "merged")

    full = learner(bases[0], spec=None, kl_coef=0.0)
    full.save(tmp_path / "full-ck", {})
    info = export_checkpoint(tmp_path / "full-ck", tmp_path / "full")
    assert info["kind"] == "full" and "model.safetensors" in info["files"] and "optimizer.pt" not in info["files"]


def test_save_weights_and_in_memory_weights_are_the_merged_policy(bases, tmp_path):
    from transformers import AutoModelForCausalLM

    a = learner(bases[0], bases[0])
    seq = sequence(a.tokenizer)
    a.update(*batch(seq))
    a.save_weights(tmp_path / "w")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "w")
    b = learner(bases[0], spec=None, kl_coef=0.0)
    b.model.load_state_dict(merged.state_dict())
    assert maxdiff(b.sequence_logprobs([seq])[0], a.sequence_logprobs([seq])[0]) < 1e-5
    pairs = dict(a.in_memory_weights()())
    assert set(pairs) == {n for n, _ in b.model.named_parameters()}  # the plain model's names
    assert all(torch.allclose(pairs[n].float(), p.float(), atol=1e-6) for n, p in merged.named_parameters())


def test_ppo_critic_trains_its_own_adapters_and_head(bases, tmp_path):
    from runtime.backends.lora import LoraCritic

    lr = learner(bases[0], bases[0], critic=True, critic_lr=1e-2)
    assert isinstance(lr.critic, LoraCritic)
    trainable = [n for n, p in lr.critic.net.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n or n.startswith("head.") for n in trainable)
    seq = sequence(lr.tokenizer)
    trajs, advs = batch(seq)
    prep = lr.prepare(trajs)
    out = lr.update(trajs, advs, prepared=prep, returns=[[1.0] * len(seq)] * 4)
    assert "critic_grad_norm" in out
    lr.save(tmp_path / "ck", {})
    assert (tmp_path / "ck" / "critic" / "model.pt").stat().st_size < 200_000  # adapters and head, no backbone
    other = learner(str(tmp_path / "ck"), bases[0], critic=True, critic_lr=1e-2)
    other.load_training_state(tmp_path / "ck", weights=False)
    assert other.critic.values([seq]) == lr.critic.values([seq])


def test_export_command(bases, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    a = learner(bases[0], bases[0])
    a.save(tmp_path / "ck", {})
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ck"), str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "LoRA adapter on" in res.output and (tmp_path / "out" / "adapter_model.safetensors").exists()
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ck"), str(tmp_path / "other"), "--base", bases[1]])
    assert res.exit_code == 2 and "sha256" in res.output  # the wrong base, refused


# --- config, dry run ---------------------------------------------------------------------------------------------
def test_config_names_and_refusals():
    from flows.config import ConfigError, build_config

    cfg = build_config("babyai", "smoke", ["model.lora.rank=16", "model.lora.target_modules=q_proj,v_proj"])
    assert cfg.model.lora.rank == 16 and cfg.model.lora.scale_alpha == 32.0
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert json.loads(cfg.model_dump_json())["model"]["lora"]["rank"] == 16  # --print-config shows it
    assert LearnerConfig.from_run(cfg).lora == LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj"))
    assert LearnerConfig.from_run(build_config("babyai", "smoke")).lora is None
    # several engines take a LoRA policy merged into their weights (auto or merged)
    two = build_config("babyai", "smoke", ["model.lora.rank=8", "rollout.backend=vllm", "rollout.engines=2"])
    assert (two.rollout.engines, two.model.lora.engine) == (2, "auto")
    ds = build_config("babyai", "tiny", ["model.lora.rank=8", "learner.engine=deepspeed", "learner.ranks=2",
                                         "rollout.backend=vllm"])  # DeepSpeed ranks train the adapters (ZeRO-2)
    assert (ds.learner.engine, ds.learner.zero_stage, ds.model.lora.rank) == ("deepspeed", 2, 8)
    for sets, says in ((["model.lora.alpha=8"], "rank is 0"),
                       (["model.lora.rank=8", "learner.engine=deepspeed", "learner.zero_stage=3",
                         "algo.optimizer=adamw", "algo.grad_dtype=fp32"], "ZeRO 0-2"),
                       (["model.lora.rank=8", "rollout.backend=transformers", "model.lora.engine=merged"],
                        "rollout.backend=vllm"),
                       (["model.lora.rank=8", "model.lora.target_modules=[]"], "empty"),
                       (["model.lora.rank=8", "rollout.backend=vllm", "rollout.engines=2", "model.lora.engine=adapter"],
                        "served by one engine")):
        with pytest.raises(ConfigError, match=says):
            build_config("babyai", "smoke", sets)


def test_dry_run_counts_adapters_not_full_optimizer_state(tmp_path):
    from flows.config import build_config
    from flows.dryrun import dry_run

    d = tmp_path / "m7b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "tie_word_embeddings": False}))
    bf16 = "model.bf16_autocast=true"  # the plan's precision pinned: it follows the machine otherwise (fp32 on AVX2)
    full = dry_run(build_config("babyai", "paper", [f"model.path={d}", bf16]))
    lora = dry_run(build_config("babyai", "paper", [f"model.path={d}", "model.lora.rank=16", bf16]))
    line = next(x for x in lora.lines if x.startswith("memory:"))
    assert "with LoRA" in line and "40.4 M parameters" in line, line  # Qwen2.5-7B, rank 16, all linear layers
    assert lora.memory_bytes < full.memory_bytes / 3
    ppo = dry_run(build_config("babyai", "paper", [f"model.path={d}", "model.lora.rank=16", "algo.estimator=ppo"]))
    assert "critic" in next(x for x in ppo.lines if x.startswith("memory:"))
    # DeepSpeed ranks: each holds the base, the adapters and its activations; the engine and runtime once
    def ds(n):
        return dry_run(build_config("babyai", "paper", [f"model.path={d}", "model.lora.rank=16", bf16,
                                                        f"learner.ranks={n}", "learner.engine=deepspeed",
                                                        "rollout.backend=vllm"]))

    one, two, three = ds(1), ds(2), ds(3)
    assert "each of 2 DeepSpeed ranks: frozen base" in next(x for x in two.lines if x.startswith("memory:"))
    per_rank = two.memory_bytes - one.memory_bytes  # a rank's learner; the engine and runtime counted once
    assert three.memory_bytes - two.memory_bytes == per_rank > 2 * 7.0e9  # the base in bf16 alone is 15 GB
    assert one.memory_bytes - per_rank > 2 * 7.0e9  # the engine's copy of the weights


def test_several_engines_serve_lora_merged_even_where_adapters_are_served(monkeypatch):
    from flows.config import build_config
    from runtime.backends import vllm_backend as vb

    monkeypatch.setattr(vb, "is_cpu_build", lambda: False)  # a build whose engine would serve the adapter
    monkeypatch.setattr(vb, "engine_serves_lora", lambda base: (True, ""))
    one = build_config("babyai", "smoke", ["model.lora.rank=8", "rollout.backend=vllm"])
    assert vb.lora_serving(one, "/models/base").mode == "adapter"
    two = build_config("babyai", "smoke", ["model.lora.rank=8", "rollout.backend=vllm", "rollout.engines=2"])
    s = vb.lora_serving(two, "/models/base")
    assert (s.mode, s.rank, s.base_dir) == ("merged", 0, "/models/base") and "rollout.engines > 1" in s.why
    # a learner in other processes (DeepSpeed ranks) has no live adapter here: merged, through the folder it writes
    remote = object()
    s = vb.lora_serving(one, "/models/base", remote)
    assert (s.mode, s.source, s.base_dir) == ("merged", None, "/models/base") and "other processes" in s.why
