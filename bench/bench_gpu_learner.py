"""The learner's throughput and GPU memory on a CUDA device, for model shapes from 135M to 1.5B parameters.

    python bench/bench_gpu_learner.py --tokenizer DIR [--shapes smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b]
                                      [--workload study|paper] [--steps 2] [--out FILE.json]
                                      [--optimizer adamw|adamw8bit] [--activation-checkpointing N] [--share-prefix on|off]

What a GPU step of the learner costs, measured rather than estimated: for each shape, a model with that
architecture and random weights (built from its config here: no download; the FLOPs and bytes of a step do
not depend on the weights' values) runs ``prepare`` (the reference model's log-probs) and ``update`` (one
policy-gradient step, bf16 autocast, AdamW) of the real ``TorchLearner`` on multi-turn trajectories shaped
like a step of

- ``study``: the multistep BabyAI study (4 tasks x 4 samples, a 400-token first prompt shared by a group,
  10 turns of a 24-token action and a 120-token observation: ~1.8k tokens per sequence);
- ``paper``: the ``paper`` preset (32 tasks x 8 samples, the same turn shape to ~3k tokens per sequence).

The tokenizer folder (``--tokenizer``, e.g. the embedded SmolLM2's) gives the pad id; token ids are drawn below
its vocabulary. One warm-up step, then ``--steps`` timed steps (``torch.cuda.synchronize`` around each);
prints per shape: parameters, tokens per step, prepare and update seconds, learner tokens/s, peak GPU memory
(``torch.cuda.max_memory_allocated``), and writes the rows as JSON to ``--out``. Needs a CUDA GPU.

``--optimizer`` picks the learner's optimizer (``adamw``: torch's, fp32 moments; ``adamw8bit``: bitsandbytes', 8-bit
moments) and ``--activation-checkpointing N`` makes every N-th decoder layer recompute its activations in the
backward pass (0: none, 1: every layer); each row records both, and the optimizer state's size after the steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Architecture facts from the models' published configs (no weights needed).
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False, rope_theta=1000000.0),
}
WORKLOADS = {"study": dict(groups=4, samples=4, prompt=400, turns=10, act=24, obs=120),
             "paper": dict(groups=32, samples=8, prompt=400, turns=18, act=24, obs=120)}


def build_model(shape: str, tokenizer: Path, into: Path) -> Path:
    """A model folder with ``shape``'s architecture, random weights (seeded) and ``tokenizer``'s files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(spec.pop("model_type"), max_position_embeddings=8192, **spec)
    torch.manual_seed(0)
    # drawn on the GPU and saved in bf16 (random weights: the step's cost does not depend on them): a 7B model's
    # fp32 initialisation on the CPU and a 30 GB write would take minutes; the learner loads them as fp32
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out = into / shape
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


def trajectories(vocab: int, groups: int, samples: int, prompt: int, turns: int, act: int, obs: int, seed: int):
    """One step's trajectories: a group's samples share their first prompt, then differ turn by turn."""
    import torch

    from core.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    trajs, advs = [], []
    for k in range(groups):
        first = torch.randint(10, vocab - 10, (prompt,), generator=g).tolist()
        for s in range(samples):
            t = Trajectory(task_id=k, group_id=k)
            t.start(first)
            for turn in range(turns):
                a = torch.randint(10, vocab - 10, (act,), generator=g).tolist()
                t.add_action(a, [-1.0] * act)
                if turn < turns - 1:
                    t.add_env(torch.randint(10, vocab - 10, (obs,), generator=g).tolist())
            trajs.append(t)
            advs.append([(1.0 if s % 2 else -1.0) * m for m in t.loss_mask])
    return trajs, advs


