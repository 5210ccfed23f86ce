"""The same single-turn GRPO workload run by TRL's GRPOTrainer and by ScalingInter, side by side.

    pip install -e '.[bench]'        # trl==1.16.0 (optional; not installed by infra/install.sh)
    python bench/bench_trl.py [--steps 3] [--only ours,ours-in-process,trl] [--engine vllm|transformers]
                              [--optimizer adamw|adamw8bit] [--grad-dtype fp32|bf16] [--model DIR]

Workload (both sides): SmolLM2-135M-Instruct; per step 8 prompts x 4 generations (temperature 1.0,
<= 64 new tokens), prompts are BabyAI first-turn chat prompts (~250 tokens); reward 1 when the reply names
an action the observation offers (the BabyAI parser), else 0; group-normalised advantages; one optimizer step
over the 32 sequences (4 micro-batches of 8), AdamW lr 1e-6, KL to the frozen initial model 0.001. With
``--optimizer adamw8bit`` both sides take bitsandbytes' 8-bit AdamW (ours ``algo.optimizer=adamw8bit``, TRL
``optim="adamw_bnb_8bit"``). ``--grad-dtype bf16`` holds our learner's gradients in bf16 (``algo.grad_dtype``; TRL
has no such setting and keeps fp32).
Precision and device follow the hardware on both sides (a CUDA GPU when torch sees one, else the CPU; bf16 autocast
where bf16 is native, fp32 elsewhere). ``--model DIR`` replaces the embedded SmolLM2 by another HF folder on both
sides (on a GPU machine without the embedded wheel: a folder of SmolLM2's shape, e.g. ``bench_gpu_learner.build_model``).

Each side runs in its own child process; the parent samples the RSS of the child's whole process tree (our
vLLM engine is a grandchild) every 0.2 s. Reported: seconds per step (median of the steps after the first,
which pays for warm-up), trained tokens/s, peak RSS. Prints a table and writes bench/results/trl/trl-<time>.json.
Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
LEVELS = "GoToObj,GoToRedBallGrey,GoToLocal"
PROMPTS, GENS, NEW_TOKENS, MICRO = 8, 4, 64, 8
MAX_LEN = 512  # our engine's max sequence length: prompt + reply
LR, KL = 1e-6, 0.001
OPTIMIZER = os.environ.get("BENCH_TRL_OPTIMIZER", "adamw")  # --optimizer, read by the child processes
GRAD_DTYPE = os.environ.get("BENCH_TRL_GRAD_DTYPE", "fp32")  # --grad-dtype (ours only), read by the child process
MODEL = os.environ.get("BENCH_TRL_MODEL", "smollm2-135m")  # --model, read by the child processes
SHARE = os.environ.get("BENCH_TRL_SHARE_PREFIX")  # --share-prefix on|off (ours only); unset: the learner's default
# the sides: ours with the vLLM engine in its own processes (the default) or inside the trainer's process
# (rollout.vllm_in_process), and TRL
SIDES = ("ours", "ours-in-process", "trl")


def babyai_prompts(n: int) -> list[dict]:
    """n BabyAI first-turn prompts: system (instruction), user (observation), the actions offered."""
    from envs.babyai.env import BabyAIEnv

    env = BabyAIEnv(levels=LEVELS)
    out = []
    for i in range(n):
        obs, info = env.reset(i)
        out.append({"system": env.instruction(), "user": obs, "available": list(env.available_actions())})
    return out


def reward(text: str, available: list[str]) -> float:
    from envs.babyai.parse import parse_action

    return 1.0 if parse_action(text, available).action is not None else 0.0


def _gpu_peak() -> dict:
    """The child's peak GPU memory allocated by torch (on a CUDA machine; nothing on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"device": torch.cuda.get_device_name(0),
            "peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}


def _timings(step_times: list[float], tokens: list[int]) -> dict:
    later = step_times[1:] or step_times
    return {"step_s": statistics.median(later), "first_step_s": step_times[0], "steps": len(step_times),
            "trained_tok_s": sum(tokens[1:] or tokens) / sum(later), "step_times_s": step_times}


