"""ScalingInter vs fixed horizons, as one command (``bench/learning_study.py`` runs the same).

    scalinginter study --env babyai --arms scalinginter,fixed-short,fixed-long --seeds 2

Every arm trains from the same base model for the same steps and episodes per step (the preset's), and
differs only in the turn limit of its phases (``core.study.arm_phases``): growing (ScalingInter), fixed at
the first phase's limit, fixed at the last phase's. A fourth arm, ``scalinginter-gigpo`` (not in the default
``--arms``), is the ScalingInter curriculum trained with the GiGPO estimator (``core.study.arm_overrides``:
``algo.estimator=gigpo``, given after ``--set`` so the arm wins; it needs ``rollout.samples_per_task`` >= 2).
Each run evaluates its phase finals on the same held-out tasks (greedy, at the largest budget of ``--budgets``)
from inside the training run, so the held-out curve costs no extra engine start; the base model is scored once
on the same tasks. The final checkpoint of each run is then scored at every budget of ``--budgets`` (the
interaction-scaling sweep).

The report (JSON; a table as ``.md``; a PNG): per arm the pooled held-out success over seeds at the largest
budget with its Wilson interval, McNemar against the base model per seed, the sweep, tokens and wall time, the
held-out and train curves (mean and min-max band over seeds), the arm's config overrides, and the stability
diagnostics of ``metrics.jsonl`` (``diag/*``, ``train/entropy``, train success) as means per phase
(``diagnostics``) and per step (``diag_curves``); the paired bootstrap of ScalingInter minus every other arm
(and of the GiGPO arm minus each fixed arm) on the per-task success pooled over seeds, at every budget. Where the
env labels its tasks with the turns its expert needs (BabyAI), the held-out tasks' labels (``task_required_turns``)
and every result by required-turns bucket (1, 2-3, 4-6, 7+): ``buckets`` per budget (base and arms),
``bucket_curves`` (per phase, at the largest budget) and the comparisons' ``buckets``.

Everything is logged to one MLflow experiment (``--experiment``, default ``learning-study-<env>``), so
``scalinginter compare --experiment learning-study-babyai RUN ...`` and ``notebooks/compare_runs.ipynb``
show the runs side by side. The table, the JSON and the PNG go to ``--results`` (default ``bench/results/``).

Each training run and evaluation is a subprocess (``scalinginter run`` / ``scalinginter eval``) whose output
goes to a log file under ``--output-dir``; the console shows our progress lines. Re-running the same command
resumes: finished runs are skipped (their summary exists), an unfinished one resumes from its checkpoint.
Leading phases two arms train alike (``core.study.shared_phases``: fixed-short's phase 1 is scalinginter's) are
trained once: the arm that runs second takes them over from the other's run in ``--output-dir`` (``share_phases``;
``--no-shared-phases`` trains them again), and a scored run keeps those phase finals until that arm has started.
``--merge A.json B.json ...`` pools reports of the same study that differ in their seeds or arms (intervals,
per-bucket results and comparisons are recomputed from the per-task outcomes the reports store): a study too long
for one machine's session runs in pieces, an arm and a seed at a time (``--arms fixed-long --seeds 1 --first-seed
2``), each piece's report kept, then merged; a piece may start from the warm start made again with the same
recipe (each seed is then compared with the starting model its own piece scored). Within a seed every arm trains in
one arithmetic (bf16 or fp32 learner) from one starting model, so that the arms' paired difference on that seed is
the arms' alone; seeds may differ, each then compared with its own start (``--status``, ``--next``, ``--merge``).

The starting model is the config's ``model.path`` (default: the base SmolLM2): ``--set model.path=DIR`` starts
every arm from DIR and scores DIR as the "base" row. ``--warmstart-demos N --warmstart-epochs E`` (and
``--warmstart-lr``) first makes that DIR: ``scalinginter warmstart`` (behaviour cloning on N expert demos of train
tasks, ``tasks/demos.py``) into ``<output-dir>/warmstart``, reused when it exists with the same settings. The
report records which model the study started from (``start_model``, with the warm start's record). The two-command
form is the same thing:

    scalinginter warmstart textcraft --preset easy --demos 61 --epochs 2 --lr 1e-5 --out runs-tc/warm
    python bench/learning_study.py --env textcraft --preset easy --set model.path=runs-tc/warm --output-dir runs-tc

The multi-step BabyAI study (the ``multistep`` preset: 3 -> 6 -> 10 turns, levels whose tasks need 1 to 10+
expert turns; a light warm start on the four shorter levels, then the four arms, results by required turns at 3
and 10 turns):

    scalinginter warmstart babyai --preset multistep \
        --set 'env.options={"levels":"GoToLocal,PickupLoc,OpenTwoDoors,UnlockLocal"}' \
        --demos 48 --epochs 2 --lr 5e-5 --turn-limit 10 --out runs-ms/warm
    python bench/learning_study.py --env babyai --preset multistep \
        --arms scalinginter,fixed-short,fixed-long,scalinginter-gigpo --seeds 2 --budgets 3,10 \
        --set model.path=runs-ms/warm --output-dir runs-ms

(the warm start's ``env.options`` are for its demos only: the study trains and scores on the preset's levels).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.study import (  # noqa: E402
    ARM_HELP,
    ARMS,
    COLLAPSE_RULE,
    DEFAULT_ARMS,
    Piece,
    arm_overrides,
    arm_phases,
    bucket_rates,
    blocked_seeds,
    bucket_stats,
    capped_share,
    collapse_check,
    comparison_pairs,
    curve_over_seeds,
    finite_number,
    heldout_churn,
    mean_of_dicts,
    merged_precision,
    other_arithmetic,
    paired_mcnemar,
    paper_claims,
    parse_arms,
    phase_means,
    piece_plan,
    piece_progress,
    pieces_in,
    pooled_successes,
    precision_text,
    report_precision,
    retention,
    seed_numbers,
    seed_precision_conflict,
    start_key,
)

# per-step keys of metrics.jsonl the report keeps: the stability diagnostics (core.metrics.DIAGNOSTICS), the
# update's policy entropy and the step's train success
DIAG_KEYS = ("diag/invalid_action_rate", "diag/repeated_action_rate", "diag/reply_tokens", "diag/turns_used_frac",
             "diag/turn_limit_frac", "diag/zero_adv_group_frac", "train/entropy")
PHASE_KEYS = DIAG_KEYS + ("success_rate",)

EVAL_KEYS = ("rollout.backend=", "rollout.vllm", "model.")
_PREFECT_PREFIX = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| \w+ *\| (?:Flow|Task) run '[^']*' - ")
PROGRESS_PREFIXES = ("phase ", "ScalingInter run", "evaluating", "before:", "after:", "held-out", "error")


def _cli() -> list[str]:
    return [sys.executable, "-m", "flows.cli"]


def _read_tally(tally: Path | None) -> float:
    """The wall seconds a run's earlier commands spent (0 without a tally file or with a broken one)."""
    if tally is None or not tally.exists():
        return 0.0
    try:
        return float(json.loads(tally.read_text())["wall_time_s"])
    except (ValueError, KeyError, TypeError):
        return 0.0


def _run_logged(cmd: list[str], log: Path, label: str, tally: Path | None = None) -> float:
    """Run ``cmd`` with its output in ``log``; echo our progress lines; return the wall time.

    With ``tally`` (a JSON file), the wall time is summed over every command given that file: the earlier
    commands' seconds are read from it, and it is rewritten at least every 30 s of output and at the end, so a
    piece resumed across sessions reports all its commands' time, less at most the killed command's last 30 s.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    prior = _read_tally(tally)
    t0 = last = time.time()

    def record() -> None:  # atomically (temporary file, then rename): a kill mid-write keeps the last total
        if tally is not None:
            tmp = tally.with_name(tally.name + ".tmp")
            tmp.write_text(json.dumps({"wall_time_s": prior + time.time() - t0}))
            os.replace(tmp, tally)
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
            if time.time() - last >= 30:
                record()
                last = time.time()
        rc = proc.wait()
    record()
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"{label} failed (exit {rc}); log: {log}\n" + "\n".join(tail))
    return prior + time.time() - t0


def preset_config(env: str, preset: str, overrides: list[str]):
    from flows.config import build_config

    return build_config(env, preset, overrides)


def run_name(a: argparse.Namespace, arm: str, seed: int) -> str:
    return f"study-{a.env}-{arm}-s{seed}"


def arm_sets(a: argparse.Namespace, arm: str, seed: int, phases: list[dict], budget: int) -> list[str]:
    """The ``--set`` overrides of an arm's ``scalinginter run`` command, in the order it applies them."""
    sets = [f"seed={seed}", f"output_dir={Path(a.output_dir).resolve()}", f"tracking.experiment={a.experiment}",
            "eval.before=false", "eval.after=false", "eval.each_phase=true", "eval.each_phase_last=false",
            f"eval.n={a.eval_n}", f"eval.turn_limit={budget}"]
    sets += list(a.set)
    # after the user's (which may set the curriculum ``phases`` came from): the arm's limits and settings win
    sets.append(f"curriculum.phases={json.dumps(arm_phases(phases, arm))}")
    return sets + arm_overrides(arm)


