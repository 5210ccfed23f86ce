"""LoRA (model.lora) against full fine-tuning: the smoke demo back to back, and the TRL workload with LoRA on both sides.

    python bench/bench_lora.py demo [--preset smoke] [--rank 16 ...] [--lr 3e-5 ...] [--set key=value ...]
    pip install -e '.[bench]'; python bench/bench_lora.py trl [--rank 16] [--lr 1e-5] [--steps 3]

``demo``: ``scalinginter run babyai --preset smoke`` as a user runs it, first with full fine-tuning (the preset as it
is), then with ``--set model.lora.rank=R --set algo.lr=LR`` for every rank and learning rate given (all pairs), one
after another in child processes on fresh output folders. Per run: wall time, the process tree's peak RSS (sampled
every 0.2 s), the weight sync's seconds per step (``train/weight_sync_s`` of metrics.jsonl), the held-out success
before and after (``eval_before.json`` / ``eval_after.json``: the same tasks and seeds) with its paired test
(McNemar), and each LoRA run's final against the full run's final on the same tasks (paired too). Writes
``bench/results/lora/lora-demo-<time>.json`` and prints a table.

``trl``: ``bench/bench_trl.py``'s single-turn GRPO workload with rank-R adapters on both sides (ours:
``model.lora`` with the in-process vLLM engine syncing the adapter alone; TRL: ``GRPOTrainer(peft_config=...)``),
at learning rate LR on both; seconds per step and peak RSS. Writes ``bench/results/lora/lora-trl-<time>.json``.

Timings need an idle machine: run it when nothing else runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "lora"


def _peak_tree_rss(proc: subprocess.Popen) -> int:
    from bench.bench_trl import _tree_rss

    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid)[0])
        time.sleep(0.2)
    return peak


def _outcomes(doc: dict) -> dict[tuple, bool]:
    """(turn budget, task, sample) -> success of an evaluation document (docs/reference/eval-json.md); masked
    episodes (null) left out."""
    out = {}
    for t, cell in doc["models"]["model"]["budgets"].items():
        for row in cell["per_task"]:
            for k, s in enumerate(row["successes"]):
                if s is not None:
                    out[(t, str(row["task_id"]), str(k))] = bool(s)
    return out


def _paired(a: dict[tuple, bool], b: dict[tuple, bool]) -> dict:
    """a - b on their common episodes: the success difference and McNemar's exact p."""
    from core.stats import mcnemar_exact

    keys = sorted(set(a) & set(b))
    only_a = sum(a[k] and not b[k] for k in keys)
    only_b = sum(b[k] and not a[k] for k in keys)
    diff = (sum(a[k] for k in keys) - sum(b[k] for k in keys)) / max(1, len(keys))
    return {"n": len(keys), "diff": diff, "only_first": only_a, "only_second": only_b,
            "mcnemar_p": mcnemar_exact(only_a, only_b)}


def run_demo_once(name: str, preset: str, sets: list[str], work: Path) -> dict:
    out = work / name
    out.mkdir(parents=True)
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]) + [
        "run", "babyai", "--preset", preset, "--run-name", name, "--set", f"output_dir={out}"]
    for s in sets:
        cmd += ["--set", s]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(out / "console.log", "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        peak = _peak_tree_rss(proc)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] failed ({proc.returncode}): see {out / 'console.log'}")
    run = out / name
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    sync = [m.get("train/weight_sync_s") for m in steps if m.get("train/weight_sync_s") is not None]
    before = json.loads((run / "eval_before.json").read_text())
    after = json.loads((run / "eval_after.json").read_text())
    a, b = _outcomes(after), _outcomes(before)
    row = {"name": name, "sets": sets, "wall_s": wall, "peak_rss_gib": peak / 2**30,
           "weight_sync_s_per_step": sum(sync) / max(1, len(sync)), "steps": len(steps),
           "success_before": sum(b.values()) / max(1, len(b)), "success_after": sum(a.values()) / max(1, len(a)),
           "gain": _paired(a, b), "_after": {":".join(k): v for k, v in a.items()}}
    print(f"[{name}] {wall:.0f} s, peak {row['peak_rss_gib']:.2f} GiB, sync {row['weight_sync_s_per_step']:.2f} s/step, "
          f"held-out {row['success_before']:.3f} -> {row['success_after']:.3f} (p {row['gain']['mcnemar_p']:.3g})",
          flush=True)
    return row


