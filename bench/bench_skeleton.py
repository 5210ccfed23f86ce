"""Benchmark the walking skeleton's three engines with the default model (SmolLM2-135M on CPU).

    python bench/bench_skeleton.py [--batches 1,8,16,32] [--new-tokens 40] [--update-seqs 8] [--update-len 512]

Prints: rollout generation tokens/s per batch size (transformers backend, real BabyAI prompts), BabyAI env
steps/s (in-process and over the HTTP server with concurrent episodes), learner update tokens/s (GRPO step,
bf16 autocast and fp32). Run it on an otherwise idle machine: two torch processes on 2 cores slow each
other down by far more than 2x (OpenMP threads spin).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bench_generation(batches: list[int], new_tokens: int) -> list[tuple[str, str]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.chat import ChatFormat
    from envs.babyai.env import BabyAIEnv
    from runtime.backends.generation import SamplingParams, TransformersBackend
    from runtime.backends.model import resolve_model

    path = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    chat = ChatFormat.from_tokenizer(tok)
    env = BabyAIEnv(levels="GoToObj,GoToRedBallGrey,GoToLocal")
    prompts = []
    for i in range(max(batches)):
        obs, _ = env.reset(i)
        prompts.append(chat.prompt_ids(env.instruction(), obs))
    rows = []
    for autocast in (True, False):
        be = TransformersBackend(model, tok.eos_token_id, tok.eos_token_id, batch_size=max(batches),
                                 bf16_autocast=autocast)
        be.generate(prompts[:1], SamplingParams(4, 1.0))  # warm-up
        for b in batches:
            t0 = time.time()
            gens = be.generate(prompts[:b], SamplingParams(new_tokens, 1.0))
            dt = time.time() - t0
            n = sum(len(g.token_ids) for g in gens)
            label = "bf16 autocast" if autocast else "fp32"
            rows.append((f"generate {label}, batch {b:>2} (prompt ~{len(prompts[0])} tok)",
                         f"{n / dt:7.1f} tok/s  ({n} tokens in {dt:.1f}s)"))
            print(*rows[-1], sep="  ", flush=True)
    return rows


def bench_env(episodes: int, turns: int) -> list[tuple[str, str]]:
    from envs.babyai.env import BabyAIEnv
    from envs.client import AsyncEnvClient
    from envs.spawn import EnvServerProcess

    rows = []
    levels = "GoToObj,GoToRedBallGrey,GoToLocal"
    env = BabyAIEnv(levels=levels)
    rng = random.Random(0)
    n = 0
    t0 = time.time()
    for ep in range(episodes):
        _, info = env.reset(ep)
        acts = info["available_actions"]
        for _ in range(turns):
            r = env.step(f"Action: {rng.choice(acts)}")
            n += 1
            acts = r.info.get("available_actions") or acts
            if r.done:
                break
    dt = time.time() - t0
    rows.append(("babyai env in-process", f"{n / dt:7.1f} steps/s ({n} steps)"))
    print(*rows[-1], sep="  ", flush=True)

    with EnvServerProcess("babyai", env_options={"levels": levels}) as server:
        async def run(concurrency: int) -> tuple[int, float]:
            client = AsyncEnvClient(server.url)
            steps = 0

            async def episode(ep: int):
                nonlocal steps
                eid = await client.create()
                r = await client.reset(eid, ep)
                acts = r.info["available_actions"]
                for _ in range(turns):
                    s = await client.step(eid, f"Action: {rng.choice(acts)}")
                    steps += 1
                    acts = s.info.get("available_actions") or acts
                    if s.terminated or s.truncated:
                        break
                await client.close(eid)

            t = time.time()
            for start in range(0, episodes, concurrency):
                await asyncio.gather(*[episode(e) for e in range(start, min(episodes, start + concurrency))])
            dt = time.time() - t
            await client.aclose()
            return steps, dt

        for c in (1, 32):
            steps, dt = asyncio.run(run(c))
            rows.append((f"babyai env over HTTP, {c:>2} concurrent episodes",
                         f"{steps / dt:7.1f} steps/s ({steps} steps, incl. create/reset/close)"))
            print(*rows[-1], sep="  ", flush=True)
    return rows


def bench_update(seqs: int, length: int) -> list[tuple[str, str]]:
    import torch

    from core.trajectory import Trajectory
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model

    path = resolve_model("smollm2-135m")
    rows = []
    for autocast in (True, False):
        learner = TorchLearner(path, LearnerConfig(lr=1e-6, kl_coef=0.001, micro_batch_size=4,
                                                   bf16_autocast=autocast))
        g = torch.Generator().manual_seed(0)
        trajs, advs = [], []
        for i in range(seqs):
            t = Trajectory(task_id=i, group_id=i // 2)
            ids = torch.randint(100, 40000, (length,), generator=g).tolist()
            t.start(ids[:length // 4])
            t.add_action(ids[length // 4:], [-1.0] * (length - length // 4))
            trajs.append(t)
            a = 1.0 if i % 2 else -1.0
            advs.append([a * m for m in t.loss_mask])
        learner.update(trajs[:2], advs[:2])  # warm-up
        st = learner.update(trajs, advs)
        label = "bf16 autocast" if autocast else "fp32"
        rows.append((f"GRPO update {label}, {seqs}x{length} tokens (policy + ref + backward + AdamW)",
                     f"{st['update_tokens_per_s']:7.1f} tok/s  ({st['update_time_s']:.1f}s per step)"))
        print(*rows[-1], sep="  ", flush=True)
        del learner
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--env-episodes", type=int, default=64)
    ap.add_argument("--env-turns", type=int, default=6)
    ap.add_argument("--update-seqs", type=int, default=8)
    ap.add_argument("--update-len", type=int, default=512)
    ap.add_argument("--only", choices=["generation", "env", "update"], default=None)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    rows = []
    if a.only in (None, "generation"):
        rows += bench_generation([int(x) for x in a.batches.split(",")], a.new_tokens)
    if a.only in (None, "env"):
        rows += bench_env(a.env_episodes, a.env_turns)
    if a.only in (None, "update"):
        rows += bench_update(a.update_seqs, a.update_len)
    width = max(len(r[0]) for r in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))


if __name__ == "__main__":
    main()