# --- ScalingInter -----------------------------------------------------------------------------------------
def run_ours(steps: int, engine: str, in_process: bool = False) -> dict:
    import torch
    from transformers import AutoTokenizer

    from core.advantages import EstimatorParams, trajectory_advantages
    from core.chat import ChatFormat
    from core.config import AlgoConfig
    from core.trajectory import Trajectory
    from runtime.backends.generation import SamplingParams, TransformersBackend
    from runtime.backends.hardware import resolve_bf16, resolve_vllm_dtype
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model
    from runtime.memory import trim_heap

    torch.manual_seed(0)
    path = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    chat = ChatFormat.from_tokenizer(tok)
    bf16 = resolve_bf16(None)
    # lengths bucketed as the product buckets them (algo.length_buckets' default: 8 per doubling on the CPU)
    learner = TorchLearner(path, LearnerConfig(lr=LR, kl_coef=KL, micro_batch_size=MICRO, bf16_autocast=bf16,
                                               temperature=1.0, optimizer=OPTIMIZER, grad_dtype=GRAD_DTYPE,
                                               length_buckets=AlgoConfig().length_buckets,
                                               **({"share_prefix": SHARE == "on"} if SHARE else {})),
                           reference_path=path)
    if engine == "vllm":
        from runtime.backends.vllm_backend import VLLMBackend, export_fn, is_cpu_build, named_weights_fn

        from core.kvcache import GiB, plan_kv_cache
        from runtime.backends.vllm_backend import model_kv_bytes_per_token

        # KV cache sized as the product sizes it: the batch's sequences x their token budget (prompts <= ~260
        # tokens + 64 new) x the engine dtype's bytes per token
        dtype = resolve_vllm_dtype(None)
        plan = plan_kv_cache(PROMPTS * GENS, MAX_LEN, model_kv_bytes_per_token(path, dtype), 2 * GiB)
        # weight sync in memory (the default), or through an HF folder with --sync disk (the old path)
        memory = os.environ.get("BENCH_TRL_SYNC", "memory") == "memory"
        backend = VLLMBackend(path, tok.eos_token_id, dtype=dtype, enforce_eager=True,
                              max_model_len=MAX_LEN, seed=0, kv_cache_gb=plan.cache_bytes / GiB,
                              export_weights=export_fn(learner),
                              named_weights=named_weights_fn(learner) if memory else None,
                              in_process=in_process, release_kv=is_cpu_build(),  # as the product: rollout.vllm_release_kv
                              release_weights=is_cpu_build())  # and rollout.vllm_release_weights
    else:
        backend = TransformersBackend(learner.model, tok.eos_token_id, tok.eos_token_id, 32, bf16)
    data = babyai_prompts(PROMPTS * steps)
    times, tokens, rewards = [], [], []
    parts: dict[str, list[float]] = {"generate_s": [], "prepare_s": [], "update_s": [], "sync_s": []}
    for step in range(steps):
        t0 = time.time()
        batch = data[step * PROMPTS:(step + 1) * PROMPTS]
        ids = [chat.prompt_ids(d["system"], d["user"]) for d in batch]
        gens = backend.generate([p for p in ids for _ in range(GENS)], SamplingParams(NEW_TOKENS, 1.0))
        t1 = time.time()
        trajs = []
        for k, g in enumerate(gens):
            d = batch[k // GENS]
            t = Trajectory(task_id=step * PROMPTS + k // GENS, group_id=k // GENS)
            t.start(ids[k // GENS])
            t.add_action(g.token_ids, g.logprobs)
            r = reward(tok.decode(g.token_ids, skip_special_tokens=True), d["available"])
            t.set_turn_reward(r)
            t.finish("success" if r > 0 else "failure", r > 0)
            trajs.append(t)
        prepared = learner.prepare(trajs)
        t2 = time.time()
        advs, _, _ = trajectory_advantages("grpo", EstimatorParams(kl_coef=KL), trajs)
        if hasattr(backend, "sleep"):  # as the product's update task: the engine's KV cache is released meanwhile
            backend.sleep()
        learner.update(trajs, advs, prepared=prepared)
        t3 = time.time()
        trim_heap()  # as the product's update task: the update's freed heap goes back before the sync
        backend.sync_weights()
        trim_heap()
        t4 = time.time()
        times.append(t4 - t0)
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[k].append(v)
        tokens.append(sum(len(t.token_ids) for t in trajs))
        rewards.append(sum(t.reward for t in trajs) / len(trajs))
        print(f"[ours] step {step + 1}/{steps}: {times[-1]:.1f} s, mean reward {rewards[-1]:.3f}", flush=True)
    if hasattr(backend, "close"):
        backend.close()
    prompt_lens = [len(chat.prompt_ids(d["system"], d["user"])) for d in data]
    where = ("in-process" if in_process else "own processes") if engine == "vllm" else ""
    name = f"scalinginter ({engine}{', ' + where if where else ''} + torch learner)"
    return {"framework": name, "precision": "bf16 autocast" if bf16 else "fp32",
            "mean_prompt_tokens": sum(prompt_lens) / len(prompt_lens), "mean_reward": rewards,
            "breakdown_s": {k: statistics.median(v[1:] or v) for k, v in parts.items()},
            **_timings(times, tokens), **_gpu_peak()}


# --- TRL --------------------------------------------------------------------------------------------------
def run_trl(steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from runtime.backends.hardware import resolve_bf16
    from runtime.backends.model import resolve_model

    torch.manual_seed(0)
    path = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    bf16 = resolve_bf16(None)
    data = babyai_prompts(PROMPTS * steps)
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": d["system"]},
                                        {"role": "user", "content": d["user"]}],
                             "available": d["available"]} for d in data])

    def reward_fn(prompts, completions, available, **kw):
        return [reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, available)]

    times: list[float] = []
    tokens: list[int] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.time() - self.t0)
            print(f"[trl] step {len(times)}/{steps}: {times[-1]:.1f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
            if logs and "num_tokens" in logs:
                tokens.append(int(logs["num_tokens"]))

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=MICRO,
                         gradient_accumulation_steps=PROMPTS * GENS // MICRO, num_generations=GENS,
                         max_completion_length=NEW_TOKENS, learning_rate=LR, beta=KL, temperature=1.0,
                         bf16=bf16, use_cpu=not torch.cuda.is_available(), max_steps=steps, logging_steps=1, report_to="none",
                         save_strategy="no", shuffle_dataset=False, seed=0, dataloader_num_workers=0,
                         lr_scheduler_type="constant", warmup_steps=0,
                         **({"optim": "adamw_bnb_8bit"} if OPTIMIZER == "adamw8bit" else {}))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=cfg, train_dataset=ds, processing_class=tok,
                              callbacks=[Timer()])
        trainer.train()
    # num_tokens is TRL's running total of prompt + completion tokens; per step = differences
    per_step = [b - a for a, b in zip([0] + tokens[:-1], tokens)] if len(tokens) == len(times) else [0] * len(times)
    return {"framework": "trl GRPOTrainer (HF generate)", "precision": "bf16 autocast" if bf16 else "fp32",
            "mean_reward": rewards, **_timings(times, per_step), **_gpu_peak()}


