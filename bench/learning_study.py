"""ScalingInter vs fixed horizons, as one command.

    python bench/learning_study.py --env babyai --arms scalinginter,fixed-short,fixed-long --seeds 2

Every arm trains from the same base model for the same steps and episodes per step (the preset's), and
differs only in the turn limit of its phases (``core.study.arm_phases``): growing (ScalingInter), fixed at
the first phase's limit, fixed at the last phase's. Each run evaluates its phase finals on the same held-out
tasks (greedy, at the largest budget of ``--budgets``) from inside the training run, so the held-out curve
costs no extra engine start; the base model is scored once on the same tasks. The final checkpoint of each
run is then scored at every budget of ``--budgets`` (the interaction-scaling sweep).

Everything is logged to one MLflow experiment (``--experiment``, default ``learning-study-<env>``), so
``scalinginter compare --experiment learning-study-babyai RUN ...`` and ``notebooks/compare_runs.ipynb``
show the runs side by side. The table, the JSON and a PNG (held-out success vs training step per arm: mean
over seeds, min-max band) go to ``--results`` (default ``bench/results/``).

Each training run and evaluation is a subprocess (``scalinginter run`` / ``scalinginter eval``) whose output
goes to a log file under ``--output-dir``; the console shows our progress lines. Re-running the same command
resumes: finished runs are skipped (their summary exists), an unfinished one resumes from its checkpoint.

The starting model is the config's ``model.path`` (default: the base SmolLM2): ``--set model.path=DIR`` starts
every arm from DIR and scores DIR as the "base" row. ``--warmstart-demos N --warmstart-epochs E`` (and
``--warmstart-lr``) first makes that DIR: ``scalinginter warmstart`` (behaviour cloning on N expert demos of train
tasks, ``tasks/demos.py``) into ``<output-dir>/warmstart``, reused when it exists with the same settings. The
report records which model the study started from (``start_model``, with the warm start's record). The two-command
form is the same thing:

    scalinginter warmstart textcraft --preset easy --demos 61 --epochs 2 --lr 1e-5 --out runs-tc/warm
    python bench/learning_study.py --env textcraft --preset easy --set model.path=runs-tc/warm --output-dir runs-tc

Use a fresh ``--output-dir`` per starting model: a directory holding another model's study is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.study import ARMS, arm_phases, curve_over_seeds, parse_arms, pooled_successes  # noqa: E402

EVAL_KEYS = ("rollout.backend=", "rollout.vllm", "model.")
_PREFECT_PREFIX = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| \w+ *\| (?:Flow|Task) run '[^']*' - ")
PROGRESS_PREFIXES = ("phase ", "ScalingInter run", "evaluating", "before:", "after:", "held-out", "error")


def _cli() -> list[str]:
    return [sys.executable, "-m", "flows.cli"]


def _run_logged(cmd: list[str], log: Path, label: str) -> float:
    """Run ``cmd`` with its output in ``log``; echo our progress lines; return the wall time."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "a", buffering=1) as fh:  # line-buffered: the log is readable while the run goes
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            text = _PREFECT_PREFIX.sub("", line.rstrip())  # "12:00:00.000 | INFO    | Flow run 'x' - " + our line
            if text.startswith(PROGRESS_PREFIXES):
                print(f"  [{label}] {text}", flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"{label} failed (exit {rc}); log: {log}\n" + "\n".join(tail))
    return time.time() - t0


def preset_config(env: str, preset: str, overrides: list[str]):
    from flows.config import build_config

    return build_config(env, preset, overrides)


