"""The ScalingInter parent flow and its phase flow.

scalinginter (parent, MLflow parent run)
  eval before -> phase 1 -> phase 2 -> ... -> eval after
phase k (child flow, MLflow child run)
  spawn env servers -> per step: rollout batch -> advantages -> policy update -> checkpoint
  -> final checkpoint (its URI is the phase's result; the next phase starts from it)

Resume: a phase whose final checkpoint exists is skipped; a phase with step checkpoints resumes after the
last one (model, optimizer, RNG; the data position and turn limit are functions of the global step). Every
checkpoint holds the fingerprint of the training config; a resume with a different one is refused unless the
changed keys are in ``resume.allow_changes``. Step records after the resumed position are recorded once:
metrics.jsonl is cut back to the position, MLflow steps that have a value are not logged again.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow

from core.config import RunConfig
from core.redact import redact, redact_uri
from core.curriculum import Gate, GateState, Phase, gate_update, phase_start, total_steps, turn_limit_at
from core.fingerprint import ResumeMismatch, check_resume, default_values, fingerprint
from core.records import kept_metric_lines
from core.metrics import step_diagnostics
from flows.config import build_config
from core.walltime import format_breakdown
from core.evalreport import SCHEMA as EVAL_SCHEMA
from core.evalreport import BUCKETS, bucket_rates, compare_models, flat_metrics, format_p
from tasks import steps as T
from tasks import timing
from tasks.console import quiet_console, restore_console
from tasks.killpoint import kill_point
from tasks.checkpoint_store import (
    CheckpointCorrupted,
    checkpoint_exists,
    delete_checkpoint,
    is_s3_uri,
    join_uri,
    list_checkpoints,
    load_checkpoint,
    read_latest,
    write_latest,
)
from tasks.tracking import Tracker, default_tracking_uri


def resolve_run(cfg: RunConfig) -> RunConfig:
    """Give an unnamed run a name. Inside a Prefect flow run the name derives from the flow run (its name
    and id stay the same when the run is retried from the UI, so a retry finds and resumes the same run)."""
    if cfg.run_name:
        return cfg
    from prefect.runtime import flow_run

    fr_id, fr_name = flow_run.get_id(), flow_run.get_name()
    if fr_id and fr_name:
        suffix = f"{fr_name}-{str(fr_id)[:8]}"
    else:
        suffix = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cfg.model_copy(update={"run_name": f"{cfg.env.name}-{cfg.preset or 'custom'}-{suffix}"})


def run_dir(cfg: RunConfig) -> Path:
    d = Path(cfg.output_dir).resolve() / cfg.run_name
    d.mkdir(parents=True, exist_ok=True)
    return d


def recorded_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as a run records it (config.json, MLflow params, trainer_state.json): URI credentials redacted."""
    return redact(cfg.model_dump(mode="json"))


def write_run_config(rd: Path, cfg: RunConfig) -> Path:
    path = rd / "config.json"
    path.write_text(json.dumps(recorded_config(cfg), indent=2))
    return path


def checkpoint_root(cfg: RunConfig) -> str:
    root = cfg.checkpoint.root or str(Path(cfg.output_dir).resolve() / "checkpoints")
    return join_uri(root, cfg.run_name)


def cache_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir).resolve() / ".checkpoint-cache"


def make_tracker(cfg: RunConfig) -> Tracker:
    uri = default_tracking_uri(cfg.output_dir, cfg.tracking.uri)
    return Tracker(uri, cfg.tracking.experiment, artifact_root=Path(cfg.output_dir).resolve() / "mlartifacts")


def local_model_dir(cfg: RunConfig, ref: str) -> str:
    """A local HF folder for a model reference or a checkpoint URI. A checkpoint (local or S3) is verified against
    its manifest — sizes and sha256 of every file — on every load: a damaged file raises CheckpointCorrupted
    naming it."""
    from tasks.backends.model import resolve_model

    if is_s3_uri(ref) or (Path(ref) / "manifest.json").exists():
        return str(load_checkpoint(ref, cache_dir(cfg), verify_sha256=True))
    return resolve_model(ref)