def train_arm(a: argparse.Namespace, arm: str, seed: int, phases: list[dict], budget: int) -> dict[str, Any]:
    name = run_name(a, arm, seed)
    run_dir = Path(a.output_dir).resolve() / name
    summary_path = run_dir / "summary.json"
    log = Path(a.output_dir).resolve() / "logs" / f"{name}.log"
    tally = log.with_suffix(".wall.json")  # the training commands' wall time, summed over resumes
    wall = None
    shared = read_shared(run_dir)
    if not summary_path.exists():
        sets = arm_sets(a, arm, seed, phases, budget)
        if shared is not None:
            shared = ensure_shared(a, name, shared)
        if shared is None and getattr(a, "share_phases", False):
            shared = share_phases(a, arm, seed, phases, sets)
        if shared is not None:  # its first phases' finals were made with the other arm's later turn limits
            sets.append(f"resume.allow_changes={json.dumps(shared['allow_changes'])}")
            shared_to_mlflow(a, name, shared, sets)
        cmd = _cli() + ["run", a.env, "--preset", a.preset, "--run-name", name]
        for s in sets:
            cmd += ["--set", s]
        extra = f"; {', '.join(arm_overrides(arm))}" if arm_overrides(arm) else ""
        print(f"training {name}: turn limits {' -> '.join(str(p['turn_limit']) for p in arm_phases(phases, arm))}"
              f"{extra}", flush=True)
        wall = _run_logged(cmd, log, name, tally=tally)
    summary = json.loads(summary_path.read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {int(m["global_step"]): m for m in metrics}  # a resumed step logged twice keeps its last record
    phase_evals = []
    for k in range(1, len(phases) + 1):
        p = run_dir / f"eval_phase-{k}.json"
        if p.exists():
            phase_evals.append(json.loads(p.read_text()))
    step_records = [{"global_step": s, "phase": m.get("phase"), **{k: m[k] for k in PHASE_KEYS if k in m}}
                    for s, m in sorted(by_step.items())]
    return {
        "run_name": name, "arm": arm, "seed": seed, "final_checkpoint": summary["final_checkpoint"],
        "overrides": arm_overrides(arm),
        # phases taken over from another arm's run (trained once for both): which run, how many, what they cost
        **({"shared_phases": {k: shared[k] for k in ("from_run", "phases", "global_step", "step_time_s")}}
           if shared is not None else {}),
        "mlflow_run_id": summary.get("mlflow_run_id"),
        "wall_time_s": wall if wall is not None else (_read_tally(tally) or summary.get("wall_time_s")),
        "steps": len(by_step),
        "generated_tokens": int(sum(m.get("generated_tokens", 0.0) for m in by_step.values())),
        "step_time_s": float(sum(m.get("step_time_s", 0.0) for m in by_step.values())),
        "train_success": {s: m.get("success_rate") for s, m in sorted(by_step.items())},
        "heldout_by_step": {int(e["global_step"]): e for e in phase_evals},
        "step_records": step_records,  # per step: phase, diag/*, train/entropy, success_rate
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
        # lock-step rounds: each generation call's batch is fixed by the tasks and the outcomes so far, not by the
        # timing of env replies, so the same checkpoint on the same tasks gets the same greedy replies
        cmd += ["--set", "rollout.async_episodes=false"]
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
    epilog = "arms:\n" + "\n".join(f"  {arm:<20}{ARM_HELP[arm]}" for arm in ARMS)
    ap = argparse.ArgumentParser(prog="scalinginter study", description=__doc__, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="babyai")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated, of: {', '.join(ARMS)} (default {','.join(DEFAULT_ARMS)})")
    ap.add_argument("--seeds", type=int, default=2, help="training seeds per arm (first-seed .. first-seed+N-1)")
    ap.add_argument("--first-seed", type=int, default=0, help="the first training seed (add seeds to an earlier study)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="REPORT.json",
                    help="no training: merge study reports of the same env, preset and held-out tasks but different "
                         "seeds or arms (a study run in pieces) into one report (table, JSON, PNG)")
    ap.add_argument("--preset", default="smoke", help="the ScalingInter curriculum and recipe every arm starts from")
    ap.add_argument("--set", action="append", default=[], help="config override for every run (key.path=value)")
    ap.add_argument("--eval-n", type=int, default=None,
                    help="held-out tasks, the same for every arm and seed (default: the preset's eval.n)")
    ap.add_argument("--budgets", default=None, help="turn budgets of the final sweep (default: the arms' limits)")
    ap.add_argument("--output-dir", default="runs-study", help="runs, checkpoints, MLflow store and logs")
    ap.add_argument("--experiment", default=None, help="MLflow experiment (default learning-study-<env>)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"), help="where the JSON/PNG/table go")
    ap.add_argument("--tag", default=None,
                    help="a word in the reports' file names after the env, to tell studies apart in one folder: "
                         "learning-study-ENV-TAG-ARM-sSEED-STAMP for a piece (letters, digits and '-')")
    ap.add_argument("--warmstart-demos", type=int, default=None,
                    help="first warm-start the model: behaviour cloning on N expert demos of train tasks "
                         "(scalinginter warmstart), every arm and the base row start from it")
    ap.add_argument("--warmstart-epochs", type=int, default=None, help="epochs of the warm start")
    ap.add_argument("--warmstart-lr", type=float, default=1e-5, help="learning rate of the warm start")
    ap.add_argument("--no-rescore", dest="rescore", action="store_false",
                    help="skip the re-score check (default: the starting model is scored a second time on the same "
                         "tasks and the report gives the share of tasks with the same outcome)")
    ap.add_argument("--no-shared-phases", dest="share_phases", action="store_false",
                    help="train every arm's phases itself (default: an arm whose first phases are another arm's "
                         "of the same seed, as fixed-short's phase 1 is scalinginter's, takes them over from that "
                         "arm's run in --output-dir when it has their final checkpoints and scores)")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' checkpoints (default: delete "
                                                                     "them once scored; ~0.5-1.6 GB each)")
    ap.add_argument("--status", action="store_true",
                    help="no training: for a study run in pieces (one arm and seed per command), list which of "
                         "--arms x seeds have a report in --results (held-out success, the arithmetic it trained "
                         "in), which are left, each seed's arithmetic and whether this machine may add to it, and the "
                         "command for the next piece it may run")
    ap.add_argument("--next", action="store_true",
                    help="run only the next piece of a study run in pieces: the first arm and seed of --arms x seeds "
                         "(seed by seed, in the arms' order) with no report in --results, as --arms ARM --seeds 1 "
                         "--first-seed S. One arithmetic and one starting model per seed: a seed whose pieces trained "
                         "in another arithmetic than this machine's, or from another model.path, is skipped (refused "
                         "when every seed left is, unless --allow-mixed-precision); nothing to do once every piece is "
                         "in")
    ap.add_argument("--allow-mixed-precision", action="store_true",
                    help="with --merge: merge pieces of one seed that trained in different arithmetic (bf16 and "
                         "fp32 learners, or engines of different dtypes), which --merge otherwise refuses (seeds may "
                         "differ from one another: the report gives each seed's arithmetic); with --next: run a "
                         "piece of such a seed")
    a = ap.parse_args(argv)
    if a.tag is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", a.tag):
        ap.error(f"--tag {a.tag!r}: use letters, digits and '-' (it goes into file names)")
    if a.merge:
        reports = []
        for path in a.merge:
            try:
                reports.append(json.loads(Path(path).read_text()))
            except OSError as e:
                ap.error(f"--merge: cannot read {path}: {e.strerror or e}")
            except ValueError as e:
                ap.error(f"--merge: {path} is not a study report (not JSON: {e})")
        paths = list(a.merge)
        earlier = [k for k, r in enumerate(reports) if r.get("merged_from")]
        if earlier and len(earlier) < len(reports):  # `--merge DIR/*.json` run again: pieces and their merge
            print(f"--merge: left out {len(earlier)} merged report(s), whose pieces are merged from their own "
                  f"reports: {', '.join(Path(paths[k]).name for k in earlier)}", flush=True)
            reports = [r for k, r in enumerate(reports) if k not in earlier]
            paths = [p for k, p in enumerate(paths) if k not in earlier]
        report = merge_reports(reports, allow_mixed_precision=a.allow_mixed_precision,
                               names=[Path(p).name for p in paths])
        report["merged_from"] = [Path(p).name for p in paths]
        a.env = report["env"]
        write_outputs(a, report)
        return 0
    try:
        arms = parse_arms(a.arms)
    except ValueError as e:
        ap.error(str(e))
    if a.seeds < 1:
        ap.error("--seeds must be >= 1")
    if a.status:
        return study_status(a, arms, argv if argv is not None else sys.argv[1:])
    if a.next:
        piece = next_piece(a, arms)
        if piece is None:
            return 0
        arms, a.seeds, a.first_seed = [piece[0]], 1, piece[1]
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
    from runtime.backends.model import ModelNotFound, resolve_model

    try:  # before anything trains or scores: a starting model that is not there
        resolve_model(cfg.model.path)
    except ModelNotFound as e:
        ap.error(str(e))
    if cfg.rollout.task_filter == "fits_turns" and {"scalinginter", "scalinginter-fit"} <= set(arms):
        ap.error("the config already draws tasks that fit each phase (rollout.task_filter=fits_turns), so the arms "
                 "scalinginter and scalinginter-fit would be the same run: set rollout.task_filter=none (the "
                 "multistep-study preset leaves it off) or drop scalinginter-fit")
    start_model = start_model_record(cfg.model.path, warm)
    warn_other_arithmetic(a, run_precision(cfg))
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
    rescore = None
    if a.rescore:  # the same model on the same tasks again: does the held-out evaluation give the same answer?
        again = evaluate(a, cfg.model.path, "base-rescore", budgets, cfg.env.options, mnt)
        rescore = rescore_report(base, again, budgets)
        print("re-score of the starting model: " + "; ".join(
            f"{b} turns {r['same']}/{r['tasks']} tasks the same" for b, r in rescore["budgets"].items()), flush=True)
    runs = []
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for arm in arms:
            r = train_arm(a, arm, seed, phases, big)
            # the env options are given, not read from the checkpoint: every model on exactly the same tasks
            r["final_eval"] = evaluate(a, r["final_checkpoint"], r["run_name"], budgets, cfg.env.options, mnt)
            runs.append(r)
            if not a.keep_checkpoints:
                prune_checkpoints(a, phases, r["run_name"])
    report = build_report(a, arms, phases, budgets, base, runs, time.time() - t_start)
    report["start_model"] = start_model
    report["precision"] = run_precision(cfg)
    if rescore is not None:
        report["rescore"] = rescore
    write_outputs(a, report)
    return 0


def run_precision(cfg) -> dict[str, str]:
    """The arithmetic a run of ``cfg`` trains in on this machine: the learner's (bf16 autocast or fp32,
    ``model.bf16_autocast`` resolved here) and the rollout's (the vLLM engine's dtype; transformers generation runs
    in the learner's)."""
    from runtime.backends.hardware import resolve_bf16, resolve_vllm_dtype

    learner = "bf16" if resolve_bf16(cfg.model.bf16_autocast) else "fp32"
    rollout = resolve_vllm_dtype(cfg.rollout.vllm_dtype) if cfg.rollout.backend == "vllm" else learner
    return {"learner": learner, "rollout": rollout}


def named_reports(results: Path) -> list[tuple[str, dict[str, Any]]]:
    """The JSON reports in a results folder, by file name (files that are not JSON skipped)."""
    named = []
    for f in sorted(results.glob("*.json")) if results.is_dir() else []:
        try:
            named.append((f.name, json.loads(f.read_text())))
        except (OSError, ValueError):
            continue
    return named


def warn_other_arithmetic(a: argparse.Namespace, here: dict[str, str]) -> None:
    """Before a study trains: a warning when --results already holds pieces of the seeds it runs (this env and
    preset) that trained in another arithmetic than this machine will (within a seed, ``--merge`` refuses such a
    mix without --allow-mixed-precision; seeds may differ from one another)."""
    seeds = set(range(a.first_seed, a.first_seed + a.seeds))
    other = [p for p in other_arithmetic(pieces_in(named_reports(Path(a.results)), a.env, a.preset), here)
             if p.seed in seeds]
    if other:
        p = other[0]
        print(f"warning: {len(other)} piece(s) of seed(s) {', '.join(str(s) for s in sorted({p.seed for p in other}))}"
              f" of this study in {a.results} trained in {precision_text(p.precision)} (e.g. {p.arm} seed {p.seed}, "
              f"{p.report}); this machine trains in {precision_text(here)}: this study's runs of those seeds will "
              "differ from them in arithmetic as well as in arm", flush=True)


@dataclass
class PiecePlan:
    """The pieces of --arms x seeds: the seeds asked for, the reports found per (arm, seed) and the (arm, seed)s
    left (``core.study.piece_plan``), the arithmetic this machine trains the study's config in, the seeds it must
    not add to with why (``core.study.blocked_seeds``), and the curriculum phases of the study's config."""
    seeds: list[int]
    found: dict[tuple[str, int], list[Piece]]
    missing: list[tuple[str, int]]
    here: dict[str, str]
    blocked: dict[int, str]
    phases: list[dict]