def train_arm(a: argparse.Namespace, arm: str, seed: int, phases: list[dict], budget: int) -> dict[str, Any]:
    name = f"study-{a.env}-{arm}-s{seed}"
    run_dir = Path(a.output_dir).resolve() / name
    summary_path = run_dir / "summary.json"
    log = Path(a.output_dir).resolve() / "logs" / f"{name}.log"
    wall = None
    if not summary_path.exists():
        cmd = _cli() + ["run", a.env, "--preset", a.preset, "--run-name", name,
                        "--set", f"seed={seed}",
                        "--set", f"curriculum.phases={json.dumps(arm_phases(phases, arm))}",
                        "--set", f"output_dir={Path(a.output_dir).resolve()}",
                        "--set", f"tracking.experiment={a.experiment}",
                        "--set", "eval.before=false", "--set", "eval.after=false",
                        "--set", "eval.each_phase=true", "--set", f"eval.n={a.eval_n}",
                        "--set", f"eval.turn_limit={budget}"]
        for s in a.set:
            cmd += ["--set", s]
        print(f"training {name}: turn limits {' -> '.join(str(p['turn_limit']) for p in arm_phases(phases, arm))}",
              flush=True)
        wall = _run_logged(cmd, log, name)
    summary = json.loads(summary_path.read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {int(m["global_step"]): m for m in metrics}  # a resumed step logged twice keeps its last record
    phase_evals = []
    for k in range(1, len(phases) + 1):
        p = run_dir / f"eval_phase-{k}.json"
        if p.exists():
            phase_evals.append(json.loads(p.read_text()))
    return {
        "run_name": name, "arm": arm, "seed": seed, "final_checkpoint": summary["final_checkpoint"],
        "mlflow_run_id": summary.get("mlflow_run_id"),
        "wall_time_s": wall if wall is not None else summary.get("wall_time_s"),
        "steps": len(by_step),
        "generated_tokens": int(sum(m.get("generated_tokens", 0.0) for m in by_step.values())),
        "step_time_s": float(sum(m.get("step_time_s", 0.0) for m in by_step.values())),
        "train_success": {s: m.get("success_rate") for s, m in sorted(by_step.items())},
        "heldout_by_step": {int(e["global_step"]): e for e in phase_evals},
    }


def evaluate(a: argparse.Namespace, ref: str, label: str, budgets: list[int], env_options: dict | None,
             max_new_tokens: int) -> dict[str, Any]:
    """``scalinginter eval`` (greedy, every budget in one engine call); its JSON document (flows.evaluate)."""
    out = Path(a.output_dir).resolve() / "evals" / f"{label}.json"
    if out.exists():
        had = json.loads(out.read_text())["models"]["model"].get("ref")
        if had != ref:
            raise SystemExit(f"{out} scored {had!r}, not {ref!r}: this output dir holds a study of another starting "
                             "model; pass a fresh --output-dir")
    else:
        cmd = _cli() + ["eval", ref, a.env, "--n", str(a.eval_n), "--turn-limits", ",".join(map(str, budgets)),
                        "--max-new-tokens", str(max_new_tokens), "--json", str(out),
                        "--experiment", a.experiment]
        if env_options is not None:
            cmd += ["--set", f"env.options={json.dumps(env_options)}"]
        for s in a.set:  # how to generate (backend, engine settings, model) is the same as in training
            if s.startswith(EVAL_KEYS):
                cmd += ["--set", s]
        print(f"evaluating {label} on {a.eval_n} held-out tasks at turn budgets {budgets}", flush=True)
        _run_logged(cmd, Path(a.output_dir).resolve() / "logs" / f"eval-{label}.log", label)
    return json.loads(out.read_text())


def per_task_success(doc: dict[str, Any], budget: int, model: str = "model") -> list[float]:
    """Per-task success (Avg@K over the task's unmasked samples; greedy: 0 or 1) at one budget, in task order."""
    cell = doc["models"][model]["budgets"][str(budget)]
    out = []
    for t in cell["per_task"]:
        s = [x for x in t["successes"] if x is not None]
        out.append(sum(s) / len(s) if s else 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="babyai")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated: " + ", ".join(ARMS))
    ap.add_argument("--seeds", type=int, default=2, help="training seeds per arm (first-seed .. first-seed+N-1)")
    ap.add_argument("--first-seed", type=int, default=0, help="the first training seed (add seeds to an earlier study)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="REPORT.json",
                    help="no training: merge study reports of the same env, preset and held-out tasks but different "
                         "seeds into one report (table, JSON, PNG)")
    ap.add_argument("--preset", default="smoke", help="the ScalingInter curriculum and recipe every arm starts from")
    ap.add_argument("--set", action="append", default=[], help="config override for every run (key.path=value)")
    ap.add_argument("--eval-n", type=int, default=None,
                    help="held-out tasks, the same for every arm and seed (default: the preset's eval.n)")
    ap.add_argument("--budgets", default=None, help="turn budgets of the final sweep (default: the arms' limits)")
    ap.add_argument("--output-dir", default="runs-study", help="runs, checkpoints, MLflow store and logs")
    ap.add_argument("--experiment", default=None, help="MLflow experiment (default learning-study-<env>)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"), help="where the JSON/PNG/table go")
    ap.add_argument("--warmstart-demos", type=int, default=None,
                    help="first warm-start the model: behaviour cloning on N expert demos of train tasks "
                         "(scalinginter warmstart), every arm and the base row start from it")
    ap.add_argument("--warmstart-epochs", type=int, default=None, help="epochs of the warm start")
    ap.add_argument("--warmstart-lr", type=float, default=1e-5, help="learning rate of the warm start")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' checkpoints (default: delete "
                                                                     "them once scored; ~0.5-1.6 GB each)")
    a = ap.parse_args(argv)
    if a.merge:
        report = merge_reports([json.loads(Path(p).read_text()) for p in a.merge])
        report["merged_from"] = [Path(p).name for p in a.merge]
        a.env = report["env"]
        write_outputs(a, report)
        return 0
    try:
        arms = parse_arms(a.arms)
    except ValueError as e:
        ap.error(str(e))
    if a.seeds < 1:
        ap.error("--seeds must be >= 1")
    a.experiment = a.experiment or f"learning-study-{a.env}"
    a.set = absolute_model_path(a.set)
    Path(a.output_dir).mkdir(parents=True, exist_ok=True)
    warm = None
    if a.warmstart_demos is not None or a.warmstart_epochs is not None:
        if a.warmstart_demos is None or a.warmstart_epochs is None:
            ap.error("--warmstart-demos and --warmstart-epochs go together")
        if a.warmstart_demos < 1 or a.warmstart_epochs < 1:
            ap.error("--warmstart-demos and --warmstart-epochs must be >= 1")
        warm = warm_start(a)
        a.set = [s for s in a.set if not s.startswith("model.path=")] + [f"model.path={warm['dir']}"]
    cfg = preset_config(a.env, a.preset, a.set)
    start_model = start_model_record(cfg.model.path, warm)
    a.eval_n = a.eval_n or cfg.eval.n
    phases = [p.model_dump() for p in cfg.curriculum.phases]
    mnt = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    limits = sorted({p["turn_limit"] for p in phases})
    budgets = sorted(int(x) for x in a.budgets.split(",")) if a.budgets else limits
    big = max(budgets)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(a.output_dir).resolve() / 'mlflow.db'}")
    Path(a.output_dir).mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    print(f"learning study on {a.env}: arms {', '.join(arms)} x {a.seeds} seed(s), preset {a.preset} "
          f"({sum(p['steps'] for p in phases)} steps), held-out n={a.eval_n}, budgets {budgets}; "
          f"MLflow experiment {a.experiment!r} ({os.environ['MLFLOW_TRACKING_URI']}); logs in {a.output_dir}/logs",
          flush=True)
    print(f"starting model (every arm and the base row): {describe_start(start_model)}", flush=True)
    base = evaluate(a, cfg.model.path, "base", budgets, cfg.env.options, mnt)
    runs = []
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for arm in arms:
            r = train_arm(a, arm, seed, phases, big)
            # the env options are given, not read from the checkpoint: every model on exactly the same tasks
            r["final_eval"] = evaluate(a, r["final_checkpoint"], r["run_name"], budgets, cfg.env.options, mnt)
            runs.append(r)
            if not a.keep_checkpoints:
                _drop_checkpoints(Path(a.output_dir).resolve() / "checkpoints" / r["run_name"])
    report = build_report(a, arms, phases, budgets, base, runs, time.time() - t_start)
    report["start_model"] = start_model
    write_outputs(a, report)
    return 0


