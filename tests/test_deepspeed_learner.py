"""DeepSpeed learner: config and sharding (pure), a ZeRO-2 step equal to the torch learner's (1 rank, slow), and
a 2-rank ZeRO-2 step under torchrun (slow). GPU-only: ZeRO-3 across GPUs (marked gpu)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from runtime.backends.learner import LearnerConfig, Prepared

HAS_DS = importlib.util.find_spec("deepspeed") is not None
pytestmark = pytest.mark.skipif(not HAS_DS, reason="deepspeed not installed")


def test_ds_config_fills_run_values_and_validates_stage():
    from runtime.backends.deepspeed_learner import ds_config

    c = ds_config(2, LearnerConfig(lr=3e-6, grad_clip=0.5))
    assert c["zero_optimization"]["stage"] == 2 and c["gradient_clipping"] == 0.5
    assert c["gradient_accumulation_steps"] == 1 and "train_batch_size" not in c and "optimizer" not in c
    off = ds_config(2, LearnerConfig(lr=3e-6), offload_optimizer=True)
    assert off["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert off["optimizer"]["params"]["lr"] == 3e-6
    assert ds_config(3, LearnerConfig())["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    with pytest.raises(ValueError, match="stage"):
        ds_config(4, LearnerConfig())


def test_shards_are_interleaved_disjoint_and_keep_every_episode():
    from runtime.backends.deepspeed_learner import shard_for_rank, shard_padding

    live = [0, 2, 3, 5, 6, 7, 9]
    a, b = shard_for_rank(live, 0, 2), shard_for_rank(live, 1, 2)
    assert a == [0, 3, 6, 9] and b == [2, 5, 7] and sorted(a + b) == live  # nothing dropped
    assert (shard_padding(7, 0, 2), shard_padding(7, 1, 2)) == (0, 1)  # every rank trains on 4 sequences
    assert [shard_padding(5, r, 3) for r in range(3)] == [0, 0, 1] and shard_padding(2, 2, 3) == 1
    assert shard_for_rank(live, 0, 1) == live and shard_padding(7, 0, 1) == 0
    with pytest.raises(ValueError):
        shard_for_rank(live, 2, 2)


def test_zero_weight_padding_does_not_change_the_update(tmp_path):
    """A rank's padding copy runs forward/backward but leaves the step exactly as without it (tiny model)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.deepspeed_learner import zero_weight_copy
    from runtime.backends.learner import TorchLearner
    from runtime.backends.model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    trajs, advs = _batch(n=3)
    for loss_agg in ("token-mean", "seq-mean"):
        cfg = LearnerConfig(lr=1e-3, kl_coef=0.01, micro_batch_size=2, bf16_autocast=False, loss_agg=loss_agg)
        plain, padded = TorchLearner(str(tmp_path), cfg), TorchLearner(str(tmp_path), cfg)
        pad = zero_weight_copy(trajs[0])
        assert pad.num_policy_tokens == 0 and trajs[0].num_policy_tokens > 0 and pad.token_ids == trajs[0].token_ids
        sa = plain.update(trajs, advs)
        sb = padded.update(trajs + [pad], advs + [[0.0] * len(advs[0])])
        assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-5) and sb["grad_norm"] == pytest.approx(sa["grad_norm"], rel=1e-5)
        wa, wb = plain.model.state_dict(), padded.model.state_dict()
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_shard_prepared_reindexes_rows():
    from runtime.backends.deepspeed_learner import shard_prepared

    p = Prepared(live=[1, 4, 6], seqs=[[1], [4], [6]], old=[[-1.0], [-4.0], [-6.0]], ref=None, values=None,
                 stats={"logprob_mismatch": 0.1})
    s = shard_prepared(p, 1, 2)  # rank 1 of 2 gets entry 1 and pads with a copy of it
    assert s.live == [0, 1] and s.seqs == [[4], [4]] and s.old == [[-4.0], [-4.0]] and s.ref is None
    assert shard_prepared(p, 0, 2).seqs == [[1], [6]]
    assert s.stats == {"logprob_mismatch": 0.1}


def test_config_requires_vllm_for_multi_rank():
    from flows.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        build_config("babyai", "tiny", ["learner.engine=deepspeed", "learner.ranks=2"])
    with pytest.raises(ConfigError, match="deepspeed"):
        build_config("babyai", "tiny", ["learner.ranks=2"])
    c = build_config("babyai", "tiny", ["learner.engine=deepspeed", "learner.zero_stage=1"])
    assert c.learner.zero_stage == 1