def demo(a) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    rows = [run_demo_once("full", a.preset, list(a.sets), work)]
    for rank, lr in itertools.product(a.rank, a.lr):
        rows.append(run_demo_once(f"lora-r{rank}-lr{lr:g}", a.preset,
                                  list(a.sets) + [f"model.lora.rank={rank}", f"algo.lr={lr}"], work))
    full = {tuple(k.split(":")): v for k, v in rows[0]["_after"].items()}
    for r in rows[1:]:  # each LoRA final against the full final, on the same held-out episodes
        r["vs_full"] = _paired({tuple(k.split(":")): v for k, v in r["_after"].items()}, full)
    print(f"\n{'run':24} {'wall s':>7} {'peak GiB':>9} {'sync s':>7} {'before':>7} {'after':>7} {'p':>7} "
          f"{'vs full':>8} {'p':>7}")
    for r in rows:
        vs = r.get("vs_full")
        print(f"{r['name']:24} {r['wall_s']:7.0f} {r['peak_rss_gib']:9.2f} {r['weight_sync_s_per_step']:7.2f} "
              f"{r['success_before']:7.3f} {r['success_after']:7.3f} {r['gain']['mcnemar_p']:7.3g} "
              + (f"{vs['diff']:+8.3f} {vs['mcnemar_p']:7.3g}" if vs else ""))
    for r in rows:
        r.pop("_after")
    return {"preset": a.preset, "rows": rows, "work": str(work)}


# --- TRL with LoRA on both sides -----------------------------------------------------------------------------------
def _trl_worker(side: str, steps: int, rank: int, lr: float, out: str) -> None:
    """One side of bench_trl's workload with adapters: our learner and vLLM engine patched to LoRA (the adapter
    synced alone), or TRL's GRPOTrainer given a peft config."""
    import dataclasses

    import bench.bench_trl as bt

    bt.LR = lr
    if side == "ours":
        import runtime.backends.learner as L
        import runtime.backends.vllm_backend as V
        from runtime.backends.lora import LoraSpec

        spec = LoraSpec(rank, 2.0 * rank)
        made: list = []

        class LoraLearner(L.TorchLearner):
            def __init__(self, path, cfg, reference_path=None):
                super().__init__(path, dataclasses.replace(cfg, lora=spec), reference_path)
                made.append(self)

        class LoraEngine(V.VLLMBackend):
            def __init__(self, *args, **kw):
                kw.update(lora_rank=rank, release_weights=False, named_weights=None, export_weights=None)
                super().__init__(*args, **kw)
                self.adapter = made[-1].lora_source()  # sync_weights moves the adapter alone
                self.push_adapter(self.adapter)

        L.TorchLearner, V.VLLMBackend = LoraLearner, LoraEngine
        row = bt.run_ours(steps, "vllm", in_process=True)
        row["framework"] = f"scalinginter LoRA r{rank} (vLLM in-process, adapter sync)"
    else:
        import trl
        from peft import LoraConfig

        init = trl.GRPOTrainer.__init__

        def with_peft(self, *args, **kw):
            kw["peft_config"] = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                           task_type="CAUSAL_LM")
            init(self, *args, **kw)

        trl.GRPOTrainer.__init__ = with_peft
        row = bt.run_trl(steps)
        row["framework"] = f"trl GRPOTrainer LoRA r{rank}"
    Path(out).write_text(json.dumps(row))


def trl_bench(a) -> dict:
    rows = []
    for side in ("ours", "trl"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, __file__, "trl-worker", side, str(a.steps), str(a.rank[0]), str(a.lr[0]), out]
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        peak = _peak_tree_rss(proc)
        if proc.returncode != 0:
            raise SystemExit(f"{side} failed ({proc.returncode})")
        row = json.loads(Path(out).read_text())
        os.unlink(out)
        row.update(peak_rss_gib=peak / 2**30, wall_s=time.time() - t0)
        rows.append(row)
    print(f"\n{'framework':56} {'s/step':>8} {'peak RSS GiB':>13}")
    for r in rows:
        print(f"{r['framework']:56} {r['step_s']:8.1f} {r['peak_rss_gib']:13.2f}")
    return {"rank": a.rank[0], "lr": a.lr[0], "steps": a.steps, "rows": rows}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "trl-worker":
        _, _, side, steps, rank, lr, out = sys.argv
        _trl_worker(side, int(steps), int(rank), float(lr), out)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["demo", "trl"])
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--rank", type=int, nargs="+", default=[16], help="LoRA ranks (demo: every one with every --lr)")
    ap.add_argument("--lr", type=float, nargs="+", default=None,
                    help="learning rates of the LoRA runs (default: demo 3e-5 1e-4, trl 1e-5)")
    ap.add_argument("--steps", type=int, default=3, help="trl: training steps per side (the first is not timed)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="demo: --set for every run")
    a = ap.parse_args()
    a.lr = a.lr or ([3e-5, 1e-4] if a.what == "demo" else [1e-5])
    doc = demo(a) if a.what == "demo" else trl_bench(a)
    RESULTS.mkdir(parents=True, exist_ok=True)
    res = RESULTS / f"lora-{a.what}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    res.write_text(json.dumps(doc, indent=2))
    print(f"wrote {res}")


if __name__ == "__main__":
    main()
