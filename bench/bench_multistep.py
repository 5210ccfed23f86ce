"""Where a multi-step training step's time goes: N steps of the ``multistep`` preset from a fixed checkpoint.

    python bench/bench_multistep.py [--steps 2] [--seed 0] [--model DIR] [--preset NAME] [--phase K]
                                    [--set key=value ...] [--out FILE.json] [--log FILE]

    # a quick check at toy size (one step, 2 tasks x 2 samples)
    python bench/bench_multistep.py --steps 1 --set rollout.tasks_per_step=2 --set rollout.samples_per_task=2

What runs is the product's own step, as ``scalinginter run babyai --preset multistep`` runs it: the config is built
from the preset (with ``model.path=--model``, ``seed=--seed``, then the ``--set`` overrides, as the CLI takes them),
a ``Runtime`` is opened, ``open_session`` loads the learner and the configured generation engine, env servers are
spawned, and each step is ``rollout_batch`` -> ``compute_advantages`` -> ``policy_update`` (the Prefect tasks'
functions, called directly: no Prefect server, no step records and no checkpoints). ``--phase`` (default: the last,
turn limit 10) picks the curriculum phase: its turn limit and its first global step, so the steps draw the tasks
that phase's first steps of a real run draw. ``--model``: the embedded base model (``smollm2-135m``, the default),
an HF folder (a warm start, ``scalinginter warmstart --out DIR``) or a step checkpoint folder, whose optimizer state
and RNG are restored as a resumed phase restores them. The checkpoint is only read.

Printed per step, and per step on average (the mean of the steps after the first, which pays for warm-up; the one
step when ``--steps 1``), with each part's share of the step's wall time:

- rollout (the ledger's ``rollout``), and inside it the engine's busy time (generation), the time an env call was
  outstanding (env) and the time the engine sat idle while episodes were live (waiting); with per-episode
  rollouts (vLLM, ``rollout.async_episodes``) generation and env calls overlap, so these do not add up;
- advantages (the learner's old/reference log-probs, if the config needs them, and the estimator);
- update, split into forward (the learner's log-prob forwards), backward, optimizer (gradient clipping and the
  step) and the rest (batching, loss, the engine's sleep, heap trims);
- weight sync (the generation engine gets the new weights), and what is in no stage;
- tokens (generated; the learner's sequences; their policy tokens), the sequences the update skipped (advantage 0
  everywhere: ``algo.skip_zero_advantage``) and the learner's forwards: token slots run,
  the share of them that is padding (rows padded to the longest in the micro-batch, then to the length bucket:
  ``core.buckets``), and the tokens a group's shared prompt saved;
- an estimate of the update's matmul rate (6 x the decoder's linear weights x the forward slots, plus the
  vocabulary projection on the policy tokens; attention scores and recomputation left out) over forward +
  backward time, as a share of the machine's measured matmul rate in the learner's precision;
- the peak resident memory (RSS) of the whole process tree (this process, env servers, engine processes), sampled
  every 50 ms, per stage and over the whole run.

Before the run it measures the machine: a 2048 x 2048 matmul loop for ~2 s on the learner's thread count, in the
learner's precision (bf16, or fp32 where the CPU has no native bf16 and the learner runs fp32; GFLOPS), and the
CPU (``/proc/cpuinfo``: model name, cpu family, model, bf16 flags), so figures from different machines can be
compared as a share of that rate. Times are wall times: run it on an otherwise idle machine, and
compare two commits back to back on one machine. The JSON goes to ``--out`` or ``bench/results/multistep-step/
multistep-step-<date>-<time>.json`` (a file kept there needs its row in ``bench/results/README.md`` and a page that
cites it: ``tests/test_docs.py``); the libraries' log to a temporary run folder (``--log`` keeps a copy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GiB = 2**30

# the parts of a step, in print order: (key, label, depth); keys are those of ``step_row``'s "time_s"
PARTS = [
    ("step", "step (wall)", 0),
    ("rollout", "rollout", 1),
    ("rollout.generation", "generation (engine busy)", 2),
    ("rollout.env", "env calls outstanding", 2),
    ("rollout.waiting", "waiting: engine idle, episodes live", 2),
    ("advantages", "advantages", 1),
    ("advantages.forward", "old/ref log-prob forwards", 2),
    ("update", "update", 1),
    ("update.forward", "forward", 2),
    ("update.backward", "backward", 2),
    ("update.optimizer", "optimizer (clip + step)", 2),
    ("update.other", "other (batching, loss, engine sleep, heap trim)", 2),
    ("weight_sync", "weight sync", 1),
    ("other", "in no stage", 1),
]


# --- pure helpers (tests/test_bench_multistep.py) --------------------------------------------------------
def cpu_info(text: str) -> dict[str, Any]:
    """The CPU from ``/proc/cpuinfo``'s text: the first processor's ``model name``, ``cpu family`` and ``model``,
    the logical CPUs listed, and which bf16 flags it has (``avx512_bf16``, ``amx_bf16``)."""
    first: dict[str, str] = {}
    n = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            n += 1
        if n <= 1 and key not in first:
            first[key] = value
    flags = set(first.get("flags", "").split())
    return {"model_name": first.get("model name"), "cpu_family": first.get("cpu family"), "model": first.get("model"),
            "logical_cpus": n, "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16"})}


def matmul_gflops(n: int, iters: int, seconds: float) -> float:
    """The rate of ``iters`` n x n by n x n matmuls in ``seconds`` (2 n^3 FLOPs each), in GFLOPS."""
    return 2.0 * n ** 3 * iters / seconds / 1e9 if seconds > 0 else 0.0


def forward_slots(lengths: list[int], width: int) -> dict[str, int]:
    """One forward over rows of these real lengths padded to ``width`` tokens: its token slots, the real tokens, the
    padding up to the longest row (``row_pad``) and from there to ``width`` (``bucket_pad``)."""
    longest = max(lengths, default=0)
    if longest > width:
        raise ValueError(f"a row of {longest} tokens in a forward {width} wide")
    real = sum(lengths)
    return {"slots": len(lengths) * width, "real": real, "row_pad": len(lengths) * longest - real,
            "bucket_pad": len(lengths) * (width - longest)}


def padding_share(slots: int, real: int) -> float:
    """The share of the token slots that hold no real token (0 when nothing ran)."""
    return (slots - real) / slots if slots else 0.0


def update_flops(linear_params: int, head_params: int, slots: int, policy_tokens: int) -> float:
    """An estimate of the matmul FLOPs of one update's forwards and backwards: 2 per weight per token forward and
    4 backward (6 in all) for the decoder's linear layers on every slot run, and for the vocabulary projection on
    the policy tokens (the learner projects those only). Attention scores and recomputed activations left out."""
    return 6.0 * (linear_params * slots + head_params * policy_tokens)


def later_mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-step average of ``rows`` (one dict of numbers, nested dicts allowed, per step): the mean of the rows
    after the first (which pays for warm-up), or the one row when there is one. A key missing from a row counts
    as 0 there."""
    if not rows:
        return {}
    use = rows[1:] or rows

    def mean(items: list[Any]) -> Any:
        if any(isinstance(x, dict) for x in items):
            keys = list(dict.fromkeys(k for x in items if isinstance(x, dict) for k in x))
            return {k: mean([x.get(k, 0) if isinstance(x, dict) else 0 for x in items]) for k in keys}
        return sum(items) / len(items)

    return mean(use)