def _batch(n=4, length=48):
    import torch

    from core.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    trajs, advs = [], []
    for i in range(n):
        t = Trajectory(task_id=i, group_id=i // 2)
        ids = torch.randint(100, 40000, (length,), generator=g).tolist()
        t.start(ids[: length // 3])
        t.add_action(ids[length // 3:], [-1.0] * (length - length // 3))
        trajs.append(t)
        advs.append([(1.0 if i % 2 else -1.0) * m for m in t.loss_mask])
    return trajs, advs


@pytest.mark.slow
def test_zero2_step_equals_torch_learner_step(tmp_path):
    """Same batch, same seed: one ZeRO-2 step (2 micro-batches accumulated) moves the weights like AdamW does."""
    import torch

    from runtime.backends.deepspeed_learner import DeepSpeedLearner
    from runtime.backends.learner import TorchLearner, load_causal_lm
    from runtime.backends.model import resolve_model

    path = resolve_model("smollm2-135m")
    cfg = LearnerConfig(lr=1e-4, kl_coef=0.001, micro_batch_size=2, bf16_autocast=False)
    a = TorchLearner(path, cfg)
    sa = a.update(*_batch())
    b = DeepSpeedLearner(path, cfg, zero_stage=2)
    sb = b.update(*_batch())
    assert abs(sa["grad_norm"] - sb["grad_norm"]) < 1e-3 * sa["grad_norm"]
    b.save(tmp_path / "ck", {"phase_step": 1})
    saved = load_causal_lm(str(tmp_path / "ck")).state_dict()
    init = load_causal_lm(path).state_dict()
    ref = a.model.state_dict()
    diff = max((ref[k] - saved[k]).abs().max().item() for k in saved)
    moved = max((ref[k] - init[k]).abs().max().item() for k in saved)
    assert moved > 5e-5 and diff < 1e-6
    assert (tmp_path / "ck" / "deepspeed" / "layout.json").exists()
    assert b.load_training_state(tmp_path / "ck", weights=False)["phase_step"] == 1
    b.close()


@pytest.mark.slow
def test_two_rank_zero2_step_under_torchrun(tmp_path):
    from runtime.backends.deepspeed_learner import DeepSpeedRemoteLearner
    from runtime.backends.learner import load_causal_lm
    from runtime.backends.model import resolve_model

    path = resolve_model("smollm2-135m")
    cfg = LearnerConfig(lr=1e-4, kl_coef=0.001, micro_batch_size=2, bf16_autocast=True)
    learner = DeepSpeedRemoteLearner(path, cfg, ranks=2, zero_stage=2, log_path=str(tmp_path / "ranks.log"))
    try:
        trajs, advs = _batch(n=5)
        prep = learner.prepare(trajs)
        assert len(prep.live) == 5
        st = learner.update(trajs, advs, prepared=prep)
        assert st["padded_for_sharding"] == 1.0 and st["sequences_trained"] == 5.0  # 3 + (2 + a zero-weight copy)
        assert st["grad_norm"] > 0 and st["optimizer_steps"] == 1.0
        learner.save(tmp_path / "ck", {"phase_step": 1})
        learner.save_weights(tmp_path / "w")
    finally:
        learner.close()
    assert learner.proc is None
    saved = load_causal_lm(str(tmp_path / "ck")).state_dict()
    init = load_causal_lm(path).state_dict()
    assert max((saved[k] - init[k]).abs().max().item() for k in saved) > 5e-5
    w = load_causal_lm(str(tmp_path / "w")).state_dict()
    assert all((w[k] == saved[k]).all() for k in saved)
    assert (tmp_path / "ck" / "deepspeed").is_dir()


@pytest.mark.gpu
def test_zero3_multi_gpu_step(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from runtime.backends.deepspeed_learner import DeepSpeedRemoteLearner
    from runtime.backends.model import resolve_model

    learner = DeepSpeedRemoteLearner(resolve_model("smollm2-135m"), LearnerConfig(lr=1e-5), ranks=2, zero_stage=3)
    try:
        trajs, advs = _batch(n=4)
        st = learner.update(trajs, advs)
        assert st["grad_norm"] > 0
        learner.save(tmp_path / "ck", {})  # ZeRO-3 weights gathered into one HF folder
        assert (tmp_path / "ck" / "model.safetensors").exists()
    finally:
        learner.close()


@pytest.mark.slow
def test_deepspeed_ppo_checkpoint_keeps_the_critic(tmp_path):
    """learner.engine=deepspeed with algo.estimator=ppo: the critic (weights + optimizer) is saved and restored."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.deepspeed_learner import DeepSpeedLearner
    from runtime.backends.model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=2, bf16_autocast=False, critic=True, critic_lr=1e-2)
    a = DeepSpeedLearner(str(model_dir), cfg, zero_stage=2)
    trajs, advs = _batch(n=2)
    rets = [[1.0 * m for m in t.loss_mask] for t in trajs]
    a.update(trajs, advs, returns=rets)
    a.save(tmp_path / "ck", {"phase_step": 1})
    assert (tmp_path / "ck" / "critic" / "model.pt").exists() and (tmp_path / "ck" / "critic" / "optimizer.pt").exists()
    trained = {k: v.clone() for k, v in a.critic.net.state_dict().items()}
    b = DeepSpeedLearner(str(model_dir), cfg, zero_stage=2)
    fresh = b.critic.net.state_dict()
    assert max((trained[k] - fresh[k]).abs().max().item() for k in trained) > 0  # the critic did train
    b.load_training_state(tmp_path / "ck")
    assert all(torch.equal(trained[k], v) for k, v in b.critic.net.state_dict().items())
    assert len(b.critic.opt.state) > 0


class _Evil:
    """Unpickling this runs ``open(marker, "w")``: what a tampered checkpoint file could do on resume."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_deepspeed_checkpoint_files_load_weights_only(tmp_path):
    """DeepSpeed's own checkpoint loads (its ``checkpoint_engine.load``, ``weights_only=False`` upstream) go through
    ``torch.load(weights_only=True)`` with only DeepSpeed's known classes allowed: its real optimizer-state objects
    load, a tampered file is refused with one line naming it, and its payload never runs."""
    import types

    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from runtime.backends.deepspeed_learner import safe_checkpoint_loads
    from runtime.backends.safe_load import UnsafeCheckpointFile

    engine = types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    safe_checkpoint_loads(engine)
    good = tmp_path / "optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
                                         "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
                                         "fp32": torch.ones(4)}}, good)
    sd = engine.checkpoint_engine.load(str(good), map_location=torch.device("cpu"))
    assert isinstance(sd["optimizer_state_dict"]["loss_scaler"], LossScaler)
    assert sd["optimizer_state_dict"]["zero_stage"] == ZeroStageEnum.gradients
    marker = tmp_path / "payload-ran"
    bad = tmp_path / "tampered.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": _Evil(marker)}}, bad)
    with pytest.raises(UnsafeCheckpointFile) as e:
        engine.checkpoint_engine.load(str(bad), map_location=torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and "io.open, which is not allowed" in msg
    assert not marker.exists()


def test_deepspeed_configs_are_found_from_an_installed_package(tmp_path, monkeypatch):
    """A wheel installs infra/deepspeed/*.json under <prefix>/share/scalinginter/deepspeed (pyproject data-files);
    without the source tree there, that copy is used; $SCALINGINTER_DEEPSPEED_CONFIGS wins over both."""
    import sys

    import runtime.backends.deepspeed_learner as dl

    assert dl.deepspeed_config_dir() == dl.REPO_ROOT / "infra" / "deepspeed"  # a checkout
    share = tmp_path / "prefix" / "share" / "scalinginter" / "deepspeed"
    share.mkdir(parents=True)
    for f in (dl.REPO_ROOT / "infra" / "deepspeed").glob("*.json"):
        (share / f.name).write_text(f.read_text())
    monkeypatch.setattr(dl, "REPO_ROOT", tmp_path / "site-packages")  # an installed package: no infra/ beside it
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "prefix"))
    assert dl.deepspeed_config_dir() == share
    assert dl.ds_config(2, LearnerConfig())["zero_optimization"]["stage"] == 2
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="SCALINGINTER_DEEPSPEED_CONFIGS"):
        dl.deepspeed_config_dir()
    monkeypatch.setenv("SCALINGINTER_DEEPSPEED_CONFIGS", str(share))
    assert dl.deepspeed_config_dir() == share
    import tomllib

    data_files = tomllib.loads((dl.__file__ and (Path(__file__).resolve().parents[1] / "pyproject.toml")).read_text())
    assert data_files["tool"]["setuptools"]["data-files"]["share/scalinginter/deepspeed"] == ["infra/deepspeed/*.json"]


