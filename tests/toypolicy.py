"""A tiny Llama that knows the toy env's answer format, for the end-to-end crash and resume tests.

Random weights with the real SmolLM2 tokenizer, then a few supervised steps on toy prompts answered with a
uniformly random door: the policy writes valid actions (not which door), so episodes succeed ~1/3 of the time,
GRPO groups have signal and an update moves the weights. It loads in well under a second, so a test's runs
are bounded by process start-up, not by the model; where the test is about the flows (checkpoints, resume,
MLflow, kill points), nothing is lost by not using SmolLM2 itself. Head size 32 so vLLM's CPU attention takes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The runs of the crash and resume tests: the toy env, this policy, transformers, phases 1 x turn limit 1 then
# 2 x turn limit 2 (global steps 1, 2, 3), two tasks per step, no held-out evaluation; each test adds its own
# settings (samples per task, learning rate, checkpoint cadence, trajectories, the checkpoint root or engine).
TOY_PHASES = '[{"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 2}]'
TOY_RUN_SETS = ("rollout.backend=transformers", f"curriculum.phases={TOY_PHASES}", "rollout.tasks_per_step=2",
                "rollout.max_new_tokens=8", "rollout.token_budget=512", "env.task_pool=1000", "eval.before=false",
                "eval.after=false")


def cli_cmd() -> list[str]:
    """The ``scalinginter`` command of this interpreter's environment (or ``python -m flows.cli``)."""
    exe = Path(sys.executable).with_name("scalinginter")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]


def toy_run_cmd(out: Path, model: Path, name: str, sets: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``scalinginter run toy --run-name NAME`` with TOY_RUN_SETS, then ``sets``, the model and the output dir
    (as ``--set`` pairs; later ones win)."""
    return cli_cmd() + ["run", "toy", "--run-name", name] + [
        a for x in (*TOY_RUN_SETS, *sets, f"model.path={model}", f"output_dir={out}") for a in ("--set", x)]


def warm_start(model, tok, steps: int = 80) -> None:
    """Supervised steps on toy prompts answered with a uniformly random door, so the policy knows the answer
    format (not which door): success ~1/3, and the estimators get signal."""
    import torch

    from core.chat import ChatFormat
    from envs.toy import ToyEnv

    chat = ChatFormat.from_tokenizer(tok)
    env = ToyEnv()
    prompts = []
    for i in range(16):
        obs, _ = env.reset(i)
        prompts.append(chat.prompt_ids(env.instruction(), obs))
    replies = [chat.encode(f"Action: open door {d}") + [tok.eos_token_id] for d in (1, 2, 3)]
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        rows, targets = [], []
        for p, d in zip(torch.randint(0, 16, (12,), generator=gen).tolist(),
                        torch.randint(0, 3, (12,), generator=gen).tolist()):
            rows.append(prompts[p] + replies[d])
            targets.append([-100] * len(prompts[p]) + replies[d])
        width = max(map(len, rows))
        ids = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
        # the logits of the reply positions only (the vocabulary is 49k wide; the prompts are most of each row)
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        target = labels[:, 1:]
        keep = target != -100
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]), target[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def make_toy_policy(d: Path, hidden: int = 64, heads: int = 2, layers: int = 2) -> Path:
    """Write the warm-started tiny Llama (fp32 safetensors) and the SmolLM2 tokenizer into ``d``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=heads, max_position_embeddings=1024,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                         torch_dtype="float32"))
    warm_start(model, tok)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d
