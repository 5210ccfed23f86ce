"""Does RL make a competent agent better? The warm start against RL recipes started from it, on multi-step BabyAI.

    python bench/rl_vs_warmstart.py --warm runs44/warm --arms recipe --seeds 3 --output-dir runs44

Every arm trains from the same behaviour-cloning warm start (``--warm``: ``scalinginter warmstart``'s folder) with
the preset's env options and turn limits (``--env``/``--preset``, default BabyAI ``multistep``: 3 -> 6 -> 10 turns;
``--phase-steps`` steps per phase, 4 tasks x 4 samples per step unless an arm says otherwise), then its final checkpoint is scored greedily on ``--eval-n``
held-out tasks at ``--turn-limit`` turns; the warm start is scored once on the same tasks. An arm is a list of
``--set`` overrides on top of those settings (``ARMS``; the ablation adds one lever at a time). Runs are
``scalinginter run`` subprocesses (logs under ``<output-dir>/logs``); re-running the command resumes: a finished run
(its ``summary.json``) is reused, an unfinished one resumes from its checkpoint. Finished runs' checkpoints are
deleted unless ``--keep-checkpoints``.

The report (``--results``, default bench/results/, the path issue 44 names): per arm, held-out success pooled over seeds,
the paired difference against the warm start with a 95 % interval from a bootstrap over seeds and tasks
(``core.stats.seed_task_bootstrap``) and, beside it, the per-task bootstrap of the pooled outcomes; each seed's
gain and exact McNemar p; success by required-turns bucket (1, 2-3, 4-6, 7+); and per-phase means of the step
diagnostics (zero-advantage groups, groups refilled, skipped updates, expert relabels, entropy, repeat rate, train
success). ``rl-vs-warmstart-<env>-<preset>-<date>.json`` holds, per arm, ``recipe`` (its settings),
``turn_limit`` and ``seeds``: per seed ``seed``, ``steps``, ``tokens``, ``wall_s``, and ``warm_start`` and
``final`` as per-task outcomes ``{"task", "required_turns", "success"}`` on the same tasks; a ``.md`` table and a
PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from core.evalreport import BUCKETS  # noqa: E402
from core.stats import bootstrap_ci, seed_task_bootstrap, wilson_interval  # noqa: E402
from core.study import bucket_indices, paired_mcnemar  # noqa: E402

# the earlier study's run shape: 3 -> 6 -> 10 turns, 4 tasks x 4 samples per step
BASE = ["rollout.tasks_per_step=4", "env.runtime=process"]  # env servers as local processes, whatever docker has

# the levers, one at a time (each arm is the one before it plus one lever), then the baselines beside them
STOP_DRIFT = ["algo.lr=2e-5", "algo.kl_coef=0.05", "algo.skip_no_signal=true"]
EXPERT = ["algo.expert_coef=1.0", "algo.expert_decay=linear"]
EXPERT03 = ["algo.expert_coef=0.3", "algo.expert_decay=linear"]
EXPERT06 = ["algo.expert_coef=0.6", "algo.expert_decay=linear"]
FIT = ["rollout.task_filter=fits_turns"]
DYN = ["rollout.dynamic_sampling_rounds=1"]
RECIPE = STOP_DRIFT + EXPERT + FIT + DYN
# the `groups` arms' levers: half the step size, the KL anchor, no update without signal, the expert's episode in
# all-fail groups
GROUPS = ["algo.lr=1e-5", "algo.kl_coef=0.05", "algo.skip_no_signal=true", "algo.expert_groups=true"]
AT10 = ['curriculum.phases=[{"turn_limit":10,"steps":12}]']  # all 12 steps at the evaluation's 10 turns
ARMS: dict[str, list[str]] = {
    "preset": [],  # the study's recipe: lr 3e-5, no KL (the runs that ended below the warm start)
    "stop-drift": STOP_DRIFT,  # lr 2e-5, a k3 KL to the warm start, no update without signal
    "+expert": STOP_DRIFT + EXPERT,  # the expert's reply at the first state each episode left its path
    "+fit": STOP_DRIFT + EXPERT + FIT,  # tasks whose expert needs at most the phase's turn limit
    "recipe": RECIPE,  # + dynamic sampling: one extra round refills groups without reward variance
    "+mask": RECIPE + ["algo.truncated=mask"],
    # the expert term as the main signal: 3 relabelled states per episode at weight 3, no decay
    "dagger": STOP_DRIFT + ["algo.expert_coef=3.0", "algo.expert_turns=3"] + FIT + DYN,
    # the expert's whole episode in every group whose samples all failed (what the warm start learned from), no
    # relabels, half the step size
    "groups": GROUPS + FIT + DYN,
    # the best arm so far, with each invalid reply charged 0.1: the runs lost tasks by repeating an invalid action
    "groups+invalid": GROUPS + ["algo.invalid_action_penalty=0.1"] + FIT + DYN,
    # the best arm at one fixed horizon, the evaluation's 10 turns, for all 12 steps: do the short phases (3, 6
    # turns) teach the habits the runs lose tasks by (the door in view opened first, an invalid reply repeated)?
    "groups@10": GROUPS + FIT + DYN + AT10,
    # groups@10 with a 4x stronger anchor to the warm start: does the KL keep the 2-3-turn tasks it loses?
    "groups@10+kl0.2": [x if not x.startswith("algo.kl_coef=") else "algo.kl_coef=0.2" for x in GROUPS] + FIT + DYN
    + AT10,
    # groups@10 with up to 2 solved groups a step replayed (advantage 1 on their own actions): tasks the warm start
    # solves keep a gradient instead of being dropped by the refill (the 2-3-turn tasks it loses)
    "groups@10+replay": GROUPS + FIT + DYN + ["algo.replay_solved=2"] + AT10,
    # groups@10 with the expert's relabels (weight 1, decaying): the expert's reply at the first state each episode
    # left its path, where a policy that lost a task's order goes wrong (recipe and dagger kept more 2-3-turn tasks)
    "groups@10+expert": GROUPS + EXPERT + FIT + DYN + AT10,
    # the relabels at 0.3 of that weight: do they keep the 2-3-turn tasks (a policy that turns in place where the
    # key and door are in view) without costing the long ones? (Its seed 0 ran as groups@10+replay+expert0.3 under a
    # refactor's bug that left every solved group out of the replay: replay_groups 0 at all 12 steps, so it trained
    # exactly this recipe; its folder was renamed.)
    "groups@10+expert0.3": GROUPS + EXPERT03 + FIT + DYN + AT10,
    # the relabels between the two weights measured: at 1 they kept the 2-3-turn tasks and lost most of the gain
    # (one seed), at 0.3 they kept the gain and not the 2-3-turn tasks (three seeds)
    "groups@10+expert0.6": GROUPS + EXPERT06 + FIT + DYN + AT10,
    # both retention levers at once: the replay kept the gain, the relabels kept the 2-3-turn tasks
    "groups@10+replay+expert0.3": GROUPS + EXPERT03 + FIT + DYN + ["algo.replay_solved=2"] + AT10,
    # the same for any env and preset: `groups` with all the preset's steps at its last phase's turn limit (on the
    # BabyAI multistep preset, groups@10; on TextCraft easy, 12 steps at 4 turns)
    "groups@last": GROUPS + FIT + DYN,
    "+groups": RECIPE + ["algo.expert_groups=true"],  # all-fail groups get the expert's episode of the task
    "+shape": RECIPE + ["algo.shaping_coef=0.1"],  # progress reward from the expert's remaining turns
    "+g8": RECIPE + ["rollout.tasks_per_step=2", "rollout.samples_per_task=8"],
    "+nostd": RECIPE + ["algo.normalize_std=false"],
    "filtered-bc": ["algo.estimator=filtered-bc"] + STOP_DRIFT + EXPERT + FIT,
    # rejection-sampling fine-tuning: every success is imitated (tasks the warm start solves are rehearsed, not left
    # without gradient as in a group-relative estimator's all-success groups), all-fail groups get the expert's episode
    "rft": ["algo.estimator=filtered-bc", "algo.lr=1e-5", "algo.kl_coef=0.05", "algo.expert_groups=true"] + FIT,
}
DIAG = ("diag/zero_adv_group_frac", "expert_groups", "dyn/first_round_zero_var_frac", "dyn/groups_dropped", "replay_groups",
        "train/skipped", "train/expert_samples", "train/expert_nll", "train/entropy", "train/kl", "diag/repeated_action_rate",
        "diag/invalid_action_rate", "diag/turns_used_frac", "success_rate", "step_time_s")


def _cli() -> list[str]:
    return [sys.executable, "-m", "flows.cli"]  # this checkout's code (run from ROOT), whatever is installed


def _run(cmd: list[str], log: Path) -> float:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {rc}); see {log}")
    return time.time() - t0


def outcomes(eval_doc: dict[str, Any], turn_limit: int) -> list[dict[str, Any]]:
    """Per-task greedy outcomes ``{"task", "required_turns", "success"}`` of an evaluation document."""
    rows = eval_doc["models"]["model"]["budgets"][str(turn_limit)]["per_task"]
    return [{"task": r["task_id"], "required_turns": r.get("required_turns"),
             "success": int(bool(r["successes"][0]))} for r in rows]


def warm_eval(args, out: Path) -> list[dict[str, Any]]:
    path = out / "warm_eval.json"
    if not path.exists():
        print(f"scoring the warm start on {args.eval_n} held-out tasks at {args.turn_limit} turns", flush=True)
        cfg = preset(args)  # as the runs' own final evaluation generates: the preset's env options and budgets
        _run(_cli() + ["eval", str(args.warm), args.env, "--n", str(args.eval_n), "--turn-limit", str(args.turn_limit),
                       "--max-new-tokens", str(cfg.rollout.max_new_tokens), "--seed", "0", "--no-mlflow", "--json",
                       str(path), "--set", f"env.options={json.dumps(cfg.env.options)}", "--set", f"output_dir={out}",
                       "--set", f"rollout.token_budget={cfg.rollout.token_budget}"],
             out / "logs" / "warm_eval.log")
    return outcomes(json.loads(path.read_text()), args.turn_limit)


def preset(args):
    from flows.config import build_config

    return build_config(args.env, args.preset)


def arm_recipe(args, arm: str) -> list[str]:
    """The arm's overrides as its runs get them: its levers, for an ``@last`` arm every step at the last phase's turn
    limit, then the command's ``--set``."""
    sets = list(ARMS[arm])
    if arm.endswith("@last"):
        phases = [{"turn_limit": p.turn_limit, "steps": args.phase_steps or p.steps}
                  for p in preset(args).curriculum.phases]
        sets.append("curriculum.phases=" + json.dumps([{"turn_limit": phases[-1]["turn_limit"],
                                                        "steps": sum(p["steps"] for p in phases)}]))
    return sets + list(args.set or [])