def absolute_model_path(overrides: list[str]) -> list[str]:
    """``model.path=DIR`` with DIR an existing local folder made absolute (the runs are subprocesses in the repo
    root, so a path relative to the caller's directory would name another folder there)."""
    out = []
    for s in overrides:
        if s.startswith("model.path="):
            p = Path(s.split("=", 1)[1]).expanduser()
            if p.exists():
                s = f"model.path={p.resolve()}"
        out.append(s)
    return out


def warm_start(a: argparse.Namespace) -> dict[str, Any]:
    """``scalinginter warmstart`` into ``<output-dir>/warmstart`` (reused when it was made with the same demos,
    epochs and lr); its record (``warmstart.json``) with the folder as ``dir``."""
    d = Path(a.output_dir).resolve() / "warmstart"
    rec_path = d / "warmstart.json"
    want = {"demos_requested": a.warmstart_demos, "epochs": a.warmstart_epochs, "lr": a.warmstart_lr}
    if rec_path.exists():
        rec = json.loads(rec_path.read_text())
        had = {k: rec.get(k) for k in want}
        if had != want:
            raise SystemExit(f"{d} is a warm start with {had}, not {want}: pass a fresh --output-dir")
        print(f"warm start: reusing {d} ({rec['demos_succeeded']}/{rec['demos_requested']} demos, "
              f"{rec['epochs']} epoch(s) at lr {rec['lr']:g})", flush=True)
    else:
        cmd = _cli() + ["warmstart", a.env, "--preset", a.preset, "--demos", str(a.warmstart_demos),
                        "--epochs", str(a.warmstart_epochs), "--lr", str(a.warmstart_lr), "--out", str(d)]
        for s in a.set:
            cmd += ["--set", s]
        print(f"warm start: {a.warmstart_demos} expert demos, {a.warmstart_epochs} epoch(s) at lr "
              f"{a.warmstart_lr:g} -> {d}", flush=True)
        _run_logged(cmd, Path(a.output_dir).resolve() / "logs" / "warmstart.log", "warmstart")
        rec = json.loads(rec_path.read_text())
    return {**rec, "dir": str(d)}


