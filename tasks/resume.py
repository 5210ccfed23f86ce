"""Where a run resumes: a phase's plan (its turn limit, steps, first global step, checkpoint URIs), the newest
intact checkpoint to continue from, the config check a resume must pass, and the phase's progress (position and
gate state) as a checkpoint records it. The fault-injection test hook lives here too."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.config import RunConfig
from core.curriculum import Gate, GateState, Phase, gate_update, phase_start, turn_limit_at
from core.fingerprint import ResumeMismatch, check_resume, default_values, fingerprint
from storage.checkpoint_store import (
    CheckpointCorrupted,
    checkpoint_exists,
    is_s3_uri,
    join_uri,
    list_checkpoints,
    read_latest,
)
from tasks.runs import checkpoint_root, local_model_dir, recorded_config

if TYPE_CHECKING:
    from tasks.recording import StepRecorder


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

    def advance(self, i: int, roll: dict[str, float], rec: StepRecorder) -> bool:
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


def final_position(plan: PhasePlan, state: dict[str, Any]) -> tuple[int, int]:
    """(global step, phase steps done) of a phase's final checkpoint: its own trainer state's (a gated phase
    ends early, so the plan's ``start + steps`` is only the fallback for a checkpoint without one)."""
    try:
        return int(state["global_step"]), int(state.get("phase_step", plan.steps))
    except (KeyError, TypeError, ValueError):
        return plan.start + plan.steps, plan.steps


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