def _plan_pieces(a: argparse.Namespace, arms: list[str]) -> PiecePlan:
    """The study's pieces as --results holds them, and what this machine may add (``PiecePlan``)."""
    seeds = list(range(a.first_seed, a.first_seed + a.seeds))
    found, missing = piece_plan(pieces_in(named_reports(Path(a.results)), a.env, a.preset), arms, seeds)
    cfg = preset_config(a.env, a.preset, absolute_model_path(a.set))
    here = run_precision(cfg)
    start = start_key({"start_model": start_model_record(cfg.model.path, None)})
    blocked = blocked_seeds([p for ps in found.values() for p in ps], here, start)
    return PiecePlan(seeds, found, missing, here, blocked, [p.model_dump() for p in cfg.curriculum.phases])


def _blocked_text(blocked: dict[int, str], here: dict[str, str]) -> str:
    return "; ".join(f"seed {s}: {why}" for s, why in sorted(blocked.items())) + (
        f"; this machine trains in {precision_text(here)}")


def next_piece(a: argparse.Namespace, arms: list[str]) -> tuple[str, int] | None:
    """``--next``: the first (arm, seed) of --arms x seeds without a report in --results that this machine may run
    (None, said, when every piece is in). One arithmetic and one starting model per seed: a seed whose pieces
    trained in another arithmetic or from another model is skipped (``core.study.blocked_seeds``); refused
    (SystemExit) when every seed left is, unless --allow-mixed-precision."""
    plan = _plan_pieces(a, arms)
    seeds, found, missing, here, blocked = plan.seeds, plan.found, plan.missing, plan.here, plan.blocked
    if not missing:
        print(f"every piece of {', '.join(arms)} x seeds {seeds[0]}..{seeds[-1]} has a report in {a.results}: "
              "nothing to run (--merge pools them)", flush=True)
        return None
    mine = missing if a.allow_mixed_precision else [m for m in missing if m[1] not in blocked]
    if not mine:
        left = {s for _, s in missing}
        raise SystemExit(f"--next: every seed left has pieces this machine must not add to: "
                         f"{_blocked_text({s: w for s, w in blocked.items() if s in left}, here)}. Within a seed "
                         "every arm trains in one arithmetic from one starting model: run these on a machine like "
                         "theirs (with their model.path), add a seed (--seeds), or pass --allow-mixed-precision")
    arm, seed = mine[0]
    skipped = sorted({s for _, s in missing if s in blocked and s < seed})
    why = f"; skipped seed(s) {', '.join(map(str, skipped))}: {_blocked_text({s: blocked[s] for s in skipped}, here)}" \
        if skipped and not a.allow_mixed_precision else ""
    print(f"next piece: {arm} seed {seed} ({len(missing)} of {len(found)} left{why})", flush=True)
    return arm, seed


def _in_progress(a: argparse.Namespace, arm: str, seed: int, phases: list[dict]) -> str:
    """A piece without a report: how far its run in --output-dir got (``core.study.piece_progress``), if it
    started; the same command resumes it."""
    run_dir = Path(a.output_dir) / run_name(a, arm, seed)
    if (run_dir / "summary.json").exists():
        return f"(trained in {a.output_dir}; its held-out scoring and report are left)"
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return f"(to run{_may_take_over(a, arm, seed, phases)})"
    from core.records import kept_metric_lines

    lines = kept_metric_lines(metrics.read_text().splitlines(), sys.maxsize)  # a line cut by a kill left out
    prog = piece_progress([json.loads(x) for x in lines], arm_phases(phases, arm))
    left = f", about {prog['left_s'] / 3600:.1f} h of training left at its pace" if prog["left_s"] is not None else ""
    return (f"(in progress in {a.output_dir}: step {prog['done']}/{prog['total']}{_phase_heldout(run_dir, phases)}"
            f"{left}; its command resumes it)")


def _may_take_over(a: argparse.Namespace, arm: str, seed: int, phases: list[dict]) -> str:
    """For a piece not started: the phases it may take over (``share_phases``), from a run whose finals are in
    --output-dir; empty when none."""
    if not getattr(a, "share_phases", False):
        return ""
    from core.study import phase_donors

    for donor, n in phase_donors(phases, arm):
        d = run_name(a, donor, seed)
        if _has_finals(Path(a.output_dir), d, n):
            return f"; it may take phases 1-{n} over from {d} in {a.output_dir}"
    return ""


def _phase_heldout(run_dir: Path, phases: list[dict]) -> str:
    """The held-out success of a run's phase evaluations so far (``eval_phase-K.json``, eval.each_phase), as
    ``, held-out after phase 1 0.307`` (at the study's largest budget); empty before the first."""
    from core.evalreport import flat_metrics

    got = []
    for k in range(1, len(phases) + 1):
        f = run_dir / f"eval_phase-{k}.json"
        try:
            got.append(f"phase {k} {flat_metrics(json.loads(f.read_text()))['success_rate']:.3f}")
        except (OSError, ValueError, KeyError, TypeError):  # not there yet, or cut by a kill: said as missing
            continue
    return f", held-out after {', '.join(got)}" if got else ""


def study_status(a: argparse.Namespace, arms: list[str], argv: list[str]) -> int:
    """``--status``: the pieces of --arms x seeds found in --results, those left, each seed's arithmetic and whether
    this machine may add to it (``core.study.blocked_seeds``), and the command for the next piece it may run."""
    import shlex

    results = Path(a.results)
    plan = _plan_pieces(a, arms)
    seeds, found, missing, here, blocked = plan.seeds, plan.found, plan.missing, plan.here, plan.blocked
    print(f"study pieces of {a.env} / {a.preset} in {results}: arms {', '.join(arms)} x seeds {seeds[0]}.."
          f"{seeds[-1]}; {len(found) - len(missing)} of {len(found)} done"
          + ("" if results.is_dir() else f" ({results} does not exist yet: no pieces)"))
    print(f"{'arm':<20}{'seed':>5}  {'held-out':>8}  {'arithmetic':<32}report")
    for (arm, seed), ps in found.items():
        if not ps:
            print(f"{arm:<20}{seed:>5}  {'-':>8}  {'-':<32}{_in_progress(a, arm, seed, plan.phases)}")
        for p in ps:
            held = f"{p.heldout:.3f}" if p.heldout is not None else "?"
            print(f"{arm:<20}{seed:>5}  {held:>8}  {precision_text(p.precision):<32}{p.report}")
    twice = [(k, [p.report for p in ps]) for k, ps in found.items() if len(ps) > 1]
    for (arm, seed), names in twice:
        print(f"warning: {arm} seed {seed} is in {len(names)} reports ({', '.join(names)}): --merge takes each run "
              "once, pass one of them")
    done = [p for ps in found.values() for p in ps]
    conflict = seed_precision_conflict([(f"{p.arm} s{p.seed}", p.seed, p.precision) for p in done])
    if conflict:
        print(f"warning: pieces of one seed trained in different arithmetic ({conflict}): --merge refuses them "
              "without --allow-mixed-precision")
    for seed in seeds:
        have = sorted({precision_text(p.precision) for p in done if p.seed == seed})
        if have:
            print(f"seed {seed}: trained in {' and '.join(have)}"
                  + (f"; this machine must not add to it: {blocked[seed]}, this machine trains in "
                     f"{precision_text(here)}" if seed in blocked else ""))
    runnable = [m for m in missing if m[1] not in blocked]
    if missing and not runnable:
        print(f"none of the {len(missing)} pieces left can run on this machine (one arithmetic and one starting model "
              "per seed): run them on a machine like theirs, or add a seed (--seeds)")
    if runnable:
        keep, skip = [], {"--arms", "--seeds", "--first-seed"}
        it = iter(argv)
        for x in it:
            if x == "--status":
                continue
            name = x.split("=", 1)[0]
            if name in skip:
                if "=" not in x:
                    next(it, None)
                continue
            keep.append(x)
        arm, seed = runnable[0]
        cmd = ["scalinginter", "study", *keep, "--arms", arm, "--seeds", "1", "--first-seed", str(seed)]
        here_only = f", {len(runnable)} of them on this machine" if len(runnable) < len(missing) else ""
        print(f"next ({len(missing)} left{here_only}): " + " ".join(shlex.quote(c) for c in cmd))
    return 0


def rescore_report(first: dict[str, Any], second: dict[str, Any], budgets: list[int]) -> dict[str, Any]:
    """Two evaluations of one model on the same tasks: per budget, the share of tasks with the same outcome."""
    from core.study import rescore_agreement

    if first["task_ids"] != second["task_ids"]:
        raise SystemExit("the re-score ran on other tasks than the first score: pass a fresh --output-dir")
    return {"model": "base", "lock_step": True,
            "budgets": {str(b): rescore_agreement(per_task_success(first, b), per_task_success(second, b))
                        for b in budgets}}


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


SHARED_FILE = "shared_phases.json"  # in a run's folder: the phases it took over from another arm's run


