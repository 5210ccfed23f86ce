"""Expert demonstrations and the behaviour-cloning warm start.

Fast: the demo trajectories are exactly what the rollout builds for a model that replied with the expert's text
(toy env in-process, the real SmolLM2 tokenizer and chat template, no forward pass); the NLL loss on hand-computed
cases; the SFT entry of the learner on a tiny random model. Slow: ``scalinginter warmstart`` on TextCraft with the
real SmolLM2 at toy size, then ``scalinginter eval`` loading the folder.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.chat import ChatFormat
from core.demos import action_reply
from core.losses import nll_loss
from envs.toy import ToyEnv
from runtime.backends.generation import Generation, SamplingParams
from tasks.demos import DemoError, collect_demos, expert_for
from envs.sessions import LocalEpisode
from runtime.rollout import EpisodeSpec, RolloutRequest, RolloutRuntime, rollout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from runtime.backends.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


class PrizeToy(ToyEnv):
    """The toy env with the prize door in ``info`` (so a stateless test expert can play two turns)."""

    def reset(self, data_idx):
        obs, info = super().reset(data_idx)
        return obs, {**info, "prize": self._prize}

    def _result(self, reward, **kw):
        r = super()._result(reward, **kw)
        r.info["prize"] = self._prize
        return r


def two_turn_expert(observation: str, info: dict) -> str | None:
    """Opens a wrong door first (a thought, then the action), then the prize door; gives up on prize door 3."""
    prize = info["prize"]
    if prize == 3:
        return None
    if "Attempts left: 2" in observation:
        return f"The note could be a trick.\nAction: open door {prize % 3 + 1}"
    return f"Action: open door {prize}"


def expected_episode(chat: ChatFormat, tok, task: int) -> tuple[list[int], list[int], list[int], list[float]] | None:
    """Built by hand from the chat framing: prompt | reply 1 + EOS | env turn | reply 2 + EOS (None: prize door 3)."""
    env = PrizeToy()
    obs, info = env.reset(task)
    if info["prize"] == 3:
        return None
    eos = tok.eos_token_id
    r1 = tok(f"Action: open door {info['prize'] % 3 + 1}", add_special_tokens=False)["input_ids"] + [eos]
    obs1 = env.step(f"Action: open door {info['prize'] % 3 + 1}").observation
    r2 = tok(f"Action: open door {info['prize']}", add_special_tokens=False)["input_ids"] + [eos]
    env_ids = chat.env_turn_ids(obs1, True)
    prompt = chat.prompt_ids(env.instruction(), obs)
    ids = prompt + r1 + env_ids + r2
    mask = [0] * len(prompt) + [1] * len(r1) + [0] * len(env_ids) + [1] * len(r2)
    ends = [len(prompt) + len(r1) - 1, len(ids) - 1]
    return ids, mask, ends, [0.0, 1.0]


class ExpectedModel:
    """A model that replies with the expert's text: for each prompt, the next reply of the hand-built sequence
    the prompt is a prefix of."""

    def __init__(self, tok, seqs):
        self.eos_token_id = tok.eos_token_id
        self.seqs = seqs

    def sync_weights(self):
        pass

    def generate(self, prompts, params: SamplingParams):
        out = []
        for p in prompts:
            (ids, mask) = next((s, m) for s, m in self.seqs if s[:len(p)] == p)
            end = mask.index(0, len(p)) if 0 in mask[len(p):] else len(ids)
            out.append(Generation(ids[len(p):end], [-0.1] * (end - len(p)), "stop"))
        return out


def test_demos_equal_the_rollout_of_a_model_replying_with_the_expert_text(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)
    tasks = [0, 1, 2, 3, 4, 5, 6, 7]
    expected = {t: expected_episode(chat, tokenizer, t) for t in tasks}
    assert 0 < sum(e is None for e in expected.values()) < len(tasks)  # the give-up path is exercised

    res = collect_demos(tasks, lambda i: LocalEpisode(PrizeToy()), two_turn_expert, chat, turn_limit=4,
                        max_new_tokens=16, token_budget=2048, seed=7)
    solvable = [t for t in tasks if expected[t] is not None]
    assert res.attempted == len(tasks) and res.succeeded == len(solvable) == len(res.trajectories)
    assert res.gave_up == len(tasks) - len(solvable)
    assert [t.task_id for t in res.trajectories] == solvable

    # the rollout itself, driven by a model that replies with the expert's text
    model = ExpectedModel(tokenizer, [(e[0], e[1]) for e in expected.values() if e is not None])
    specs = [EpisodeSpec(task_id=t, group_id=g) for g, t in enumerate(solvable)]
    ref, _ = asyncio.run(rollout(RolloutRequest(specs, 4, SamplingParams(16, 1.0), 2048),
                                 RolloutRuntime(model, chat, lambda i: LocalEpisode(PrizeToy()))))
    for demo, r in zip(res.trajectories, ref):
        ids, mask, ends, rewards = expected[demo.task_id]
        assert demo.token_ids == r.token_ids == ids
        assert demo.loss_mask == r.loss_mask == mask
        assert demo.action_ends == r.action_ends == ends
        assert demo.turn_rewards == r.turn_rewards == rewards
        assert demo.prompt_len == r.prompt_len and demo.success and r.success
        assert demo.finish_reason == r.finish_reason == "success"
        assert demo.replies == r.replies  # the env saw the same text


def test_a_reply_longer_than_the_turn_cap_is_cut_like_a_sampled_one(tokenizer):
    chat = ChatFormat.from_tokenizer(tokenizer)

    def verbose(obs, info):
        return "Action: " + "please " * 20 + "open door 1"  # far beyond 6 tokens: cut, the env sees no door

    res = collect_demos([0, 1], lambda i: LocalEpisode(ToyEnv()), verbose, chat, turn_limit=2, max_new_tokens=6,
                        token_budget=2048)
    assert res.succeeded == 0 and res.trajectories == []
    assert res.finish_reasons == {"turn_limit": 2}


def test_action_reply():
    assert action_reply("Following the recipe tree.\nAction: get 1 oak log") == "Action: get 1 oak log"
    assert action_reply("Action: open door 1\nthinking\naction:  open door 2 ") == "Action: open door 2"
    assert action_reply("turn left") == "Action: turn left"
    for bad in ("", "Action:   ", "two\nlines"):
        with pytest.raises(ValueError):
            action_reply(bad)


def test_expert_lookup():
    assert expert_for("textcraft").__module__ == "envs.textcraft.contract"
    assert expert_for("toy").__module__ == "envs.toy_contract"
    with pytest.raises(DemoError, match="no scripted expert"):
        expert_for("no_such_env")


# --- the loss ------------------------------------------------------------------------------------------
def test_nll_loss_hand_computed():
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -3.0, -4.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]])
    loss, st = nll_loss(logp, mask)
    # masked-in: -1, -2, -4 -> (1 + 2 + 4) / 3
    assert math.isclose(float(loss), 7 / 3, rel_tol=1e-6) and st["tokens"] == 3
    loss, st = nll_loss(logp, mask, denom=7)  # a micro-batch of a 7-token batch
    assert math.isclose(float(loss), 1.0, rel_tol=1e-6) and math.isclose(st["nll"], 1.0, rel_tol=1e-6)
    # a masked-out -inf does not leak in
    loss, _ = nll_loss(torch.tensor([[float("-inf"), -2.0]]), torch.tensor([[0, 1]]))
    assert float(loss) == 2.0
    # the gradient is -mask / denom
    lp = logp.clone().requires_grad_(True)
    nll_loss(lp, mask)[0].backward()
    assert torch.allclose(lp.grad, -mask.float() / 3)


def test_nll_loss_errors():
    with pytest.raises(ValueError, match="at least one token"):
        nll_loss(torch.zeros(1, 3), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape"):
        nll_loss(torch.zeros(1, 3), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="smaller"):
        nll_loss(torch.zeros(1, 3), torch.ones(1, 3), denom=2)
    with pytest.raises(ValueError, match="0 and 1"):
        nll_loss(torch.zeros(1, 2), torch.tensor([[0, 2]]))


# --- the learner's SFT entry on a tiny random model ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def test_sft_lowers_the_nll_and_accumulates_micro_batches_exactly(tiny_model_dir, tokenizer):
    from runtime.backends.learner import LearnerConfig, TorchLearner

    chat = ChatFormat.from_tokenizer(tokenizer)
    res = collect_demos(list(range(8)), lambda i: LocalEpisode(PrizeToy()), two_turn_expert, chat, turn_limit=4,
                        max_new_tokens=16, token_budget=2048)
    demos = res.trajectories
    # one optimizer step over 4 demos: micro-batches of 1 and of 4 give the same gradient (token-mean of the batch)
    grads = []
    for mb in (1, 4):
        torch.manual_seed(0)
        ln = TorchLearner(tiny_model_dir, LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=mb,
                                                        bf16_autocast=False, grad_clip=1e9))
        captured = {}
        ln._step = lambda ln=ln, captured=captured: captured.setdefault("g", [p.grad.clone() for p in
                                                                              ln.model.parameters()]) and 0.0
        ln.sft(demos[:4], epochs=1, lr=1e-3, batch_size=4)
        grads.append(captured["g"])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)

    ln = TorchLearner(tiny_model_dir, LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=2, bf16_autocast=False,
                                                    temperature=0.5))
    seen = []
    losses = ln.sft(demos, epochs=3, lr=3e-3, batch_size=2, on_epoch=lambda e, loss, st: seen.append((e, loss)))
    assert [e for e, _ in seen] == [1, 2, 3] and [x for _, x in seen] == losses
    assert losses[-1] < losses[0]
    assert ln.cfg.temperature == 0.5  # restored after the supervised pass (its NLL is at temperature 1)
    assert all(g["lr"] == 3e-3 for g in ln.opt.param_groups)
    with pytest.raises(ValueError, match="epochs"):
        ln.sft(demos, epochs=0, lr=1e-3)
    with pytest.raises(ValueError, match="no trajectory"):
        ln.sft([], epochs=1, lr=1e-3)


# --- the command ----------------------------------------------------------------------------------------
def _cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_warmstart_refuses_bad_input(tmp_path):
    r = _cli("warmstart", "textcraft", "--demos", "0", "--epochs", "1", "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and "--demos must be >= 1" in r.stderr
    r = _cli("warmstart", "textcraft", "--demos", "2", "--epochs", "0", "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and "--epochs must be >= 1" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = _cli("warmstart", "toy", "--demos", "2", "--epochs", "1", "--out", str(tmp_path / "full"))
    assert r.returncode == 2 and "not an empty folder" in r.stderr
    r = _cli("warmstart", "nope", "--demos", "2", "--epochs", "1", "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and "unknown environment" in r.stderr


def test_warmstart_refuses_zero_successful_demos(tmp_path):
    # a 4-token reply cap cuts every expert action: no demo succeeds, nothing is written
    r = _cli("warmstart", "toy", "--demos", "2", "--epochs", "1", "--set", "rollout.max_new_tokens=3",
             "--set", "model.threads=1", "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and "no expert demo succeeded" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow  # not in CI: SmolLM2 SFT + eval + run (minutes); the warm-start maths is the default tier's
def test_warmstart_textcraft_then_eval_and_run_load_it(tmp_path):
    out = tmp_path / "warm"
    r = _cli("warmstart", "textcraft", "--preset", "easy", "--demos", "4", "--epochs", "1", "--lr", "1e-5",
             "--set", "algo.micro_batch_size=2", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("warm start: textcraft, 4 expert demos")
    assert any(x.startswith("epoch 1/1: mean NLL") for x in lines)
    assert lines[-1].startswith("warm start done: 4/4 demos succeeded, loss ")
    rec = json.loads((out / "warmstart.json").read_text())
    assert rec["demos_succeeded"] == 4 and len(rec["epoch_losses"]) == 1
    assert rec["env_options"] == {"depth": 1, "n_test": 64, "show_actions": True}
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / f).exists(), f
    assert not (out / "optimizer.pt").exists()  # RL starts with a fresh optimizer
    js = tmp_path / "eval.json"
    r = _cli("eval", str(out), "textcraft", "--n", "2", "--turn-limits", "2", "--json", str(js), "--no-mlflow",
             "--set", "rollout.backend=transformers", "--set", f"output_dir={tmp_path}")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(js.read_text())
    assert doc["env_options_source"] == "checkpoint" and doc["env_options"]["depth"] == 1
    assert doc["models"]["model"]["budgets"]["2"]["overall"]["episodes"] == 2
    # `scalinginter run` accepts it as the model (the config validates and names it)
    r = _cli("run", "textcraft", "--preset", "easy", "--set", f"model.path={out}", "--print-config")
    assert r.returncode == 0 and json.loads(r.stdout)["model"]["path"] == str(out)


# --- the learning study's starting model -------------------------------------------------------------------
def _study():
    import importlib.util

    spec = importlib.util.spec_from_file_location("learning_study", ROOT / "bench" / "learning_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_records_and_checks_its_starting_model(tmp_path, monkeypatch):
    study = _study()
    warm = tmp_path / "warm"
    warm.mkdir()
    monkeypatch.chdir(tmp_path)
    assert study.absolute_model_path(["model.path=warm", "seed=1", "model.path=smollm2-135m"]) == [
        f"model.path={warm.resolve()}", "seed=1", "model.path=smollm2-135m"]
    assert study.start_model_record("smollm2-135m", None) == {"path": "smollm2-135m", "warmstart": None}
    assert study.describe_start({"path": "smollm2-135m", "warmstart": None}) == "smollm2-135m"
    rec = {"source_model": "smollm2-135m", "demos_requested": 61, "demos_succeeded": 61, "epochs": 2, "lr": 1e-5,
           "epoch_losses": [1.5, 0.25], "batch_size": 8, "demo_turn_limit": 4, "env_options": {"depth": 1}}
    (warm / "warmstart.json").write_text(json.dumps(rec))
    sm = study.start_model_record(str(warm), None)
    assert sm["warmstart"]["demos_succeeded"] == 61
    assert study.describe_start(sm) == (f"{warm} (behaviour-cloning warm start of smollm2-135m: 61/61 expert demos "
                                        "of train tasks, 2 epoch(s) at lr 1e-05, NLL 1.500 -> 0.250)")
    # a cached evaluation of another starting model is refused, not reused
    a = type("A", (), {"output_dir": str(tmp_path / "study"), "env": "textcraft", "eval_n": 2, "set": [],
                       "experiment": "x"})()
    (tmp_path / "study" / "evals").mkdir(parents=True)
    (tmp_path / "study" / "evals" / "base.json").write_text(json.dumps({"models": {"model": {"ref": "smollm2-135m"}}}))
    with pytest.raises(SystemExit, match="another starting model"):
        study.evaluate(a, str(warm), "base", [2], None, 32)
    assert study.evaluate(a, "smollm2-135m", "base", [2], None, 32)["models"]["model"]["ref"] == "smollm2-135m"


@pytest.mark.slow  # not in CI: SmolLM2 warm start then a study arm (minutes); the study command is in CI
def test_learning_study_with_a_warm_start_toy(tmp_path):
    """The study's one-command form at toy size: the warm start is made, the base row scores it, the arm trains
    from it, the report says so; a second invocation reuses all of it."""
    out, res = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "bench" / "learning_study.py"), "--env", "textcraft", "--preset", "easy",
           "--arms", "scalinginter", "--seeds", "1", "--eval-n", "2", "--budgets", "2", "--output-dir", str(out),
           "--results", str(res), "--warmstart-demos", "2", "--warmstart-epochs", "1",
           "--set", "rollout.backend=transformers", "--set", "rollout.max_new_tokens=24",
           "--set", 'curriculum.phases=[{"turn_limit": 2, "steps": 1}]', "--set", "rollout.tasks_per_step=1",
           "--set", "rollout.samples_per_task=2"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    warm = out / "warmstart"
    assert (warm / "warmstart.json").exists() and "starting model (every arm and the base row): " + str(warm) in p.stdout
    (js,) = res.glob("learning-study-textcraft-*.json")
    rep = json.loads(js.read_text())
    assert rep["start_model"]["path"] == str(warm) and rep["start_model"]["warmstart"]["demos_requested"] == 2
    base = json.loads((out / "evals" / "base.json").read_text())
    assert base["models"]["model"]["ref"] == str(warm)
    cfg = json.loads((out / "study-textcraft-scalinginter-s0" / "config.json").read_text())
    assert cfg["model"]["path"] == str(warm)  # the arm trained from the warm start
    p2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0 and "warm start: reusing" in p2.stdout and "training study-" not in p2.stdout
