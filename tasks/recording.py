"""Where a step's results go (MLflow, metrics.jsonl, Parquet, the printed line) and where a phase's checkpoints
go (step checkpoints, the final, the pointers, pruning); each global step is recorded once, also after a resume."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from core.config import RunConfig
from core.curriculum import GateState, total_steps
from core.metrics import step_diagnostics
from core.records import kept_metric_lines
from storage.checkpoint_store import delete_checkpoint, join_uri, read_latest, write_latest
from storage.tracking import Tracker
from tasks import steps as T
from tasks.resume import PhasePlan
from tasks.runs import run_dir


def fmt(metrics: dict[str, float], keys: list[str]) -> str:
    return " | ".join(f"{k} {metrics[k]:.3g}" for k in keys if k in metrics)




class StepRecorder:
    """Where a step's results go: the phase's MLflow run (and the parent's headline metrics), metrics.jsonl,
    sample trajectories as an MLflow artifact, every episode as Parquet, and one printed line.

    Each global step is recorded once, also when it runs again after a resume (core.records): opening at
    ``position`` (the global step the phase resumes from) cuts metrics.jsonl back to it, MLflow metrics are
    logged only at steps that have no value yet, Parquet files and artifacts are replaced by name."""

    HEADLINE = ("mean_reward", "success_rate", "mean_turns")

    def __init__(self, cfg: RunConfig, plan: PhasePlan, tracker: Tracker, run_id: str, parent_run_id: str | None,
                 position: int = 0):
        self.cfg, self.plan, self.tracker, self.run_id, self.parent_run_id = cfg, plan, tracker, run_id, parent_run_id
        self.dir = run_dir(cfg)
        self.last_metrics: dict[str, float] | None = None
        trim_metrics_file(self.dir / "metrics.jsonl", position)

    def step(self, i: int, gstep: int, limit: int, batch: T.Batch, adv: T.Advantages, upd: dict[str, float],
             step_time_s: float) -> dict[str, float]:
        cfg, plan, roll, trajs = self.cfg, self.plan, batch.metrics, batch.trajectories
        metrics = {**roll, **adv.stats, **{f"train/{k}": v for k, v in upd.items()}, "turn_limit": float(limit),
                   "step_time_s": step_time_s, **step_diagnostics(trajs, adv.advantages, limit)}
        self.tracker.log_metrics_once(self.run_id, metrics, step=gstep)
        if self.parent_run_id:
            self.tracker.log_metrics_once(self.parent_run_id, {k: metrics[k] for k in self.HEADLINE}, step=gstep)
        if cfg.tracking.log_trajectories:
            self.tracker.log_text(self.run_id, T.trajectories_text(trajs, cfg.tracking.log_trajectories),
                                  f"trajectories/step-{gstep + 1:06d}.json")
        with open(self.dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"global_step": gstep + 1, "phase": plan.phase, **metrics}) + "\n")
        T.write_rollout_parquet(trajs, self.dir / "rollouts" / f"step-{gstep + 1:06d}.parquet", plan.phase, gstep,
                                advantages=adv.advantages)
        print(f"phase {plan.phase}/{len(plan.phases)} step {i + 1}/{plan.steps} (global {gstep + 1}/"
              f"{total_steps(list(plan.phases))}) turns<={limit} | episodes {int(roll['episodes'])} | "
              + fmt(metrics, ["mean_reward", "success_rate", "mean_turns", "gen_tokens_per_s",
                              "env_steps_per_s", "train/loss", "train/kl", "train/entropy"])
              + _diag_text(metrics) + f" | {step_time_s:.1f}s", flush=True)
        self.last_metrics = metrics
        return metrics

    def transition(self, global_step: int, phase_steps: int, reason: str, gstate: GateState) -> None:
        """A gated phase ended: an MLflow event (metric + tags + JSON artifact) on the phase and parent runs."""
        phase = self.plan.phase
        event = {"event": "phase_transition", "phase": phase, "global_step": global_step,
                 "phase_steps": phase_steps, "reason": reason, "smoothed_success": gstate.best,
                 "history": list(gstate.history)}
        print(f"phase {phase}: gated transition after {phase_steps} steps ({reason}; "
              f"best smoothed success {gstate.best:.3f})")
        for rid in filter(None, (self.run_id, self.parent_run_id)):
            self.tracker.log_metrics_once(rid, {"curriculum/transition_phase": float(phase)}, step=global_step)
            self.tracker.set_tag(rid, f"scalinginter.phase_{phase}.end", f"{reason} at step {global_step}")
        self.tracker.log_text(self.run_id, json.dumps(event, indent=2), f"events/phase-{phase}-transition.json")


def _diag_text(m: dict[str, float]) -> str:
    """The step line's short stability part: invalid and repeated actions, turns used of the limit, groups
    without signal (``core.metrics.step_diagnostics``)."""
    parts = [(label, m.get(key)) for label, key in (("inv", "diag/invalid_action_rate"),
                                                    ("rep", "diag/repeated_action_rate"),
                                                    ("used", "diag/turns_used_frac"),
                                                    ("0-adv", "diag/zero_adv_group_frac"))]
    parts = [f"{label} {v:.2f}" for label, v in parts if v is not None]
    return f" | {' '.join(parts)}" if parts else ""


def trim_metrics_file(path: Path, position: int) -> None:
    """Drop the lines of ``metrics.jsonl`` after global step ``position`` (steps about to run again) and any
    torn line; rewritten atomically (temporary file, then rename), and only when something is dropped."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = kept_metric_lines(lines, position)
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    print(f"{path}: dropped {len(lines) - len(kept)} line(s) after global step {position} (they run again)")


class PhaseCheckpoints:
    """Step checkpoints every ``checkpoint.every_n_steps`` and the phase's final one; the phase pointer (or the
    run's ``latest`` for a final) moves to each, and the superseded step checkpoint is pruned after."""

    def __init__(self, cfg: RunConfig, plan: PhasePlan, key: str):
        self.cfg, self.plan, self.key = cfg, plan, key

    def save_if_due(self, i: int, last: bool, state: dict[str, Any]) -> str | None:
        if not (last or (i + 1) % self.cfg.checkpoint.every_n_steps == 0):
            return None
        prev = read_latest(self.plan.phase_uri)
        if last:
            out = T.save_step_checkpoint(self.key, self.plan.final_uri, state)
            write_latest(self.plan.root, out)
        else:
            out = T.save_step_checkpoint(self.key, join_uri(self.plan.phase_uri, f"step-{i + 1:06d}"), state,
                                         latest_of=self.plan.phase_uri)
        _prune(self.cfg, prev, out)
        return out


def _phase_artifact(cfg: RunConfig, phase: int, steps_done: int, global_step: int,
                    metrics: dict[str, float] | None, uri: str, run_id: str | None, note: str = "") -> None:
    from tasks.artifacts import artifact_key, phase_markdown, publish_markdown

    phases = cfg.curriculum.as_phases()
    md = phase_markdown(cfg.run_name, phase, len(phases), phases[phase - 1].turn_limit, steps_done,
                        phases[phase - 1].steps, global_step, metrics, uri, run_id, note)
    publish_markdown(artifact_key(cfg.run_name, f"phase-{phase}"), md,
                     f"ScalingInter {cfg.run_name} phase {phase}: steps, reward, success, turns, checkpoint")


def _prune(cfg: RunConfig, prev: str | None, current: str) -> None:
    """Delete the superseded step checkpoint ``prev`` (local or S3) once ``current`` is complete.

    Called only after ``current`` and the pointer to it are written, so a crash at any point leaves a
    complete checkpoint to resume from. Phase finals are never pruned (they are registered models).
    """
    if cfg.checkpoint.keep_step_checkpoints or not prev or prev == current:
        return
    if not prev.rstrip("/").rsplit("/", 1)[-1].startswith("step-"):
        return
    try:
        delete_checkpoint(prev)
    except Exception as exc:  # noqa: BLE001 - disk space is not worth failing a finished step over
        print(f"warning: could not delete the superseded checkpoint {prev}: {exc}")