def run_arm(args, out: Path, arm: str, seed: int) -> dict[str, Any]:
    name = f"{arm}-s{seed}"
    rd = out / name
    summary = rd / "summary.json"
    phases = json.dumps([{"turn_limit": p.turn_limit, "steps": args.phase_steps or p.steps}
                         for p in preset(args).curriculum.phases])
    recipe = arm_recipe(args, arm)
    sets = BASE + [f"curriculum.phases={phases}", f"model.path={args.warm}", f"output_dir={out}", f"seed={seed}",
                   f"eval.n={args.eval_n}", f"eval.turn_limit={args.turn_limit}", "eval.before=false",
                   "tracking.log_trajectories=0"] + recipe
    wall = None
    if not summary.exists():
        print(f"training {name} ({', '.join(recipe) or 'the preset as it is'})", flush=True)
        cmd = _cli() + ["run", args.env, "--preset", args.preset, "--run-name", name]
        for s in sets:
            cmd += ["--set", s]
        wall = _run(cmd, out / "logs" / f"{name}.log")
    if not args.keep_checkpoints:
        shutil.rmtree(out / "checkpoints" / name, ignore_errors=True)
    doc = json.loads(summary.read_text())
    metrics = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"seed": seed, "steps": len(metrics),
            "tokens": int(sum(m.get("generated_tokens", 0) for m in metrics)),
            "wall_s": round(doc.get("wall_time_s", wall or 0.0), 1),
            "final": outcomes(json.loads((rd / "eval_after.json").read_text()), args.turn_limit),
            "diagnostics": phase_diagnostics(metrics)}