def resume_source(cfg: RunConfig, plan: "PhasePlan", init_ref: str) -> tuple[str, str, bool]:
    """(ref, local dir, resumed?): the newest intact checkpoint of the phase — the one its pointer names, then
    older step checkpoints — else the previous phase's result ``init_ref``. A corrupted or truncated checkpoint
    is skipped with a warning naming the file, and the previous complete one is used."""
    pointed = read_latest(plan.phase_uri)
    candidates = [pointed] if pointed and checkpoint_exists(pointed) else []
    for uri in reversed(list_checkpoints(plan.phase_uri)):  # newest step first
        if uri.rstrip("/").rsplit("/", 1)[-1].startswith("step-") and uri.rstrip("/") not in {
                c.rstrip("/") for c in candidates}:
            candidates.append(uri)
    for uri in candidates:
        try:
            return uri, local_model_dir(cfg, uri), True
        except CheckpointCorrupted as e:
            print(f"warning: phase {plan.phase}: checkpoint {uri} is damaged ({e.reason}); falling back to the "
                  "previous complete checkpoint of the phase")
    return init_ref, local_model_dir(cfg, init_ref), False


def checkpoint_state(cfg: RunConfig, uri: str) -> dict[str, Any]:
    """The trainer_state.json of a complete checkpoint ({} when it has none). A local one is read in place; an
    S3 one is loaded (verified) into the cache, where the resume or evaluation that follows finds it."""
    d = Path(uri) if not is_s3_uri(uri) else Path(local_model_dir(cfg, uri))
    path = d / "trainer_state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def check_config(cfg: RunConfig, state: dict[str, Any], checkpoint: str) -> None:
    """Refuse to continue ``checkpoint`` (its trainer state ``state``) under a training config that differs
    from the one it was made with, unless every changed key is in ``resume.allow_changes``."""
    chk = check_resume(state.get("fingerprint"), fingerprint(recorded_config(cfg)), cfg.resume.allow_changes,
                       defaults=default_values())
    if chk.unchecked:
        print(f"warning: checkpoint {checkpoint} has no config fingerprint (written by an older version); "
              "resuming without checking that the training config is the same")
    if chk.refused:
        raise ResumeMismatch(cfg.run_name or "", checkpoint, chk.refused)
    if chk.allowed:
        print(f"resuming from {checkpoint} with allowed config changes (resume.allow_changes): "
              + "; ".join(str(c) for c in chk.allowed))


def check_run_resume(cfg: RunConfig) -> None:
    """Before a run writes anything: the newest checkpoint of the run (a phase's final or step checkpoint, last
    phase first) must have been made with the same training config (``check_config``). A damaged one is left
    to the phase's own resume, which falls back past it."""
    for k in range(len(cfg.curriculum.phases), 0, -1):
        plan = PhasePlan.of(cfg, k)
        uri = plan.final_uri if checkpoint_exists(plan.final_uri) else read_latest(plan.phase_uri)
        if uri and checkpoint_exists(uri):
            try:
                state = checkpoint_state(cfg, uri)
            except (CheckpointCorrupted, ValueError):
                continue
            check_config(cfg, state, uri)
            return


FAULT_ENV = "SCALINGINTER_FAULT_AFTER_STEP"


def inject_fault(global_step: int) -> None:
    """Test hook, outside the run config: with ``$SCALINGINTER_FAULT_AFTER_STEP=N`` the run fails right after
    global step N's checkpoint (to try resume and the Prefect UI's Retry)."""
    raw = os.environ.get(FAULT_ENV, "").strip()
    if not raw:
        return
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={raw!r} is not a step number: set it to a global step (e.g. 2) or unset it") from None
    if global_step == n:
        raise RuntimeError(f"fault injection: failing after global step {global_step} ({FAULT_ENV}={n})")


def fmt(metrics: dict[str, float], keys: list[str]) -> str:
    return " | ".join(f"{k} {metrics[k]:.3g}" for k in keys if k in metrics)


