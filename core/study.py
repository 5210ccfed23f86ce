"""The ScalingInter-vs-fixed-horizon study, as pure functions (no Prefect, no disk).

The arms train for the same number of steps with the same episodes per step and differ only in the turn
limit of each phase, or (``scalinginter-gigpo``) in the advantage estimator:

- ``scalinginter``: the curriculum as given (growing limits, e.g. 2 -> 3 -> 4);
- ``fixed-short``: every phase at the first phase's limit;
- ``fixed-long``: every phase at the last phase's limit;
- ``scalinginter-gigpo``: the ScalingInter curriculum trained with GiGPO's per-turn advantage
  (``algo.estimator=gigpo``: the episode advantage plus a step advantage among the group's turns that acted on
  the same observation), the arm's own config overrides (``arm_overrides``).

The phase boundaries stay the same in every arm, so each arm has a checkpoint at the same global steps
and the held-out curve of every arm is measured at the same points.

Results by required turns: an env that labels its tasks with the fewest turns its expert needs (BabyAI) puts each
held-out task in a bucket (``core.evalreport.BUCKETS``: 1, 2-3, 4-6, 7+); ``bucket_indices`` / ``bucket_stats``
break per-task outcomes down by it. ``phase_means`` / ``mean_of_dicts`` average a run's per-step stability
diagnostics (``diag/*`` in ``metrics.jsonl``) over each phase and over seeds.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from core.evalreport import BUCKETS, required_turns_bucket
from core.stats import mcnemar_exact, seed_task_bootstrap, wilson_interval

ARMS = ("scalinginter", "fixed-short", "fixed-long", "scalinginter-gigpo", "scalinginter-fit")
DEFAULT_ARMS = ("scalinginter", "fixed-short", "fixed-long")  # the study command's --arms default
_OVERRIDES = {"scalinginter-gigpo": ("algo.estimator=gigpo",),  # needs rollout.samples_per_task >= 2 (groups)
              "scalinginter-fit": ("rollout.task_filter=fits_turns",)}  # needs an env with a scripted expert
ARM_HELP = {  # what each arm is, for the command's --help
    "scalinginter": "the preset's curriculum as given: turn limits growing phase by phase (e.g. 3 -> 6 -> 10)",
    "fixed-short": "every phase at the first phase's turn limit (same steps and episodes)",
    "fixed-long": "every phase at the last phase's turn limit (same steps and episodes)",
    "scalinginter-gigpo": "the ScalingInter curriculum trained with GiGPO (algo.estimator=gigpo: the episode "
                          "advantage plus a step advantage among the group's turns from the same observation)",
    "scalinginter-fit": "the ScalingInter curriculum with each phase's training tasks matched to its limit: drawn among "
                        "those the env's expert solves within the phase's turn limit (rollout.task_filter=fits_turns)",
}


def _check_arm(arm: str) -> None:
    if arm not in ARMS:
        raise ValueError(f"unknown study arm {arm!r}; choose from {', '.join(ARMS)}")


def arm_phases(phases: list[dict], arm: str) -> list[dict]:
    """The curriculum of one arm, from the ScalingInter one (a list of ``{"turn_limit", "steps"}``)."""
    if not phases:
        raise ValueError("the study needs a curriculum with at least one phase")
    _check_arm(arm)
    if arm.startswith("scalinginter"):  # scalinginter, -gigpo, -fit: the curriculum's own limits
        limit = None
    elif arm == "fixed-short":
        limit = phases[0]["turn_limit"]
    else:  # fixed-long
        limit = phases[-1]["turn_limit"]
    return [{"turn_limit": p["turn_limit"] if limit is None else limit, "steps": p["steps"]} for p in phases]


def arm_overrides(arm: str) -> list[str]:
    """The config overrides (``key.path=value``) that make an arm besides its turn limits; applied after the
    user's, so the arm's win."""
    _check_arm(arm)
    return list(_OVERRIDES.get(arm, ()))


def shared_phases(phases: list[dict], arm: str, other: str) -> int:
    """How many leading phases ``arm`` trains exactly as ``other`` does: the same turn limits and steps phase by
    phase, and the same overrides (``arm_overrides``). Such phases, with one seed and one starting model, are the
    same training (the rest of the curriculum is not read before its phase starts), so one arm's phase finals can
    stand for the other's. Never the whole run: two arms that agree on every phase would be one arm."""
    if arm == other or arm_overrides(arm) != arm_overrides(other):
        return 0
    mine, theirs = arm_phases(phases, arm), arm_phases(phases, other)
    n = 0
    while n < min(len(mine), len(theirs)) - 1 and mine[n] == theirs[n]:
        n += 1
    return n


