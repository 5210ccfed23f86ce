"""The transformers rollout engine's prefill and decode rates on a CUDA device, for model shapes of 135M and 1.5B.

    python bench/bench_gpu_rollout.py --tokenizer DIR [--shapes smollm2-135m,qwen2.5-1.5b] [--batches 16,32,140]
                                      [--contexts 400,1800] [--new-tokens 24] [--repeats 3] [--gen-batch-size 32]
                                      [--out FILE.json]

What a rollout turn costs on a GPU with the product's own engine (``TransformersBackend``: transformers ``generate``
on the learner's policy module, bf16 autocast, ``rollout.gen_batch_size`` rows per call), measured rather than
assumed. For each shape a model with that architecture and random weights (``bench_gpu_learner.build_model``: no
download; the cost of a forward does not depend on the weights' values) is loaded by the real ``TorchLearner``
(fp32 weights on the GPU, as the learner holds its policy) and the engine generates for ``B`` prompts of ``L``
tokens each (distinct random ids below the vocabulary), sampling at temperature 1:

- ``prefill``: one new token (``max_new_tokens=1``): the prompt's forward and one sample;
- ``full``: ``--new-tokens`` new tokens; a decode step is then ``(full - prefill) / (new_tokens - 1)``.

A multi-step study's turn is a prefill at the episode's context plus as many decode steps as the batch's longest
reply (replies end at EOS; random weights almost never sample it, so rows run to the limit: each row's finish is
checked and counted). ``B`` above ``--gen-batch-size`` runs in several calls, as the product does. One warm-up call
per shape, then ``--repeats`` timed calls of each (``torch.cuda.synchronize`` around each; the median is kept).
Prints a table per shape and writes the rows as JSON to ``--out``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what}: a comma-separated list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{what}: integers >= 1, got {text!r}")
    return vals


def timed_generate(backend, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, int]:
    """The median seconds of ``repeats`` calls generating ``new_tokens`` for ``prompts``, and how many rows ended
    before the limit (EOS) in the last call."""
    import torch

    from runtime.backends.generation import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    times, early = [], 0
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        gens = backend.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - t0)
        early = sum(1 for g in gens if len(g.token_ids) < new_tokens)
    return statistics.median(times), early


def run_shape(path: Path, shape: str, batches: list[int], contexts: list[int], new_tokens: int, repeats: int,
              gen_batch_size: int, device: str = "cuda") -> list[dict]:
    import torch

    from runtime.backends.generation import TransformersBackend
    from runtime.backends.learner import LearnerConfig, TorchLearner

    t0 = time.perf_counter()
    learner = TorchLearner(str(path), LearnerConfig(lr=1e-6, kl_coef=0.0, bf16_autocast=True, device=device))
    load_s = time.perf_counter() - t0
    tok = learner.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    backend = TransformersBackend(learner.model, tok.eos_token_id, pad, gen_batch_size, bf16_autocast=True)
    params_m = sum(p.numel() for p in learner.model.parameters()) / 1e6
    vocab = min(tok.vocab_size, learner.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)

    def prompts(b: int, n: int) -> list[list[int]]:
        return torch.randint(10, vocab - 10, (b, n), generator=g).tolist()

    timed_generate(backend, prompts(min(batches), min(contexts)), 4, 1)  # warm-up: kernels, allocator
    rows = []
    for n in contexts:
        for b in batches:
            ps = prompts(b, n)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            prefill_s, _ = timed_generate(backend, ps, 1, repeats)
            full_s, early = timed_generate(backend, ps, new_tokens, repeats)
            calls = -(-b // gen_batch_size)
            decode_ms = 1000 * (full_s - prefill_s) / (new_tokens - 1)
            row = {"shape": shape, "params_m": round(params_m, 1), "batch": b, "calls": calls, "context": n,
                   "new_tokens": new_tokens, "prefill_s": round(prefill_s, 4), "full_s": round(full_s, 4),
                   "decode_step_ms": round(decode_ms, 2), "decode_step_ms_per_call": round(decode_ms / calls, 2),
                   "rows_ended_early": early,
                   "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
                   "load_s": round(load_s, 1), "gen_batch_size": gen_batch_size}
            rows.append(row)
            print(f"  {shape} B={b:<4} ({calls} call(s)) L={n:<5} prefill {prefill_s:7.3f} s  {new_tokens} tokens "
                  f"{full_s:7.3f} s  decode step {decode_ms:7.2f} ms ({decode_ms / calls:6.2f} per call)  "
                  f"rows ended early {early}  peak {row['peak_gpu_mem_gib']} GiB", flush=True)
    del backend, learner
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from bench_gpu_learner import SHAPES, build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a folder with tokenizer files (e.g. the embedded SmolLM2's)")
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-1.5b")
    ap.add_argument("--batches", default="16,32,140", help="prompts per generate (the study: 16 a step, 140 scored)")
    ap.add_argument("--contexts", default="400,1800", help="prompt tokens (the study: about 400 at the first turn, "
                                                           "about 1.8 k at the tenth)")
    ap.add_argument("--new-tokens", type=int, default=24, help="the reply limit (rollout.max_new_tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gen-batch-size", type=int, default=32, help="rows per generate call (rollout.gen_batch_size)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp", default=None, help="where the random models are written (default: the system's)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a check of the script itself on a small case (its times say nothing about a GPU)")
    a = ap.parse_args()
    import torch

    if a.new_tokens < 2:
        raise SystemExit("--new-tokens N needs N >= 2 (a decode step is measured between 1 and N tokens)")
    if a.repeats < 1 or a.gen_batch_size < 1:
        raise SystemExit("--repeats and --gen-batch-size need values >= 1")
    batches, contexts = _ints(a.batches, "--batches"), _ints(a.contexts, "--contexts")
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}: choose from {', '.join(SHAPES)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_rollout: torch sees no CUDA GPU; this benchmark measures generation on one")
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    import transformers

    print(f"GPU {gpu}; torch {torch.__version__}; transformers {transformers.__version__}; batches {batches}; "
          f"contexts {contexts}; {a.new_tokens} new tokens; gen_batch_size {a.gen_batch_size}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        for shape in shapes:
            path = build_model(shape, Path(a.tokenizer), Path(tmp))
            rows += run_shape(path, shape, batches, contexts, a.new_tokens, a.repeats, a.gen_batch_size, a.device)
    print(f"\n{'shape':<14}{'B':>5}{'L':>6}{'prefill s':>11}{'decode ms/step':>16}{'turn of 8 tokens, s':>21}")
    for r in rows:
        turn = r["prefill_s"] + 7 * r["decode_step_ms"] / 1000
        print(f"{r['shape']:<14}{r['batch']:>5}{r['context']:>6}{r['prefill_s']:>11.3f}{r['decode_step_ms']:>16.2f}"
              f"{turn:>21.3f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                           "transformers": transformers.__version__, "rows": rows}, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