# --- phase flow ------------------------------------------------------------------------------------------
@flow(name="phase", flow_run_name="phase-{phase}", log_prints=True)
def phase_flow(config: RunConfig, phase: int, init_ref: str, parent_run_id: str | None = None) -> str:
    """Train one phase (``phase`` is 1-based). Returns the URI of the phase's final checkpoint."""
    cfg, plan = config, PhasePlan.of(config, phase)
    if checkpoint_exists(plan.final_uri):
        return finished_phase(cfg, plan, parent_run_id)
    tracker, run_id, key, status = make_tracker(cfg), None, None, "FAILED"
    try:  # the MLflow run and every resource are opened inside the try that ends them
        run_id = tracker.start_run(f"{cfg.run_name}/phase-{phase}", params=plan.params(), parent_id=parent_run_id,
                                   tags={"scalinginter.phase": str(phase)})
        key, prog = open_phase(cfg, plan, init_ref)
        urls = T.spawn_env_servers(key)
        rec = StepRecorder(cfg, plan, tracker, run_id, parent_run_id, position=prog.start + prog.done)
        ckpt = PhaseCheckpoints(cfg, plan, key)
        for i in range(prog.done, plan.steps):
            gstep, t0 = prog.start + i, time.time()
            limit = plan.limit_at(gstep)
            T.ensure_servers_alive(key)
            batch = T.rollout_batch(key, urls, gstep, limit)
            adv = T.compute_advantages(key, batch)
            upd = T.policy_update(key, batch, adv)
            rec.step(i, gstep, limit, batch, adv, upd, time.time() - t0)
            last = prog.advance(i, batch.metrics, rec)
            ckpt.save_if_due(i, last, prog.trainer_state(i, limit))
            inject_fault(gstep + 1)
            if last:
                break
        status = "FINISHED"
        return finish_phase(cfg, plan, tracker, run_id, prog, rec.last_metrics)
    finally:
        if run_id is not None:
            tracker.end_run(run_id, status)
        if key is not None:
            T.close_session(key)


@dataclass(frozen=True)
class PhasePlan:
    """Where a phase sits in the curriculum and where its checkpoints go."""

    phase: int  # 1-based
    turn_limit: int
    steps: int  # the phase's length (gated: its maximum)
    start: int  # global step of its first step (gated: the checkpoint's position wins)
    phases: tuple[Phase, ...]
    gated: bool
    root: str  # <checkpoint root>/<run>
    phase_uri: str
    final_uri: str

    @classmethod
    def of(cls, cfg: RunConfig, phase: int) -> "PhasePlan":
        phases = cfg.curriculum.as_phases()
        ph, root = phases[phase - 1], checkpoint_root(cfg)
        phase_uri = join_uri(root, f"phase-{phase}")
        return cls(phase, ph.turn_limit, ph.steps, phase_start(phases, phase - 1), tuple(phases),
                   cfg.curriculum.mode == "gated", root, phase_uri, join_uri(phase_uri, "final"))

    def limit_at(self, global_step: int) -> int:
        """steps mode: the curriculum is a pure function of the global step; gated: of the phase."""
        return self.turn_limit if self.gated else turn_limit_at(list(self.phases), global_step)

    def params(self) -> dict[str, Any]:
        return {"phase": self.phase, "turn_limit": self.turn_limit, "steps": self.steps, "start_step": self.start}

    def registry_tags(self, cfg: RunConfig, global_step: int) -> dict[str, str]:
        return {"phase": str(self.phase), "turn_limit": str(self.turn_limit), "run_name": cfg.run_name,
                "global_step": str(global_step)}