def step_parts(ledger: dict[str, float], wall: float, rollout: dict[str, float],
               probe: dict[str, float]) -> dict[str, float]:
    """One step's times (``PARTS``' keys): the ledger's exclusive seconds per stage during the step (``rollout``,
    ``advantages``, ``update``, ``weight_sync``), the step's ``wall`` time, the rollout's own split (``generation``,
    ``env``, ``waiting``), and the learner's (``probe``: seconds per ``stage.part``); the update's rest is what its
    ledger time leaves after forward, backward and optimizer, and ``other`` what the wall time leaves after the
    stages."""
    out = {"step": wall}
    for k in ("rollout", "advantages", "update", "weight_sync"):
        out[k] = ledger.get(k, 0.0)
    for k in ("generation", "env", "waiting"):
        out[f"rollout.{k}"] = rollout.get(k, 0.0)
    out["advantages.forward"] = probe.get("advantages.forward", 0.0)
    for k in ("forward", "backward", "optimizer"):
        out[f"update.{k}"] = probe.get(f"update.{k}", 0.0)
    learner = sum(out[f"update.{k}"] for k in ("forward", "backward", "optimizer"))
    out["update.other"] = max(0.0, out["update"] - learner)
    out["other"] = max(0.0, wall - sum(out[k] for k in ("rollout", "advantages", "update", "weight_sync")))
    return out


