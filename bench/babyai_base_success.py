"""How well does the base model play BabyAI before any training?

For each level and temperature: success rate, the fraction of replies that name a valid action, mean
turns, reply length and generation speed, using the real model and the real text env in-process (the
same rollout loop as training). A uniformly random valid action is scored on the same tasks for scale.

    python bench/babyai_base_success.py --levels GoToObj,GoToLocal --temperatures 0,0.7,1.0 \
        --episodes 24 --turns 3 --max-new-tokens 40

Task ids are ``0..episodes-1`` of the train split (``--split test`` for held-out ones), one level at a
time, so every temperature sees the same worlds. ``--show N`` prints N sample episodes per cell.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs.babyai.env import BabyAIEnv, short_name  # noqa: E402
from envs.base import task_index  # noqa: E402
from envs.sessions import LocalEpisode  # noqa: E402
from envs.base import EnvReply  # noqa: E402
from runtime.rollout import EpisodeSpec, run_rollout  # noqa: E402

DEFAULT_LEVELS = "GoToObj,GoToRedBallGrey,GoToLocal,PickupLoc,OpenDoor"


class _Recorded(LocalEpisode):
    """A local BabyAI episode that keeps every step's info (valid_action, ...) for scoring."""

    def __init__(self, env: BabyAIEnv):
        super().__init__(env)
        self.steps: list[dict[str, Any]] = []

    async def step(self, reply_text: str) -> EnvReply:
        r = await super().step(reply_text)
        self.steps.append(r.info)
        return r


def load_policy(model_ref: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.chat import ChatFormat
    from runtime.backends.generation import TransformersBackend
    from runtime.backends.model import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model_ref)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    backend = TransformersBackend(model, tok.eos_token_id, tok.eos_token_id)
    return backend, ChatFormat.from_tokenizer(tok)


def task_ids(split: str, episodes: int, first: int = 0) -> list[int]:
    return [task_index(split, first + i) for i in range(episodes)]


def run_model(backend, chat, level: str, ids: list[int], temperature: float, turns: int,
              max_new_tokens: int, token_budget: int, seed: int = 0) -> tuple[dict[str, float], list]:
    import torch

    from core.metrics import episode_metrics
    from runtime.backends.generation import SamplingParams

    sessions: list[_Recorded] = []

    def make(_i: int) -> _Recorded:
        s = _Recorded(BabyAIEnv(levels=level))
        sessions.append(s)
        return s

    specs = [EpisodeSpec(t, t) for t in ids]
    torch.manual_seed(seed)  # every cell samples from the same seed, whatever ran before it
    t0 = time.time()
    trajs, stats = asyncio.run(run_rollout(specs, make, backend, chat, SamplingParams(max_new_tokens, temperature),
                                           turns, token_budget))
    wall = time.time() - t0
    m = episode_metrics(trajs)
    steps = [info for s in sessions for info in s.steps]
    first = [s.steps[0] for s in sessions if s.steps]
    replies = sum(t.turns for t in trajs if not t.masked)
    return {
        "success": m["success_rate"],
        "valid": sum(bool(i.get("valid_action")) for i in steps) / len(steps) if steps else 0.0,
        "valid_first": sum(bool(i.get("valid_action")) for i in first) / len(first) if first else 0.0,
        "turns": m["mean_turns"],
        "reply_tokens": stats.generated_tokens / replies if replies else 0.0,
        "tok_s": stats.tokens_per_s,
        "wall_s": wall,
        "masked": m["masked_episodes"],
    }, trajs


def run_random(level: str, ids: list[int], turns: int, seed: int = 0, repeats: int = 4) -> float:
    """Success of a uniformly random available action per turn (averaged over ``repeats`` draws)."""
    rng = random.Random(seed)
    env = BabyAIEnv(levels=level)
    wins = 0
    for _ in range(repeats):
        for t in ids:
            _, info = env.reset(t)
            for _turn in range(turns):
                res = env.step("Action: " + rng.choice(info["available_actions"]))
                info = res.info
                if res.done:
                    wins += bool(info["success"])
                    break
    env.close()
    return wins / (repeats * len(ids))


def show(trajs, n: int) -> None:
    for tr in trajs[:n]:
        print(f"  --- task {tr.task_id}: {tr.finish_reason}")
        print("  | " + (tr.first_observation or "").replace("\n", "\n  | "))
        obs = tr.observations or []
        for k, reply in enumerate(tr.replies or []):
            print("  > " + reply.strip().replace("\n", "\n  > "))
            if k < len(obs):
                print("  | " + obs[k].replace("\n", "\n  | "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default=DEFAULT_LEVELS, help="comma-separated BabyAI levels")
    ap.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated; 0 = greedy")
    ap.add_argument("--episodes", type=int, default=24, help="tasks per (level, temperature)")
    ap.add_argument("--turns", type=int, default=3, help="turn limit per episode")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--token-budget", type=int, default=1536)
    ap.add_argument("--split", choices=("train", "test"), default="train")
    ap.add_argument("--first-task", type=int, default=0, help="offset of the first task within the split")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", type=int, default=0, help="print this many sample episodes per cell")
    ap.add_argument("--no-random", action="store_true", help="skip the random-action baseline")
    args = ap.parse_args(argv)

    levels = [s.strip() for s in args.levels.split(",") if s.strip()]
    temps = [float(s) for s in args.temperatures.split(",") if s.strip()]
    ids = task_ids(args.split, args.episodes, args.first_task)
    backend, chat = load_policy(args.model, args.threads)

    header = (f"{'level':<18} {'temp':>5} {'success':>8} {'valid':>6} {'valid@1':>8} {'turns':>6} "
              f"{'tok/reply':>9} {'tok/s':>7} {'time_s':>7} {'random':>7}")
    rows: list[str] = []
    print(f"# {args.episodes} {args.split} tasks/cell, {args.turns} turns, {args.max_new_tokens} new tokens/turn",
          flush=True)
    print(header, flush=True)
    for level in levels:
        name = short_name(BabyAIEnv(levels=level).levels[0])
        rand = "" if args.no_random else f"{run_random(level, ids, args.turns):7.2f}"
        for temp in temps:
            m, trajs = run_model(backend, chat, level, ids, temp, args.turns, args.max_new_tokens,
                                 args.token_budget)
            row = (f"{name:<18} {temp:>5.2f} {m['success']:>8.2f} {m['valid']:>6.2f} {m['valid_first']:>8.2f} "
                   f"{m['turns']:>6.2f} {m['reply_tokens']:>9.1f} {m['tok_s']:>7.0f} {m['wall_s']:>7.0f} {rand:>7}")
            if m["masked"]:
                row += f"  ({m['masked']:.0f} masked)"
            rows.append(row)
            print(row, flush=True)
            if args.show:
                show(trajs, args.show)
    print("\n" + header)
    print("\n".join(rows))
    print("success: episodes won; valid: replies naming an available action; valid@1: first replies only; "
          "random: a uniformly random available action each turn.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