# --- driver -----------------------------------------------------------------------------------------------
def _tree_rss(pid: int) -> tuple[int, dict[str, int]]:
    """RSS of the process tree under ``pid``: the total and, per process, keyed by its name and pid."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, {}
    each = {}
    for q in procs:
        try:
            each[f"{q.name()}:{q.pid}"] = q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return sum(each.values()), each


def run_child(which: str, steps: int, engine: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--worker", which, "--steps", str(steps), "--engine", engine, "--out", out]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=str(ROOT))
    peak, at_peak = 0, {}
    while proc.poll() is None:
        total, each = _tree_rss(proc.pid)
        if total > peak:
            peak, at_peak = total, each
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{which} failed with exit code {proc.returncode}")
    row = json.loads(Path(out).read_text())
    os.unlink(out)
    row.update(peak_rss_gib=peak / 2**30, wall_s=time.time() - t0,
               rss_at_peak_gib={k: round(v / 2**30, 3) for k, v in at_peak.items()})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="training steps per side (the first is not timed)")
    ap.add_argument("--only", default="ours,ours-in-process,trl",
                    help="sides to run: ours (vLLM in its own processes), ours-in-process (rollout.vllm_in_process), trl")
    ap.add_argument("--engine", choices=["vllm", "transformers"], default="vllm", help="our generation backend")
    ap.add_argument("--sync", choices=["memory", "disk"], default=None,
                    help="vLLM weight sync: in memory (default) or through an HF folder (the old path)")
    ap.add_argument("--optimizer", choices=["adamw", "adamw8bit"], default=None,
                    help="both sides' optimizer: torch AdamW (default) or bitsandbytes' 8-bit AdamW")
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default=None,
                    help="our learner's gradient buffers (algo.grad_dtype; TRL keeps fp32): fp32 (default) or bf16")
    ap.add_argument("--model", default=None,
                    help="an HF model folder for both sides instead of the embedded smollm2-135m")
    ap.add_argument("--share-prefix", choices=["on", "off"], default=None,
                    help="our learner's shared-prompt forward (algo.share_prefix); default: the learner's default")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sync:  # read by the "ours" child process
        os.environ["BENCH_TRL_SYNC"] = a.sync
    if a.optimizer:  # read by both child processes
        os.environ["BENCH_TRL_OPTIMIZER"] = a.optimizer
    if a.grad_dtype:  # read by our child process
        os.environ["BENCH_TRL_GRAD_DTYPE"] = a.grad_dtype
    if a.share_prefix:  # read by our child process
        os.environ["BENCH_TRL_SHARE_PREFIX"] = a.share_prefix
    if a.model:  # read by both child processes
        if not Path(a.model).is_dir():
            ap.error(f"--model {a.model}: no such folder (an HF model folder: config.json, weights, tokenizer)")
        os.environ["BENCH_TRL_MODEL"] = str(Path(a.model).resolve())
    if a.steps < 2:
        ap.error("--steps must be >= 2 (the first step is warm-up)")
    if a.worker:
        if a.worker.startswith("ours"):
            row = run_ours(a.steps, a.engine, in_process=a.worker == "ours-in-process")
        else:
            row = run_trl(a.steps)
        Path(a.out).write_text(json.dumps(row))
        return
    which = [w.strip() for w in a.only.split(",") if w.strip()]
    bad = [w for w in which if w not in SIDES]
    if bad:
        ap.error(f"--only: unknown {', '.join(bad)} (choose from {', '.join(SIDES)})")
    if "ours-in-process" in which and a.engine != "vllm":
        ap.error("ours-in-process is the vLLM engine inside the trainer's process: use --engine vllm")
    if "trl" in which:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -e '.[bench]' (trl==1.16.0), or --only ours")
    rows = [run_child(w, a.steps, a.engine) for w in which]
    print(f"\n{'framework':44} {'precision':14} {'s/step':>8} {'tok/s':>8} {'peak RSS GiB':>13}")
    for r in rows:
        print(f"{r['framework']:44} {r['precision']:14} {r['step_s']:8.1f} {r['trained_tok_s']:8.1f} "
              f"{r['peak_rss_gib']:13.2f}")
    for r in rows:
        if "breakdown_s" in r:
            print(f"{r['framework']}: per step " + ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown_s"].items()))
        print(f"{r['framework']}: RSS at the peak " + ", ".join(f"{k} {v:.2f} GiB"
                                                              for k, v in r["rss_at_peak_gib"].items()))
        if "peak_gpu_allocated_gib" in r:
            print(f"{r['framework']}: on {r['device']}, peak GPU memory allocated {r['peak_gpu_allocated_gib']:.2f} GiB")
    trl_rows = [r for r in rows if r["framework"].startswith("trl")]
    for r in rows:
        if trl_rows and r is not trl_rows[0]:
            print(f"{r['framework']} vs TRL: {trl_rows[0]['step_s'] / r['step_s']:.2f}x faster per step, "
                  f"{r['peak_rss_gib'] / trl_rows[0]['peak_rss_gib']:.2f}x TRL's peak memory")
    res = ROOT / "bench" / "results" / "trl" / f"trl-{time.strftime('%Y%m%d-%H%M%S')}.json"
    res.parent.mkdir(parents=True, exist_ok=True)
    res.write_text(json.dumps({"workload": {"prompts": PROMPTS, "generations": GENS, "max_new_tokens": NEW_TOKENS,
                                            "micro_batch": MICRO, "lr": LR, "kl": KL,
                                            "optimizer": a.optimizer or "adamw",
                                            "grad_dtype": a.grad_dtype or "fp32",
                                            "model": a.model or "smollm2-135m",
                                            "share_prefix": a.share_prefix or "default"}, "rows": rows}, indent=2))
    print(f"wrote {res}")


if __name__ == "__main__":
    main()