def phase_donors(phases: list[dict], arm: str, arms: Iterable[str] = ARMS) -> list[tuple[str, int]]:
    """The arms whose first phases ``arm`` may take over (``shared_phases`` > 0), as ``(arm, phases)``, the most
    phases first, then in the order of ``arms``."""
    got = [(o, shared_phases(phases, arm, o)) for o in arms]
    return sorted([(o, n) for o, n in got if n > 0], key=lambda x: -x[1])


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    if not arms:
        raise ValueError("--arms is empty: give e.g. scalinginter,fixed-short,fixed-long")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    if len(set(arms)) != len(arms):
        raise ValueError(f"--arms names an arm twice: {text}")
    return arms


def comparison_pairs(arms: Iterable[str]) -> list[tuple[str, str]]:
    """The paired comparisons (a, b) reported as "a - b": ScalingInter minus every other arm, then the GiGPO arm
    minus each fixed arm; only pairs whose arms both ran."""
    arms = list(arms)
    out = [("scalinginter", b) for b in arms if b != "scalinginter"] if "scalinginter" in arms else []
    if "scalinginter-gigpo" in arms:
        out += [("scalinginter-gigpo", b) for b in ("fixed-long", "fixed-short") if b in arms]
    return out


def rescore_agreement(first: Sequence[float], second: Sequence[float]) -> dict[str, Any]:
    """The same model scored twice on the same tasks: how many tasks got the same outcome (per-task success, greedy:
    0 or 1), which did not (their positions), and both rates."""
    if len(first) != len(second):
        raise ValueError(f"a re-score covers the same tasks: {len(first)} outcomes vs {len(second)}")
    differ = [i for i, (a, b) in enumerate(zip(first, second)) if abs(float(a) - float(b)) > 1e-12]
    n = len(first)
    return {"tasks": n, "same": n - len(differ), "agreement": (n - len(differ)) / n if n else 1.0, "differ": differ,
            "first": sum(first) / n if n else 0.0, "second": sum(second) / n if n else 0.0}


@dataclass(frozen=True)
class Band:
    """Mean and spread (min, max) over seeds of one quantity at one point."""

    mean: float
    lo: float
    hi: float
    n: int


def band(values: list[float]) -> Band:
    if not values:
        raise ValueError("band of no values")
    return Band(statistics.fmean(values), min(values), max(values), len(values))


def curve_over_seeds(curves: list[dict[int, float]]) -> dict[int, Band]:
    """Per-seed curves ``{step: value}`` -> ``{step: Band}`` over the seeds that have the step."""
    steps = sorted({s for c in curves for s in c})
    return {s: band([c[s] for c in curves if s in c]) for s in steps}


def pooled_successes(per_seed: list[list[float]]) -> list[float]:
    """Per-task success averaged over seeds (each seed's list is over the same tasks, in the same order)."""
    if not per_seed:
        raise ValueError("no seeds")
    n = len(per_seed[0])
    if any(len(p) != n for p in per_seed):
        raise ValueError("the seeds were scored on different numbers of tasks; a paired test needs the same tasks")
    return [statistics.fmean(p[i] for p in per_seed) for i in range(n)]


