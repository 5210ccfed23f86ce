#!/usr/bin/env bash
# The smoke preset on a GPU: `scalinginter run babyai --preset smoke` with the learner on CUDA and vLLM's CUDA engine
# (sleep mode: the engine frees the GPU during each update), then its wall-time breakdown and tokens/s.
# On a fresh GPU machine, from the repository root:
#   ./infra/install.sh            # nvidia-smi lists a GPU: the CUDA builds of torch and vLLM (or --gpu)
#   bench/gpu_smoke.sh            # extra --set key=value arguments are passed on (e.g. --set rollout.gpu_memory_utilization=0.5)
# Prints the run's summary lines, then one block: wall time by category (summary.json), generation tokens/s
# (rollout, per step), learner tokens/s (update, per step), step times, GPU, peak GPU memory seen by nvidia-smi.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L | grep -q "^GPU " \
  || { echo "bench/gpu_smoke.sh: nvidia-smi lists no GPU: this benchmark needs a CUDA machine" >&2; exit 2; }
$PY -c 'import sys, torch; torch.cuda.is_available() or sys.exit("torch sees no CUDA GPU (torch " + torch.__version__ + "): run infra/install.sh --gpu")'
$PY -c 'import sys; from vllm.platforms import current_platform as p; (not p.is_cpu()) or sys.exit("vLLM is the CPU build: run infra/install.sh --gpu")'
RUN="gpu-smoke-$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-runs}"
mkdir -p "$OUT"
# peak GPU memory while the run lasts (nvidia-smi, every second)
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 > "$OUT/$RUN.gpumem.txt" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null || true' EXIT
START=$(date +%s)
.venv/bin/scalinginter run babyai --preset smoke --run-name "$RUN" --set "output_dir=$OUT" \
  --set model.device=cuda --set rollout.backend=vllm "$@" | tee "$OUT/$RUN.console.txt"
END=$(date +%s)
kill $SMI 2>/dev/null || true
$PY - "$OUT/$RUN" "$OUT/$RUN.gpumem.txt" "$((END - START))" <<'PY'
import json, sys
from pathlib import Path

run, mem_file, elapsed = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
s = json.loads((run / "summary.json").read_text())
rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
wall = s["wall_time_s"]
print(f"\n== GPU smoke: {run.name}")
import torch
if torch.cuda.is_available():
    print(f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; torch {torch.__version__} (CUDA {torch.version.cuda})")
print(f"wall time {wall:.0f} s in the flow ({elapsed:.0f} s with the CLI's start):")
for k, v in sorted(s["wall_time_breakdown_s"].items(), key=lambda kv: -kv[1]):
    print(f"  {k:<12} {v:8.1f} s  {100 * v / wall:5.1f} %")

def col(key):
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]

def show(label, vals, unit):
    if vals:
        print(f"{label}: mean {sum(vals) / len(vals):.0f} {unit} (min {min(vals):.0f}, max {max(vals):.0f}) over {len(vals)} steps")

show("generation (rollout) tokens/s", col("gen_tokens_per_s"), "tok/s")
show("learner (update) tokens/s", col("train/update_tokens_per_s"), "tok/s")
show("step time", col("step_time_s"), "s")
mem = [int(x) for x in mem_file.read_text().split() if x.strip().isdigit()] if mem_file.exists() else []
if mem:
    print(f"peak GPU memory used (nvidia-smi, all processes): {max(mem) / 1024:.1f} GiB")
before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
if before and after:
    print(f"held-out success {before.get('success_rate', float('nan')):.3f} -> {after.get('success_rate', float('nan')):.3f}")
PY