@pytest.mark.slow
def test_tampered_deepspeed_optimizer_file_is_refused_on_resume(tmp_path):
    """A real ZeRO-2 checkpoint of the learner resumes; the same checkpoint with its optimizer partition file
    replaced by one carrying a payload is refused by ``load_training_state`` with one line, the payload never run."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.deepspeed_learner import DeepSpeedLearner
    from runtime.backends.model import resolve_model
    from runtime.backends.safe_load import UnsafeCheckpointFile

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=2, bf16_autocast=False)
    a = DeepSpeedLearner(str(model_dir), cfg, zero_stage=2)
    a.update(*_batch(n=2))
    a.save(tmp_path / "ck", {"phase_step": 1})
    b = DeepSpeedLearner(str(model_dir), cfg, zero_stage=2)
    assert b.load_training_state(tmp_path / "ck")["phase_step"] == 1  # DeepSpeed's own files pass weights_only
    optim = next((tmp_path / "ck" / "deepspeed" / "state").glob("*optim_states.pt"))
    sd = torch.load(optim, weights_only=False)
    marker = tmp_path / "payload-ran"
    sd["optimizer_state_dict"]["loss_scaler"] = _Evil(marker)
    torch.save(sd, optim)
    with pytest.raises(UnsafeCheckpointFile) as e:
        DeepSpeedLearner(str(model_dir), cfg, zero_stage=2).load_training_state(tmp_path / "ck")
    assert "\n" not in str(e.value) and optim.name in str(e.value)
    assert not marker.exists()
