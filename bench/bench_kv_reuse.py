"""The transformers engine with and without its kept keys and values (``rollout.kv_reuse_gib``), beside vLLM's CPU
engine: lock-step rollout passes of multi-step BabyAI from one model (e.g. the learning study's warm start), the
same episodes (tasks, turn limit, temperature, per-episode seeds) on each engine, one engine at a time. ENGINE@N
runs at most N episodes at once (what a KV cache that holds N sets in a run).

    python bench/bench_kv_reuse.py --model runs-ms32/warm [--episodes 16] [--turns 6] [--temperature 1.0]
                                   [--engines transformers-kv,vllm,vllm@7,transformers]

Per engine: its start, the pass's wall time, generated tokens per second, episode-turns per second, prompt tokens the
engine ran against those it was given (the kept rows' share: what transformers-kv did not run again), and the
process's peak RSS so far. The machine's CPU and its fp32 matmul rate are printed first; compare engines within
one run on an idle machine. Writes bench/results/engines/kv-reuse-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.bench_engines import _fresh  # noqa: E402
from bench.bench_multistep import cpu_info, measure_matmul  # noqa: E402
from envs.babyai.presets import MULTISTEP_LEVELS  # noqa: E402


def make_engine(name: str, path: str, eos: int, max_len: int, vllm_kv_gb: float):
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.backends.generation import TransformersBackend
    from runtime.backends.hardware import resolve_bf16, resolve_vllm_dtype

    if name == "vllm":
        from runtime.backends.vllm_backend import VLLMBackend

        return VLLMBackend(path, eos, dtype=resolve_vllm_dtype(None), enforce_eager=True, max_model_len=max_len,
                           in_process=True, kv_cache_gb=vllm_kv_gb)
    if name not in ("transformers", "transformers-kv"):
        raise SystemExit(f"unknown engine {name!r}: transformers, transformers-kv or vllm")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return TransformersBackend(model, eos, eos, batch_size=32, bf16_autocast=resolve_bf16(None),
                               kv_reuse_bytes=4 * 2**30 if name == "transformers-kv" else 0)


def one_pass(be, chat, episodes: int, turns: int, temperature: float, budget: int, max_live: int | None) -> dict:
    from envs.sessions import local_factory
    from runtime.backends.generation import SamplingParams
    from runtime.rollout import EpisodeSpec, run_rollout

    specs = [EpisodeSpec(task_id=i // 4, group_id=i // 4) for i in range(episodes)]  # groups of 4, as training
    params = SamplingParams(24, temperature)
    import torch

    _fresh(be)
    torch.manual_seed(0)  # the transformers engine samples from torch's RNG (vLLM from the episodes' seeds)
    kv = getattr(be, "kv", None)
    before = (kv.reused_tokens, kv.prompt_tokens) if kv is not None else None
    trajs, st = asyncio.run(run_rollout(specs, local_factory("babyai", {"levels": MULTISTEP_LEVELS}), be, chat,
                                        params, turns, budget, seed=1234, max_live=max_live, async_episodes=False))
    row = {"wall_s": round(st.wall_time_s, 2), "generated_tokens": st.generated_tokens,
           "gen_tok_s": round(st.generated_tokens / st.wall_time_s, 1),
           "episode_turns": st.env_steps, "episode_turns_s": round(st.env_steps / st.wall_time_s, 2),
           "success": sum(t.success for t in trajs), "masked": sum(t.masked for t in trajs),
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if kv is not None:
        reused, prompt = kv.reused_tokens - before[0], kv.prompt_tokens - before[1]
        row.update(prompt_tokens=prompt, prompt_tokens_run=prompt - reused)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF model folder (the study's warm start)")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=3072, help="token budget of an episode")
    ap.add_argument("--engines", default="transformers-kv,vllm,transformers")
    ap.add_argument("--vllm-kv-gb", type=float, default=2.5,
                    help="vLLM's KV cache (GiB): enough for every episode at once, so it does not cap the live ones")
    a = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from core.chat import ChatFormat

    torch.set_num_threads(os.cpu_count() or 1)
    cpu = cpu_info(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else {}
    mm = measure_matmul(dtype="fp32")
    print(f"CPU: {cpu.get('model_name')} (family {cpu.get('cpu_family')}, model {cpu.get('model')}, bf16 flags "
          f"{cpu.get('bf16_flags')}); fp32 matmul {mm['gflops']:.0f} GFLOPS on {mm['threads']} threads", flush=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    chat = ChatFormat.from_tokenizer(tok)
    rows = []
    for spec in a.engines.split(","):
        name, _, cap = spec.partition("@")  # ENGINE@N: at most N episodes live at once (as a KV cap sets them)
        t0 = time.time()
        be = make_engine(name, a.model, tok.eos_token_id, a.budget + 64, a.vllm_kv_gb)
        start = time.time() - t0
        row = {"engine": spec, "start_s": round(start, 1),
               **one_pass(be, chat, a.episodes, a.turns, a.temperature, a.budget, int(cap) if cap else None)}
        rows.append(row)
        print(row, flush=True)
        if hasattr(be, "close"):
            be.close()
        del be
    out = Path(__file__).resolve().parent / "results" / "engines" / f"kv-reuse-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "cpu": cpu, "matmul": mm, "rows": rows}, indent=2))
    print(f"\n{'engine':<16}{'wall s':>9}{'gen tok/s':>11}{'ep-turns/s':>12}{'prompt run / given':>22}{'success':>9}")
    for r in rows:
        run = f"{r['prompt_tokens_run']}/{r['prompt_tokens']}" if "prompt_tokens" in r else "-"
        print(f"{r['engine']:<16}{r['wall_s']:>9.1f}{r['gen_tok_s']:>11.1f}{r['episode_turns_s']:>12.2f}{run:>22}"
              f"{r['success']:>9}")
    print(f"written {out}")


if __name__ == "__main__":
    main()