def start_model_record(path: str, warm: dict[str, Any] | None) -> dict[str, Any]:
    """Which model the study started from: the path, and the warm start's record when the folder has one."""
    rec = warm
    if rec is None and (Path(path) / "warmstart.json").exists():
        rec = json.loads((Path(path) / "warmstart.json").read_text())
    keep = ("source_model", "demos_requested", "demos_succeeded", "epochs", "lr", "batch_size", "epoch_losses",
            "demo_turn_limit", "env_options")
    return {"path": path, "warmstart": None if rec is None else {k: rec.get(k) for k in keep}}


def describe_start(sm: dict[str, Any] | None) -> str:
    if not sm:
        return "the config's model.path (not recorded)"
    w = sm.get("warmstart")
    if not w:
        return sm["path"]
    losses = w.get("epoch_losses") or [float("nan")]
    return (f"{sm['path']} (behaviour-cloning warm start of {w['source_model']}: {w['demos_succeeded']}/"
            f"{w['demos_requested']} expert demos of train tasks, {w['epochs']} epoch(s) at lr {w['lr']:g}, "
            f"NLL {losses[0]:.3f} -> {losses[-1]:.3f})")


def _drop_checkpoints(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def build_report(a: argparse.Namespace, arms: list[str], phases: list[dict], budgets: list[int],
                 base: dict[str, Any], runs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    from core.evalreport import flat_metrics
    from core.stats import mcnemar_exact, wilson_interval

    big = max(budgets)
    base_s = per_task_success(base, big)
    arms_out: dict[str, Any] = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        per_seed = [per_task_success(r["final_eval"], big) for r in rs]
        pooled = pooled_successes(per_seed)
        n = len(pooled)
        k = sum(sum(p) for p in per_seed)
        lo, hi = wilson_interval(int(round(k)), n * len(per_seed))
        vs_base = [mcnemar_exact(sum(1 for x, y in zip(base_s, s) if y > x), sum(1 for x, y in zip(base_s, s) if x > y))
                   for s in per_seed]
        # held-out curve: the base at step 0, each phase final (eval.each_phase), the final at the last step
        curves = [{0: sum(base_s) / n,
                   **{s: flat_metrics(e)["success_rate"] for s, e in r["heldout_by_step"].items()},
                   r["steps"]: sum(p) / n} for r, p in zip(rs, per_seed)]
        train_curves = [{int(s): float(v) for s, v in r["train_success"].items() if v is not None} for r in rs]
        arms_out[arm] = {
            "turn_limits": [p["turn_limit"] for p in arm_phases(phases, arm)],
            "runs": [r["run_name"] for r in rs],
            "heldout_success": k / (n * len(per_seed)), "ci95": [lo, hi],
            "per_seed_success": [sum(p) / n for p in per_seed],
            "vs_base_mcnemar_p": vs_base,
            "sweep": {b: sum(sum(per_task_success(r["final_eval"], b)) for r in rs) / (n * len(rs)) for b in budgets},
            "steps": rs[0]["steps"] if rs else 0,
            "generated_tokens": sum(r["generated_tokens"] for r in rs) / max(len(rs), 1),
            "wall_time_s": (sum(r["wall_time_s"] or 0 for r in rs) / max(len(rs), 1)),
            "step_time_s": sum(r["step_time_s"] for r in rs) / max(len(rs), 1),
            "curve": {s: vars(b) for s, b in curve_over_seeds(curves).items()},
            "train_curve": {s: vars(b) for s, b in curve_over_seeds(train_curves).items()},
            "pooled_per_task": pooled,
            "per_seed_per_task": per_seed,  # greedy 0/1 per held-out task, per seed (task order of the eval)
        }
    comparisons = arm_comparisons(arms_out)
    return {"env": a.env, "preset": a.preset, "overrides": a.set, "seeds": a.seeds, "eval_n": a.eval_n,
            "budgets": budgets, "experiment": a.experiment, "machine": _machine(),
            "base": {"heldout_success": sum(base_s) / len(base_s), "ci95": list(wilson_interval(int(sum(base_s)), len(base_s))),
                     "sweep": {b: sum(per_task_success(base, b)) / len(base_s) for b in budgets}},
            "arms": arms_out, "comparisons": comparisons, "wall_time_s": wall,
            "runs": [{k: v for k, v in r.items() if k != "final_eval"} for r in runs]}


def arm_comparisons(arms_out: dict[str, Any]) -> dict[str, Any]:
    """ScalingInter minus every other arm on the same held-out tasks: the paired bootstrap over the per-task
    success pooled over seeds."""
    from core.stats import paired_bootstrap

    if "scalinginter" not in arms_out:
        return {}
    si = arms_out["scalinginter"]["pooled_per_task"]
    out = {}
    for arm, r in arms_out.items():
        if arm != "scalinginter":
            c = paired_bootstrap(si, r["pooled_per_task"], seed=0)
            out[f"scalinginter - {arm}"] = {"diff": c.diff, "ci95": list(c.ci), "p_value": c.p_value}
    return out


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from study reports that differ only in their seeds (same env, preset, held-out tasks and base
    model outcome): pooled success and intervals over every seed's episodes, the paired comparisons on the
    per-task means over all seeds, the sweeps at the budgets every report has (mean over seeds), the curves' points
    with the number of seeds behind each. A report written before ``per_seed_per_task`` existed counts as one seed
    per arm whose per-task outcomes are its ``pooled_per_task``."""
    from core.stats import wilson_interval

    if len(reports) < 2:
        raise SystemExit("--merge needs two or more reports")
    first = reports[0]
    for r in reports[1:]:
        for key in ("env", "preset", "eval_n"):
            if r[key] != first[key]:
                raise SystemExit(f"--merge: reports differ in {key}: {first[key]!r} vs {r[key]!r}")
        if (r.get("start_model") or {}).get("path") != (first.get("start_model") or {}).get("path"):
            raise SystemExit("--merge: the reports started from different models")
        if abs(r["base"]["heldout_success"] - first["base"]["heldout_success"]) > 1e-12:
            raise SystemExit("--merge: the base model scored differently: not the same held-out tasks")
        if list(r["arms"]) != list(first["arms"]):
            raise SystemExit(f"--merge: reports have different arms: {list(first['arms'])} vs {list(r['arms'])}")
    budgets = sorted(set.intersection(*(set(int(b) for b in r["budgets"]) for r in reports)))
    if max(budgets) != max(int(b) for b in first["budgets"]):
        raise SystemExit("--merge: the reports do not share their largest budget")
    arms_out: dict[str, Any] = {}
    for arm in first["arms"]:
        parts = [r["arms"][arm] for r in reports]
        per_seed = [s for p in parts for s in p.get("per_seed_per_task") or [p["pooled_per_task"]]]
        n, seeds = len(per_seed[0]), len(per_seed)
        k = sum(sum(s) for s in per_seed)
        lo, hi = wilson_interval(int(round(k)), n * seeds)

        def merged_curve(key: str) -> dict[str, Any]:
            pts: dict[int, list[tuple[dict, int]]] = {}
            for p in parts:
                for step, b in p[key].items():
                    pts.setdefault(int(step), []).append((b, int(b.get("n", 1))))
            out = {}
            for step, bs in sorted(pts.items()):
                total = sum(w for _, w in bs)
                out[str(step)] = {"mean": sum(b["mean"] * w for b, w in bs) / total,
                                  "lo": min(b["lo"] for b, _ in bs), "hi": max(b["hi"] for b, _ in bs), "n": total}
            return out

        arms_out[arm] = {
            "turn_limits": parts[0]["turn_limits"], "runs": [x for p in parts for x in p["runs"]],
            "heldout_success": k / (n * seeds), "ci95": [lo, hi],
            "per_seed_success": [x for p in parts for x in p["per_seed_success"]],
            "vs_base_mcnemar_p": [x for p in parts for x in p["vs_base_mcnemar_p"]],
            "sweep": {str(b): sum(p["sweep"][str(b)] * len(p["per_seed_success"]) for p in parts) / seeds
                      for b in budgets},
            "steps": parts[0]["steps"],
            **{key: sum(p[key] * len(p["per_seed_success"]) for p in parts) / seeds
               for key in ("generated_tokens", "wall_time_s", "step_time_s")},
            "curve": merged_curve("curve"), "train_curve": merged_curve("train_curve"),
            "pooled_per_task": pooled_successes(per_seed),
            "per_seed_per_task": per_seed,
        }
    comparisons = arm_comparisons(arms_out)
    base = dict(first["base"])
    base["sweep"] = {str(b): first["base"]["sweep"][str(b)] for b in budgets}
    return {"env": first["env"], "preset": first["preset"], "overrides": first["overrides"],
            "seeds": len(arms_out[next(iter(arms_out))]["per_seed_success"]), "eval_n": first["eval_n"],
            "budgets": budgets, "experiment": first["experiment"], "start_model": first.get("start_model"),
            "machine": "; ".join(sorted({r["machine"] for r in reports})), "base": base, "arms": arms_out,
            "comparisons": comparisons, "wall_time_s": sum(r["wall_time_s"] for r in reports),
            "runs": [x for r in reports for x in r["runs"]]}


def _machine() -> str:
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    kind = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["avx2-only (fp32)"]
    return f"{os.cpu_count()} cores, {', '.join(kind)}"


def table(report: dict[str, Any]) -> str:
    big = max(report["budgets"])
    lines = [f"learning study: {report['env']}, preset {report['preset']}, {report['seeds']} seed(s), "
             f"held-out n={report['eval_n']} at {big} turns (greedy); {report['machine']}",
             f"starting model: {describe_start(report.get('start_model'))}",
             f"{'arm':<14}{'limits':<12}{'held-out':>10}{'95% CI':>16}{'vs base p (per seed)':>22}{'steps':>7}"
             f"{'tokens':>10}{'step s':>8}{'wall s':>9}",
             f"{'base model':<14}{'-':<12}{report['base']['heldout_success']:>10.3f}"
             f"{'[%.3f, %.3f]' % tuple(report['base']['ci95']):>16}{'':>22}{0:>7}{'-':>10}{'-':>8}{'-':>9}"]
    for arm, r in report["arms"].items():
        ps = ",".join(f"{p:.2g}" for p in r["vs_base_mcnemar_p"])
        lines.append(f"{arm:<14}{'>'.join(map(str, r['turn_limits'])):<12}{r['heldout_success']:>10.3f}"
                     f"{'[%.3f, %.3f]' % tuple(r['ci95']):>16}{ps:>22}{r['steps']:>7}"
                     f"{r['generated_tokens']:>10.0f}{r['step_time_s']:>8.0f}{r['wall_time_s']:>9.0f}")
    for name, c in report["comparisons"].items():
        lines.append(f"{name}: {c['diff']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}], "
                     f"paired bootstrap p = {c['p_value']:.3g}")
    lines.append("sweep (held-out success by turn budget): " + "; ".join(
        f"{arm} " + ", ".join(f"{b}:{v:.2f}" for b, v in r["sweep"].items()) for arm, r in report["arms"].items()))
    return "\n".join(lines)


def write_outputs(a: argparse.Namespace, report: dict[str, Any]) -> None:
    out = Path(a.results)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"learning-study-{a.env}-{time.strftime('%Y%m%d-%H%M%S')}"
    text = table(report)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text("```\n" + text + "\n```\n")
    plot(report, stem.with_suffix(".png"))
    print("\n" + text)
    print(f"\nwrote {stem}.json, .md, .png")


def plot(report: dict[str, Any], path: Path) -> None:
    """Held-out success vs training step (left) and train success per step (right), per arm: mean over seeds
    and the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    panels = [("curve", f"held-out success (n={report['eval_n']}, {max(report['budgets'])} turns, greedy)"),
              ("train_curve", "train success (sampled episodes of the step)")]
    for ax, (key, label) in zip(axes, panels):
        for arm, r in report["arms"].items():
            pts = sorted((int(s), b) for s, b in r[key].items())
            xs = [s for s, _ in pts]
            ax.plot(xs, [b["mean"] for _, b in pts], marker="o", markersize=3,
                    label=f"{arm} ({'>'.join(map(str, r['turn_limits']))})")
            ax.fill_between(xs, [b["lo"] for _, b in pts], [b["hi"] for _, b in pts], alpha=0.15)
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['env']}: ScalingInter vs fixed horizons ({report['seeds']} seed(s); band = min-max "
                 f"over seeds); {report['machine']}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
