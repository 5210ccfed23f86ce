"""Weight sync learner -> vLLM engine: seconds per sync for each way of handing the weights over.

    .venv/bin/python bench/bench_weight_sync.py [--dtype bfloat16|float32] [--repeats 3]

disk: the learner writes an HF folder (save_pretrained, fp32) and the engine reloads it (the old path);
rpc:  the named tensors, cast to the engine's dtype, pickled inside the collective_rpc message;
shm:  the same tensors copied into one shared-memory segment, the worker reads views of it (the default).
Every variant is checked: after the sync the engine scores a fixed sequence like the learner does.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default=None, help="engine dtype (default: bf16 where native, else fp32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="disk,rpc,shm")
    args = ap.parse_args()

    import torch

    from runtime.backends.hardware import resolve_vllm_dtype
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model
    from runtime.backends.vllm_backend import VLLMBackend, export_fn, named_weights_fn

    dtype = resolve_vllm_dtype(args.dtype)
    path = resolve_model("smollm2-135m")
    learner = TorchLearner(path, LearnerConfig(lr=1e-4, kl_coef=0.0, bf16_autocast=dtype == "bfloat16"))
    tok = learner.tokenizer
    seq = tok("The red ball is in front of me. Action: go to red ball 1. The key is behind the door.")["input_ids"]
    with VLLMBackend(path, tok.eos_token_id, dtype=dtype, max_model_len=512, kv_cache_gb=0.25,
                     export_weights=export_fn(learner), named_weights=named_weights_fn(learner)) as engine:
        print(f"engine {dtype}: started in {engine.start_time_s:.1f}s")
        with torch.no_grad():  # move the learner so each sync has something to carry
            for p in learner.model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        want = learner.sequence_logprobs([seq])[0]
        for how in args.only.split(","):
            times = []
            for _ in range(args.repeats):
                t0 = time.time()
                if how == "disk":
                    engine.named_weights, keep = None, engine.named_weights
                    engine.sync_weights()
                    engine.named_weights = keep
                else:
                    engine.push_weights(learner.model.named_parameters(), how)
                times.append(time.time() - t0)
                print(f"  {how}: {times[-1]:.3f}s, worker reload, head refresh {engine._llm.collective_rpc('last_load_seconds')[0]}", flush=True)
            got = engine.prompt_logprobs([seq])[0]
            err = max(abs(a - b) for a, b in zip(got[1:], want[1:]))
            print(f"{how:5s} sync: median {statistics.median(times):.3f}s (runs {', '.join(f'{t:.3f}' for t in times)})"
                  f"; max |logprob engine - learner| {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