@dataclass
class PhaseProgress:
    """The resume position (phase steps done, the phase's first global step) and the gate's bookkeeping."""

    plan: PhasePlan
    cfg: RunConfig
    done: int = 0
    start: int = 0
    gate: Gate | None = None
    gstate: GateState = field(default_factory=GateState)
    reason: str | None = None  # why a gated phase ended

    def advance(self, i: int, roll: dict[str, float], rec: "StepRecorder") -> bool:
        """Phase step ``i`` is done; True when the phase ends after it (its last step, or the gate closed)."""
        self.done = i + 1
        if self.gate is None:
            return self.done == self.plan.steps
        self.gstate, self.reason = gate_update(self.gate, self.gstate, float(roll.get("success_rate", 0.0)),
                                               self.plan.steps)
        if self.reason is not None:
            rec.transition(self.start + self.done, self.done, self.reason, self.gstate)
        return self.reason is not None or self.done == self.plan.steps

    def trainer_state(self, i: int, limit: int) -> dict[str, Any]:
        state = {"global_step": self.start + i + 1, "phase": self.plan.phase, "phase_step": i + 1,
                 "turn_limit": limit, "run_name": self.cfg.run_name,
                 "config": recorded_config(self.cfg),  # no URI credentials in checkpoints
                 "fingerprint": fingerprint(recorded_config(self.cfg))}  # what a resume must match
        if self.gate is not None:
            state["gate"] = self.gstate.to_dict()
            if self.reason is not None:
                state["gate_reason"] = self.reason
        return state


def open_phase(cfg: RunConfig, plan: PhasePlan, init_ref: str) -> tuple[str, PhaseProgress]:
    """Load the learner from the phase's last step checkpoint (resume) or the previous phase's result, and
    restore the optimizer, RNG, position and gate state from a checkpoint. Returns the session key."""
    src, model_dir, resumed = resume_source(cfg, plan, init_ref)
    if resumed:  # before the model loads: a mismatched config fails fast
        state_file = Path(model_dir) / "trainer_state.json"
        check_config(cfg, json.loads(state_file.read_text()) if state_file.exists() else {}, src)
    key = T.open_session(cfg, model_dir, train=True, reference_dir=local_model_dir(cfg, cfg.model.path))
    prog = PhaseProgress(plan, cfg, start=plan.start, gate=Gate(**cfg.curriculum.gate.model_dump()) if plan.gated else None)
    if src != cfg.model.path:  # a checkpoint: restore optimizer, RNG and position
        try:
            state = T.get_session(key).learner.load_training_state(Path(model_dir), weights=False)
        except BaseException:
            T.close_session(key)
            raise
        if resumed:
            prog.done = int(state.get("phase_step", 0))
            prog.gstate = GateState.from_dict(state.get("gate"))
            print(f"phase {plan.phase}: resuming after step {prog.done}/{plan.steps} from {src}")
        if plan.gated:  # phases have data-dependent lengths: the position comes from the checkpoint
            prog.start = int(state.get("global_step", 0)) - prog.done
    return key, prog


def finish_phase(cfg: RunConfig, plan: PhasePlan, tracker: Tracker, run_id: str, prog: PhaseProgress,
                 metrics: dict[str, float] | None) -> str:
    """Register the phase's final checkpoint as a model version and publish the phase's artifact."""
    kill_point("register")  # test hook (tasks.killpoint): a no-op unless $SCALINGINTER_KILL_AT names it
    tracker.set_tag(run_id, "scalinginter.final_checkpoint", plan.final_uri)
    version = tracker.register_checkpoint(cfg.env.name, plan.final_uri, run_id,
                                          plan.registry_tags(cfg, prog.start + prog.done))
    print(f"phase {plan.phase}: registered {plan.final_uri} as model scalinginter-{cfg.env.name} version {version}")
    _phase_artifact(cfg, plan.phase, prog.done, prog.start + prog.done, metrics, plan.final_uri, run_id)
    return plan.final_uri


def finished_phase(cfg: RunConfig, plan: PhasePlan, parent_run_id: str | None) -> str:
    """A phase whose final checkpoint exists is skipped; if the earlier run stopped between that checkpoint and
    its registration, the registration is repaired and the phase's MLflow run finished (tagged with the final
    checkpoint), as an uninterrupted run leaves them."""
    state = checkpoint_state(cfg, plan.final_uri)
    check_config(cfg, state, plan.final_uri)
    gstep, done = final_position(plan, state)
    print(f"phase {plan.phase}: final checkpoint exists ({plan.final_uri}, global step {gstep}); skipping")
    tracker = make_tracker(cfg)
    run_id = tracker.find_run(f"{cfg.run_name}/phase-{plan.phase}", parent_run_id)
    if run_id is not None:  # registration is the step after the final checkpoint: make sure it happened
        version = tracker.ensure_registered(cfg.env.name, plan.final_uri, run_id, plan.registry_tags(cfg, gstep))
        if version is not None:
            print(f"phase {plan.phase}: registered {plan.final_uri} as model scalinginter-{cfg.env.name} version "
                  f"{version} (the earlier run stopped before registering it)")
        if tracker.client.get_run(run_id).info.status != "FINISHED":  # its process died after the final checkpoint
            tracker.set_tag(run_id, "scalinginter.final_checkpoint", plan.final_uri)
            tracker.end_run(run_id, "FINISHED")
    _phase_artifact(cfg, plan.phase, done, gstep, None, plan.final_uri, None,
                    note="Skipped: the final checkpoint of this phase exists (resumed run).")
    return plan.final_uri