def run_shape(path: Path, shape: str, work: dict, steps: int, micro_batch_tokens: int, optimizer: str = "adamw",
              activation_checkpointing: int = 0, length_buckets: int | None = None, lora_rank: int = 0,
              share_prefix: bool | None = None) -> dict:
    import torch

    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.lora import LoraSpec

    lora = LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None
    t_load = time.perf_counter()

    torch.cuda.reset_peak_memory_stats()
    learner = TorchLearner(str(path), LearnerConfig(lr=1e-6, kl_coef=0.001, micro_batch_size=64,
                                                    micro_batch_tokens=micro_batch_tokens, bf16_autocast=True,
                                                    device="cuda", optimizer=optimizer,
                                                    activation_checkpointing=activation_checkpointing,
                                                    length_buckets=length_buckets, lora=lora,
                                                    share_prefix=share_prefix))
    load_s = time.perf_counter() - t_load
    params = sum(p.numel() for n, p in learner.model.named_parameters() if ".lora_" not in n)  # the base
    trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    vocab = min(learner.tokenizer.vocab_size, SHAPES[shape]["vocab_size"])
    times = []
    for i in range(steps + 1):
        trajs, advs = trajectories(vocab, seed=i, **work)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prep = learner.prepare(trajs)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        stats = learner.update(trajs, advs, prepared=prep)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:  # step 0 warms up kernels and the allocator
            times.append((t1 - t0, t2 - t1))
        print(f"  {shape} step {i}: prepare {t1 - t0:.2f} s, update {t2 - t1:.2f} s, loss {stats['loss']:.4f}",
              flush=True)
    tokens = sum(len(t.token_ids) for t in trajs)
    policy = sum(sum(t.loss_mask) for t in trajs)
    opt_bytes = learner.optimizer_state_bytes()
    prep_s = sum(a for a, _ in times) / len(times)
    upd_s = sum(b for _, b in times) / len(times)
    row = {"shape": shape, "params_m": round(params / 1e6, 1), "sequences": len(trajs), "tokens_per_step": tokens,
           "policy_tokens_per_step": policy, "prepare_s": round(prep_s, 3), "update_s": round(upd_s, 3),
           "learner_tokens_per_s": round(tokens / (prep_s + upd_s)),
           "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "micro_batch_tokens": micro_batch_tokens, "optimizer": optimizer,
           "activation_checkpointing": activation_checkpointing, "optimizer_state_gib": round(opt_bytes / 2**30, 2),
           "length_buckets": learner.cfg.length_buckets, "share_prefix": learner.cfg.share_prefix,
           "lora_rank": lora_rank,
           "trainable_params_m": round(trainable / 1e6, 2), "load_s": round(load_s, 1)}
    del learner
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a folder with tokenizer files (e.g. the embedded SmolLM2's)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--workload", default="study", choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=32768)
    ap.add_argument("--out", default=None)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"],
                    help="the learner's optimizer (adamw8bit needs bitsandbytes)")
    ap.add_argument("--activation-checkpointing", type=int, default=0, metavar="N",
                    help="every N-th decoder layer recomputes its activations in the backward (0: off, 1: every layer)")
    ap.add_argument("--length-buckets", type=int, default=None, metavar="K",
                    help="forwards run on lengths rounded up to one of K per doubling (default: the product's "
                         "algo.length_buckets default, exact lengths on a GPU; 0: exact lengths)")
    ap.add_argument("--lora-rank", type=int, default=0, metavar="R",
                    help="train rank-R LoRA adapters (alpha 2R, all linear layers) on the frozen base, as "
                         "model.lora.rank=R does (0: full weights)")
    ap.add_argument("--share-prefix", choices=["on", "off"], default=None,
                    help="the shared-prompt forward (algo.share_prefix; default: the product's, off on a GPU)")
    ap.add_argument("--tmp", default=None, help="where the random models are written (default: the system's; "
                                               "/dev/shm keeps a 7B model's 15 GB off the disk)")
    a = ap.parse_args()
    import torch

    buckets = a.length_buckets
    if buckets is not None and buckets < 0:
        raise SystemExit("--length-buckets K needs K >= 0 (0: exact lengths)")

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_learner: torch sees no CUDA GPU; this benchmark measures the learner on one")
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}: choose from {', '.join(SHAPES)}")
    if a.activation_checkpointing < 0:
        raise SystemExit("--activation-checkpointing N needs N >= 0 (0: off)")
    gpu = torch.cuda.get_device_name(0)
    print(f"GPU {gpu}; torch {torch.__version__}; workload {a.workload} {WORKLOADS[a.workload]}; "
          f"optimizer {a.optimizer}; activation checkpointing every {a.activation_checkpointing or '-'} layer(s); "
          f"length buckets per doubling {'default' if buckets is None else buckets}",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        for shape in shapes:
            path = build_model(shape, Path(a.tokenizer), Path(tmp))
            rows.append(run_shape(path, shape, WORKLOADS[a.workload], a.steps, a.micro_batch_tokens, a.optimizer,
                                  a.activation_checkpointing, buckets, a.lora_rank,
                                  None if a.share_prefix is None else a.share_prefix == "on"))
            r = rows[-1]
            print(f"{shape:>13} ({r['params_m']}M): {r['sequences']} seqs, {r['tokens_per_step']} tokens/step, "
                  f"prepare {r['prepare_s']:.2f} s + update {r['update_s']:.2f} s -> "
                  f"{r['learner_tokens_per_s']} tokens/s; peak GPU memory {r['peak_gpu_mem_gib']} GiB; "
                  f"optimizer {r['optimizer']} (state {r['optimizer_state_gib']} GiB), activation checkpointing "
                  f"{r['activation_checkpointing']}; LoRA rank {r['lora_rank'] or '-'} ({r['trainable_params_m']}M "
                  f"trainable); load {r['load_s']} s", flush=True)
            shutil.rmtree(path, ignore_errors=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "workload": a.workload,
                                           "workload_shape": WORKLOADS[a.workload], "optimizer": a.optimizer,
                                           "activation_checkpointing": a.activation_checkpointing,
                                           "lora_rank": a.lora_rank, "rows": rows},
                                          indent=2))


if __name__ == "__main__":
    main()
