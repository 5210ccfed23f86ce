"""The history window's cost and gain: rollout throughput and the update's tokens per episode-turn, all-history vs
a k-turn window, at 10 and 20 turns.

    python bench/bench_history.py [--turns 10,20] [--windows all,2] [--episodes 16] [--new-tokens 48] [--update]

One vLLM engine (the product's ``EnginePool.backend_for``, KV cache sized by its plan for the largest budget) and one BabyAI
env server over HTTP (multi-step levels, so the base model's episodes run to the turn limit), the product's rollout
(per-episode async, seeded per episode-turn, temperature 1.0). Per (turn limit, window):
- rollout: generated tok/s, episode-turns/s, wall time, mean prompt tokens per generated turn;
- update: the learner's sequences (one per episode without a window, one per turn with one): tokens, tokens per
  episode-turn, the longest sequence, and sum of squared lengths per episode-turn (attention's share grows with
  it); with ``--update``, the wall time of one learner update (torch, the smoke preset's settings) on them.
Prints a table and writes bench/results/history-window/history-<time>.json. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
LEVELS = "GoToLocal,PickupLoc,Open,PutNextLocal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", default="10,20")
    ap.add_argument("--windows", default="all,2", help="'all' (no window) and/or k values")
    ap.add_argument("--episodes", type=int, default=16, help="4 samples per task")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=8000, help="token budget (per episode; per sample with a window)")
    ap.add_argument("--update", action="store_true", help="also time one learner update per configuration")
    a = ap.parse_args()
    turns = [int(x) for x in a.turns.split(",")]
    windows = [None if w == "all" else int(w) for w in a.windows.split(",")]

    from transformers import AutoTokenizer

    from core.chat import ChatFormat
    from core.trajectory import turn_samples
    from flows.config import build_config
    from runtime.backends.generation import SamplingParams
    from runtime.backends.model import resolve_model
    from runtime.backends.vllm_backend import EnginePool
    from runtime.rollout import EpisodeSpec, RolloutRequest, RolloutRuntime, rollout
    from bench.bench_engines import _HttpEnvs

    cfg = build_config("babyai", "smoke", [f"env.options={{\"levels\": \"{LEVELS}\"}}",
                                           f"rollout.token_budget={a.budget}",
                                           f"rollout.max_new_tokens={a.new_tokens}",
                                           f"rollout.tasks_per_step={a.episodes // 4}", "eval.n=1"])
    r = cfg.rollout
    path = resolve_model(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat.from_tokenizer(tok)
    pool = EnginePool()  # the product's engine (a run's Runtime holds one of these)
    be = pool.backend_for(cfg, path, tok)
    http = _HttpEnvs("babyai", dict(cfg.env.options))
    learner = None
    if a.update:
        from runtime.backends.hardware import resolve_bf16
        from runtime.backends.learner import LearnerConfig, TorchLearner

        learner = TorchLearner(path, LearnerConfig(lr=1e-7, kl_coef=0.0, micro_batch_size=cfg.algo.micro_batch_size,
                                                   micro_batch_tokens=cfg.algo.micro_batch_tokens,
                                                   bf16_autocast=resolve_bf16(None)))
    rows = []
    try:
        for T in turns:
            for k in windows:
                specs = [EpisodeSpec(task_id=5000 + i // 4, group_id=i // 4) for i in range(a.episodes)]
                req = RolloutRequest(specs, T, SamplingParams(a.new_tokens, 1.0), a.budget, seed=7, history_turns=k)
                from envs.client import AsyncEnvClient
                from envs.sessions import HttpEpisode

                async def go():
                    client = AsyncEnvClient(http.server.url, timeout_s=120)
                    try:
                        return await rollout(req, RolloutRuntime(be, chat, lambda i: HttpEpisode(client),
                                                                 be.max_live_episodes, async_episodes=True))
                    finally:
                        await client.aclose()

                trajs, st = asyncio.run(go())
                samples, _ = turn_samples(trajs)
                ep_turns = sum(t.turns for t in trajs)
                lens = [len(s.token_ids) for s in samples]
                prompt_tokens = sum(s.prompt_len for s in samples) if k is not None else None
                row = {"turn_limit": T, "window": "all" if k is None else k, "episodes": len(trajs),
                       "episode_turns": ep_turns, "mean_turns": ep_turns / len(trajs),
                       "finished_at_limit": sum(t.finish_reason == "turn_limit" for t in trajs),
                       "token_budget_ends": sum(t.finish_reason == "token_budget" for t in trajs),
                       "success": sum(t.success for t in trajs), "masked": sum(t.masked for t in trajs),
                       "rollout_s": st.wall_time_s, "gen_tok_s": st.generated_tokens / st.wall_time_s,
                       "episode_turns_s": st.env_steps / st.wall_time_s,
                       "update_sequences": len(samples), "update_tokens": sum(lens),
                       "update_tokens_per_episode_turn": sum(lens) / max(ep_turns, 1),
                       "longest_sequence": max(lens), "sq_len_per_episode_turn": sum(x * x for x in lens) / max(ep_turns, 1),
                       "mean_sample_prompt_tokens": None if prompt_tokens is None else prompt_tokens / len(samples)}
                if learner is not None:
                    adv = [[0.01 * m for m in s.loss_mask] for s in samples]
                    t0 = time.time()
                    learner.update(samples, adv)
                    row["update_s"] = time.time() - t0
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        http.close()
        pool.shutdown()
    cols = ["turn_limit", "window", "mean_turns", "rollout_s", "gen_tok_s", "episode_turns_s", "update_sequences",
            "update_tokens_per_episode_turn", "longest_sequence", "sq_len_per_episode_turn", "update_s"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row[c]:.1f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in cols))
    out = Path(__file__).parent / "results" / "history-window" / f"history-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = sorted(set(x for x in open("/proc/cpuinfo").read().split() if x in ("avx512_bf16", "amx_bf16")))
    out.write_text(json.dumps({"cpu_flags": cpu, "nproc": os.cpu_count(), "args": vars(a), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