def final_position(plan: PhasePlan, state: dict[str, Any]) -> tuple[int, int]:
    """(global step, phase steps done) of a phase's final checkpoint: its own trainer state's (a gated phase
    ends early, so the plan's ``start + steps`` is only the fallback for a checkpoint without one)."""
    try:
        return int(state["global_step"]), int(state.get("phase_step", plan.steps))
    except (KeyError, TypeError, ValueError):
        return plan.start + plan.steps, plan.steps


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
        T.write_rollout_parquet(trajs, self.dir / "rollouts" / f"step-{gstep + 1:06d}.parquet", plan.phase, gstep)
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


# --- evaluation ------------------------------------------------------------------------------------------
def evaluate_model(cfg: RunConfig, ref: str, n: int | None = None, turn_limit: int | None = None,
                   episodes_path: Path | None = None) -> dict[str, Any]:
    """The held-out evaluation document (flows.evaluate; greedy, the run's env options) of a model. Before and
    after training it is the same tasks and seeds, so the two can be paired."""
    from flows.evaluate import evaluate

    return evaluate(cfg, ref, split="test", n=n or cfg.eval.n, samples=1, turn_limits=[turn_limit or cfg.eval_turn_limit],
                    seed=cfg.seed, env_options=cfg.env.options,
                    max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, episodes_path=episodes_path)


# --- parent flow -----------------------------------------------------------------------------------------
def _cached_eval(cfg: RunConfig, path: Path, ref: str) -> dict[str, Any]:
    """The evaluation document of ``ref`` (written to ``path``; a resumed run reads it back)."""
    if path.exists():
        doc = json.loads(path.read_text())
        if doc.get("schema") == EVAL_SCHEMA:  # an older run's flat metrics are scored again
            return doc
    doc = evaluate_model(cfg, ref, episodes_path=path.with_suffix(".parquet"))  # the viewer lists its episodes
    path.write_text(json.dumps(doc, indent=2))
    return doc


def _phase_end_step(cfg: RunConfig, phase: int, ref: str) -> int:
    """The global step at which ``phase`` ended: its checkpoint's own (gated phases end early), else the plan's."""
    state = Path(ref) / "trainer_state.json"
    if state.exists():
        try:
            return int(json.loads(state.read_text())["global_step"])
        except (ValueError, KeyError):
            pass
    phases = cfg.curriculum.as_phases()
    return phase_start(phases, phase - 1) + phases[phase - 1].steps


def _phase_eval(cfg: RunConfig, tracker: Tracker, parent: str, phase: int, ref: str) -> None:
    """eval.each_phase: the phase's final on the run's held-out tasks, a point of the held-out learning curve."""
    step = _phase_end_step(cfg, phase, ref)
    print(f"evaluating phase {phase}'s final model on {cfg.eval.n} held-out tasks ({cfg.eval_turn_limit} turns)")
    doc = _cached_eval(cfg, run_dir(cfg) / f"eval_phase-{phase}.json", ref)
    doc["global_step"] = step
    (run_dir(cfg) / f"eval_phase-{phase}.json").write_text(json.dumps(doc, indent=2))
    m = flat_metrics(doc)
    tracker.log_metrics_once(parent, {"heldout/success_rate": m["success_rate"]}, step=step)
    print(f"phase {phase} held-out: " + fmt(m, ["success_rate", "success_rate_ci_low", "success_rate_ci_high"]))