def phase_diagnostics(metrics: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per phase, the mean of each step diagnostic over the phase's steps (keys a run did not log are left out)."""
    out: dict[str, dict[str, float]] = {}
    for ph in sorted({int(m["phase"]) for m in metrics}):
        rows = [m for m in metrics if int(m["phase"]) == ph]
        out[str(ph)] = {k: statistics.fmean(float(m[k]) for m in rows) for k in DIAG if all(k in m for m in rows)}
    return out


def arm_report(warm: list[dict[str, Any]], seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled success, the paired gain over the warm start (seed x task bootstrap and per-task bootstrap), per seed
    gains and McNemar p, and success by required-turns bucket."""
    w = [o["success"] for o in warm]
    labels = [o["required_turns"] for o in warm]
    finals = []
    for s in seeds:
        if [o["task"] for o in s["final"]] != [o["task"] for o in warm]:
            raise SystemExit(f"seed {s['seed']}: scored on other tasks than the warm start")
        finals.append([o["success"] for o in s["final"]])
    diffs = [[f - b for f, b in zip(row, w)] for row in finals]
    mean, lo, hi = seed_task_bootstrap(diffs)
    pooled_task = [statistics.fmean(row[t] for row in diffs) for t in range(len(w))]
    tlo, thi = bootstrap_ci(pooled_task)
    wins = sum(map(sum, finals))
    n = len(w) * len(finals)
    rep: dict[str, Any] = {
        "final": wins / n, "final_wilson": list(wilson_interval(int(wins), n)),
        "warm_start": statistics.fmean(w), "gain": mean, "gain_ci_seed_task": [lo, hi],
        "gain_ci_task_only": [tlo, thi],
        "per_seed_gain": [statistics.fmean(d) for d in diffs],
        "per_seed_mcnemar_p": [paired_mcnemar(f, w) for f in finals], "buckets": {}}
    for k, idx in bucket_indices(labels).items():
        gain, glo, ghi = seed_task_bootstrap([[row[i] for i in idx] for row in diffs])
        rep["buckets"][k] = {"tasks": len(idx), "warm_start": statistics.fmean(w[i] for i in idx),
                             "final": statistics.fmean(row[i] for row in finals for i in idx),
                             "per_seed": [statistics.fmean(row[i] for i in idx) for row in finals],
                             "gain": gain, "gain_ci_seed_task": [glo, ghi]}
    return rep


def merge_arms(arms: dict[str, Any], earlier: list[tuple[Path, dict[str, Any]]], turn_limit: int,
               tasks: list[str]) -> dict[str, Any]:
    """This run's arms after the earlier reports' arms it did not run (an arm run here again replaces the earlier one);
    a carried arm keeps its seeds, each with the warm start outcomes it was scored against, and names its report.
    Refused unless the earlier arms were scored on the same held-out tasks at the same turn limit."""
    out: dict[str, Any] = {}
    for path, doc in earlier:
        if doc.get("turn_limit") != turn_limit:
            raise SystemExit(f"--merge {path}: its arms were scored at {doc.get('turn_limit')} turns, this run's at "
                             f"{turn_limit}")
        if [o["task"] for o in doc.get("warm_start", [])] != tasks:
            raise SystemExit(f"--merge {path}: its arms were scored on other held-out tasks (same --eval-n and "
                             "preset needed)")
        for arm, a in doc.get("arms", {}).items():
            if arm not in arms:
                out[arm] = {**a, "merged_from": a.get("merged_from", path.name)}
    return {**out, **arms}


def _bucket_keys(doc: dict[str, Any]) -> list[str]:
    """The required-turns buckets the held-out tasks fall in (BabyAI multistep: all four; TextCraft easy: two)."""
    return [k for k in BUCKETS if any(k in a["report"]["buckets"] for a in doc["arms"].values())]


def warm_starts(doc: dict[str, Any]) -> dict[str, tuple[float, dict[str, Any], list[str]]]:
    """The warm starts the arms were scored against, in order: label -> (pooled success, buckets, arms). One unless
    arms merged from an earlier report (``--merge``) started from a warm start made again, which in bf16 is not the
    same model twice."""
    out: dict[str, tuple[float, dict[str, Any], list[str]]] = {}
    keys: dict[tuple, str] = {}
    for arm, a in doc["arms"].items():
        ws = a["seeds"][0].get("warm_start")
        key = (tuple(o["success"] for o in ws) if ws else
               (a["report"]["warm_start"], *(b["warm_start"] for b in a["report"]["buckets"].values())))
        if key not in keys:
            keys[key] = "warm start" if not keys else f"warm start {len(keys) + 1}"
            out[keys[key]] = (a["report"]["warm_start"], a["report"]["buckets"], [])
        out[keys[key]][2].append(arm)
    return out


def table(doc: dict[str, Any]) -> str:
    keys = _bucket_keys(doc)
    lines = [f"# RL from the warm start, {doc['env']} `{doc['preset']}` ({doc['turn_limit']} turns, {doc['eval_n']} "
             f"held-out tasks, greedy)", "", f"Machine: {doc['machine']}. Warm start: {doc['warm']}. Each arm: "
             f"{doc['phase_steps'] or 'the preset’s'} steps per phase, the preset's turn limits.", "",
             "| arm | seeds | final (pooled) | gain over warm start [95 % CI, seeds x tasks] | [per-task CI] | "
             "per-seed gain | McNemar p | needs " + " / ".join(keys) + " |", "|---|---|---|---|---|---|---|---|"]
    warms = warm_starts(doc)
    most = max((len(v[2]) for v in warms.values()), default=0)
    for label, (w, wb, arms) in warms.items():
        # with several warm starts, each row names its arms (the one most arms started from: "the other arms")
        who = "" if len(warms) == 1 else " (the other arms)" if len(arms) == most else f" ({', '.join(arms)})"
        lines.append(f"| {label}{who} | - | {w:.3f} | - | - | - | - | "
                     + " / ".join(f"{wb[k]['warm_start']:.2f}" for k in BUCKETS if k in wb) + " |")
    for arm, a in doc["arms"].items():
        r = a["report"]
        lines.append(
            f"| {arm} | {len(a['seeds'])} | {r['final']:.3f} | {r['gain']:+.3f} [{r['gain_ci_seed_task'][0]:+.3f}, "
            f"{r['gain_ci_seed_task'][1]:+.3f}] | [{r['gain_ci_task_only'][0]:+.3f}, {r['gain_ci_task_only'][1]:+.3f}] | "
            + ", ".join(f"{g:+.3f}" for g in r["per_seed_gain"]) + " | "
            + ", ".join(f"{p:.2g}" for p in r["per_seed_mcnemar_p"]) + " | "
            + " / ".join(f"{r['buckets'][k]['final']:.2f}" for k in BUCKETS if k in r["buckets"]) + " |")
    lines += ["", "Gain over the warm start by required turns (95 % CI, bootstrap over seeds and tasks):", "",
              "| arm | " + " | ".join(f"needs {k}" for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for arm, a in doc["arms"].items():
        b = a["report"]["buckets"]
        lines.append(f"| {arm} | " + " | ".join(
            f"{b[k]['gain']:+.3f} [{b[k]['gain_ci_seed_task'][0]:+.3f}, {b[k]['gain_ci_seed_task'][1]:+.3f}]"
            if k in b and "gain" in b[k] else "-" for k in keys) + " |")
    lines += ["", f"Settings per arm (on top of the `{doc['preset']}` preset and 4 tasks x 4 samples per step):", ""]
    for arm, a in doc["arms"].items():
        lines.append(f"- `{arm}`: {' '.join(a['recipe']) or '(the preset: lr 3e-5, no KL)'}")
    lines += ["", "Diagnostics, mean per phase (seed 0 of each arm):", "",
              "| arm | phase | 0-adv groups | first-round zero-var | groups dropped | skipped | expert relabels | "
              "entropy | repeat | train success | step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in doc["arms"].items():
        for ph, d in a["seeds"][0]["diagnostics"].items():
            def f(k, fmt=".2f"):
                return format(d[k], fmt) if k in d else "-"
            lines.append(f"| {arm} | {ph} | {f('diag/zero_adv_group_frac')} | {f('dyn/first_round_zero_var_frac')} | "
                         f"{f('dyn/groups_dropped')} | {f('train/skipped')} | {f('train/expert_samples', '.1f')} | "
                         f"{f('train/entropy', '.3f')} | {f('diag/repeated_action_rate')} | {f('success_rate')} | "
                         f"{f('step_time_s', '.0f')} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(doc["arms"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for i, arm in enumerate(arms):
        r = doc["arms"][arm]["report"]
        lo, hi = r["gain_ci_seed_task"]
        ax.errorbar([i], [r["gain"]], yerr=[[r["gain"] - lo], [hi - r["gain"]]], fmt="o", capsize=4)
        ax.scatter([i] * len(r["per_seed_gain"]), r["per_seed_gain"], marker="x", color="grey", zorder=3)
    ax.axhline(0, color="k", lw=0.8)
    ax.axhline(0.08, color="g", lw=0.8, ls="--", label="+0.08 goal")
    ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    ax.set_ylabel("held-out success - warm start")
    ax.set_title("gain over the warm start (95 % CI over seeds x tasks; x: seeds)")
    ax.legend()
    ax = axes[1]
    keys = [k for k in BUCKETS if arms and k in doc["arms"][arms[0]]["report"]["buckets"]]
    width = 0.8 / (len(arms) + 1)
    for n, (label, (_, wb, _)) in enumerate(warm_starts(doc).items()):  # the warm start(s), grey, under the arms
        ax.bar([j - n * width / 3 for j in range(len(keys))], [wb[k]["warm_start"] for k in keys], width,
               label=label, color="lightgrey" if n == 0 else "darkgrey")
    for i, arm in enumerate(arms):
        b = doc["arms"][arm]["report"]["buckets"]
        ax.bar([j + (i + 1) * width for j in range(len(keys))], [b[k]["final"] for k in keys], width, label=arm)
    ax.set_xticks([j + width * len(arms) / 2 for j in range(len(keys))], [f"needs {k}" for k in keys])
    ax.set_ylabel("held-out success")
    ax.set_title("by the turns the expert needs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    from bench_multistep import cpu_info  # the benches' one /proc/cpuinfo reader

    c = cpu_info(Path("/proc/cpuinfo").read_text())
    return (f"{os.cpu_count()} cores, {c['model_name'] or '?'} (cpu family {c['cpu_family'] or '?'}, model "
            f"{c['model'] or '?'}), {', '.join(c['bf16_flags']) or 'no bf16'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=Path, required=True, help="the warm start's folder (scalinginter warmstart --out)")
    ap.add_argument("--arms", default="recipe", help=f"comma-separated, from: {', '.join(ARMS)}")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--env", default="babyai")
    ap.add_argument("--preset", default="multistep", help="the env's preset: levels, curriculum's turn limits, rollout")
    ap.add_argument("--phase-steps", type=int, default=4, help="steps per phase (0: the preset's)")
    ap.add_argument("--eval-n", type=int, default=None, help="held-out tasks (default: the preset's eval.n)")
    ap.add_argument("--turn-limit", type=int, default=None,
                    help="the held-out budget (default: the preset's last phase's turn limit)")
    ap.add_argument("--output-dir", type=Path, default=Path("runs-rl-vs-warm"))
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--set", action="append", help="a config override for every arm (after the arm's own)")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--chosen", default="groups@10+expert0.6,groups@10,groups@last,recipe",
                    help="the arm whose recipe, turn limit and seeds the JSON repeats at its top level (the first of "
                         "these that ran)")
    ap.add_argument("--report-only", action="store_true", help="report the runs that finished; train nothing")
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="an earlier report's JSON: its arms that this command does not report (their runs no longer on "
                         "disk) are carried into the report as they are, each beside the warm start it started from")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    if not (args.warm / "config.json").exists():
        ap.error(f"--warm {args.warm} is not a model folder (no config.json): make it with scalinginter warmstart")
    args.warm = args.warm.resolve()
    cfg = preset(args)
    args.eval_n = args.eval_n or cfg.eval.n
    args.turn_limit = args.turn_limit or cfg.curriculum.phases[-1].turn_limit
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_eval(args, out)
    print(f"warm start: {sum(o['success'] for o in warm)}/{len(warm)} at {args.turn_limit} turns", flush=True)
    doc: dict[str, Any] = {"env": args.env, "preset": args.preset, "turn_limit": args.turn_limit,
                           "eval_n": args.eval_n, "phase_steps": args.phase_steps, "warm": str(args.warm),
                           "machine": machine(), "warm_start": warm, "arms": {}}
    for arm in arms:
        seeds = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            if args.report_only and not (out / f"{arm}-s{seed}" / "summary.json").exists():
                continue
            s = run_arm(args, out, arm, seed)
            s["warm_start"] = warm
            seeds.append(s)
            print(f"{arm} seed {seed}: {sum(o['success'] for o in s['final'])}/{len(s['final'])} "
                  f"({s['wall_s']:.0f} s)", flush=True)
        if seeds:
            doc["arms"][arm] = {"recipe": arm_recipe(args, arm), "turn_limit": args.turn_limit,
                                "seeds": seeds, "report": arm_report(warm, seeds)}
    doc["arms"] = merge_arms(doc["arms"], [(p, json.loads(p.read_text())) for p in args.merge], args.turn_limit,
                             [o["task"] for o in warm])
    chosen = next((a for a in args.chosen.split(",") if a in doc["arms"]), None)
    if chosen:  # the chosen recipe's runs, at the top level as well
        doc["chosen_arm"] = chosen
        doc.update({k: doc["arms"][chosen][k] for k in ("recipe", "turn_limit", "seeds")})
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"rl-vs-warmstart-{args.env}-{args.preset}-{time.strftime('%Y%m%d')}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    stem.with_suffix(".md").write_text(table(doc))
    if doc["arms"]:
        plot(doc, stem.with_suffix(".png"))
    print(table(doc))
    print(f"wrote {stem}.json, .md, .png")


if __name__ == "__main__":
    main()