# --- measuring --------------------------------------------------------------------------------------------
def measure_matmul(n: int = 2048, seconds: float = 2.0, device: str = "cpu", dtype: str = "bf16") -> dict[str, Any]:
    """A loop of n x n matmuls in ``dtype`` (bf16 or fp32: the learner's, so a CPU without native bf16 is measured
    at the rate its fp32 learner runs at) for about ``seconds`` (after one warm-up call) on ``device`` (the CPU: on
    torch's current threads)."""
    import torch

    g = torch.Generator().manual_seed(0)
    dt_ = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dt_)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dt_)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    c = torch.mm(a, b)
    sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=c)
        iters += 1
        if iters % 8 == 0 or torch.device(device).type != "cuda":
            sync()
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
    return {"n": n, "dtype": dtype, "device": str(device), "iters": iters, "seconds": round(dt, 3),
            "threads": torch.get_num_threads(), "gflops": round(matmul_gflops(n, iters, dt), 1)}


class LearnerProbe:
    """Times the learner's log-prob forwards (``_token_logp``), backwards (``_backward``) and optimizer steps
    (``_step``) by wrapping those methods on this one learner object, and counts the token slots of every forward
    through its models' decoder (a forward pre-hook on ``base_model``); all charged to ``stage``, which the caller
    sets before each task. Nothing the learner computes changes. A forward without an attention mask (right-padded
    rows: the learner's maskless causal path) gets its rows' real lengths from the learner's ``_plain_hidden``
    call that runs it, which this wraps too."""

    def __init__(self, learner: Any):
        import torch

        self.stage = "setup"
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, int] = defaultdict(int)
        cuda = getattr(getattr(learner, "device", None), "type", "cpu") == "cuda"
        self._sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        for name, part in (("_token_logp", "forward"), ("_backward", "backward"), ("_step", "optimizer")):
            fn = getattr(learner, name, None)
            if fn is None:  # another learner (DeepSpeed) or a renamed method: that part reads 0
                print(f"bench: the learner has no {name}: its {part} time is not measured", flush=True)
            else:
                setattr(learner, name, self._timer(fn, part))
        self._lengths: list[int] | None = None  # the real lengths of the rows _plain_hidden is about to run
        plain = getattr(learner, "_plain_hidden", None)
        if plain is not None:
            def lengths_then(core, ids, att, *args, **kwargs):
                self._lengths = att.sum(1).tolist()
                try:
                    return plain(core, ids, att, *args, **kwargs)
                finally:
                    self._lengths = None

            learner._plain_hidden = lengths_then
        self._hooks = []
        for model in (getattr(learner, "model", None), getattr(learner, "ref", None)):
            if model is not None:
                core = getattr(model, "module", model)
                self._hooks.append(core.base_model.register_forward_pre_hook(self._count, with_kwargs=True))

    def _timer(self, fn: Callable, part: str) -> Callable:
        def timed_call(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds[f"{self.stage}.{part}"] += time.perf_counter() - t0

        return timed_call

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        att = kwargs.get("attention_mask")
        width = ids.shape[1]
        known = self._lengths
        if att is None and known is not None and len(known) == ids.shape[0] and max(known) <= width:
            lengths = known  # right-padded rows without a mask (the learner's _plain_hidden said how long)
        elif att is None:
            lengths = [width] * ids.shape[0]
        else:  # with a cached prefix the mask has its columns in front: this forward's tokens are the last ones
            lengths = att[:, -width:].sum(1).tolist()
        for k, v in forward_slots(lengths, width).items():
            self.tokens[f"{self.stage}.{k}"] += v
        self.tokens[f"{self.stage}.forwards"] += 1

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """The seconds and token counts since the last ``take``, reset."""
        out = dict(self.seconds), dict(self.tokens)
        self.seconds.clear()
        self.tokens.clear()
        return out


class RolloutProbe:
    """The rollout's own stats (``runtime.rollout.RolloutStats``: engine busy, env calls, idle engine) of each
    ``rollout`` call, caught by wrapping ``runtime.rollout.rollout``, which ``tasks.steps`` imports per call."""

    def __init__(self):
        import runtime.rollout as R

        self.calls: list[Any] = []
        inner = R.rollout

        async def rollout(req, rt):
            trajs, stats = await inner(req, rt)
            self.calls.append(stats)
            return trajs, stats

        R.rollout = rollout

    def take(self) -> dict[str, float]:
        calls, self.calls = self.calls, []
        return {"generation": sum(s.gen_time_s for s in calls), "env": sum(s.env_time_s for s in calls),
                "waiting": sum(s.gen_idle_s for s in calls), "wall": sum(s.wall_time_s for s in calls),
                "env_steps": sum(s.env_steps for s in calls),
                "async_episodes": float(any(s.async_episodes for s in calls))}


def linear_params(model: Any) -> tuple[int, int]:
    """(the weights of the model's linear layers but the output projection, the output projection's weights)."""
    import torch

    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head.weight.numel()


def _commit() -> str | None:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() + ("+changes" if dirty else "")) or None