def paired_eval(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """After vs before on the same tasks and seeds (exact McNemar on the greedy outcomes, paired bootstrap interval
    of the difference) at the eval budget; None unless both exist on the same tasks."""
    if not before or not after or before["task_ids"] != after["task_ids"] or before["seed"] != after["seed"]:
        return None
    cmp = compare_models(after["models"]["model"], before["models"]["model"], after["samples"], after["confidence"],
                         after["seed"])
    return next(iter(cmp.values()))["overall"] if cmp else None


@flow(name="scalinginter", log_prints=True)
def scalinginter(config: RunConfig | None = None, env: str = "babyai", preset: str | None = "smoke",
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """A ScalingInter curriculum: phases of growing turn limits, each starting from the previous one.

    Pass a full ``config``, or ``env`` + ``preset`` + ``overrides`` (``key=value`` strings).

    Args:
        config: A full typed run config (every field has a default and a description). When given, env,
            preset and overrides are ignored.
        env: Registered environment (babyai, textcraft, sciworld, webarena, searchqa, miniwob, toy).
        preset: Preset of the env (envs/<env>/presets.py): smoke (CPU demo), paper (the paper's schedule),
            tiny (babyai: the smallest real run). Empty = the config defaults.
        overrides: Config overrides as key.path=value strings, e.g. rollout.temperature=0.7 or
            run_name=my-run (the same run name resumes a run).
    """
    cfg = resolve_run(config or build_config(env, preset, overrides))
    if cfg.checkpoint.s3_block:
        from tasks.s3_block import apply_s3_block

        print(f"S3 settings from Prefect block {cfg.checkpoint.s3_block!r}: {', '.join(apply_s3_block(cfg.checkpoint.s3_block))}")
    phases = cfg.curriculum.as_phases()
    rd = run_dir(cfg)
    t_run = time.time()
    ledger = timing.reset()
    check_run_resume(cfg)  # a reused run name with another training config stops here, before anything is written
    log_path = quiet_console(rd)  # engine / library chatter -> the run's engine.log
    write_run_config(rd, cfg)  # no URI secrets
    tracker = make_tracker(cfg)
    parent = tracker.start_run(cfg.run_name, params=recorded_config(cfg), tags={"scalinginter.env": cfg.env.name})
    print(f"ScalingInter run {cfg.run_name}: env {cfg.env.name}, model {cfg.model.path}, "
          f"turn limits {' -> '.join(str(p.turn_limit) for p in phases)}, {total_steps(phases)} steps; "
          f"MLflow run {parent} ({redact_uri(tracker.uri)})")
    if log_path is not None:
        print(f"engine, transformers, DeepSpeed, MLflow and Prefect logs: {log_path} (SCALINGINTER_VERBOSE=1 shows "
              "them here)")
    status = "FAILED"
    from tasks.backends.vllm_backend import keep_engines

    engines = keep_engines().open()  # one vLLM engine for the run: phases and evaluations reuse it
    try:
        before = before_doc = after_doc = None
        if cfg.eval.before:
            print(f"evaluating the initial model on {cfg.eval.n} held-out tasks (greedy, "
                  f"{cfg.eval_turn_limit} turns)")
            before_doc = _cached_eval(cfg, rd / "eval_before.json", cfg.model.path)
            before = flat_metrics(before_doc)
            tracker.log_metrics_once(parent, {f"eval_before/{k}": v for k, v in before.items()}, step=0)
            print("before: " + fmt(before, ["success_rate", "success_rate_ci_low", "success_rate_ci_high",
                                            "mean_reward", "mean_turns"]))
        if before is not None:
            tracker.log_metrics_once(parent, {"heldout/success_rate": before["success_rate"]}, step=0)
        ref = cfg.model.path
        for k in range(len(phases)):
            ref = phase_flow(cfg, k + 1, ref, parent)
            if cfg.eval.each_phase and not (cfg.eval.after and k + 1 == len(phases)):
                _phase_eval(cfg, tracker, parent, k + 1, ref)
        after = None
        if cfg.eval.after:
            print(f"evaluating the final model on {cfg.eval.n} held-out tasks")
            after_doc = _cached_eval(cfg, rd / "eval_after.json", ref)
            after = flat_metrics(after_doc)
            tracker.log_metrics_once(parent, {f"eval_after/{k}": v for k, v in after.items()},
                                     step=total_steps(phases))
            tracker.log_metrics_once(parent, {"heldout/success_rate": after["success_rate"]},
                                     step=_phase_end_step(cfg, len(phases), ref))
        paired = paired_eval(before_doc, after_doc)
        if paired is not None:
            tracker.log_metrics_once(parent, {"eval_after/diff_vs_before": paired["diff"],
                                              "eval_after/p_value_vs_before": paired["p_value"]},
                                     step=total_steps(phases))
        tracker.set_tag(parent, "scalinginter.final_checkpoint", ref)
        summary = {"run_name": cfg.run_name, "mlflow_run_id": parent, "mlflow_uri": redact_uri(tracker.uri),
                   "final_checkpoint": ref, "eval_before": before, "eval_after": after, "eval_paired": paired}
        by_turns = {"before": bucket_rates(before_doc), "after": bucket_rates(after_doc)}
        if by_turns["before"] or by_turns["after"]:  # the env labels its tasks with the turns an expert needs
            summary["eval_required_turns"] = by_turns
        wall = time.time() - t_run
        summary["wall_time_s"] = round(wall, 1)
        summary["wall_time_breakdown_s"] = ledger.breakdown(wall)  # where the time went (core.walltime)
        (rd / "summary.json").write_text(json.dumps(summary, indent=2))
        print(summary_table(summary, cfg))
        print(format_breakdown(summary["wall_time_breakdown_s"], wall))
        status = "FINISHED"
        return summary
    finally:
        try:
            engines.close()  # the run's engine is shut down here
        finally:
            tracker.end_run(parent, status)
            restore_console()


def summary_table(summary: dict[str, Any], cfg: RunConfig) -> str:
    from core.trajview import viewer_url

    b, a = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    rows = [("success rate", "success_rate"), ("mean reward", "mean_reward"), ("mean turns", "mean_turns")]
    title = (f"held-out {cfg.env.name} tasks (n={cfg.eval.n}, greedy, {cfg.eval_turn_limit} turns; "
             "success with its 95% Wilson interval)")
    lines = ["", title, f"{'':<14}{'before':>24}{'after':>24}"]

    def cell(m: dict[str, Any], key: str) -> str:
        if key not in m:
            return "-"
        if key == "success_rate" and "success_rate_ci_low" in m:
            return f"{m[key]:.3f} [{m['success_rate_ci_low']:.3f}, {m['success_rate_ci_high']:.3f}]"
        return f"{m[key]:.3f}"

    for label, key in rows:
        lines.append(f"{label:<14}{cell(b, key):>24}{cell(a, key):>24}")
    by_turns = summary.get("eval_required_turns") or {}
    for k in BUCKETS:  # success per required-turns bucket (the fewest turns the env's expert needs)
        rb, ra = (by_turns.get(side, {}).get(k) for side in ("before", "after"))
        if rb is None and ra is None:
            continue

        def rate(r: dict[str, Any] | None) -> str:
            return "-" if r is None or r["value"] is None else f"{r['value']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"

        n = (ra or rb)["tasks"]
        lines.append(f"{f'needs {k} ({n})':<14}{rate(rb):>24}{rate(ra):>24}")
    p = summary.get("eval_paired")
    if p and p.get("diff") is not None:
        lines.append(f"after - before: {p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] on the same "
                     f"{p['tasks']} tasks and seeds; McNemar p = {format_p(p['p_value'])} ({p.get('a_better', 0)} "
                     f"tasks solved only after, {p.get('b_better', 0)} only before)")
    lines += [f"MLflow run id:    {summary['mlflow_run_id']}  ({summary['mlflow_uri']})",
              f"final checkpoint: {summary['final_checkpoint']}",
              f"trajectories:     {viewer_url(cfg.run_name)}  (scalinginter view --runs-dir {cfg.output_dir})", ""]
    return "\n".join(lines)