def paired_mcnemar(x: list[float], y: list[float]) -> float:
    """Exact two-sided McNemar p of per-task outcomes ``x`` against ``y`` on the same tasks (discordant pairs:
    tasks where one scores higher than the other)."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} vs {len(y)} task scores: a paired test needs the same tasks")
    return mcnemar_exact(sum(1 for a, b in zip(x, y) if a > b), sum(1 for a, b in zip(x, y) if b > a))


# --- results by required turns -----------------------------------------------------------------------------
def bucket_indices(labels: list[int | None]) -> dict[str, list[int]]:
    """Positions of the labelled tasks per required-turns bucket, in bucket order (``labels``: the fewest turns
    each task needs, None where the env did not label it; unlabelled tasks are in no bucket, empty buckets are
    left out)."""
    out: dict[str, list[int]] = {}
    for i, need in enumerate(labels):
        if need is not None:
            out.setdefault(required_turns_bucket(int(need)), []).append(i)
    return {k: out[k] for k in BUCKETS if k in out}


def bucket_rates(values: list[float], labels: list[int | None]) -> dict[str, float]:
    """Mean per-task success per bucket of one seed (``values[i]`` scores the task labelled ``labels[i]``)."""
    if len(values) != len(labels):
        raise ValueError(f"{len(values)} task scores for {len(labels)} labels")
    return {k: statistics.fmean(values[i] for i in idx) for k, idx in bucket_indices(labels).items()}


def bucket_stats(per_seed: list[list[float]], labels: list[int | None],
                 base: list[float] | None = None,
                 seed_bases: list[list[float]] | None = None) -> dict[str, dict[str, Any]]:
    """Per bucket, over the seeds' per-task success lists (the same tasks in the same order as ``labels``):
    ``success`` pooled over seeds and tasks, ``ci95`` its Wilson interval over the seeds' episodes (as the study's
    overall number), ``tasks`` in the bucket, ``per_seed_success``; with ``base`` (the base model's per-task
    success on the same tasks) ``vs_base_mcnemar_p``, the exact McNemar p of each seed against it; with
    ``seed_bases`` instead (one per seed: a warm start made again for each seed's part of the study), each seed
    against its own. ``ci95_seed_task``: the bucket's interval from a bootstrap over the seeds and the bucket's tasks
    (``core.stats.seed_task_bootstrap``), which carries the seed-to-seed variation the Wilson interval leaves out
    (with one seed, a bootstrap over the tasks alone)."""
    if not per_seed:
        raise ValueError("no seeds")
    if base is not None and seed_bases is not None:
        raise ValueError("give base or seed_bases, not both")
    if seed_bases is None and base is not None:
        seed_bases = [base] * len(per_seed)
    if seed_bases is not None and len(seed_bases) != len(per_seed):
        raise ValueError(f"{len(seed_bases)} starting models for {len(per_seed)} seeds")
    if any(len(s) != len(labels) for s in [*per_seed, *(seed_bases or [])]):
        raise ValueError(f"per-task scores and the {len(labels)} task labels differ in length")
    out: dict[str, dict[str, Any]] = {}
    for k, idx in bucket_indices(labels).items():
        n = len(idx)
        wins = sum(s[i] for s in per_seed for i in idx)
        lo, hi = wilson_interval(int(round(wins)), n * len(per_seed))
        _, slo, shi = seed_task_bootstrap([[s[i] for i in idx] for s in per_seed])
        cell: dict[str, Any] = {"success": wins / (n * len(per_seed)), "ci95": [lo, hi], "ci95_seed_task": [slo, shi],
                                "tasks": n, "per_seed_success": [sum(s[i] for i in idx) / n for s in per_seed]}
        if seed_bases is not None:
            cell["vs_base_mcnemar_p"] = [paired_mcnemar([s[i] for i in idx], [sb[i] for i in idx])
                                         for s, sb in zip(per_seed, seed_bases)]
        out[k] = cell
    return out


# --- stability diagnostics ---------------------------------------------------------------------------------
def finite_number(v: Any) -> float | None:
    """``v`` as a float where it is a number and not NaN (a bool is not a number here), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def phase_means(records: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, dict[str, float]]:
    """``{"phase-K": {key: mean over the phase's steps}}`` from a run's per-step records (``metrics.jsonl``: each
    with ``phase`` and the keys); a key missing or NaN in a step is averaged over the steps that have it, and left
    out of a phase where no step has it. Phases in order."""
    keys = list(keys)
    vals: dict[int, dict[str, list[float]]] = {}
    for r in records:
        if r.get("phase") is None:
            continue
        row = vals.setdefault(int(r["phase"]), {})
        for k in keys:
            v = finite_number(r.get(k))
            if v is not None:
                row.setdefault(k, []).append(v)
    return {f"phase-{p}": {k: statistics.fmean(v) for k, v in vals[p].items()} for p in sorted(vals)}


def mean_of_dicts(parts: list[tuple[dict[str, dict[str, float]], float]]) -> dict[str, dict[str, float]]:
    """Weighted mean of nested ``{group: {key: value}}`` dicts (``parts``: (dict, weight), e.g. one per seed with
    weight 1, or one per merged report with its number of seeds); a value is averaged over the parts that have it.
    Groups in first-seen order."""
    acc: dict[str, dict[str, list[float]]] = {}
    for d, w in parts:
        for g, row in d.items():
            for k, v in row.items():
                if finite_number(v) is not None:
                    a = acc.setdefault(g, {}).setdefault(k, [0.0, 0.0])
                    a[0] += w * float(v)
                    a[1] += w
    return {g: {k: s / w for k, (s, w) in row.items() if w > 0} for g, row in acc.items()}


# --- collapse, horizon use and retention, per run ------------------------------------------------------------
COLLAPSE_WINDOW = 3  # steps in the moving averages of the collapse rule
COLLAPSE_RULE = (f"collapsed: the mean train success of the last {COLLAPSE_WINDOW} steps is below half the best "
                 f"{COLLAPSE_WINDOW}-step moving average before them (a best of at least 0.05), and the mean policy "
                 f"entropy of the last {COLLAPSE_WINDOW} steps is below half or above twice that of the first "
                 f"{COLLAPSE_WINDOW}")


def collapse_check(success: list[float], entropy: list[float], window: int = COLLAPSE_WINDOW) -> dict[str, Any]:
    """The collapse rule (``COLLAPSE_RULE``) on a run's per-step train success and policy entropy: whether it
    collapsed, and the numbers behind the verdict (None where the run is too short to tell)."""
    out: dict[str, Any] = {"collapsed": False, "final_success": None, "best_success": None, "entropy_ratio": None}
    if len(success) < 2 * window:
        return out
    moving = [sum(success[i:i + window]) / window for i in range(len(success) - window + 1)]
    final, best = moving[-1], max(moving[:-1])
    out.update(final_success=final, best_success=best)
    fell = best >= 0.05 and final < 0.5 * best
    if len(entropy) >= 2 * window:
        first = sum(entropy[:window]) / window
        last = sum(entropy[-window:]) / window
        ratio = last / first if first > 0 else None
        out["entropy_ratio"] = ratio
        out["collapsed"] = bool(fell and ratio is not None and (ratio < 0.5 or ratio > 2.0))
    return out


def retention(base: list[float], final: list[float], labels: list[int | None] | None = None) -> dict[str, Any]:
    """What a run kept of what its starting policy solved: of the tasks the start solved (per-task success > 0),
    the share the final policy still solves, overall (``all``) and per required-turns bucket (with ``labels``); None
    where the start solved none."""
    if len(base) != len(final):
        raise ValueError(f"{len(base)} starting and {len(final)} final task scores: not the same tasks")

    def kept(idx: list[int]) -> float | None:
        solved = [i for i in idx if base[i] > 0]
        return sum(1 for i in solved if final[i] > 0) / len(solved) if solved else None

    out: dict[str, Any] = {"all": kept(list(range(len(base))))}
    if labels:
        out.update({k: kept(idx) for k, idx in bucket_indices(labels).items()})
    return out


def heldout_churn(points: Sequence[tuple[int, Sequence[float]]]) -> dict[str, Any]:
    """How steadily a run moved on its held-out tasks: ``points`` are its held-out per-task scores in step order
    (the start at step 0, each phase final, the final), all on the same tasks at the same turn limit. Per pair of
    consecutive points: the tasks it lost (solved before, not after), gained, and the change in the rate; then the
    largest drop in the rate between two consecutive points (0 where it never fell) and the tasks lost in all.
    A run that ends where another does may have got there steadily or by losing and regaining many tasks."""
    steps = []
    for (s0, a), (s1, b) in zip(points, points[1:]):
        if len(a) != len(b):
            raise ValueError(f"{len(a)} and {len(b)} task scores at steps {s0} and {s1}: not the same tasks")
        if not a:
            raise ValueError("no task scores")
        steps.append({"from_step": int(s0), "to_step": int(s1),
                      "lost": sum(1 for x, y in zip(a, b) if x > 0 and not y > 0),
                      "gained": sum(1 for x, y in zip(a, b) if not x > 0 and y > 0),
                      "change": (sum(b) - sum(a)) / len(a)})
    return {"transitions": steps, "largest_drop": max([0.0] + [-t["change"] for t in steps]) if steps else None,
            "lost": sum(t["lost"] for t in steps)}


def capped_share(successes: Sequence[Sequence[float | None]], turns: Sequence[Sequence[int]], limit: int) -> float:
    """The share of a held-out evaluation's episodes that failed at the turn limit (ran out of turns rather than
    ending in success or an error before it): per task its samples' outcomes (None: masked, left out) and turns."""
    if len(successes) != len(turns):
        raise ValueError(f"{len(successes)} tasks' outcomes and {len(turns)} tasks' turns")
    pairs = [(s, t) for ss, ts in zip(successes, turns) for s, t in zip(ss, ts) if s is not None]
    if not pairs:
        raise ValueError("no scored episode")
    return sum(1 for s, t in pairs if not s > 0 and t >= limit) / len(pairs)


# --- the paper's claims, side by side with a study's results ---------------------------------------------------
PLATEAU_TOLERANCE = 0.02  # a last phase that adds less held-out success than this (about 3 tasks in 140) is flat

PAPER_CLAIMS = {  # what AgentGym-RL's ScalingInter-RL experiments report (7B, ~25k episodes), one line each
    "fixed_long_collapse": "a fixed long horizon collapses: train success falls and episodes pin at the turn cap "
                           "(the 10-turn search run below 0.30 by step ~175)",
    "fixed_short_plateau": "a fixed short horizon plateaus: it stops gaining while the curriculum goes on "
                           "(fixed-5 near 0.55 late)",
    "curriculum_ahead_of_short": "the curriculum ends ahead of the fixed short horizon (~0.62 vs ~0.55, only "
                                 "after ~200 steps)",
    "curriculum_ahead_of_long": "the curriculum ends ahead of the fixed long horizon, which it outlasts",
}


def _separation(c: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """A paired comparison's verdict from its interval (seeds x tasks where the report has it, else tasks)."""
    if not c:
        return "not run", {}
    kind = "seeds x tasks" if c.get("ci95_seed_task") else "tasks"
    lo, hi = c.get("ci95_seed_task") or c["ci95"]
    verdict = "appears" if lo > 0 else "reversed" if hi < 0 else "not separated"
    measured = {"diff": c["diff"], "ci95": [lo, hi], "interval": kind}
    if c.get("ci95_seed_category"):  # whole categories drawn: wider where a level's tasks move together
        measured["ci95_seed_category"] = c["ci95_seed_category"]
    return verdict, measured


def paper_claims(arms: dict[str, Any], comparisons: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's four effects (``PAPER_CLAIMS``) measured on a study's report parts: ``arms`` (per arm its
    ``per_seed`` health records with ``collapsed`` and ``horizon`` per phase, its held-out ``curve`` and ``steps``)
    and ``comparisons`` (``"a - b"`` paired differences). Each entry: ``claim``, ``paper``, ``rule``, ``measured``
    and ``verdict`` ("appears", "does not appear", "partly", "reversed", "not separated", or "not run" where an arm
    it needs is missing)."""
    out: list[dict[str, Any]] = []

    def add(claim: str, rule: str, verdict: str, measured: dict[str, Any]) -> None:
        out.append({"claim": claim, "paper": PAPER_CLAIMS[claim], "rule": rule, "measured": measured,
                    "verdict": verdict})

    def collapsed(arm: str) -> tuple[int, int] | None:
        health = (arms.get(arm) or {}).get("per_seed")
        return (sum(bool(h.get("collapsed")) for h in health), len(health)) if health else None

    def at_limit(arm: str) -> float | None:  # the last phase's share of episodes ending at the turn limit
        vals = []
        for h in (arms.get(arm) or {}).get("per_seed") or []:
            phases = list((h.get("horizon") or {}).values())
            v = finite_number(phases[-1].get("diag/turn_limit_frac")) if phases else None
            if v is not None:
                vals.append(v)
        return statistics.fmean(vals) if vals else None

    fl, si = collapsed("fixed-long"), collapsed("scalinginter")
    rule = ("appears: fixed-long collapsed in more than half its seeds and scalinginter in fewer; does not appear: "
            "in none; partly: otherwise (collapse by the report's collapse rule)")
    if fl is None:
        add("fixed_long_collapse", rule, "not run", {})
    else:
        k, n = fl
        verdict = ("does not appear" if k == 0 else
                   "appears" if 2 * k > n and (si is None or si[0] < k) else "partly")
        add("fixed_long_collapse", rule, verdict,
            {"fixed-long collapsed": f"{k}/{n}", "scalinginter collapsed": None if si is None else f"{si[0]}/{si[1]}",
             "fixed-long at-limit share, last phase": at_limit("fixed-long"),
             "scalinginter at-limit share, last phase": at_limit("scalinginter"),
             "steps": arms["fixed-long"].get("steps")})

    def last_phase_gain(arm: str) -> tuple[float, int, int] | None:
        """(gain, from step, to step) between the held-out curve's last two points (``{step: {"mean": ...}}``,
        steps as ints or JSON strings, in step order)."""
        pts = sorted((int(s), float(v["mean"])) for s, v in ((arms.get(arm) or {}).get("curve") or {}).items())
        if len(pts) < 2:
            return None
        (s0, before), (s1, last) = pts[-2:]
        return last - before, s0, s1

    fs, sg = last_phase_gain("fixed-short"), last_phase_gain("scalinginter")
    rule = (f"appears: fixed-short's held-out success (largest budget, mean over seeds) gains less than "
            f"{PLATEAU_TOLERANCE} over its last phase while scalinginter gains {PLATEAU_TOLERANCE} or more; does not "
            f"appear: fixed-short gains {PLATEAU_TOLERANCE} or more; partly: both gain less; not run: fixed-short flat "
            f"and no scalinginter arm to compare")
    if fs is None:
        add("fixed_short_plateau", rule, "not run", {})
    else:
        flat = fs[0] < PLATEAU_TOLERANCE
        verdict = ("does not appear" if not flat else "not run" if sg is None else
                   "appears" if sg[0] >= PLATEAU_TOLERANCE else "partly")
        add("fixed_short_plateau", rule, verdict,
            {"fixed-short last-phase gain": fs[0], "from step": fs[1], "to step": fs[2],
             "scalinginter last-phase gain": None if sg is None else sg[0]})

    rule = ("appears: the paired difference's 95% interval (seeds x tasks where the report has it, else tasks) is "
            "above 0; reversed: below 0; not separated: it covers 0")
    for claim, other in (("curriculum_ahead_of_short", "fixed-short"), ("curriculum_ahead_of_long", "fixed-long")):
        verdict, measured = _separation(comparisons.get(f"scalinginter - {other}"))
        add(claim, rule, verdict, measured)
    return out


# --- a study run in pieces: which arithmetic each piece trained in, which pieces are there -----------------------
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # how a report's ``machine`` names a CPU with native bf16


def _override(overrides: Iterable[str], key: str) -> str | None:
    """The last ``key=value`` override's value (as written), None when not set."""
    found = None
    for s in overrides or ():
        k, sep, v = str(s).partition("=")
        if sep and k.strip() == key:
            found = v.strip()
    return found


def seed_numbers(part: dict[str, Any]) -> list[int | None]:
    """The training seeds behind a report arm's per-seed lists, in their order (``seeds``, else the per-run health
    records, else the run names' ``-s<N>``); None where a report does not say."""
    n = len(part["per_seed_success"])
    if part.get("seeds") and len(part["seeds"]) == n:
        return list(part["seeds"])
    health = part.get("per_seed") or []
    if len(health) == n and all(h.get("seed") is not None for h in health):
        return [int(h["seed"]) for h in health]
    found = [re.search(r"-s(\d+)$", str(x)) for x in part.get("runs") or []]
    return [int(m.group(1)) if m else None for m in found] if len(found) == n else [None] * n


def report_precision(report: dict[str, Any]) -> dict[str, str]:
    """The arithmetic a study report's runs trained in: its recorded ``precision`` (``learner``: bf16 or fp32;
    ``rollout``: the generator's dtype), else, for reports written before it was recorded, the learner's inferred
    from the ``machine`` the report names and its overrides: ``model.bf16_autocast`` when set, else bf16 on a machine
    with native bf16 (AMX or AVX512-BF16 in its flags) and fp32 elsewhere, the config's default."""
    if report.get("precision"):
        return dict(report["precision"])
    forced = _override(report.get("overrides") or [], "model.bf16_autocast")
    if forced is not None and forced.lower() not in ("none", "null"):
        return {"learner": "bf16" if forced.lower() in ("true", "1", "yes", "on") else "fp32"}
    native = any(f in str(report.get("machine", "")) for f in NATIVE_BF16_FLAGS)
    return {"learner": "bf16" if native else "fp32"}


def precision_conflict(precisions: Sequence[dict[str, str]], names: Sequence[str]) -> str | None:
    """None when the pieces trained in the same arithmetic (compared on the keys each pair records), else a line per
    differing key naming each piece's value: pieces in bf16 and in fp32 differ in more than their arm or seed."""
    if len(precisions) != len(names):
        raise ValueError("one name per precision")
    lines = []
    for key in sorted({k for p in precisions for k in p}):
        have = [(n, p[key]) for n, p in zip(names, precisions) if key in p]
        if len({v for _, v in have}) > 1:
            lines.append(f"{key}: " + ", ".join(f"{n} {v}" for n, v in have))
    return "; ".join(lines) or None


def precision_text(p: dict[str, str]) -> str:
    """A precision as words: ``learner bf16, rollout bfloat16``."""
    return ", ".join(f"{k} {v}" for k, v in sorted(p.items()))


def merged_precision(precisions: Sequence[dict[str, str]]) -> dict[str, str]:
    """The merged report's precision: each key's common value, or ``mixed (a, b)`` where pieces differ."""
    out = {}
    for key in sorted({k for p in precisions for k in p}):
        values = sorted({p[key] for p in precisions if key in p})
        out[key] = values[0] if len(values) == 1 else f"mixed ({', '.join(values)})"
    return out


def seed_precision_conflict(rows: Sequence[tuple[str, int | None, dict[str, str]]]) -> str | None:
    """One arithmetic per seed: ``rows`` are (piece name, seed, precision); None when the pieces of each seed trained
    in the same arithmetic (seeds may differ from one another), else ``precision_conflict``'s lines per seed. Rows
    whose seed is unknown are compared with every other row."""
    if any(seed is None for _, seed, _ in rows):
        return precision_conflict([p for _, _, p in rows], [n for n, _, _ in rows])
    lines = []
    for seed in sorted({seed for _, seed, _ in rows}):
        mine = [(n, p) for n, s, p in rows if s == seed]
        c = precision_conflict([p for _, p in mine], [n for n, _ in mine])
        if c:
            lines.append(f"seed {seed}: {c}")
    return "; ".join(lines) or None


def start_key(report: dict[str, Any]) -> str | None:
    """What makes two pieces' starting models the same for pieces of one seed: a warm start's recipe with its epoch
    losses to 3 decimals (a remake on a like machine reproduces them; a warm start trained in other arithmetic does
    not: bf16 0.424 against fp32 0.406 in its first epoch), else the model path; None when the report does not say."""
    sm = report.get("start_model") or {}
    w = sm.get("warmstart")
    if not w:
        return sm.get("path")
    losses = [round(float(x), 3) for x in w.get("epoch_losses") or []]
    return json.dumps({**{k: v for k, v in w.items() if k != "epoch_losses"}, "epoch_losses": losses}, sort_keys=True)


@dataclass(frozen=True)
class Piece:
    """One (arm, seed) run found in a study report."""
    arm: str
    seed: int
    report: str  # the report's file name
    heldout: float | None  # its held-out success at the report's largest budget
    precision: dict[str, str]
    start: str | None = None  # ``start_key`` of its report


def pieces_in(named_reports: Sequence[tuple[str, dict[str, Any]]], env: str, preset: str) -> list[Piece]:
    """The (arm, seed) runs of the reports of this env and preset (merged reports left out: their pieces are
    listed on their own), in the reports' order."""
    out = []
    for name, r in named_reports:
        if r.get("env") != env or r.get("preset") != preset or r.get("merged_from") or not r.get("arms"):
            continue
        prec = report_precision(r)
        for arm, a in r["arms"].items():
            rates = a.get("per_seed_success")
            if not isinstance(rates, list):  # not an arm of a study report
                continue
            for k, s in enumerate(seed_numbers(a)):
                if isinstance(s, int):
                    out.append(Piece(arm, s, name, rates[k], prec, start_key(r)))
    return out


def other_arithmetic(pieces: Sequence[Piece], here: dict[str, str]) -> list[Piece]:
    """The pieces that trained in another arithmetic than ``here`` (``precision_conflict`` on the pair)."""
    return [p for p in pieces if precision_conflict([p.precision, here], ["piece", "here"])]


def piece_plan(pieces: Sequence[Piece], arms: Sequence[str], seeds: Sequence[int]
               ) -> tuple[dict[tuple[str, int], list[Piece]], list[tuple[str, int]]]:
    """For every (arm, seed) asked for: the pieces found for it (more than one: the same run in two reports, which
    ``--merge`` refuses), and the (arm, seed) pairs still to run, seed by seed in the arms' order."""
    found: dict[tuple[str, int], list[Piece]] = {(a, s): [] for s in seeds for a in arms}
    for p in pieces:
        if (p.arm, p.seed) in found:
            found[(p.arm, p.seed)].append(p)
    missing = [(a, s) for s in seeds for a in arms if not found[(a, s)]]
    return found, missing


def blocked_seeds(pieces: Sequence[Piece], here: dict[str, str], start: str | None) -> dict[int, str]:
    """The seeds this machine must not add a piece to, with why: within a seed every arm trains in one arithmetic
    from one starting model (``start_key``), so that the arms' paired difference on that seed is the arms'; seeds
    may differ from one another (each is compared with its own starting model). A seed is blocked when one of its
    pieces trained in another arithmetic than ``here`` or started from another model than ``start``."""
    out: dict[int, str] = {}
    for p in pieces:
        if p.seed in out:
            continue
        if precision_conflict([p.precision, here], ["piece", "here"]):
            out[p.seed] = f"its pieces trained in {precision_text(p.precision)} ({p.arm}, {p.report})"
        elif start is not None and p.start is not None and p.start != start:
            out[p.seed] = f"its pieces started from another model ({p.arm}, {p.report})"
    return out


def piece_progress(records: Sequence[dict[str, Any]], phases: Sequence[dict], recent: int = 3) -> dict[str, Any]:
    """How far a run in progress is, from its ``metrics.jsonl`` records (``global_step``, ``turn_limit``,
    ``step_time_s``; a step logged twice, once before a resume, counts once with its last record) and its arm's
    phases (``arm_phases``): steps done and in all, and the training time left at its own pace. A step's time grows
    about linearly with its turn limit (episodes run longer and the update sees more tokens), so the estimate is the
    seconds per unit of turn limit of its last ``recent`` steps times the turn limits of the steps left: the pace
    of the machine as it runs now, not of an earlier stretch slowed by other work or run on another machine before
    a resume. None before the first step. The held-out scoring after the run is not in it."""
    limits = [int(p["turn_limit"]) for p in phases for _ in range(int(p["steps"]))]
    by_step = {int(r["global_step"]): r for r in records}
    done = [r for s, r in sorted(by_step.items()) if s <= len(limits)]
    secs = [float(r.get("step_time_s") or 0.0) for r in done]
    last = max(1, recent)
    units = sum(float(r.get("turn_limit") or limits[int(r["global_step"]) - 1]) for r in done[-last:])
    left = sum(limits[len(done):])
    return {"done": len(done), "total": len(limits), "spent_s": sum(secs),
            "left_s": sum(secs[-last:]) / units * left if done and units else None}
