"""One vLLM engine per process (``runtime.backends.vllm_backend`` holder): what makes two sessions' engines the same
(pure), and — with the real CPU engine (slow) — that a kept engine with other weights loaded generates exactly what
a fresh engine on those weights generates, and that two sessions and an evaluation start the engine once."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from runtime.backends.vllm_backend import model_signature, settings_diff

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _hf_folder(d: Path, **config) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
                                               "transformers_version": "4.0", **config}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "transformers_version": "4.0"}))
    (d / "tokenizer.json").write_text('{"vocab": {"a": 0, "b": 1}}')
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "b", "local_files_only": False}))
    return d


def test_model_signature_ignores_save_noise_and_sees_architecture_and_tokenizer(tmp_path):
    a = model_signature(_hf_folder(tmp_path / "a"))
    # what save_pretrained writes differently between a base model and its checkpoints
    assert model_signature(_hf_folder(tmp_path / "b", transformers_version="5.1", local_files_only=True,
                                      torch_dtype="float32", _name_or_path="/x")) == a
    assert model_signature(_hf_folder(tmp_path / "c", hidden_size=960)) != a
    e = _hf_folder(tmp_path / "e")  # a learner's checkpoint writes local_files_only: true (the smoke run's did)
    (e / "tokenizer_config.json").write_text(json.dumps({"local_files_only": True, "eos_token": "b"}))
    assert model_signature(e) == a
    (e / "tokenizer_config.json").write_text(json.dumps({"local_files_only": True, "eos_token": "a"}))
    assert model_signature(e)["tokenizer"] != a["tokenizer"]
    d = _hf_folder(tmp_path / "d")
    (d / "tokenizer.json").write_text('{"vocab": {"a": 0, "c": 1}}')
    assert model_signature(d)["tokenizer"] != a["tokenizer"] and model_signature(d)["config"] == a["config"]


def test_settings_diff_names_the_changed_keys():
    base = {"model": {"config": {"h": 1}, "tokenizer": "x"}, "dtype": "bfloat16", "max_model_len": 769, "seed": 0}
    assert settings_diff(base, dict(base)) == []
    other = {**base, "model": {"config": {"h": 2}, "tokenizer": "x"}, "max_model_len": 1537}
    assert settings_diff(base, other) == ["max_model_len", "model.config"]


# --- the real engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The embedded SmolLM2 and a copy with every weight perturbed by 10 % (multiplicative noise, seed 0)."""
    import torch
    from safetensors.torch import load_file, save_file

    from runtime.backends.model import resolve_model

    base = Path(resolve_model("smollm2-135m"))
    pert = tmp_path_factory.mktemp("perturbed")
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, pert / f.name)
    g = torch.Generator().manual_seed(0)
    tensors = {n: (t * (1 + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype))).contiguous()
               for n, t in load_file(str(base / "model.safetensors")).items()}
    save_file(tensors, str(pert / "model.safetensors"), metadata={"format": "pt"})
    return str(base), str(pert)


def _cfg(tmp_path):
    from flows.config import build_config

    return build_config("babyai", "tiny", ["rollout.backend=vllm", f"output_dir={tmp_path}"])


def _prompts(tok) -> list[list[int]]:
    out = []
    for q in ("You are in a room with a red ball. What do you do?", "Name three colors.",
              "Go to the grey key. Your options: turn left, turn right, go forward. Action:"):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


def _greedy(engine, prompts) -> list[list[int]]:
    from runtime.backends.generation import SamplingParams

    return [g.token_ids for g in engine.generate(prompts, SamplingParams(24, 0.0))]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_kept_engine_with_loaded_weights_generates_like_a_fresh_engine(folders, tmp_path):
    from transformers import AutoTokenizer

    from runtime.backends.learner import LearnerConfig, TorchLearner

    base, pert = folders
    cfg, tok = _cfg(tmp_path), AutoTokenizer.from_pretrained(base)
    prompts = _prompts(tok)
    from runtime.context import Runtime

    with Runtime() as rt:
        pool = rt.engines
        engine = pool.backend_for(cfg, base, tok)
        ids_base = _greedy(engine, prompts)
        pool.release(engine)
        assert engine._llm is not None, "a released engine stays up while its Runtime is open"

        assert pool.backend_for(cfg, pert, tok) is engine  # from the folder's safetensors
        ids_folder = _greedy(engine, prompts)
        pool.release(engine)

        learner = TorchLearner(pert, LearnerConfig(lr=1e-5, kl_coef=0.0, micro_batch_size=2))
        assert pool.backend_for(cfg, base, tok, learner) is engine  # the learner's weights, in memory
        ids_learner = _greedy(engine, prompts)
        pool.release(engine)
        del learner

        assert pool.backend_for(cfg, base, tok) is engine  # and back
        ids_back = _greedy(engine, prompts)
        pool.release(engine)
        assert pool.starts == 1
    assert engine._llm is None and not pool.stats()["live"], "closing the Runtime shuts the engine down"

    with Runtime() as rt:  # another Runtime: a new engine, shut down when it closes
        fresh = rt.engines.backend_for(cfg, pert, tok)
        assert fresh is not engine and rt.engines.starts == 1
        ids_fresh = _greedy(fresh, prompts)
        rt.engines.release(fresh)
    assert fresh._llm is None
    assert ids_folder != ids_base, "the perturbation must change the greedy replies (else nothing is tested)"
    assert ids_folder == ids_fresh
    assert ids_learner == ids_fresh
    assert ids_back == ids_base


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_two_sessions_and_an_evaluation_start_one_engine(folders, tmp_path):
    from flows.evaluate import evaluate
    from tasks import steps as T
    from runtime.context import Runtime

    base, pert = folders
    cfg = _cfg(tmp_path)
    ckpt = tmp_path / "phase-1-final"
    with Runtime() as rt:
        ledger, pool = rt.ledger, rt.engines
        key = T.open_session(cfg, base, train=True)  # a phase: learner + engine
        engine = T.get_session(key).backend
        T.get_session(key).learner.save(ckpt, {"global_step": 1})  # a real checkpoint folder, as a phase writes
        T.close_session(key)
        key = T.open_session(cfg, str(ckpt), train=True)  # the next phase, from that checkpoint
        assert T.get_session(key).backend is engine
        T.close_session(key)
        doc = evaluate(cfg, str(ckpt), n=2, turn_limits=[1], max_new_tokens=8)  # an evaluation inside the run
        assert doc["models"]["model"]["budgets"]["1"]["overall"]["episodes"] == 2
        assert pool.stats()["live"], "the evaluation keeps the run's engine"
    assert (pool.starts, pool.reuses) == (1, 2)
    assert not pool.stats()["live"] and engine._llm is None
    totals = ledger.totals
    print(f"\nengine start {engine.start_time_s:.1f} s; ledger setup {totals.get('setup', 0):.1f} s, "
          f"weight_sync {totals.get('weight_sync', 0):.1f} s, evaluation {totals.get('evaluation', 0):.1f} s")
    assert totals["setup"] >= engine.start_time_s  # the engine start counts as setup
    assert totals["weight_sync"] > 0  # the two loads into the kept engine