# --- the run ----------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from bench_memory import TreeSampler

    sampler = TreeSampler(every_s=0.05)
    sampler.mark("setup")
    from runtime.backends.model import hub_offline_default

    hub_offline_default(["bench", f"model.path={a.model}"] + a.sets)  # as the CLI: offline unless a hub id is named
    from flows.config import build_config
    from runtime.backends.hardware import resolve_bf16, resolve_device
    from runtime.backends.model import resolve_model
    from runtime.backends.vllm_backend import vllm_available
    from runtime.console import quiet_console, restore_console
    from runtime.context import Runtime
    from tasks import steps as T
    from tasks.resume import PhasePlan
    from tasks.runs import resolve_run

    out_dir = tempfile.mkdtemp(prefix="bench-multistep-")
    cfg = resolve_run(build_config("babyai", a.preset, [f"output_dir={out_dir}", f"model.path={a.model}",
                                                        f"seed={a.seed}"] + a.sets))
    phases = cfg.curriculum.as_phases()
    phase = a.phase or len(phases)
    if not 1 <= phase <= len(phases):
        raise SystemExit(f"--phase {phase}: the config has phases 1..{len(phases)}")
    plan = PhasePlan.of(cfg, phase)
    model_dir = resolve_model(cfg.model.path)
    checkpoint = (Path(model_dir) / "optimizer.pt").exists() or (Path(model_dir) / "trainer_state.json").exists()

    T._threads(cfg)  # the learner's thread count, as open_session sets it
    cpu = cpu_info(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else {}
    matmul = measure_matmul(seconds=a.matmul_seconds, device=str(resolve_device(cfg.model.device)),
                            dtype="bf16" if resolve_bf16(cfg.model.bf16_autocast) else "fp32")
    print(f"machine: {cpu.get('model_name')} (cpu family {cpu.get('cpu_family')}, model {cpu.get('model')}), "
          f"{cpu.get('logical_cpus')} logical CPUs, bf16 flags {' '.join(cpu.get('bf16_flags') or []) or 'none'}; "
          f"{matmul['dtype']} matmul {matmul['n']}x{matmul['n']} on {matmul['threads']} threads: {matmul['gflops']:.0f} GFLOPS",
          flush=True)
    if vllm_available() and cfg.rollout.backend == "vllm":
        import vllm  # noqa: F401  (its import time stays out of the setup figure's engine start)
    chatter = quiet_console(Path(out_dir))
    rows: list[dict[str, Any]] = []
    peaks: dict[str, int] = {}
    t_setup = time.time()
    try:
        with Runtime() as rt:
            key = T.open_session(cfg, model_dir, train=True, reference_dir=model_dir)
            s = T.get_session(key)
            if checkpoint:  # a step checkpoint: its optimizer state and RNG, as a resumed phase restores them
                s.learner.load_training_state(Path(model_dir), weights=False)
            learner_probe, rollout_probe = LearnerProbe(s.learner), RolloutProbe()
            body, head = linear_params(s.learner.model)
            learner_cfg = {"bf16_autocast": bool(s.learner.cfg.bf16_autocast), "device": str(s.learner.device)}
            urls = T.spawn_env_servers.fn(key)
            setup_s = time.time() - t_setup
            print(f"setup {setup_s:.0f} s (learner, {cfg.rollout.backend} engine, env servers); phase {phase}: "
                  f"turn limit {plan.limit_at(plan.start)}, global steps {plan.start}..{plan.start + a.steps - 1}",
                  flush=True)
            for i in range(a.steps):
                gstep = plan.start + i
                limit = plan.limit_at(gstep)
                T.ensure_servers_alive(key)
                learner_probe.take()
                rollout_probe.take()
                before = dict(rt.ledger.totals)
                t0 = time.perf_counter()
                learner_probe.stage = "rollout"
                sampler.mark(f"step {i + 1}: rollout")
                batch = T.rollout_batch.fn(key, urls, gstep, limit)
                learner_probe.stage = "advantages"
                sampler.mark(f"step {i + 1}: advantages")
                adv = T.compute_advantages.fn(key, batch)
                learner_probe.stage = "update"
                sampler.mark(f"step {i + 1}: update")
                upd = T.policy_update.fn(key, batch, adv)
                wall = time.perf_counter() - t0
                sampler.mark("between steps")
                learner_probe.stage = "between"
                ledger = {k: v - before.get(k, 0.0) for k, v in rt.ledger.totals.items()}
                seconds, tokens = learner_probe.take()
                ro = rollout_probe.take()
                row = step_row(i, gstep, limit, wall, ledger, ro, seconds, tokens, batch, upd, body, head)
                rows.append(row)
                print_step(row)
                del batch, adv
            T.close_session(key)
    finally:
        sampler.close()
        restore_console()
        if chatter is not None and a.log and chatter.exists():
            shutil.copyfile(chatter, a.log)
        shutil.rmtree(out_dir, ignore_errors=True)
    for stage, (_, tree) in sampler.peaks.items():
        kind = stage.split(": ")[-1]
        peaks[kind] = max(peaks.get(kind, 0), tree)
    avg = later_mean([{"time_s": r["time_s"], "tokens": r["tokens"], "update_gflops": r["update_gflops"]}
                      for r in rows])
    return {"bench": "multistep-step", "commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "env": "babyai", "preset": a.preset, "model": a.model, "from_checkpoint": checkpoint, "seed": a.seed,
            "sets": a.sets, "phase": phase, "turn_limit": plan.limit_at(plan.start), "start_step": plan.start,
            "steps": a.steps, "backend": cfg.rollout.backend, "async_episodes": cfg.rollout.async_episodes,
            **learner_cfg,
            "tasks_per_step": cfg.rollout.tasks_per_step, "samples_per_task": cfg.rollout.samples_per_task,
            "micro_batch_size": cfg.algo.micro_batch_size, "cpu": cpu, "matmul": matmul, "setup_s": round(setup_s, 2),
            "linear_params": body, "head_params": head,
            "peak_tree_rss_gib": {k: round(v / GiB, 3) for k, v in peaks.items()},
            "peak_tree_rss_whole_gib": round(max(peaks.values(), default=0) / GiB, 3),
            "per_step": avg, "per_step_is": "mean of the steps after the first" if len(rows) > 1 else "the one step",
            "rows": rows}


def step_row(i: int, gstep: int, limit: int, wall: float, ledger: dict[str, float], ro: dict[str, float],
             seconds: dict[str, float], tokens: dict[str, int], batch: Any, upd: dict[str, float], body: int,
             head: int) -> dict[str, Any]:
    """One step's record: times (``step_parts``), tokens, forwards, episodes, the update's matmul estimate."""
    from core.trajectory import turn_samples

    samples, _ = turn_samples(batch.trajectories)
    live = [t for t in samples if not t.masked and t.num_policy_tokens > 0]
    times = step_parts(ledger, wall, ro, seconds)
    tok = {"generated": int(batch.metrics.get("generated_tokens", 0)),
           "sequence": sum(len(t.token_ids) for t in live), "policy": sum(t.num_policy_tokens for t in live),
           "sequences": len(live), "skipped_sequences": int(upd.get("skipped_episodes", 0)),
           "skipped_tokens": int(upd.get("skipped_tokens", 0))}
    for stage in ("advantages", "update"):
        for k in ("slots", "real", "row_pad", "bucket_pad", "forwards"):
            tok[f"{stage}.{k}"] = tokens.get(f"{stage}.{k}", 0)
    fb = times["update.forward"] + times["update.backward"]
    flops = update_flops(body, head, tok["update.slots"], tok["policy"])
    trajs = batch.trajectories
    return {"step": i + 1, "global_step": gstep, "turn_limit": limit,
            "time_s": {k: round(v, 3) for k, v in times.items()}, "tokens": tok,
            "episodes": len(trajs), "learner_sequences": len(live),
            "mean_turns": round(sum(t.turns for t in trajs) / max(1, len(trajs)), 3),
            "success_rate": round(batch.metrics.get("success_rate", 0.0), 4),
            "env_steps": int(ro.get("env_steps", 0)), "async_episodes": bool(ro.get("async_episodes")),
            "update_gflops": round(flops / fb / 1e9, 1) if fb > 0 else 0.0,
            "optimizer_steps": upd.get("optimizer_steps")}


def print_step(row: dict[str, Any]) -> None:
    t, tok = row["time_s"], row["tokens"]
    print(f"step {row['step']} (global {row['global_step']}, turn limit {row['turn_limit']}): {t['step']:.1f} s; "
          f"rollout {t['rollout']:.1f}, advantages {t['advantages']:.1f}, update {t['update']:.1f} (forward "
          f"{t['update.forward']:.1f}, backward {t['update.backward']:.1f}, optimizer {t['update.optimizer']:.1f}), "
          f"sync {t['weight_sync']:.1f}; {row['episodes']} episodes ({tok['skipped_sequences']} skipped by the "
          f"update), mean {row['mean_turns']:.1f} turns, "
          f"{tok['update.slots']} update slots ({100 * padding_share(tok['update.slots'], tok['update.real']):.0f}% "
          f"padding)", flush=True)


def report(res: dict[str, Any]) -> str:
    """The run's table: times per step with shares, tokens and padding, matmul rate, memory."""
    rows, avg = res["rows"], res["per_step"]
    one = len(rows) == 1
    head = [f"step {r['step']}" for r in rows] + ([] if one else ["per step*"])
    lines = [f"\nmulti-step step: babyai {res['preset']} from {res['model']}"
             f"{' (checkpoint: optimizer + RNG restored)' if res['from_checkpoint'] else ''}, seed {res['seed']}, "
             f"phase {res['phase']} (turn limit {res['turn_limit']}), global steps {res['start_step']}.."
             f"{res['start_step'] + res['steps'] - 1}; {res['tasks_per_step']} tasks x {res['samples_per_task']} "
             f"samples; {res['backend']} engine{' (per-episode rollout)' if rows and rows[0]['async_episodes'] else ''}"
             f", learner on {res['device']}{' (bf16 autocast)' if res['bf16_autocast'] else ' (fp32)'}"
             + (f"; --set {' '.join(res['sets'])}" if res["sets"] else ""),
             f"{'seconds':<50}" + "".join(f"{h:>11}" for h in head) + f"{'share':>8}"]
    wall = avg["time_s"]["step"]
    for key, label, depth in PARTS:
        vals = [r["time_s"][key] for r in rows] + ([] if one else [avg["time_s"][key]])
        share = f"{100 * avg['time_s'][key] / wall:7.0f}%" if wall > 0 else ""
        lines.append(f"{'  ' * depth + label:<50}" + "".join(f"{v:11.2f}" for v in vals) + share)
    if rows and rows[0]["async_episodes"]:
        lines.append("  (per-episode rollout: generation and env calls run at once, so the rollout's parts overlap)")

    def tok_line(label: str, f: Callable[[dict[str, Any]], float], fmt: str = "{:11.0f}") -> str:
        vals = [f(r["tokens"]) for r in rows] + ([] if one else [f(avg["tokens"])])
        return f"{label:<50}" + "".join(fmt.format(v) for v in vals)

    pct = "{:10.1f}%"
    lines += [tok_line("tokens generated", lambda t: t["generated"]),
              tok_line("learner sequences' tokens", lambda t: t["sequence"]),
              tok_line("  of them policy tokens", lambda t: t["policy"]),
              tok_line("learner sequences", lambda t: t["sequences"]),
              tok_line("  skipped by the update (advantage 0 everywhere)", lambda t: t["skipped_sequences"]),
              tok_line("update forwards' token slots", lambda t: t["update.slots"]),
              tok_line("  padding share", lambda t: 100 * padding_share(t["update.slots"], t["update.real"]), pct),
              tok_line("    to the longest row", lambda t: 100 * t["update.row_pad"] / max(1, t["update.slots"]), pct),
              tok_line("    to the length bucket", lambda t: 100 * t["update.bucket_pad"] / max(1, t["update.slots"]),
                       pct),
              tok_line("  prompt tokens shared (run once per group)",
                       lambda t: t["sequence"] - t.get("skipped_tokens", 0) - t["update.real"]
                       if t["update.slots"] else 0)]
    if any(r["tokens"]["advantages.slots"] for r in rows):
        lines.append(tok_line("advantages forwards' slots", lambda t: t["advantages.slots"]))
        lines.append(tok_line("  padding share",
                              lambda t: 100 * padding_share(t["advantages.slots"], t["advantages.real"]), pct))
    rate = res["matmul"]["gflops"]
    g = [r["update_gflops"] for r in rows] + ([] if one else [avg["update_gflops"]])
    lines.append(f"{'update matmul GFLOPS (estimate)':<50}" + "".join(f"{v:11.1f}" for v in g))
    lines.append(f"{'  share of the ' + res['matmul'].get('dtype', 'bf16') + ' matmul rate':<50}"
                 + "".join(pct.format(100 * v / rate if rate else 0) for v in g))
    cpu, m = res["cpu"], res["matmul"]
    lines.append(f"* the mean of the steps after the first (warm-up)" if not one else "(one step: it includes warm-up)")
    lines.append(f"machine: {cpu.get('model_name')} (cpu family {cpu.get('cpu_family')}, model {cpu.get('model')}), "
                 f"{cpu.get('logical_cpus')} logical CPUs, bf16 flags {' '.join(cpu.get('bf16_flags') or []) or 'none'}"
                 f"; {m.get('dtype', 'bf16')} matmul {m['n']}x{m['n']} x{m['iters']} in {m['seconds']:.1f} s on {m['threads']} threads: "
                 f"{m['gflops']:.0f} GFLOPS")
    pk = res["peak_tree_rss_gib"]
    lines.append("process tree's peak RSS (GiB): " + ", ".join(
        f"{k} {pk[k]:.2f}" for k in ("setup", "rollout", "advantages", "update") if k in pk)
        + f"; whole run {res['peak_tree_rss_whole_gib']:.2f}")
    lines.append(f"setup (not in the steps) {res['setup_s']:.0f} s; commit {res['commit']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Usage and what it prints: the module docstring (bench/bench_multistep.py).")
    ap.add_argument("--steps", type=int, default=2, help="training steps (the first one pays for warm-up)")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed (config `seed`): tasks and sampling")
    ap.add_argument("--model", default="smollm2-135m",
                    help="the fixed start: the embedded base model (default), an HF folder (a warm start) or a step "
                         "checkpoint folder (its optimizer state and RNG restored)")
    ap.add_argument("--phase", type=int, default=None, help="the curriculum phase (1-based; default the last)")
    ap.add_argument("--preset", default="multistep",
                    help="the BabyAI preset whose phase is measured (default multistep; e.g. multistep-study)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as the CLI's --set (repeatable)")
    ap.add_argument("--out", default=None,
                    help="the JSON (default bench/results/multistep-step/multistep-step-<date>-<time>.json)")
    ap.add_argument("--log", default=None, help="keep a copy of the libraries' log (engine lines) here")
    ap.add_argument("--matmul-seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    res = run(a)
    print(report(res))
    out = Path(a.out) if a.out else (ROOT / "bench" / "results" / "multistep-step"
                                     / f"multistep-step-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
