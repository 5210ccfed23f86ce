"""Where the smoke recipe's memory goes: resident memory by component, and the whole process tree's peak.

    python bench/bench_memory.py [--preset smoke] [--steps 1] [--set key=value ...] [--out FILE.json]

Runs the preset's phase as the product does (a ``Runtime``, ``open_session`` with the learner and the configured
generation engine, env servers, then per step ``rollout_batch`` -> ``compute_advantages`` -> ``policy_update``,
then ``evaluate_ids`` on ``eval.n`` held-out tasks), one stage at a time, while a thread samples the resident
memory (RSS) of this process and of its whole tree (env servers, engine processes) every 20 ms. Prints per stage:
the tree's RSS when the stage ends, its peak during the stage, and what the stage added; beside them, the sizes
that explain them, computed from the model and the config: the policy's weights, gradients and AdamW state (fp32),
the reference model, the vLLM engine's KV cache (its plan) and the vocabulary-wide tensors of one micro-batch.
RSS is not a timing: it holds on a busy machine too. Run it once per change, before and after, on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 2**30


class TreeSampler:
    """RSS of this process and of the tree under it, sampled every ``every_s``; ``mark`` starts a stage."""

    def __init__(self, every_s: float = 0.02):
        import psutil

        self.me = psutil.Process()
        self.every_s = every_s
        self.stage = "start"
        self.peaks: dict[str, tuple[int, int]] = {}  # stage -> (own peak, tree peak)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> tuple[int, int]:
        import psutil

        own = self.me.memory_info().rss
        tree = own
        for c in self.me.children(recursive=True):
            try:
                tree += c.memory_info().rss
            except psutil.Error:
                pass
        return own, tree

    def _run(self) -> None:
        while not self._stop.is_set():
            own, tree = self.now()
            p = self.peaks.get(self.stage, (0, 0))
            self.peaks[self.stage] = (max(p[0], own), max(p[1], tree))
            time.sleep(self.every_s)

    def mark(self, stage: str) -> None:
        own, tree = self.now()
        self.stage = stage
        self.peaks[stage] = (own, tree)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def sizes(cfg, learner, model_dir: str) -> dict[str, float]:
    """What the components should take, from the model and the config (GiB)."""
    from runtime.backends.vllm_backend import kv_plan_for, resolve_vllm_dtype

    n = sum(p.numel() for p in learner.model.parameters())
    out = {"policy_weights_fp32": n * 4 / GiB, "policy_grads_fp32": n * 4 / GiB, "adamw_state_fp32": 2 * n * 4 / GiB,
           "reference_weights_fp32": (n * 4 / GiB) if learner.ref is not None else 0.0}
    vocab = learner.model.config.vocab_size
    out["vocab_tensor_per_1k_policy_tokens_fp32"] = 1000 * vocab * 4 / GiB
    if cfg.rollout.backend == "vllm":
        plan = kv_plan_for(cfg, model_dir, resolve_vllm_dtype(cfg.rollout.vllm_dtype))
        out["vllm_kv_cache"] = plan.cache_bytes / GiB
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="babyai")
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sampler = TreeSampler()
    sampler.mark("imports (torch, transformers, Prefect, vLLM)")
    import torch  # noqa: F401

    from flows.config import build_config
    from runtime.backends.model import resolve_model
    from runtime.context import Runtime
    from tasks import steps as T
    from tasks.runs import resolve_run

    from runtime.backends.vllm_backend import vllm_available

    if vllm_available():
        import vllm  # noqa: F401
    cfg = resolve_run(build_config(a.env, a.preset, [f"output_dir=/tmp/bench-memory-{os.getpid()}"] + a.sets))
    model_dir = resolve_model(cfg.model.path)
    rows = []

    def record(stage: str) -> None:
        own, tree = sampler.now()
        peak_own, peak_tree = sampler.peaks.get(stage, (own, tree))
        prev = rows[-1]["tree_rss_gib"] if rows else 0.0
        rows.append({"stage": stage, "rss_gib": round(own / GiB, 3), "tree_rss_gib": round(tree / GiB, 3),
                     "peak_rss_gib": round(peak_own / GiB, 3), "peak_tree_rss_gib": round(peak_tree / GiB, 3),
                     "added_gib": round(tree / GiB - prev, 3)})
        r = rows[-1]
        print(f"{stage:<58} tree {r['tree_rss_gib']:6.2f} GiB (peak {r['peak_tree_rss_gib']:6.2f}; "
              f"added {r['added_gib']:+6.2f}); this process {r['rss_gib']:6.2f} (peak {r['peak_rss_gib']:6.2f})",
              flush=True)

    record("imports (torch, transformers, Prefect, vLLM)")
    with Runtime():
        sampler.mark("learner (policy + reference) and generation engine")
        key = T.open_session(cfg, model_dir, train=True)
        record("learner (policy + reference) and generation engine")
        s = T.get_session(key)
        expect = sizes(cfg, s.learner, model_dir)
        sampler.mark("env servers")
        urls = T.spawn_env_servers.fn(key)
        record("env servers")
        limit = cfg.curriculum.as_phases()[0].turn_limit
        for step in range(a.steps):
            sampler.mark(f"step {step + 1}: rollout")
            batch = T.rollout_batch.fn(key, urls, step, limit)
            record(f"step {step + 1}: rollout")
            sampler.mark(f"step {step + 1}: prepare + advantages")
            adv = T.compute_advantages.fn(key, batch)
            record(f"step {step + 1}: prepare + advantages")
            sampler.mark(f"step {step + 1}: update (+ weight sync)")
            T.policy_update.fn(key, batch, adv)
            del batch, adv
            record(f"step {step + 1}: update (+ weight sync)")
        from envs.base import task_index

        sampler.mark(f"evaluation ({cfg.eval.n} held-out tasks, greedy)")
        T.evaluate_ids.fn(key, urls, [task_index("test", i) for i in range(cfg.eval.n)], cfg.eval_turn_limit,
                          cfg.rollout.max_new_tokens)
        record(f"evaluation ({cfg.eval.n} held-out tasks, greedy)")
        T.close_session(key)
    sampler.close()
    whole = max(r["peak_tree_rss_gib"] for r in rows)
    flags = sorted(set(f for f in open("/proc/cpuinfo").read().split() if f in ("avx512_bf16", "amx_bf16")))
    print(f"\nwhole process tree's peak: {whole:.2f} GiB ({a.env} {a.preset}, backend {cfg.rollout.backend}, "
          f"cpu flags {' '.join(flags) or 'none'})")
    print("sizes from the model and config (GiB): " + ", ".join(f"{k} {v}" for k, v in expect.items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"env": a.env, "preset": a.preset, "sets": a.sets, "cpu_flags": flags,
                                           "backend": cfg.rollout.backend, "stages": rows, "peak_tree_rss_gib": whole,
                                           "expected_gib": expect}, indent=2))


if __name__ == "__main__":
    main()
