"""The training config a checkpoint was made with, and whether a resume may continue it.

Every checkpoint's trainer state holds a fingerprint: the training-relevant settings (the model, env and its
options, algorithm, rollout, curriculum, learner engine and seed) as dotted keys with their values, and a
sha256 over them. Where results go (eval, tracking, output and checkpoint paths) and operational settings that
do not change what is trained (the address and number of env servers, timeouts, threads, generation batching,
the vLLM cache size) are left out. A resume compares the checkpoint's fingerprint with the current config and
refuses differences the user did not allow (``resume.allow_changes``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from core.config import ConfigError

FINGERPRINT_VERSION = 1
TRAINING_SECTIONS = ("model", "env", "algo", "rollout", "curriculum", "learner", "seed")
OPERATIONAL_KEYS = frozenset({
    "env.url", "env.num_servers", "env.runtime", "env.image", "env.request_timeout_s", "model.threads",
    "rollout.gen_batch_size", "rollout.max_live_episodes", "rollout.vllm_kv_cache_gb", "rollout.vllm_kv_budget_gb",
    # how the work is scheduled, not what is trained: episodes stepped one by one or in lock-step (same seeds), and
    # how a mini-batch is cut into forwards and padded (the loss weights are the whole mini-batch's;
    # tests/test_learning.py)
    "rollout.async_episodes", "algo.micro_batch_tokens", "algo.length_buckets",
    # a group's prompt run once or with each row: the same log-probs and gradients (its default follows the device)
    "algo.share_prefix",
    # an expert relabel run as a branch of its episode's forward or as its own sequence: the same loss and gradients
    "algo.expert_branches",
    # what the engine hands back to the OS while the learner updates (it generates the same tokens either way)
    "rollout.vllm_release_kv", "rollout.vllm_release_weights",
    # the transformers engine's kept keys and values: the prompt's tail run against them or the whole prompt again
    "rollout.kv_reuse_gib",
    # where it runs: env servers' addresses, the device, the engine's GPU share and sharding, the learner's nodes
    "env.urls", "rollout.engine_urls", "rollout.engine_sync_dir", "model.device", "rollout.gpu_memory_utilization", "rollout.tensor_parallel_size", "rollout.vllm_sleep",
    "learner.nodes", "learner.node_rank", "learner.master_addr", "learner.master_port",
})


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()  # a key one side of a diff does not have


def _flatten(value: Any, key: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):  # an empty section adds no key: {} -> {"a": 1} is one added key, not two
        for k, v in value.items():
            _flatten(v, f"{key}.{k}", out)
    else:
        out[key] = value


def training_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The training-relevant settings of a run config (its JSON form) as ``{dotted key: value}``; lists (such
    as ``curriculum.phases``) are one value."""
    flat: dict[str, Any] = {}
    for section in TRAINING_SECTIONS:
        if section in config:
            _flatten(config[section], section, flat)
    return {k: v for k, v in sorted(flat.items()) if k not in OPERATIONAL_KEYS}


def fingerprint(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores: the format version, the training values and their sha256."""
    values = training_values(config)
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"version": FINGERPRINT_VERSION, "sha256": digest, "values": values}


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        def show(v: Any) -> str:
            return repr(v) if v is ABSENT else json.dumps(v)

        return f"{self.key}: {show(self.old)} -> {show(self.new)}"


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The keys whose values differ (present on one side only included), sorted by key."""
    return [Change(k, old.get(k, ABSENT), new.get(k, ABSENT)) for k in sorted(set(old) | set(new))
            if old.get(k, ABSENT) != new.get(k, ABSENT)]


def is_allowed(key: str, allow: Iterable[str]) -> bool:
    """``key`` is named in ``allow`` itself or under a named section (``env.options`` allows ``env.options.x``)."""
    return any(key == a or key.startswith(a + ".") for a in allow)


@dataclass(frozen=True)
class ResumeCheck:
    refused: list[Change] = field(default_factory=list)
    allowed: list[Change] = field(default_factory=list)
    unchecked: bool = False  # the checkpoint has no fingerprint (written before they existed)


def default_values() -> dict[str, Any]:
    """The training values of a config left at its defaults (what a key a checkpoint predates meant then)."""
    from core.config import RunConfig

    return training_values(RunConfig().model_dump(mode="json"))


def check_resume(stored: Mapping[str, Any] | None, current: Mapping[str, Any],
                 allow: Iterable[str] = (), defaults: Mapping[str, Any] | None = None) -> ResumeCheck:
    """Compare a checkpoint's fingerprint ``stored`` with the current config's ``current`` (both as made by
    ``fingerprint``); differences under a key in ``allow`` are allowed, the others refused. A setting added after
    the checkpoint was written (absent from it) is no change while the current value is its default
    (``defaults``, e.g. ``default_values()``): the checkpoint was trained with what that default does. A key an
    older checkpoint recorded that is operational now (``OPERATIONAL_KEYS``) is no change either."""
    if not stored or "values" not in stored:
        return ResumeCheck(unchecked=True)
    if stored.get("sha256") == current.get("sha256"):
        return ResumeCheck()
    allow = list(allow)
    # a key made operational after the checkpoint was written is in its values but no longer counts
    changes = [c for c in diff(stored["values"], current["values"]) if c.key not in OPERATIONAL_KEYS]
    if defaults is not None:
        changes = [c for c in changes if not (c.old is ABSENT and c.key in defaults and c.new == defaults[c.key])]
    return ResumeCheck(refused=[c for c in changes if not is_allowed(c.key, allow)],
                       allowed=[c for c in changes if is_allowed(c.key, allow)])


class ResumeMismatch(ConfigError):
    """A run resumed with a training config that differs from its checkpoint's."""

    def __init__(self, run_name: str, checkpoint: str, changes: list[Change]):
        self.changes = changes
        keys = ",".join(c.key for c in changes)
        lines = [f"run {run_name!r} cannot resume: its checkpoint {checkpoint} was trained with a different config "
                 f"({len(changes)} training setting{'s' if len(changes) != 1 else ''} changed, old -> new):"]
        lines += [f"  {c}" for c in changes]
        lines.append(f"Either start a new run (--run-name NEW_NAME), or continue this one under the new values: "
                     f"--set 'resume.allow_changes=[{keys}]'")
        super().__init__("\n".join(lines))
