"""Peak memory and time of one learner update as the micro-batch's padded tokens grow.

    python bench/bench_learner_memory.py [--seqs 4] [--len 2048] [--caps none,4096,2048]

One policy-gradient update of SmolLM2-135M (the embedded model, the learner's own precision choice) over
``--seqs`` sequences of ``--len`` tokens with action tokens spread through them (as in a 6-turn BabyAI episode),
``micro_batch_size`` = ``--seqs`` and each ``--caps`` value as ``algo.micro_batch_tokens``. Every setting runs in
its own child process, so its peak RSS (``ru_maxrss``) is its own: model + optimizer + activations. Prints a table
and writes bench/results/learner-memory/learner-memory-<time>.json. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(seqs: int, length: int, cap: int | None) -> dict:
    import torch

    from core.trajectory import Trajectory
    from runtime.backends.hardware import resolve_bf16
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model

    torch.manual_seed(0)
    learner = TorchLearner(resolve_model("smollm2-135m"), LearnerConfig(
        lr=1e-6, kl_coef=0.0, micro_batch_size=seqs, micro_batch_tokens=cap, bf16_autocast=resolve_bf16(None),
        share_prefix=False))
    vocab = learner.tokenizer.vocab_size
    trajs, advs = [], []
    for i in range(seqs):
        t = Trajectory(task_id=i, group_id=i)
        ids = torch.randint(10, vocab - 10, (length,)).tolist()
        t.start(ids[:256])
        pos = 256
        while pos < length:  # 24 action tokens, then an observation of ~200 tokens, to the end
            act = ids[pos:pos + 24]
            t.add_action(act, [-1.0] * len(act))
            pos += len(act)
            if pos < length:
                obs = ids[pos:pos + 200]
                t.add_env(obs)
                pos += len(obs)
        trajs.append(t)
        advs.append([(1.0 if i % 2 else -1.0) * m for m in t.loss_mask])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.time()
    learner.update(trajs, advs, prepared=learner.prepare(trajs))
    dt = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seqs": seqs, "len": length, "cap": cap, "update_s": round(dt, 2),
            "rss_before_update_gb": round(base / 2**20, 2), "peak_rss_gb": round(peak / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--caps", default="none,4096,2048")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.seqs, a.len, None if a.child == "none" else int(a.child))))
        return
    flags = sorted(set(f for f in open("/proc/cpuinfo").read().split() if f in ("avx512_bf16", "amx_bf16")))
    rows = []
    for cap in a.caps.split(","):
        out = subprocess.run([sys.executable, __file__, "--seqs", str(a.seqs), "--len", str(a.len), "--child", cap],
                             capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        if out.returncode != 0:
            raise SystemExit(f"cap {cap} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"cap {str(r['cap']):>5}: update {r['update_s']:6.1f} s, peak RSS {r['peak_rss_gb']:5.2f} GB "
              f"(before the update {r['rss_before_update_gb']:.2f} GB)", flush=True)
    res = ROOT / "bench" / "results" / "learner-memory"
    res.mkdir(parents=True, exist_ok=True)
    path = res / f"learner-memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"cpu_flags": flags, "rows": rows}, indent=2))
    print(f"cpu flags: {' '.join(flags) or 'none (AVX2: fp32)'}; written {path}")


if __name__ == "__main__":
    main()