def read_shared(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / SHARED_FILE).read_text())
    except FileNotFoundError:
        return None


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (a copy where the two cannot share one file system)."""
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _phase_final(out: Path, run: str, k: int) -> Path:
    """Where a study run's phase-``k`` final checkpoint lies (the study's runs keep theirs under --output-dir)."""
    return out / "checkpoints" / run / f"phase-{k}" / "final"


def _has_finals(out: Path, run: str, n: int) -> bool:
    """Whether ``run`` has the complete final checkpoints of its phases 1..n."""
    from storage.checkpoint_store import checkpoint_exists

    return all(checkpoint_exists(str(_phase_final(out, run, k))) for k in range(1, n + 1))


def _link_finals(out: Path, record: dict[str, Any], name: str) -> bool:
    """Put the donor's phase finals named in ``record`` under this run's checkpoint folder (linked, each staged
    beside it and renamed into place, so that a kill leaves either a whole checkpoint or none). False when the
    donor's are gone and this run's are not all there."""
    import shutil

    from storage.checkpoint_store import checkpoint_exists

    ck = out / "checkpoints"
    for k in range(1, int(record["phases"]) + 1):
        mine, theirs = _phase_final(out, name, k), _phase_final(out, record["from_run"], k)
        if checkpoint_exists(str(mine)):
            continue
        if not checkpoint_exists(str(theirs)):
            return False
        stage = ck / f".sharing-{name}-phase-{k}"
        shutil.rmtree(stage, ignore_errors=True)
        for f in sorted(theirs.rglob("*")):
            if f.is_file():
                _link(f, stage / f.relative_to(theirs))
        shutil.rmtree(mine, ignore_errors=True)  # an incomplete one (no manifest)
        mine.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage, mine)
    return True


def share_phases(a: argparse.Namespace, arm: str, seed: int, phases: list[dict],
                 sets: list[str]) -> dict[str, Any] | None:
    """Before an arm's run starts: take over the first phases it trains exactly as another arm of the same seed
    does (``core.study.shared_phases``: ``fixed-short`` and ``scalinginter`` share phase 1), when that arm's run
    in this output dir has their final checkpoints and held-out scores. Checked, not assumed: the donor's last
    shared final must have been made with this run's training config but for ``curriculum.phases`` (the later
    phases' limits), and with its evaluation settings. This run then gets the donor's phase finals (linked), its
    ``eval_phase-K.json`` and its step records (``metrics.jsonl``, rollouts) for those phases, and
    ``shared_phases.json`` saying so; it resumes after them. Returns that record, or None (trains on its own)."""
    from core.fingerprint import diff, fingerprint
    from core.records import kept_metric_lines
    from core.study import phase_donors
    from storage.checkpoint_store import is_s3_uri
    from tasks.runs import checkpoint_root, recorded_config

    out = Path(a.output_dir).resolve()
    name = run_name(a, arm, seed)
    run_dir, donors = out / name, phase_donors(phases, arm)
    if not donors or (run_dir / "metrics.jsonl").exists():
        return None  # no arm trains its phases alike, or this run has started on its own: it goes on so
    cfg = preset_config(a.env, a.preset, sets + [f"run_name={name}"])
    root = checkpoint_root(cfg)
    if is_s3_uri(root) or Path(root) != out / "checkpoints" / name:
        return None  # checkpoints elsewhere (checkpoint.root): not linked from here
    if Path(root).exists() and any(Path(root).iterdir()):
        return None
    mine = recorded_config(cfg)
    for donor, n in donors:
        dname = run_name(a, donor, seed)
        evals = [out / dname / f"eval_phase-{k}.json" for k in range(1, n + 1)]
        if not _has_finals(out, dname, n) or not all(e.exists() for e in evals):
            continue
        try:
            state = json.loads((_phase_final(out, dname, n) / "trainer_state.json").read_text())
            theirs = json.loads((out / dname / "config.json").read_text())
        except (OSError, ValueError):
            continue
        changed = [c.key for c in diff((state.get("fingerprint") or {}).get("values") or {},
                                       fingerprint(mine)["values"])]
        if changed != ["curriculum.phases"] or theirs.get("eval") != mine.get("eval"):
            why = ", ".join(changed) if changed != ["curriculum.phases"] else "the held-out evaluation settings"
            print(f"{name}: not taking phases over from {dname}: it trained or scored with other settings ({why})",
                  flush=True)
            continue
        end = int(state["global_step"])
        records = [json.loads(x) for x in kept_metric_lines((out / dname / "metrics.jsonl").read_text().splitlines(),
                                                             end)]
        if sorted({int(r["global_step"]) for r in records}) != list(range(1, end + 1)):
            continue  # its step records are not all there
        record = {"from_run": dname, "from_arm": donor, "phases": n, "global_step": end,
                  "step_time_s": float(sum({int(r["global_step"]): r.get("step_time_s", 0.0)
                                            for r in records}.values())),
                  "allow_changes": ["curriculum.phases"],
                  "why": f"phases 1-{n} of {arm} and {donor} are the same training (the same turn limits, steps, "
                         "seed, starting model and settings): trained once, in " + dname}
        run_dir.mkdir(parents=True, exist_ok=True)
        for k in range(1, n + 1):
            for suffix in (".json", ".parquet"):
                src = out / dname / f"eval_phase-{k}{suffix}"
                if src.exists():
                    _link(src, run_dir / src.name)
        for step in range(1, end + 1):
            src = out / dname / "rollouts" / f"step-{step:06d}.parquet"
            if src.exists():
                _link(src, run_dir / "rollouts" / src.name)
        tmp = run_dir / (SHARED_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, run_dir / SHARED_FILE)
        if not _link_finals(out, record, name):
            raise SystemExit(f"{name}: {dname}'s phase finals went away while they were being linked")
        print(f"{name}: phases 1-{n} taken over from {dname} (the same {end} steps; trained once): their final "
              f"checkpoint{'s' if n > 1 else ''}, held-out score{'s' if n > 1 else ''} and step records; it trains "
              f"from step {end + 1}", flush=True)
        return record
    return None


def ensure_shared(a: argparse.Namespace, name: str, record: dict[str, Any]) -> dict[str, Any] | None:
    """A run that took phases over and has not finished: its phase finals must be there (a kill may have come
    between the record and the links). Relinked from the donor, which keeps them until this run's checkpoint
    folder exists (``prune_checkpoints``); where neither has them, the run cannot go on and says how to start it
    again."""
    out = Path(a.output_dir).resolve()
    if _link_finals(out, record, name):
        return record
    raise SystemExit(f"{name} took phases 1-{record['phases']} over from {record['from_run']}, but neither run has "
                     f"their final checkpoints now: delete {out / name} and {out / 'checkpoints' / name} to train "
                     "this run from the start")


def shared_to_mlflow(a: argparse.Namespace, name: str, record: dict[str, Any], sets: list[str]) -> None:
    """The phases a run took over, in its MLflow runs as if it had trained them: the run and one finished run per
    taken phase (its steps' metrics from ``metrics.jsonl``, tagged with the run they were trained in), the headline
    metrics on the run, as ``tasks.recording.StepRecorder`` logs them. The run then finds these phase runs when it
    skips the phases (``flows.scalinginter.finished_phase`` registers their finals), and ``scalinginter compare``
    shows its whole curve. Idempotent: a metric already logged at a step is not logged again."""
    from tasks.recording import StepRecorder
    from tasks.resume import PhasePlan
    from tasks.runs import make_tracker, recorded_config

    cfg = preset_config(a.env, a.preset, sets + [f"run_name={name}"])
    records = [json.loads(x) for x in (Path(a.output_dir).resolve() / name / "metrics.jsonl").read_text().splitlines()
               if x.strip()]
    tracker = make_tracker(cfg)
    parent = tracker.start_run(name, params=recorded_config(cfg), tags={"scalinginter.env": cfg.env.name})
    for k in range(1, int(record["phases"]) + 1):
        plan = PhasePlan.of(cfg, k)
        rid = tracker.start_run(f"{name}/phase-{k}", params=plan.params(), parent_id=parent,
                                tags={"scalinginter.phase": str(k), "scalinginter.shared_from": record["from_run"]})
        for r in (r for r in records if int(r.get("phase", 0)) == k):
            step = int(r["global_step"]) - 1  # StepRecorder logs at the 0-based global step
            metrics = {key: v for key, v in r.items() if key not in ("global_step", "phase")}
            tracker.log_metrics_once(rid, metrics, step=step)
            tracker.log_metrics_once(parent, {h: metrics[h] for h in StepRecorder.HEADLINE if h in metrics}, step=step)
        tracker.set_tag(rid, "scalinginter.final_checkpoint", plan.final_uri)
        tracker.end_run(rid, "FINISHED")


KEPT_FOR_SHARING = ".kept-for-sharing"  # in a scored run's checkpoint folder: its finals are kept for another arm


def prune_checkpoints(a: argparse.Namespace, phases: list[dict], name: str) -> None:
    """After run ``name`` is scored: delete its checkpoints, except the phase finals that an arm of the same seed,
    not started yet, may take over (``share_phases``); those are marked, and deleted by a later call once no arm
    is left to take them (every such arm has checkpoints of its own, linked or trained, or is done)."""
    import shutil

    from core.study import phase_donors

    out = Path(a.output_dir).resolve()
    ck = out / "checkpoints"
    pat = re.compile(rf"study-{re.escape(a.env)}-(.+)-s(\d+)")
    targets = [ck / name] + sorted(p.parent for p in ck.glob(f"*/{KEPT_FOR_SHARING}"))
    for d in dict.fromkeys(targets):
        m = pat.fullmatch(d.name)
        if not d.is_dir() or m is None or m[1] not in ARMS:
            continue
        arm, seed = m[1], int(m[2])
        keep, takers = 0, []
        if getattr(a, "share_phases", False):
            for other, n in phase_donors(phases, arm):  # the arms that share phases with this one, both ways
                odir = out / run_name(a, other, seed)
                # started: it has taken them over or trained on its own (its checkpoints), or is done
                if not (odir / "summary.json").exists() and not (ck / odir.name).exists():
                    keep, takers = max(keep, n), takers + [other]
        for sub in sorted(d.iterdir()):
            k = re.fullmatch(r"phase-(\d+)", sub.name)
            if k is None or int(k[1]) > keep:
                shutil.rmtree(sub, ignore_errors=True) if sub.is_dir() else sub.unlink()
            else:
                for part in sub.iterdir():
                    if part.name != "final":
                        shutil.rmtree(part, ignore_errors=True) if part.is_dir() else part.unlink()
        if keep:
            if not (d / KEPT_FOR_SHARING).exists():
                print(f"{d.name}: phase final(s) 1-{keep} kept for {', '.join(takers)}, which may take them over "
                      "(deleted once it has started; --no-shared-phases deletes them)", flush=True)
            (d / KEPT_FOR_SHARING).write_text(f"phases 1-{keep}: kept for {', '.join(takers)} of seed {seed}\n")
        else:
            shutil.rmtree(d, ignore_errors=True)


def task_labels(doc: dict[str, Any], budget: int | None = None, model: str = "model") -> list[int | None] | None:
    """The fewest turns each held-out task needs (``required_turns``), in the evaluation's task order, at one budget
    (default the largest; the label does not depend on it); None when the env labels no task."""
    budgets = doc["models"][model]["budgets"]
    cell = budgets[str(budget) if budget is not None else max(budgets, key=int)]
    labels = [t.get("required_turns") for t in cell["per_task"]]
    return labels if any(x is not None for x in labels) else None


def _bands(curves: list[dict[int, float]]) -> dict[int, dict[str, Any]]:
    return {s: vars(b) for s, b in curve_over_seeds(curves).items()}


def build_report(a: argparse.Namespace, arms: list[str], phases: list[dict], budgets: list[int],
                 base: dict[str, Any], runs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    from core.evalreport import flat_metrics
    from core.stats import wilson_interval

    big = max(budgets)
    task_ids = base["task_ids"]
    for r in runs:
        if r["final_eval"]["task_ids"] != task_ids:
            raise SystemExit(f"{r['run_name']} was scored on other held-out tasks than the base model; pass a fresh "
                             "--output-dir")
    labels = task_labels(base, big)  # None: the env labels no task, no per-bucket results
    base_by_budget = {str(b): per_task_success(base, b) for b in budgets}
    base_s = base_by_budget[str(big)]
    base_rates = bucket_rates(base_s, labels) if labels else {}
    arms_out: dict[str, Any] = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        by_budget = {str(b): [per_task_success(r["final_eval"], b) for r in rs] for b in budgets}
        per_seed = by_budget[str(big)]
        pooled = pooled_successes(per_seed)
        n = len(pooled)
        k = sum(sum(p) for p in per_seed)
        lo, hi = wilson_interval(int(round(k)), n * len(per_seed))
        vs_base = [paired_mcnemar(s, base_s) for s in per_seed]
        # held-out curve: the base at step 0, each phase final (eval.each_phase), the final at the last step
        curves = [{0: sum(base_s) / n,
                   **{s: flat_metrics(e)["success_rate"] for s, e in r["heldout_by_step"].items()},
                   r["steps"]: sum(p) / n} for r, p in zip(rs, per_seed)]
        train_curves = [{int(s): float(v) for s, v in r["train_success"].items() if v is not None} for r in rs]
        out: dict[str, Any] = {
            "turn_limits": [p["turn_limit"] for p in arm_phases(phases, arm)],
            "overrides": arm_overrides(arm),
            "runs": [r["run_name"] for r in rs], "seeds": [r["seed"] for r in rs],
            "heldout_success": k / (n * len(per_seed)), "ci95": [lo, hi],
            "per_seed_success": [sum(p) / n for p in per_seed],
            "vs_base_mcnemar_p": vs_base,
            "sweep": {b: sum(sum(p) for p in by_budget[str(b)]) / (n * len(rs)) for b in budgets},
            "steps": rs[0]["steps"] if rs else 0,
            "generated_tokens": sum(r["generated_tokens"] for r in rs) / max(len(rs), 1),
            "wall_time_s": (sum(r["wall_time_s"] or 0 for r in rs) / max(len(rs), 1)),
            "step_time_s": sum(r["step_time_s"] for r in rs) / max(len(rs), 1),
            "curve": _bands(curves),
            "train_curve": _bands(train_curves),
            "pooled_per_task": pooled,
            "per_seed_per_task": per_seed,  # greedy 0/1 per held-out task, per seed (task order of the eval)
            "per_seed_per_task_by_budget": by_budget,  # the same at every budget of the sweep
            # stability diagnostics: per phase the mean over its steps, then over seeds; per step, a band over seeds
            "diagnostics": mean_of_dicts([(phase_means(r["step_records"], PHASE_KEYS), 1.0) for r in rs]),
            "diag_curves": {key: c for key in DIAG_KEYS if (c := _bands(
                [{int(x["global_step"]): v for x in r["step_records"] if (v := finite_number(x.get(key))) is not None}
                 for r in rs]))},
        }
        out["per_seed"] = run_health(rs, per_seed, base_s, labels, big, base)
        if labels:
            out["buckets"] = {str(b): bucket_stats(by_budget[str(b)], labels, base_by_budget[str(b)])
                              for b in budgets}
            per_run = []  # {step: {bucket: rate}} per seed, at the largest budget: base, phase finals, final
            for r, p in zip(rs, per_seed):
                c = {0: base_rates}
                for step, e in r["heldout_by_step"].items():
                    lab = task_labels(e)
                    if lab:
                        c[int(step)] = bucket_rates(per_task_success(e, max(map(int, e["models"]["model"]["budgets"]))),
                                                    lab)
                c[r["steps"]] = bucket_rates(p, labels)
                per_run.append(c)
            out["bucket_curves"] = {key: _bands([{s: v[key] for s, v in c.items() if key in v} for c in per_run])
                                    for key in base_rates}
        arms_out[arm] = out
    base_out: dict[str, Any] = {
        "heldout_success": sum(base_s) / len(base_s), "ci95": list(wilson_interval(int(sum(base_s)), len(base_s))),
        "sweep": {b: sum(base_by_budget[str(b)]) / len(base_s) for b in budgets},
        "per_task_by_budget": base_by_budget}
    if labels:
        base_out["buckets"] = {str(b): bucket_stats([base_by_budget[str(b)]], labels) for b in budgets}
    report = {"env": a.env, "preset": a.preset, "overrides": a.set, "seeds": a.seeds, "eval_n": a.eval_n,
              "budgets": budgets, "experiment": a.experiment, "machine": _machine(), "task_ids": task_ids}
    if labels:
        report["task_required_turns"] = labels
    categories = task_categories(base)
    if categories:
        report["task_categories"] = categories
    seed_level_intervals(arms_out, categories)
    report.update({"base": base_out, "arms": arms_out, "comparisons": arm_comparisons(arms_out, labels, categories),
                   "wall_time_s": wall, "runs": [{k: v for k, v in r.items() if k != "final_eval"} for r in runs],
                   "collapse_rule": COLLAPSE_RULE})
    report["paper_claims"] = paper_claims(arms_out, report["comparisons"])
    return report


def run_health(rs: list[dict[str, Any]], per_seed: list[list[float]], base_s: list[float],
               labels: list[int | None] | None, big: int, base_doc: dict[str, Any] | None = None
               ) -> list[dict[str, Any]]:
    """Per run (seed) of an arm: whether it collapsed (``core.study.collapse_check`` on its train success and
    entropy per step), its horizon use per phase (turns used / limit, episodes ending at the limit, repeated
    actions), its retention of what the starting model solved (overall and per required-turns bucket), the
    tasks it lost and gained between its held-out points (``run_churn``), and at each held-out point the share of
    episodes that failed at the turn limit (``heldout_at_cap``: greedy episodes pinned at the cap, which the
    sampled training episodes may not show)."""
    out = []
    for r, final in zip(rs, per_seed):
        recs = sorted(r.get("step_records") or [], key=lambda x: int(x["global_step"]))
        succ = [float(x["success_rate"]) for x in recs if finite_number(x.get("success_rate")) is not None]
        ent = [float(x["train/entropy"]) for x in recs if finite_number(x.get("train/entropy")) is not None]
        phases = phase_means(recs, ("diag/turns_used_frac", "diag/turn_limit_frac", "diag/repeated_action_rate"))
        out.append({"seed": r.get("seed"), "run": r.get("run_name"), **collapse_check(succ, ent),
                    "horizon": phases, "retention": retention(base_s, final, labels),
                    "heldout_churn": run_churn(r, final, base_s, big),
                    "heldout_at_cap": run_at_cap(r, big, base_doc)})
    return out


def _at_cap(doc: dict[str, Any], budget: int) -> float | None:
    """``core.study.capped_share`` of an evaluation document at one budget (None where it has no such budget)."""
    cell = doc["models"]["model"]["budgets"].get(str(budget))
    if cell is None:
        return None
    return capped_share([t["successes"] for t in cell["per_task"]], [t["turns"] for t in cell["per_task"]],
                        int(cell.get("turn_limit", budget)))


def _phase_points(r: dict[str, Any], big: int) -> list[tuple[int, dict[str, Any]]]:
    """A run's phase-final evaluations scored at the largest budget, in step order, between its start and its
    final checkpoint (the held-out points of ``run_at_cap`` and ``run_churn`` besides those two)."""
    return sorted((int(s), e) for s, e in (r.get("heldout_by_step") or {}).items()
                  if str(big) in e["models"]["model"]["budgets"] and 0 < int(s) < int(r["steps"]))


def run_at_cap(r: dict[str, Any], big: int, base_doc: dict[str, Any] | None) -> dict[str, float]:
    """Per held-out point of a run (step 0: the starting model, each phase final, the final checkpoint), the share
    of its episodes at the largest budget that failed at the turn limit."""
    docs = [(0, base_doc)] + _phase_points(r, big) + [(int(r["steps"]), r.get("final_eval"))]
    return {str(s): v for s, d in docs if d is not None and (v := _at_cap(d, big)) is not None}


def run_churn(r: dict[str, Any], final: list[float], base_s: list[float], big: int) -> dict[str, Any]:
    """``core.study.heldout_churn`` of a run at the largest budget: the starting model's scores (step 0), each
    phase final's and the final checkpoint's."""
    return heldout_churn([(0, base_s)] + [(s, per_task_success(e, big)) for s, e in _phase_points(r, big)]
                         + [(int(r["steps"]), final)])


def seed_level_intervals(arms_out: dict[str, Any], categories: list[str] | None = None) -> None:
    """Each arm's pooled held-out success gets ``ci95_seed_task``: the interval of a bootstrap over seeds and tasks
    (``core.stats.seed_task_bootstrap``), beside the Wilson interval over all episodes (``ci95``), which counts
    seeds x tasks as independent episodes and so leaves the seed-to-seed variation out; and with the tasks'
    categories (BabyAI: their levels), ``ci95_seed_category``, a bootstrap over seeds and whole categories
    (``core.stats.seed_cluster_bootstrap``): the tasks of one level often succeed or fail together."""
    from core.stats import seed_cluster_bootstrap, seed_task_bootstrap

    for r in arms_out.values():
        rows = r.get("per_seed_per_task")
        if rows:
            _, lo, hi = seed_task_bootstrap(rows)
            r["ci95_seed_task"] = [lo, hi]
            if _clusters_fit(categories, rows):
                _, lo, hi = seed_cluster_bootstrap(rows, categories)
                r["ci95_seed_category"] = [lo, hi]


def _clusters_fit(categories: list[str] | None, rows: list[list[float]]) -> bool:
    """Whether a category per task is known and there are at least two categories to draw."""
    return bool(categories) and len(set(categories)) > 1 and all(len(x) == len(categories) for x in rows)


def _categories_from_runs(reports: list[dict[str, Any]], task_ids: list | None) -> list[str] | None:
    """The tasks' categories for reports made before they carried ``task_categories``: from a phase evaluation
    of one of their runs, on the same tasks."""
    for r in reports:
        for run in r.get("runs") or []:
            for e in (run.get("heldout_by_step") or {}).values():
                if task_ids is not None and e.get("task_ids") == task_ids:
                    return task_categories(e)
    return None


def task_categories(doc: dict[str, Any], model: str = "model") -> list[str] | None:
    """Each held-out task's category (BabyAI: its level), in the evaluation's task order; None if any lacks one."""
    budgets = doc["models"][model]["budgets"]
    cats = [t.get("category") for t in budgets[max(budgets, key=int)]["per_task"]]
    return cats if cats and all(isinstance(c, str) and c for c in cats) else None


def _paired(x: list[float], y: list[float]) -> dict[str, Any]:
    from core.stats import paired_bootstrap

    c = paired_bootstrap(x, y, seed=0)
    return {"diff": c.diff, "ci95": list(c.ci), "p_value": c.p_value, "tasks": len(x)}


def arm_comparisons(arms_out: dict[str, Any], labels: list[int | None] | None = None,
                    categories: list[str] | None = None) -> dict[str, Any]:
    """``"A - B"`` for the pairs of ``core.study.comparison_pairs`` (ScalingInter minus every other arm, the GiGPO
    arm minus each fixed arm) on the same held-out tasks: the paired bootstrap over the per-task success pooled over
    seeds at the largest budget (``diff``, ``ci95``, ``p_value``), and where the reports have the per-task outcomes
    at every budget, the same per budget (``budgets``) and, with the tasks' labels, per required-turns bucket
    (``budgets[<T>]["buckets"]``); where the two arms' seeds pair up, each of those also gets ``ci95_seed_task``,
    the bootstrap over seeds and tasks of the per-seed paired differences.

    Paired by seed too: where both arms know their seeds, a pair is compared on the seeds both have (``seeds``; a
    merge of pieces can hold an arm with seeds 0-3 beside one with 1-3), so every difference is between the same
    seeds' runs; a pair with no seed in common is left out (``seedless_pairs`` in the report says which)."""
    from core.study import bucket_indices

    out = {}
    from core.stats import seed_cluster_bootstrap, seed_task_bootstrap

    for x, y in comparison_pairs(arms_out):
        ax, ay = arms_out[x], arms_out[y]
        shared = shared_seeds(ax, ay)
        if shared == []:
            continue
        if shared is not None:
            ax, ay = on_seeds(ax, shared), on_seeds(ay, shared)
        entry = _paired(ax["pooled_per_task"], ay["pooled_per_task"])
        if shared is not None:
            entry["seeds"] = shared
        sx, sy = ax.get("per_seed_per_task"), ay.get("per_seed_per_task")
        same_seeds = ax.get("seeds") == ay.get("seeds")  # both unknown: a report's own order
        if sx and sy and len(sx) == len(sy) and same_seeds:  # the same seeds, in order: paired by seed and by task
            diffs = [[a - b for a, b in zip(u, v)] for u, v in zip(sx, sy)]
            _, lo, hi = seed_task_bootstrap(diffs)
            entry["ci95_seed_task"] = [lo, hi]
            if _clusters_fit(categories, diffs):  # paired by seed, whole categories drawn
                _, lo, hi = seed_cluster_bootstrap(diffs, categories)
                entry["ci95_seed_category"] = [lo, hi]
        bx, by = ax.get("per_seed_per_task_by_budget"), ay.get("per_seed_per_task_by_budget")
        if bx and by:
            entry["budgets"] = {}
            buckets = bucket_indices(labels) if labels else None
            for b in sorted(set(bx) & set(by), key=int):
                px, py = pooled_successes(bx[b]), pooled_successes(by[b])
                by_seed = same_seeds and len(bx[b]) == len(by[b])  # paired by seed and by task
                d = [[u - v for u, v in zip(su, sv)] for su, sv in zip(bx[b], by[b])] if by_seed else None
                e = _paired(px, py)
                if d:
                    e["ci95_seed_task"] = list(seed_task_bootstrap(d)[1:])
                if buckets is not None:
                    e["buckets"] = {}
                    for k, idx in buckets.items():
                        cell = _paired([px[i] for i in idx], [py[i] for i in idx])
                        if d:
                            cell["ci95_seed_task"] = list(seed_task_bootstrap([[r[i] for i in idx] for r in d])[1:])
                        e["buckets"][k] = cell
                entry["budgets"][b] = e
        out[f"{x} - {y}"] = entry
    return out


def _seed_rows(arm: dict[str, Any]) -> list[int] | None:
    """An arm record's seeds, where they are known and its per-seed outcomes line up with them (else None)."""
    seeds, rows = arm.get("seeds"), arm.get("per_seed_per_task")
    return list(seeds) if seeds and rows and len(seeds) == len(rows) else None


def shared_seeds(ax: dict[str, Any], ay: dict[str, Any]) -> list[int] | None:
    """The seeds two arm records both have, in ``ax``'s order; None where either does not know its seeds or both
    have the same ones (nothing to restrict), [] where they share none."""
    kx, ky = _seed_rows(ax), _seed_rows(ay)
    if kx is None or ky is None or kx == ky:
        return None
    return [s for s in kx if s in ky]


def on_seeds(arm: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """An arm record restricted to the seeds ``keep`` (each one it has): its per-seed outcomes, per budget too, and
    the per-task success pooled over those seeds."""
    pos = [arm["seeds"].index(s) for s in keep]
    out = {**arm, "seeds": list(keep), "per_seed_per_task": [arm["per_seed_per_task"][i] for i in pos]}
    out["pooled_per_task"] = pooled_successes(out["per_seed_per_task"])
    if arm.get("per_seed_per_task_by_budget"):
        out["per_seed_per_task_by_budget"] = {b: [v[i] for i in pos]
                                              for b, v in arm["per_seed_per_task_by_budget"].items()}
    return out


def seedless_pairs(arms_out: dict[str, Any]) -> list[str]:
    """The comparison pairs left out because the two arms have no seed in common."""
    return [f"{x} - {y}" for x, y in comparison_pairs(arms_out) if shared_seeds(arms_out[x], arms_out[y]) == []]


def _merge_bands(curves: list[dict[str, Any]]) -> dict[str, Any]:
    """Curves ``{step: band}`` of several reports -> one: the mean weighted by each point's seeds, the min-max
    envelope, the seeds behind each point."""
    pts: dict[int, list[dict]] = {}
    for c in curves:
        for step, b in c.items():
            pts.setdefault(int(step), []).append(b)
    out = {}
    for step, bs in sorted(pts.items()):
        total = sum(int(b.get("n", 1)) for b in bs)
        out[str(step)] = {"mean": sum(b["mean"] * int(b.get("n", 1)) for b in bs) / total,
                          "lo": min(b["lo"] for b in bs), "hi": max(b["hi"] for b in bs), "n": total}
    return out


def _merge_nested_bands(parts: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """``{name: {step: band}}`` (bucket_curves, diag_curves) of several reports' arm -> one (None: none has it)."""
    have = [p[key] for p in parts if p.get(key)]
    if not have:
        return None
    names = list(dict.fromkeys(n for h in have for n in h))
    return {n: _merge_bands([h[n] for h in have if n in h]) for n in names}


def start_identity(report: dict[str, Any]) -> Any:
    """What makes two reports' starting models the same: a warm start's record (source model, recipe, and its epoch
    losses, which a remade warm start reproduces to the last digit) wherever its folder was; else the model path."""
    sm = report.get("start_model") or {}
    return ("warmstart", json.dumps(sm["warmstart"], sort_keys=True)) if sm.get("warmstart") else ("path", sm.get("path"))


def start_recipe(report: dict[str, Any]) -> str | None:
    """A warm start's recipe (source model, demos, epochs, lr, batch size, env options) without what making it again
    can change, its folder and its epoch losses (a remake on another machine or build); None without a warm start."""
    w = (report.get("start_model") or {}).get("warmstart")
    return None if not w else json.dumps({k: v for k, v in w.items() if k != "epoch_losses"}, sort_keys=True)


def merge_reports(reports: list[dict[str, Any]], allow_mixed_precision: bool = False,
                  names: list[str] | None = None) -> dict[str, Any]:
    """One report from study reports of the same study (same env, preset and held-out tasks) that differ in their
    seeds or in their arms: a study run in pieces, an arm or a seed at a time, each piece's report kept. Pooled
    success and intervals over every seed's episodes, the paired comparisons on the per-task means over all seeds,
    the sweeps at the budgets every report has (mean over seeds), the curves' points with the number of seeds behind
    each, the per-phase diagnostics weighted by seeds; an arm's seeds in seed order, each (arm, seed) from one report
    only. Per required-turns bucket (where the reports carry the same ``task_required_turns``): the buckets' rates,
    intervals and comparisons recomputed from the per-seed per-task outcomes.

    The pieces start from one model, or from a warm start made again with the same recipe (``start_recipe``; bf16
    training on another machine or build is not the same model twice): then each seed is compared with the starting
    model its own piece scored (McNemar per seed), the base row is the per-task mean of the pieces' starting models,
    and ``base["starts"]`` gives each one's score and the tasks on which they all agree. A report written before
    ``per_seed_per_task`` existed counts as one seed per arm whose per-task outcomes are its ``pooled_per_task``; one
    written before the per-budget outcomes (``per_seed_per_task_by_budget``) leaves the merged per-bucket results and
    per-budget comparisons out."""
    from core.stats import wilson_interval

    if len(reports) < 2:
        raise SystemExit("--merge needs two or more reports")
    names = names or [f"report {k + 1}" for k in range(len(reports))]
    precisions = [report_precision(r) for r in reports]
    seed_rows = [(n, s, p) for n, r, p in zip(names, reports, precisions)
                 for a in r["arms"].values() for s in seed_numbers(a)]
    conflict = seed_precision_conflict(seed_rows)
    if conflict and not allow_mixed_precision:
        raise SystemExit(f"--merge: pieces of one seed trained in different arithmetic ({conflict}): within a seed the "
                         "arms should differ in arm only. Run the missing pieces of that seed on a machine like the "
                         "others' (scalinginter study --status lists them), or pass --allow-mixed-precision to merge "
                         "anyway")
    first = reports[0]
    remade = False
    for r in reports[1:]:
        for key in ("env", "preset", "eval_n"):
            if r[key] != first[key]:
                raise SystemExit(f"--merge: reports differ in {key}: {first[key]!r} vs {r[key]!r}")
        if start_identity(r) != start_identity(first):
            if start_recipe(r) is None or start_recipe(r) != start_recipe(first):
                raise SystemExit("--merge: the reports started from different models (not one warm start's recipe)")
            remade = True
        if r.get("task_ids") and first.get("task_ids") and r["task_ids"] != first["task_ids"]:
            raise SystemExit("--merge: the reports were scored on different held-out tasks")
        if not remade and abs(r["base"]["heldout_success"] - first["base"]["heldout_success"]) > 1e-12:
            raise SystemExit("--merge: the base model scored differently: not the same held-out tasks")
        if r.get("task_required_turns") != first.get("task_required_turns"):
            raise SystemExit("--merge: the reports' held-out tasks have different required-turns labels "
                             "(task_required_turns)")
    arm_names = list(dict.fromkeys(arm for r in reports for arm in r["arms"]))
    for arm in arm_names:
        have = [r["arms"][arm] for r in reports if arm in r["arms"]]
        for p in have[1:]:
            if "overrides" in p and "overrides" in have[0] and p["overrides"] != have[0]["overrides"]:
                raise SystemExit(f"--merge: arm {arm} has other overrides: {have[0]['overrides']} vs {p['overrides']}")
        seen = [s for p in have for s in seed_numbers(p) if s is not None]
        if len(seen) != len(set(seen)):
            raise SystemExit(f"--merge: arm {arm} has a seed in two reports ({sorted(seen)}): merge each run once")
    budgets = sorted(set.intersection(*(set(int(b) for b in r["budgets"]) for r in reports)))
    if max(budgets) != max(int(b) for b in first["budgets"]):
        raise SystemExit("--merge: the reports do not share their largest budget")
    labels = first.get("task_required_turns")
    # the starting model's per-task success per budget, per report, where every report has it
    bases = ([{str(b): r["base"]["per_task_by_budget"][str(b)] for b in budgets} for r in reports]
             if all("per_task_by_budget" in r["base"] for r in reports) else None)
    if bases and not remade and any(x != bases[0] for x in bases):
        raise SystemExit("--merge: the base model scored differently: not the same held-out tasks")
    base_tasks = None if bases is None else (bases[0] if not remade else {
        b: pooled_successes([x[b] for x in bases]) for b in bases[0]})
    arms_out: dict[str, Any] = {}
    for arm in arm_names:
        # (report index, position in its lists, seed), in seed order (a report's order where seeds are unknown)
        rows = [(i, j, s) for i, r in enumerate(reports) if arm in r["arms"]
                for j, s in enumerate(seed_numbers(r["arms"][arm]))]
        if all(s is not None for _, _, s in rows):
            rows.sort(key=lambda x: x[2])
        parts = [reports[i]["arms"][arm] for i in dict.fromkeys(i for i, _, _ in rows)]
        at = [(reports[i]["arms"][arm], j) for i, j, _ in rows]  # each seed: its report's arm, its position there
        per_seed = [(p.get("per_seed_per_task") or [p["pooled_per_task"]])[j] for p, j in at]
        n, seeds = len(per_seed[0]), len(per_seed)
        k = sum(sum(s) for s in per_seed)
        lo, hi = wilson_interval(int(round(k)), n * seeds)
        out: dict[str, Any] = {
            "turn_limits": parts[0]["turn_limits"], "overrides": parts[0].get("overrides", []),
            "runs": [x for p in parts for x in p["runs"]],
            "heldout_success": k / (n * seeds), "ci95": [lo, hi],
            "per_seed_success": [p["per_seed_success"][j] for p, j in at],
            "vs_base_mcnemar_p": [p["vs_base_mcnemar_p"][j] for p, j in at],
            "sweep": {str(b): sum(p["sweep"][str(b)] * len(p["per_seed_success"]) for p in parts) / seeds
                      for b in budgets},
            "steps": parts[0]["steps"],
            **{key: sum(p[key] * len(p["per_seed_success"]) for p in parts) / seeds
               for key in ("generated_tokens", "wall_time_s", "step_time_s")},
            "curve": _merge_bands([p["curve"] for p in parts]),
            "train_curve": _merge_bands([p["train_curve"] for p in parts]),
            "pooled_per_task": pooled_successes(per_seed),
            "per_seed_per_task": per_seed,
        }
        if all(s is not None for _, _, s in rows):
            out["seeds"] = [s for _, _, s in rows]
        if all(str(b) in (p.get("per_seed_per_task_by_budget") or {}) for p in parts for b in budgets):
            by_budget = {str(b): [p["per_seed_per_task_by_budget"][str(b)][j] for p, j in at] for b in budgets}
            out["per_seed_per_task_by_budget"] = by_budget
            if labels:  # each seed against the starting model its own report scored
                out["buckets"] = {b: bucket_stats(v, labels, seed_bases=[bases[i][b] for i, _, _ in rows]
                                                  if bases else None) for b, v in by_budget.items()}
        if any(p.get("diagnostics") for p in parts):
            out["diagnostics"] = mean_of_dicts([(p.get("diagnostics") or {}, len(p["per_seed_success"]))
                                                for p in parts])
        for key in ("diag_curves", "bucket_curves"):
            merged = _merge_nested_bands(parts, key)
            if merged is not None:
                out[key] = merged
        arms_out[arm] = out
    base = dict(first["base"])
    base["sweep"] = {str(b): first["base"]["sweep"][str(b)] for b in budgets}
    if base_tasks is not None:
        base["per_task_by_budget"] = base_tasks
        if labels:
            base["buckets"] = {b: bucket_stats([v], labels) for b, v in base_tasks.items()}
    elif "buckets" in base:
        base["buckets"] = {str(b): base["buckets"][str(b)] for b in budgets if str(b) in base["buckets"]}
    if remade:  # the warm start made again per piece: the base row is their mean, each listed (table: _starts)
        base["heldout_success"] = sum(r["base"]["heldout_success"] for r in reports) / len(reports)
        base["sweep"] = {str(b): sum(r["base"]["sweep"][str(b)] for r in reports) / len(reports) for b in budgets}
        n_tasks = first["eval_n"]
        base["ci95"] = list(wilson_interval(int(round(base["heldout_success"] * n_tasks)), n_tasks))
        base["starts"] = [{"heldout_success": r["base"]["heldout_success"],
                           "epoch_losses": ((r.get("start_model") or {}).get("warmstart") or {}).get("epoch_losses")}
                          for r in reports]
        if bases:
            base["starts_agree"] = {b: sum(len({x[b][t] for x in bases}) == 1 for t in range(len(bases[0][b])))
                                    for b in bases[0]}
    seeds_per_arm = [len(a["per_seed_success"]) for a in arms_out.values()]
    report = {"env": first["env"], "preset": first["preset"], "overrides": first["overrides"],
              "seeds": max(seeds_per_arm), "eval_n": first["eval_n"],
              "budgets": budgets, "experiment": first["experiment"], "start_model": first.get("start_model"),
              "machine": "; ".join(sorted({r["machine"] for r in reports})),
              "precision": merged_precision(precisions)}
    by_seed = {}
    for _, seed, prec in seed_rows:
        if seed is not None:
            by_seed.setdefault(str(seed), []).append(prec)
    if by_seed:  # the arithmetic each seed trained in (seeds may differ; within a seed --merge refuses a mix)
        report["precision_by_seed"] = {k: merged_precision(v) for k, v in sorted(by_seed.items(),
                                                                                 key=lambda x: int(x[0]))}
    if len(set(seeds_per_arm)) > 1:
        report["seeds_per_arm"] = {arm: n for arm, n in zip(arms_out, seeds_per_arm)}
    if first.get("task_ids"):
        report["task_ids"] = first["task_ids"]
    if labels:
        report["task_required_turns"] = labels
    rescores = []  # pieces that shared an output dir share the starting model's re-score: one entry each
    for r in reports:
        if r.get("rescore") and r["rescore"] not in rescores:
            rescores.append(r["rescore"])
    if rescores:
        report["rescore"] = rescores[0] if len(rescores) == 1 else {"parts": rescores}
    for r in reports:  # pieces reported before the held-out churn was: computed from what they carry
        big = max(map(int, r["budgets"]))
        base_s = (r["base"].get("per_task_by_budget") or {}).get(str(big))
        for arm, ar in r["arms"].items():
            runs_of = {x["run_name"]: x for x in r.get("runs") or [] if x.get("arm") == arm}
            for h, final in zip(ar.get("per_seed") or [], ar.get("per_seed_per_task") or []):
                if "heldout_churn" not in h and base_s and h.get("run") in runs_of:
                    h["heldout_churn"] = run_churn(runs_of[h["run"]], final, base_s, big)
    for arm, out in arms_out.items():
        health = sorted((h for r in reports if arm in r["arms"] for h in r["arms"][arm].get("per_seed") or []),
                        key=lambda h: (h.get("seed") is None, h.get("seed") or 0))
        if len(health) == len(out["per_seed_per_task"]):
            out["per_seed"] = health
    categories = first.get("task_categories") or _categories_from_runs(reports, report.get("task_ids"))
    if categories:
        report["task_categories"] = categories
    seed_level_intervals(arms_out, categories)
    report.update({"base": base, "arms": arms_out, "comparisons": arm_comparisons(arms_out, labels, categories),
                   "wall_time_s": sum(r["wall_time_s"] for r in reports),
                   "runs": [x for r in reports for x in r["runs"]], "collapse_rule": COLLAPSE_RULE})
    report["paper_claims"] = paper_claims(arms_out, report["comparisons"])
    left_out = seedless_pairs(arms_out)
    if left_out:
        report["seedless_pairs"] = left_out
    return report


def _machine() -> str:
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    kind = [f for f in ("amx_bf16", "avx512_bf16") if f in flags] or ["avx2-only (fp32)"]
    return f"{os.cpu_count()} cores, {', '.join(kind)}"


def _rate(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    st = f" [{c['ci95_seed_task'][0]:.2f},{c['ci95_seed_task'][1]:.2f}]" if c.get("ci95_seed_task") else ""
    return f"{c['success']:.2f} [{c['ci95'][0]:.2f},{c['ci95'][1]:.2f}]{st}"


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return "[" + ", ".join(_num(x) for x in v) + "]"
    return str(v)


def _diff(c: dict[str, Any]) -> str:
    st = (f" seeds x tasks [{c['ci95_seed_task'][0]:+.3f}, {c['ci95_seed_task'][1]:+.3f}]"
          if c.get("ci95_seed_task") else "")
    return f"{c['diff']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] p={c['p_value']:.2g}{st}"


DIAG_COLUMNS = (("invalid", "diag/invalid_action_rate"), ("repeat", "diag/repeated_action_rate"),
                ("used", "diag/turns_used_frac"), ("at-limit", "diag/turn_limit_frac"),
                ("0-adv", "diag/zero_adv_group_frac"), ("entropy", "train/entropy"), ("train", "success_rate"))


def _starts(report: dict[str, Any]) -> str:
    """The table's note on a warm start made again per piece of a merged study (empty otherwise)."""
    starts = report["base"].get("starts")
    if not starts:
        return ""
    big = str(max(report["budgets"]))
    agree = report["base"].get("starts_agree", {}).get(big)
    same = f"; the same outcome on {agree}/{report['eval_n']} tasks at {big} turns" if agree is not None else ""
    return (f"; scored by each of the {len(starts)} pieces, which started from " + starts_text(starts)
            + f"{same}; base row: the pieces' mean, each seed compared with its own")


def starts_text(starts: list[dict[str, Any]]) -> str:
    """The warm starts behind a merged study's pieces, told apart by their epoch losses (3 decimals, as
    ``core.study.start_key``): how many pieces started from each and what each piece scored."""
    groups: dict[str, list[float]] = {}
    for s in starts:
        losses = s.get("epoch_losses")
        key = " -> ".join(f"{x:.3f}" for x in losses) if losses else "losses not recorded"
        groups.setdefault(key, []).append(s["heldout_success"])
    parts = []
    for key, scores in groups.items():
        said = (f"{scores[0]:.3f} each" if len(scores) > 1 and len(set(scores)) == 1
                else ", ".join(f"{x:.3f}" for x in scores))
        parts.append(f"epoch NLL {key}: {len(scores)} piece{'s' if len(scores) > 1 else ''}, {said}")
    n = len(groups)
    return f"{n} warm start{'s' if n > 1 else ''} of this recipe ({'; '.join(parts)})"


def _arithmetic(report: dict[str, Any]) -> str:
    """The table's arithmetic line: the report's, and each seed's where the seeds differ."""
    text = precision_text(report["precision"])
    by_seed = report.get("precision_by_seed") or {}
    if len({precision_text(p) for p in by_seed.values()}) > 1:
        groups: dict[str, list[str]] = {}
        for seed, p in by_seed.items():
            groups.setdefault(precision_text(p), []).append(seed)
        text += " (" + "; ".join(f"seed{'s' if len(v) > 1 else ''} {', '.join(v)}: {k}" for k, v in groups.items()) + \
            "; within a seed, one)"
    return text


def _path_text(h: dict[str, Any]) -> str:
    """A run's held-out path for its table line: tasks lost/gained point to point, the largest drop, and the share
    failed at the cap at each point (empty where the run's record has neither)."""
    text = ""
    churn = h.get("heldout_churn") or {}
    if churn.get("transitions"):
        moves = " ".join(f"{t['lost']}/{t['gained']}" for t in churn["transitions"])
        text += f"; held-out lost/gained {moves} (largest drop {churn['largest_drop']:.3f})"
    cap = h.get("heldout_at_cap") or {}
    if cap:
        text += "; held-out failed at the cap " + " ".join(f"{v:.2f}" for _, v in sorted(cap.items(),
                                                                                        key=lambda x: int(x[0])))
    return text


def table(report: dict[str, Any]) -> str:
    big = max(report["budgets"])
    lines = [f"learning study: {report['env']}, preset {report['preset']}, {report['seeds']} seed(s), "
             f"held-out n={report['eval_n']} at {big} turns (greedy); {report['machine']}",
             f"starting model: {describe_start(report.get('start_model'))}" + _starts(report),
             *([f"arithmetic: {_arithmetic(report)}"] if report.get("precision") else []),
             "(95% CI: seeds x tasks = a bootstrap over seeds and tasks, with the seed-to-seed variation; seeds x "
             "categories = the same drawing whole task categories (levels), whose tasks often succeed or fail "
             "together; episodes = Wilson over all seeds' episodes as if independent)",
             f"{'arm':<20}{'limits':<12}{'held-out':>10}{'CI seeds x tasks':>18}{'CI seeds x categ.':>19}"
             f"{'CI episodes':>16}{'vs base p (per seed)':>22}{'steps':>7}{'tokens':>10}{'step s':>8}{'wall s':>9}",
             f"{'base model':<20}{'-':<12}{report['base']['heldout_success']:>10.3f}{'-':>18}{'-':>19}"
             f"{'[%.3f, %.3f]' % tuple(report['base']['ci95']):>16}{'':>22}{0:>7}{'-':>10}{'-':>8}{'-':>9}"]
    for arm, r in report["arms"].items():
        ps = ",".join(f"{p:.2g}" for p in r["vs_base_mcnemar_p"])
        st = "[%.3f, %.3f]" % tuple(r["ci95_seed_task"]) if r.get("ci95_seed_task") else "-"
        sc = "[%.3f, %.3f]" % tuple(r["ci95_seed_category"]) if r.get("ci95_seed_category") else "-"
        lines.append(f"{arm:<20}{'>'.join(map(str, r['turn_limits'])):<12}{r['heldout_success']:>10.3f}{st:>18}"
                     f"{sc:>19}{'[%.3f, %.3f]' % tuple(r['ci95']):>16}{ps:>22}{r['steps']:>7}"
                     f"{r['generated_tokens']:>10.0f}{r['step_time_s']:>8.0f}{r['wall_time_s']:>9.0f}")
    extra = [f"{arm}: {', '.join(r['overrides'])}" for arm, r in report["arms"].items() if r.get("overrides")]
    if extra:
        lines.append("arm overrides: " + "; ".join(extra))
    for name, c in report["comparisons"].items():
        st = (f"; seeds x tasks [{c['ci95_seed_task'][0]:+.3f}, {c['ci95_seed_task'][1]:+.3f}]"
              if c.get("ci95_seed_task") else "")
        st += (f"; seeds x categories [{c['ci95_seed_category'][0]:+.3f}, {c['ci95_seed_category'][1]:+.3f}]"
               if c.get("ci95_seed_category") else "")
        on = f" on seeds {', '.join(map(str, c['seeds']))}" if c.get("seeds") else ""
        lines.append(f"{name}{on}: {c['diff']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] (tasks), "
                     f"paired bootstrap p = {c['p_value']:.3g}{st}")
        for b, e in sorted((c.get("budgets") or {}).items(), key=lambda kv: -int(kv[0])):
            parts = ([f"all {_diff(e)}"] if int(b) != big else []) + [
                f"{k} {_diff(x)}" for k, x in (e.get("buckets") or {}).items()]
            if parts:
                lines.append(f"    at {b} turns: " + "; ".join(parts))
    if report.get("seedless_pairs"):
        lines.append("not compared (no seed in common): " + ", ".join(report["seedless_pairs"]))
    for rs in ([report["rescore"]] if "budgets" in report.get("rescore", {}) else
               report.get("rescore", {}).get("parts", [])):
        lines.append("re-score (the starting model scored twice, same tasks, lock-step greedy): " + "; ".join(
            f"{b} turns {r['same']}/{r['tasks']} tasks the same ({r['first']:.3f} vs {r['second']:.3f})"
            for b, r in rs["budgets"].items()))
    lines.append("sweep (held-out success by turn budget): " + "; ".join(
        f"{arm} " + ", ".join(f"{b}:{v:.2f}" for b, v in r["sweep"].items()) for arm, r in report["arms"].items()))
    labels = report.get("task_required_turns")
    if labels:
        from core.study import bucket_indices

        sizes = {k: len(v) for k, v in bucket_indices(labels).items()}
        for b in sorted(report["budgets"], key=int, reverse=True):
            lines.append(f"held-out by required turns at {b} turns (success [95% CI episodes] [95% CI seeds x "
                         "tasks], pooled over seeds):")
            lines.append(f"{'':<20}" + "".join(f"{f'{k} (n={n})':>30}" for k, n in sizes.items()))
            rows = [("base model", report["base"].get("buckets", {}).get(str(b), {}))] + [
                (arm, r.get("buckets", {}).get(str(b), {})) for arm, r in report["arms"].items()]
            for name, cells in rows:
                lines.append(f"{name:<20}" + "".join(f"{_rate(cells.get(k)):>30}" for k in sizes))
    if any(r.get("per_seed") for r in report["arms"].values()):
        lines.append(f"per run: collapse ({report.get('collapse_rule', COLLAPSE_RULE)}); turns used / limit per "
                     "phase; retention = share of the tasks the starting model solved that the run still solves; "
                     "held-out lost/gained = tasks lost and gained from each held-out point to the next (start, "
                     "phase finals, final); held-out failed at the cap = share of those points' episodes that "
                     "failed at the turn limit")
        for arm, r in report["arms"].items():
            for h in r.get("per_seed") or []:
                used = " ".join(f"{v.get('diag/turns_used_frac', float('nan')):.2f}" for v in h["horizon"].values())
                rep = " ".join(f"{v.get('diag/repeated_action_rate', float('nan')):.2f}"
                               for v in h["horizon"].values())
                ret = " ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in h["retention"].items())
                lines.append(f"  {arm:<20} seed {h['seed']}: {'COLLAPSED' if h['collapsed'] else 'no collapse'}; "
                             f"used {used}; repeat {rep}; retention {ret}{_path_text(h)}")
    shared = [r for r in report.get("runs") or [] if r.get("shared_phases")]
    if shared:
        lines.append("phases trained once for two arms: " + "; ".join(
            f"{r['run_name']} took phases 1-{r['shared_phases']['phases']} (steps 1-{r['shared_phases']['global_step']}, "
            f"{r['shared_phases']['step_time_s']:.0f} s) over from {r['shared_phases']['from_run']}" for r in shared))
    claims = report.get("paper_claims") or []
    if claims:
        lines.append(f"the paper's claims here (after {max(r['steps'] for r in report['arms'].values())} steps; "
                     "rules in the JSON's paper_claims):")
        for c in claims:
            m = "; ".join(f"{k} {_num(v)}" for k, v in c["measured"].items() if v is not None)
            lines.append(f"  {c['claim']:<26} {c['verdict'].upper():<16} {m}")
    if any(r.get("diagnostics") for r in report["arms"].values()):
        lines.append("stability diagnostics per phase (mean over the phase's steps and the seeds; train = train "
                     "success):")
        lines.append(f"{'arm':<20}{'phase':<9}{'limit':>6}" + "".join(f"{h:>10}" for h, _ in DIAG_COLUMNS))
        for arm, r in report["arms"].items():
            for i, (ph, vals) in enumerate((r.get("diagnostics") or {}).items()):
                lim = r["turn_limits"][i] if i < len(r["turn_limits"]) else "-"
                lines.append(f"{arm:<20}{ph:<9}{lim:>6}" + "".join(
                    f"{vals[k]:>10.3f}" if k in vals else f"{'-':>10}" for _, k in DIAG_COLUMNS))
    return "\n".join(lines)


def write_outputs(a: argparse.Namespace, report: dict[str, Any]) -> None:
    out = Path(a.results)
    out.mkdir(parents=True, exist_ok=True)
    name = f"learning-study-{a.env}" + (f"-{a.tag}" if a.tag else "")
    arms = report.get("arms") or {}
    if not report.get("merged_from") and len(arms) == 1 and report.get("seeds") == 1:  # a piece: its arm and seed
        arm, part = next(iter(arms.items()))
        seeds = part.get("seeds") or []
        if len(seeds) == 1 and isinstance(seeds[0], int):
            name += f"-{arm}-s{seeds[0]}"
    stem = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    text = table(report)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text("```\n" + text + "\n```\n")
    plot(report, stem.with_suffix(".png"))
    print("\n" + text)
    print(f"\nwrote {stem}.json, .md, .png")


def _plot_bands(ax, bands: dict[Any, dict[str, Any]], label: str) -> None:
    pts = sorted((int(s), b) for s, b in bands.items())
    xs = [s for s, _ in pts]
    ax.plot(xs, [b["mean"] for _, b in pts], marker="o", markersize=3, label=label)
    ax.fill_between(xs, [b["lo"] for _, b in pts], [b["hi"] for _, b in pts], alpha=0.15)


PLOT_DIAG = ("diag/turn_limit_frac", "episodes ending at the turn limit (share, per step)")


def plot(report: dict[str, Any], path: Path) -> None:
    """Top: held-out success vs training step (left) and train success per step (right), per arm: mean over seeds
    and the min-max band. Bottom (where the report has them): held-out success per required-turns bucket vs step
    (one panel per bucket) and the share of episodes ending at the turn limit per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    big = max(report["budgets"])
    buckets = list(dict.fromkeys(k for r in arms.values() for k in r.get("bucket_curves") or {}))
    diag = any(PLOT_DIAG[0] in (r.get("diag_curves") or {}) for r in arms.values())
    bottom = len(buckets) + int(diag)
    fig = plt.figure(figsize=(max(12, 3.6 * bottom), 8.6 if bottom else 4.2), constrained_layout=True)
    top, low = fig.subfigures(2, 1) if bottom else (fig, None)
    axes = top.subplots(1, 2)
    panels = [("curve", f"held-out success (n={report['eval_n']}, {big} turns, greedy)"),
              ("train_curve", "train success (sampled episodes of the step)")]
    for ax, (key, label) in zip(axes, panels):
        for arm, r in arms.items():
            _plot_bands(ax, r[key], f"{arm} ({'>'.join(map(str, r['turn_limits']))})")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if low is not None:
        sizes = {}
        if report.get("task_required_turns"):
            from core.study import bucket_indices

            sizes = {k: len(v) for k, v in bucket_indices(report["task_required_turns"]).items()}
        row = low.subplots(1, bottom, squeeze=False)[0]
        for ax, k in zip(row, buckets):
            for arm, r in arms.items():
                if k in (r.get("bucket_curves") or {}):
                    _plot_bands(ax, r["bucket_curves"][k], arm)
            n = f", n={sizes[k]}" if k in sizes else ""
            ax.set_title(f"held-out, needs {k} turn(s){n}", fontsize=9)
            ax.set_xlabel("training step")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        if buckets:
            row[0].set_ylabel(f"held-out success at {big} turns")
        if diag:
            ax = row[-1]
            for arm, r in arms.items():
                if PLOT_DIAG[0] in (r.get("diag_curves") or {}):
                    _plot_bands(ax, r["diag_curves"][PLOT_DIAG[0]], arm)
            ax.set_title(PLOT_DIAG[1], fontsize=9)
            ax.set_xlabel("training step")
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{report['env']}: ScalingInter vs fixed horizons ({report['seeds']} seed(s); band = min-max "
                 f"over seeds); {report['machine']}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
