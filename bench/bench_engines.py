"""Benchmark the engines of issue 8: vLLM vs transformers rollout, torch vs DeepSpeed update, env protocol overhead.

    python bench/bench_engines.py [--only rollout|update|env] [--episodes 8,32,64] [--turns 2] [--new-tokens 32]
                                 [--envs babyai,sciworld] [--transport inproc,http] [--async] [--lockstep]

rollout: generated tok/s and env steps/s for N concurrent BabyAI (and SciWorld) episodes (the real rollout
  loop; envs in-process and behind a real env server over HTTP), per backend; pure generation tok/s on the same prompts; the fraction of rollout wall time the
  generator sat idle waiting for envs and episode-turns/s, per rollout mode: lock-step rounds and (vLLM) per-episode
  loops on the engine's continuous batching (--async / --lockstep: only that one; default both); a sequential
  per-episode loop (batch 1) as the baseline. ``--backends`` also takes ``transformers-kv``: the transformers engine
  keeping its prompts' keys and values across turns (``rollout.kv_reuse_gib``; each timed pass starts without them). Pure generation is measured three ways: the first-turn prompts at
  once, the same in batches of the env's live cap (SciWorld: one JVM per live episode, ``--sciworld-jvms``), and a
  replay of the rollout's own per-turn prompts (histories included, prefix cache reset) without envs; with the env
  server's CPU share over the rollout (its JVMs compete with the generator for the cores).
update: GRPO-step tokens/s of the torch and DeepSpeed ZeRO-2 learners (fp32, bf16 autocast) next to a bare
  fp32/bf16 matmul roofline measured in the same run.
env: per-step latency p50/p99, BabyAI in-process vs over the HTTP server.
evalscale: the smoke preset's engine (``EnginePool.backend_for``: KV cache sized by the product's plan) and BabyAI server,
  its 16-episode training rollout (T=1.0, seeded) and its 96-episode evaluation (greedy, and sampled at T=1.0 as
  K > 1 evaluations are), all at 4 turns over HTTP in the product's rollout mode, in one run: generated tok/s and
  episode-turns/s of each, and their ratios.
Prints a table and writes bench/results/engines/engines-<time>.json. Run on an idle machine (flock /tmp/si-heavy.lock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
LEVELS = "GoToObj,GoToRedBallGrey,GoToLocal"


ENV_OPTIONS = {"babyai": {"levels": LEVELS}, "sciworld": {"max_jvms": 8, "jvm_heap_mb": 384}}
MAX_LIVE = {"sciworld": 8}  # one JVM per live episode: the rest start as others end


def _prompts(chat, n, env_name="babyai"):
    from envs.base import make_env

    env = make_env(env_name, **ENV_OPTIONS.get(env_name, {}))
    out = []
    for i in range(n):
        obs, _ = env.reset(i)
        out.append(chat.prompt_ids(env.instruction(), obs))
    env.close()
    return out


class _HttpEnvs:
    """``make_env`` over a real env server process (one AsyncEnvClient per rollout)."""

    def __init__(self, env_name, options: dict | None = None):
        from envs.spawn import EnvServerProcess

        opts = ENV_OPTIONS.get(env_name, {}) if options is None else options
        self.server = EnvServerProcess(env_name, env_options=opts, max_envs=512).start()

    async def run(self, specs, be, chat, params, turns, max_live, async_episodes, seed=None,
                  budget=2048):
        from envs.client import AsyncEnvClient
        from envs.sessions import HttpEpisode
        from runtime.rollout import run_rollout

        client = AsyncEnvClient(self.server.url, timeout_s=120)
        try:
            return await run_rollout(specs, lambda i: HttpEpisode(client), be, chat, params, turns, budget,
                                     max_live=max_live, async_episodes=async_episodes, seed=seed)
        finally:
            await client.aclose()

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the env server and its children (SciWorld's JVMs)."""
        import psutil

        try:
            p = psutil.Process(self.server.pid)
            procs = [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for q in procs:
            try:
                c = q.cpu_times()
                total += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return total

    def close(self):
        self.server.stop()


def _fresh(be) -> None:
    """Each timed pass starts without kept keys and values (the transformers engine's, when it keeps them), as a
    rollout does: a pass must not reuse the prompts an earlier pass ran."""
    if hasattr(be, "clear_cache"):
        be.clear_cache()


def _generated_tokens(be, prompts, params, max_live) -> int:
    """Generate ``prompts`` in consecutive batches of at most ``max_live`` (all at once when None): tokens made."""
    step = max_live or len(prompts)
    return sum(len(g.token_ids) for j in range(0, len(prompts), step)
               for g in be.generate(prompts[j:j + step], params))


def _replay_pure(be, trajs, params, max_live) -> float:
    """Pure generation of the rollout's own work: every turn's prompt as the episode saw it (its history), turn by
    turn, at most ``max_live`` at once, no env in between. Returns generated tok/s."""
    from core.trajview import token_segments

    turns: dict[int, list[list[int]]] = {}
    for t in trajs:
        for seg in token_segments(t.loss_mask, t.action_ends):
            if seg.kind == "action":  # the turn's prompt is everything before its action
                turns.setdefault(seg.turn, []).append(t.token_ids[:seg.start])
    reset = getattr(getattr(be, "_llm", None), "reset_prefix_cache", None)
    if reset is not None:
        reset()  # the rollout left these prompts cached: the replay pays their prefill as the rollout did
    t0 = time.time()
    ntok = sum(_generated_tokens(be, turns[k], params, max_live) for k in sorted(turns))
    return ntok / (time.time() - t0)


def bench_rollout(episodes: list[int], turns: int, new_tokens: int, backends: list[str],
                  env_names: tuple[str, ...] = ("babyai",), transports: tuple[str, ...] = ("inproc",),
                  modes: tuple[str, ...] = ("lockstep", "async")) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.chat import ChatFormat
    from runtime.backends.generation import SamplingParams, TransformersBackend
    from runtime.backends.hardware import resolve_vllm_dtype
    from runtime.backends.model import resolve_model
    from envs.sessions import local_factory
    from runtime.rollout import EpisodeSpec, run_rollout

    path = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat.from_tokenizer(tok)
    params = SamplingParams(new_tokens, 1.0)
    rows = []
    for name in backends:
        t0 = time.time()
        if name == "vllm":
            from runtime.backends.vllm_backend import VLLMBackend

            be = VLLMBackend(path, tok.eos_token_id, dtype=resolve_vllm_dtype(None), enforce_eager=True,
                             max_model_len=2048)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            # transformers-kv: the same engine keeping its prompts' keys and values (rollout.kv_reuse_gib=4)
            be = TransformersBackend(model, tok.eos_token_id, tok.eos_token_id, batch_size=64, bf16_autocast=False,
                                     kv_reuse_bytes=4 * 2**30 if name == "transformers-kv" else 0)
        start_s = time.time() - t0
        be.generate(_prompts(chat, 2), SamplingParams(4, 1.0))  # warm-up
        for env_name in env_names:
            for transport in transports:
                http = _HttpEnvs(env_name) if transport == "http" else None
                max_live = MAX_LIVE.get(env_name)
                try:
                    for n in episodes:
                        prompts = _prompts(chat, n, env_name)
                        _fresh(be)
                        t = time.time()
                        gens = be.generate(prompts, params)
                        dt = time.time() - t
                        pure = sum(len(g.token_ids) for g in gens) / dt
                        # the env's capacity caps live episodes (one JVM each): pure generation at that cap too,
                        # the prompts in consecutive batches of max_live
                        pure_cap = None
                        if max_live is not None and max_live < n:
                            t = time.time()
                            _fresh(be)
                            pure_cap = _generated_tokens(be, prompts, params, max_live) / (time.time() - t)
                        specs = [EpisodeSpec(task_id=i, group_id=i) for i in range(n)]
                        for mode in modes if hasattr(be, "request_engine") else ("lockstep",):
                            a = mode == "async"
                            env_cpu0 = http.cpu_seconds() if http is not None else None
                            _fresh(be)
                            if http is not None:
                                trajs, st = asyncio.run(http.run(specs, be, chat, params, turns, max_live, a))
                            else:
                                trajs, st = asyncio.run(run_rollout(
                                    specs, local_factory(env_name, ENV_OPTIONS.get(env_name, {})), be, chat, params,
                                    turns, 2048, max_live=max_live, async_episodes=a))
                            env_cpu = None if http is None else http.cpu_seconds() - env_cpu0
                            _fresh(be)
                            replay = _replay_pure(be, trajs, params, max_live)
                            row = {"section": "rollout", "backend": name, "mode": mode, "env": env_name,
                                   "transport": transport, "episodes": n, "engine_start_s": start_s,
                                   "pure_gen_tok_s": pure, "rollout_tok_s": st.generated_tokens / st.wall_time_s,
                                   "rollout_gen_tok_s": st.tokens_per_s,
                                   "episode_turns_s": st.env_steps / st.wall_time_s,
                                   "generator_idle_frac": st.gen_idle_frac,
                                   "rollout_vs_pure": (st.generated_tokens / st.wall_time_s) / pure,
                                   "max_live": max_live, "pure_gen_at_cap_tok_s": pure_cap,
                                   "rollout_vs_pure_at_cap": (None if pure_cap is None else
                                                              (st.generated_tokens / st.wall_time_s) / pure_cap),
                                   # the same prompts (with their histories) generated without envs
                                   "pure_replay_tok_s": replay,
                                   "rollout_vs_pure_replay": (st.generated_tokens / st.wall_time_s) / replay,
                                   # CPU the env server (and its JVMs) took during the rollout, as a share of
                                   # the machine's cores over the rollout's wall time
                                   "env_cpu_s": env_cpu, "env_cpu_share": (None if env_cpu is None else
                                                                           env_cpu / (st.wall_time_s *
                                                                                      (os.cpu_count() or 1))),
                                   "masked": sum(t.masked for t in trajs), "wall_s": st.wall_time_s}
                            rows.append(row)
                            print(row, flush=True)
                finally:
                    if http is not None:
                        http.close()
        # sequential baseline: one episode at a time (batch 1), 4 BabyAI episodes in-process
        specs = [EpisodeSpec(task_id=i, group_id=i) for i in range(4)]
        t = time.time()
        ntok = 0
        for sp in specs:
            trajs, st = asyncio.run(run_rollout([sp], local_factory("babyai", {"levels": LEVELS}), be, chat, params,
                                                turns, 2048, async_episodes=False))
            ntok += st.generated_tokens
        rows.append({"section": "rollout", "backend": name, "env": "babyai", "transport": "inproc",
                     "episodes": "4 sequential", "rollout_tok_s": ntok / (time.time() - t)})
        print(rows[-1], flush=True)
        if hasattr(be, "close"):
            be.close()
        del be
    return rows


def bench_evalscale(train_eps: int = 16, eval_eps: int = 96, turns: int = 4, reps: int = 2) -> list[dict]:
    """Training rollout vs evaluation on one engine, as the smoke run does them (its preset, its KV plan)."""
    from transformers import AutoTokenizer

    from core.chat import ChatFormat
    from flows.config import build_config
    from runtime.backends.generation import SamplingParams
    from runtime.backends.model import resolve_model
    from runtime.backends.vllm_backend import EnginePool
    from runtime.rollout import EpisodeSpec

    cfg = build_config("babyai", "smoke")
    r = cfg.rollout
    path = resolve_model(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat.from_tokenizer(tok)
    t0 = time.time()
    pool = EnginePool()  # the product's engine (a run's Runtime holds one of these)
    be = pool.backend_for(cfg, path, tok)
    start_s = time.time() - t0
    http = _HttpEnvs("babyai", dict(cfg.env.options))
    rows = []
    try:
        be.generate(_prompts(chat, 2), SamplingParams(4, 1.0))  # warm-up
        for rep in range(reps):
            for kind, n, params in (
                    ("training", train_eps, SamplingParams(r.max_new_tokens, r.temperature)),
                    ("evaluation", eval_eps, SamplingParams(r.max_new_tokens, 0.0)),
                    # K > 1 evaluations sample at T = 1.0: replies as long as training's, like-for-like tok/s
                    ("evaluation T=1", eval_eps, SamplingParams(r.max_new_tokens, 1.0))):
                # training groups: tasks_per_step tasks x samples_per_task samples, each sample its own seed
                k = r.samples_per_task if kind == "training" else 1
                specs = [EpisodeSpec(task_id=1000 * rep + i // k, group_id=i // k) for i in range(n)]
                # seeded per episode-turn, as the product samples (training and evaluation alike)
                trajs, st = asyncio.run(http.run(specs, be, chat, params, turns, be.max_live_episodes,
                                                 r.async_episodes, seed=cfg.seed + rep,
                                                 budget=r.token_budget))
                row = {"section": "evalscale", "kind": kind, "rep": rep, "episodes": n, "turns": turns,
                       "temperature": params.temperature, "async_episodes": r.async_episodes,
                       "max_live": be.max_live_episodes, "engine_start_s": start_s,
                       "tok_s": st.generated_tokens / st.wall_time_s,
                       "episode_turns_s": st.env_steps / st.wall_time_s,
                       "tok_per_episode_turn": st.generated_tokens / max(st.env_steps, 1),
                       "generator_idle_frac": st.gen_idle_frac, "wall_s": st.wall_time_s,
                       "masked": sum(t.masked for t in trajs)}
                rows.append(row)
                print(row, flush=True)
    finally:
        http.close()
        pool.shutdown()
    for kind in ("evaluation", "evaluation T=1"):
        for key in ("tok_s", "episode_turns_s"):
            tr = statistics.median(x[key] for x in rows if x["kind"] == "training")
            ev = statistics.median(x[key] for x in rows if x["kind"] == kind)
            rows.append({"section": "evalscale", "kind": f"ratio {key}", "evaluation": kind, "eval_value": ev,
                         "training_value": tr, "evaluation_vs_training": ev / tr})
            print(rows[-1], flush=True)
    return rows


def _roofline(dtype, n=1024, reps=5) -> float:
    import torch

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    t = time.time()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.time() - t) / 1e9


def bench_update(seqs: int, length: int, engines: list[str]) -> list[dict]:
    import torch

    from core.trajectory import Trajectory
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model

    path = resolve_model("smollm2-135m")
    n_params = 134.5e6
    rows = [{"section": "update", "engine": "matmul roofline", "precision": p,
             "gflops": _roofline(torch.float32 if p == "fp32" else torch.bfloat16)} for p in ("fp32", "bf16")]
    for r in rows:
        # a GRPO step per trained token ~ policy fwd+bwd (6N) + old/ref forwards (2N each) = 10N flops
        r["tok_s_bound"] = r["gflops"] * 1e9 / (10 * n_params)
        print(r, flush=True)
    g = torch.Generator().manual_seed(0)
    trajs, advs = [], []
    for i in range(seqs):
        t = Trajectory(task_id=i, group_id=i // 2)
        ids = torch.randint(100, 40000, (length,), generator=g).tolist()
        t.start(ids[: length // 4])
        t.add_action(ids[length // 4:], [-1.0] * (length - length // 4))
        trajs.append(t)
        advs.append([(1.0 if i % 2 else -1.0) * m for m in t.loss_mask])
    for eng in engines:
        for autocast in (True, False):
            cfg = LearnerConfig(lr=1e-6, kl_coef=0.001, micro_batch_size=4, bf16_autocast=autocast)
            if eng == "deepspeed-zero2":
                from runtime.backends.deepspeed_learner import DeepSpeedLearner

                learner = DeepSpeedLearner(path, cfg, zero_stage=2)
            else:
                learner = TorchLearner(path, cfg)
            learner.update(trajs[:2], advs[:2])  # warm-up
            t = time.time()
            st = learner.update(trajs, advs)
            dt = time.time() - t
            row = {"section": "update", "engine": eng, "precision": "bf16 autocast" if autocast else "fp32",
                   "tok_s": seqs * length / dt, "step_s": dt}
            rows.append(row)
            print(row, flush=True)
            del learner
    return rows


def bench_env(steps: int) -> list[dict]:
    from envs.babyai.env import BabyAIEnv
    from envs.client import EnvClient
    from envs.spawn import EnvServerProcess

    rng = random.Random(0)

    def run(reset, step):
        lat = []
        ep = 0
        acts = reset(ep)
        while len(lat) < steps:
            t = time.perf_counter()
            done, acts2 = step(f"Action: {rng.choice(acts)}")
            lat.append((time.perf_counter() - t) * 1e3)
            acts = acts2 or acts
            if done:
                ep += 1
                acts = reset(ep)
        lat.sort()
        return statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]

    env = BabyAIEnv(levels=LEVELS)

    def lreset(i):
        return env.reset(i)[1]["available_actions"]

    def lstep(a):
        r = env.step(a)
        return r.done, r.info.get("available_actions")

    p50l, p99l = run(lreset, lstep)
    rows = [{"section": "env", "transport": "in-process", "p50_ms": p50l, "p99_ms": p99l}]
    with EnvServerProcess("babyai", env_options={"levels": LEVELS}) as srv:
        c = EnvClient(srv.url)
        eid = c.create()

        def hreset(i):
            return c.reset(eid, i).info["available_actions"]

        def hstep(a):
            r = c.step(eid, a)
            return r.terminated or r.truncated, r.info.get("available_actions")

        p50h, p99h = run(hreset, hstep)
        c.close(eid)
    rows.append({"section": "env", "transport": "HTTP", "p50_ms": p50h, "p99_ms": p99h,
                 "overhead_p50_ms": p50h - p50l, "overhead_p99_ms": p99h - p99l})
    for r in rows:
        print(r, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["rollout", "update", "env", "evalscale"], default=None)
    ap.add_argument("--episodes", default="8,32,64")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backends", default="vllm,transformers")
    ap.add_argument("--envs", default="babyai", help="rollout envs, e.g. babyai,sciworld")
    ap.add_argument("--transport", default="inproc,http", help="rollout env transport: inproc, http or both")
    ap.add_argument("--async", dest="async_only", action="store_true",
                    help="rollout: only the per-episode (async) pass (vLLM); default: async and lock-step")
    ap.add_argument("--lockstep", dest="lockstep_only", action="store_true",
                    help="rollout: only the lock-step pass; default: async and lock-step")
    ap.add_argument("--sciworld-jvms", type=int, default=8,
                    help="SciWorld JVMs of the env server = live SciWorld episodes (one JVM each)")
    ap.add_argument("--engines", default="torch,deepspeed-zero2")
    ap.add_argument("--update-seqs", type=int, default=8)
    ap.add_argument("--update-len", type=int, default=512)
    ap.add_argument("--env-steps", type=int, default=500)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    ENV_OPTIONS["sciworld"]["max_jvms"] = MAX_LIVE["sciworld"] = a.sciworld_jvms
    rows: list[dict] = []
    if a.only in (None, "rollout"):
        modes = tuple(m for m, only in (("lockstep", a.lockstep_only), ("async", a.async_only))
                      if only or not (a.async_only or a.lockstep_only))
        rows += bench_rollout([int(x) for x in a.episodes.split(",")], a.turns, a.new_tokens, a.backends.split(","),
                              tuple(a.envs.split(",")), tuple(a.transport.split(",")), modes)
    if a.only in (None, "update"):
        rows += bench_update(a.update_seqs, a.update_len, a.engines.split(","))
    if a.only in (None, "env"):
        rows += bench_env(a.env_steps)
    if a.only in (None, "evalscale"):
        rows += bench_evalscale()
    out = (Path(__file__).resolve().parent / "results" / "engines"
           / f"engines-{a.only or 'all'}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    print("\n" + table(rows) + f"\n\nwritten {out}")


if __name__ == "__main__":
    main()
