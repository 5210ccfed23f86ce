"""Prefect tasks of a phase: thin adapters that do I/O and call one pure function or one backend method.

Only live handles (the learner's models, the generation engine, env server processes) stay behind, in a
``Session`` of the open ``Runtime`` (``runtime.context``); tasks receive its key. Everything else goes in and out as values:
``rollout_batch`` returns the step's ``Batch``, ``compute_advantages(key, batch)`` returns its ``Advantages``
(with the learner's prepared log-probs), ``policy_update(key, batch, adv)`` takes both (in-process Prefect
results with persistence off carry Python objects). Step checkpoints are written to local disk or S3 via
``storage.checkpoint_store``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from core.advantages import EstimatorParams, get_estimator, trajectory_advantages
from core.redact import redact_uri
from core.chat import ChatFormat
from core.config import RunConfig
from core.evalinput import MAX_EVAL_SAMPLES
from core.metrics import episode_metrics
from core.seeds import round_seed, step_seed
from core.trajectory import Trajectory, is_truncated, join_rows, split_rows, turn_samples
from envs.base import task_index
from runtime.context import Runtime, Session
from runtime.killpoint import kill_point
from runtime.memory import trim_heap
from runtime.timing import timed

TASK_OPTS = dict(cache_policy=NO_CACHE, persist_result=False)


@dataclass
class Batch:
    """One training step's episodes and their rollout metrics (``rollout_batch``'s result)."""

    trajectories: list[Trajectory]
    metrics: dict[str, float]
    replay_groups: list[int] = field(default_factory=list)  # algo.replay_solved: solved groups kept for a gradient


@dataclass
class Advantages:
    """``compute_advantages``' result: per-token advantages (and critic targets for PPO), the learner's prepared
    inputs of the same batch (old/ref log-probs, values) that the update consumes, and the estimator's stats."""

    advantages: list[list[float]]
    returns: list[list[float]] | None
    prepared: Any
    stats: dict[str, float]


PROGRESS_LINE_EVERY_S = 15.0  # rollout progress: the first turn's line, later turns' at most this often (none once all ended)

def get_session(key: str) -> Session:
    """The open Runtime's session ``key`` (``runtime.context``: where Prefect tasks find their live handles)."""
    return Runtime.current().session(key)


def _threads(cfg: RunConfig) -> None:
    import torch

    torch.set_num_threads(cfg.model.threads or max(1, os.cpu_count() or 1))


# --- setup / teardown ------------------------------------------------------------------------------------
@task(name="spawn-env-servers", retries=2, retry_delay_seconds=2, **TASK_OPTS)
@timed("setup")
def spawn_env_servers(key: str) -> list[str]:
    """Start the phase's env servers (containers or local processes, ``env.runtime``), or use the configured running
    ones (``env.urls``, or ``env.url`` as one); returns their URLs."""
    from envs.spawn import spawn_env_server

    s = get_session(key)
    if s.cfg.env.server_urls:
        return s.cfg.env.server_urls
    for srv in s.servers:  # a retry of this task after a partial start: do not leak the first servers
        srv.stop()
    s.servers.clear()
    urls = []
    for _ in range(s.cfg.env.num_servers):
        srv = spawn_env_server(s.cfg.env.name, env_server_options(s.cfg), runtime=s.cfg.env.runtime,
                               image=s.cfg.env.image)
        s.servers.append(srv)
        urls.append(srv.url)
    kinds = sorted({srv.kind for srv in s.servers})
    print(f"env servers: {len(urls)} x {s.cfg.env.name} ({', '.join(kinds)}) at {', '.join(urls)}")
    return urls


def env_server_options(cfg: RunConfig) -> dict[str, Any]:
    """The spawned env servers' options: env.options, plus what a lever needs of the env (progress shaping: the
    expert's remaining turns after every step)."""
    opts = dict(cfg.env.options)
    if cfg.algo.shaping_coef > 0:
        opts["label_remaining"] = True
    return opts


def ensure_servers_alive(key: str) -> int:
    """Replace env servers that died (same port, so clients keep their URL). Returns the number replaced."""
    return _replace_dead_servers(get_session(key))


def _replace_dead_servers(s: Session) -> int:
    restarted = 0
    for srv in s.servers:
        if not srv.alive():
            print(f"env server {srv!r} is down: replacing it ({srv.log_tail(5).strip()[-300:]!r})")
            srv.restart()
            restarted += 1
    return restarted


@timed("setup")
def open_session(cfg: RunConfig, model_dir: str, train: bool, reference_dir: str | None = None) -> str:
    """Load models into a new session of the open Runtime. ``model_dir`` is a local HF folder."""
    import torch

    from runtime.backends.generation import TransformersBackend
    from runtime.backends.hardware import resolve_bf16
    from runtime.backends.learner import LearnerConfig, TorchLearner, load_causal_lm

    rt = Runtime.current()  # before anything loads: no Runtime open is a caller's mistake
    _threads(cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    s = Session(cfg=cfg)
    if train:
        lc = LearnerConfig.from_run(cfg, critic_path=local_critic_path(cfg.algo.critic.model))
        if cfg.learner.engine == "deepspeed":
            from runtime.backends.deepspeed_learner import make_learner

            s.learner = make_learner(model_dir, lc, reference_dir, cfg.learner)
        else:
            s.learner = TorchLearner(model_dir, lc, reference_path=reference_dir)
        s.model, s.tokenizer = s.learner.model, s.learner.tokenizer
    else:
        from transformers import AutoTokenizer

        s.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if cfg.rollout.backend == "transformers":
            from runtime.backends.hardware import resolve_device

            s.model = load_causal_lm(model_dir, resolve_device(cfg.model.device))
            s.model.eval()
    pad = s.tokenizer.pad_token_id if s.tokenizer.pad_token_id is not None else s.tokenizer.eos_token_id
    s.chat = ChatFormat.from_tokenizer(s.tokenizer, cfg.env.prompt)
    if cfg.rollout.backend == "vllm":  # the process's kept engine (this session's weights loaded) or a new one
        store = None
        if cfg.rollout.engine_sync_dir.startswith("s3://"):  # engines on other hosts get the weights through S3
            from storage.engine_weights import StoreHandover

            store = StoreHandover()
        s.backend = rt.engines.backend_for(cfg, model_dir, s.tokenizer, s.learner, weight_store=store)
    else:
        s.backend = TransformersBackend(s.model, s.tokenizer.eos_token_id, pad, cfg.rollout.gen_batch_size,
                                        resolve_bf16(cfg.model.bf16_autocast),
                                        kv_reuse_bytes=int(cfg.rollout.kv_reuse_gib * 2**30))
    return rt.add_session(s)


def close_session(key: str) -> None:
    """Close the session's env servers, engine hold and learner (``Runtime.close_session``: each part closed even
    when another fails, failures reported)."""
    rt = Runtime.current_or_none()
    if rt is not None:
        rt.close_session(key)


# --- data position: tasks are a pure function of (seed, global step) ---------------------------------
def train_tasks_for_step(cfg: RunConfig, global_step: int, rollout_round: int = 0, n: int | None = None) -> list[int]:
    """The step's train tasks (round > 0: dynamic sampling's refills; ``n``: how many, default tasks_per_step)."""
    rng = random.Random(round_seed(step_seed(cfg.seed, global_step), rollout_round))
    pool = cfg.env.task_pool
    n = cfg.rollout.tasks_per_step if n is None else n
    return rng.sample(range(pool), n) if n <= pool else [rng.randrange(pool) for _ in range(n)]


LABEL_DRAWS = 64  # fits_turns: candidate tasks labelled per step at most, as multiples of tasks_per_step


def _fitting_tasks(s: Session, urls: list[str], global_step: int, rollout_round: int, turn_limit: int) -> list[int]:
    """rollout.task_filter=fits_turns: the step's tasks drawn from those whose expert needs at most ``turn_limit``
    turns (the env's ``info["required_turns"]`` at reset), in the seeded candidate order; a pure function of the
    position, so a resumed step draws the same. Fewer candidates fit than wanted: the rest are filled unfiltered."""
    from core.levers import fits_turns

    n = s.cfg.rollout.tasks_per_step
    cands = train_tasks_for_step(s.cfg, global_step, rollout_round, n=min(n * LABEL_DRAWS, s.cfg.env.task_pool))

    async def labels() -> list[int]:
        out: list[int] = []
        async with env_clients(s, urls[:1]) as (c,):
            env_id = await c.create()
            try:
                for t in cands:
                    r = await c.reset(env_id, t)
                    turns = r.info.get("required_turns")
                    if fits_turns(int(turns) if turns is not None else None, turn_limit):
                        out.append(t)
                        if len(out) == n:
                            break
            finally:
                await c.close(env_id)
        return out

    picked = asyncio.run(labels())  # inside the step's "rollout" time
    if len(picked) < n:
        print(f"  [step {global_step + 1}] only {len(picked)} of {len(cands)} candidate tasks fit {turn_limit} turns; "
              "the rest are drawn unfiltered")
        picked += [t for t in cands if t not in picked][: n - len(picked)]
    return picked


def eval_tasks(n: int) -> list[int]:
    return [task_index("test", i) for i in range(n)]


# --- rollout -------------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def env_clients(s: Session, urls: list[str]):
    """The run's async env clients for ``urls`` (its dialect, env and timeout), their connections closed on exit."""
    from envs.agentgym import make_async_client

    clients = [make_async_client(s.cfg.env.dialect, u, s.cfg.env.name, s.cfg.env.request_timeout_s) for u in urls]
    try:
        yield clients
    finally:
        for c in clients:
            await c.aclose()


async def live_cap(clients: list[Any], configured: int | None) -> tuple[list[int | None], int | None]:
    """(each server's capacity, the rollout's cap on live episodes): ``core.capacity.live_episode_cap`` over what
    the servers advertise on ``/health`` (None: unbounded, e.g. an AgentGym server or one that does not answer)."""
    from core.capacity import live_episode_cap

    async def one(c) -> int | None:
        try:
            return await c.capacity()
        except Exception as e:  # noqa: BLE001 - an unreachable server masks its episodes anyway
            print(redact_uri(f"env server {c.base_url}: capacity unknown ({type(e).__name__}: {e}); treating it as "
                             "unbounded"))
            return None

    caps = list(await asyncio.gather(*(one(c) for c in clients)))
    return caps, live_episode_cap(configured, caps)


def _rollout(s: Session, urls: list[str], task_ids: list[int], samples: int, turn_limit: int,
             temperature: float, max_new_tokens: int, label: str,
             seed: int | None = None, specs: list[Any] | None = None,
             after_turn: Callable[[int], None] | None = None,
             expert: Callable[[str, dict], "str | None"] | None = None) -> tuple[list[Trajectory], dict[str, float]]:
    from runtime.backends.generation import SamplingParams
    from envs.sessions import PooledEpisode, ServerSlots
    from runtime.rollout import RolloutRequest, RolloutRuntime, rollout

    params = SamplingParams(max_new_tokens, temperature, s.cfg.rollout.top_p)
    if specs is None:
        req = RolloutRequest.for_tasks(task_ids, samples, turn_limit, params, s.cfg.rollout.token_budget, seed,
                                       s.cfg.rollout.history_turns)
    else:  # the caller's episodes (an eval sweep: each with its own turn budget and seed key)
        req = RolloutRequest(specs, turn_limit, params, s.cfg.rollout.token_budget, seed, s.cfg.rollout.history_turns)
    specs = req.specs

    async def go():
        async with env_clients(s, urls) as clients:
            # the servers' capacities (pool sizes; AgentGym servers advertise none) cap the live episodes
            caps, cap = await live_cap(clients, s.cfg.rollout.max_live_episodes)
            kv_cap = getattr(s.backend, "max_live_episodes", None)  # what the engine's KV cache holds (vLLM)
            kv_binds = kv_cap is not None and (cap is None or kv_cap < cap)
            if kv_binds:
                cap = kv_cap
            waits_for = "room in the KV cache" if kv_binds else "env capacity"  # named on the progress line
            slots = ServerSlots(clients, caps)

            def make(i):
                return PooledEpisode(slots)

            if cap is not None and cap < len(specs):
                limits = [f"env capacity {' + '.join('unbounded' if c is None else str(c) for c in caps)}"]
                if s.cfg.rollout.max_live_episodes is not None:
                    limits.append(f"rollout.max_live_episodes {s.cfg.rollout.max_live_episodes}")
                if kv_binds:
                    limits.append(f"the KV cache holds {kv_cap}")
                print(f"  [{label}] {len(specs)} episodes, at most {cap} live at once ({', '.join(limits)}): "
                      f"{len(specs) - cap} wait for a free slot", flush=True)

            last_print = [time.monotonic()]

            def on_round(rnd, live, st):  # the console stays short: see PROGRESS_LINE_EVERY_S
                if after_turn is not None:
                    after_turn(rnd)
                now = time.monotonic()
                if rnd > 1 and (live == 0 or now - last_print[0] < PROGRESS_LINE_EVERY_S):
                    return
                last_print[0] = now
                # episodes, not turns: with a live cap (or per-episode async turns) the rounds outnumber the turn limit
                wait = f" ({st.waiting} waiting for {waits_for}, at most {st.live_cap} live)" if st.waiting else ""
                first = "first turn: " if rnd == 1 else ""
                print(f"  [{label}] {first}{len(specs) - live}/{len(specs)} episodes done, {live} to go{wait}, "
                      f"{st.generated_tokens} tokens generated ({st.tokens_per_s:.0f} tok/s)", flush=True)

            async def heal() -> int:  # a dead server is replaced on its port; its masked episodes run again
                return await asyncio.to_thread(_replace_dead_servers, s)

            return await rollout(req, RolloutRuntime(s.backend, s.chat, make, cap, s.cfg.rollout.env_retries, heal,
                                                     on_round, s.cfg.rollout.async_episodes, expert))

    clear = getattr(s.backend, "clear_cache", None)  # the transformers engine's kept keys and values: this rollout's
    if clear is not None:
        clear()
    try:
        trajs, stats = _run_rollout(s, go, label)
    finally:
        if clear is not None:  # their memory is the learner's again
            clear()
    metrics = {**episode_metrics(trajs), **stats.as_metrics()}
    return trajs, metrics


def _run_rollout(s: Session, go: Callable[[], Any], label: str):
    """``asyncio.run(go())``, with a single vLLM engine that died replaced (``VLLMBackend.restart``, at most
    ``rollout.engine_restarts`` times): before the rollout when it died since its last use, and during it, where
    the whole rollout runs again on the new engine with the learner's weights (its episodes' envs are closed with the
    failed attempt; each episode's sampling seed is its own, so the rerun draws what it would have drawn)."""
    backend = s.backend
    restartable = hasattr(backend, "replace_if_dead") and getattr(backend, "restart_limit", 0)
    if restartable:
        backend.replace_if_dead()
    while True:
        try:
            return asyncio.run(go())
        except Exception as e:  # noqa: BLE001 - re-raised unless the engine died and may be replaced
            if not restartable or not backend.dead() or backend.why_not_restarted() is not None:
                raise
            print(f"  [{label}] the vLLM engine died during the rollout ({type(e).__name__}): replacing it and "
                  "running the rollout again", flush=True)
            backend.restart()


@task(name="rollout-batch", **TASK_OPTS)
@timed("rollout")
def rollout_batch(key: str, urls: list[str], global_step: int, turn_limit: int) -> Batch:
    """The step's episodes: its tasks (a function of the global step), ``samples_per_task`` each, at ``turn_limit``."""
    from core.levers import keep_groups, solved_groups

    s = get_session(key)
    r = s.cfg.rollout
    reported: list[int] = []
    expert = _expert(s.cfg)

    def after_turn(rnd: int) -> None:  # test hook (runtime.killpoint): one arrival per step, at its first progress report
        if not reported:
            reported.append(rnd)
            kill_point("rollout")

    def one_round(k: int) -> tuple[list[Trajectory], dict[str, float]]:
        tasks = (_fitting_tasks(s, urls, global_step, k, turn_limit) if r.task_filter == "fits_turns"
                 else train_tasks_for_step(s.cfg, global_step, k))
        label = f"step {global_step + 1}" + (f" round {k + 1}" if k else "")
        trajs, m = _rollout(s, urls, tasks, r.samples_per_task, turn_limit, r.temperature, r.max_new_tokens, label,
                            seed=round_seed(step_seed(s.cfg.seed, global_step), k), after_turn=after_turn,
                            expert=expert)
        if s.cfg.algo.expert_groups:  # all-fail groups get the expert's own episode of their task
            trajs, m["expert_groups"] = with_expert_episodes(s, urls, trajs, turn_limit)
        return trajs, m

    trajs, metrics = one_round(0)
    replay_n, replay = s.cfg.algo.replay_solved, []
    if r.dynamic_sampling_rounds:  # drop groups without reward variance, refill with fresh tasks (DAPO)
        rounds, flags = [trajs], [_variance_flags(trajs)]
        while sum(map(sum, flags)) < r.tasks_per_step and len(rounds) <= r.dynamic_sampling_rounds:
            more, m = one_round(len(rounds))
            rounds.append(more)
            flags.append(_variance_flags(more))
            for k in ("rollout_time_s", "generated_tokens", "retried_episodes", "recovered_episodes",
                      "env_servers_replaced", "expert_groups"):
                metrics[k] = metrics.get(k, 0.0) + m.get(k, 0.0)
        kept = keep_groups(flags, r.tasks_per_step)
        # algo.replay_solved: solved groups the refill dropped join the batch after the groups with signal
        extra = solved_groups([_solved_flags(rnd) for rnd in rounds], kept, replay_n) if kept and replay_n else []
        everything = [t for rnd in rounds for t in rnd]
        metrics.update(episode_metrics([t for t in everything if not t.expert_demo]))  # what the policy did
        metrics["dyn/rounds"] = float(len(rounds))
        metrics["dyn/groups_rolled"] = float(sum(len(f) for f in flags))
        metrics["dyn/groups_kept"] = float(len(kept))
        metrics["dyn/groups_dropped"] = float(sum(len(f) for f in flags) - len(kept))
        metrics["dyn/first_round_zero_var_frac"] = 1.0 - sum(flags[0]) / max(1, len(flags[0]))
        if kept:
            groups = [[t for t in rounds[k] if t.group_id == g] for k, g in kept + extra]  # all picked, renumbered
            trajs = []
            for new_gid, group in enumerate(groups):
                for t in group:
                    t.group_id = new_gid
                trajs += group
            replay = list(range(len(kept), len(kept) + len(extra)))
        # no group with signal after the last round: the first round's groups, a step without signal (unless some
        # are solved and algo.replay_solved replays them, below)
    if replay_n and not replay:  # no solved group was dropped (or no refill ran): the batch's own solved groups
        solved = [g for g, ok in zip(_by_group(trajs), _solved_flags(trajs)) if ok]
        replay = solved[:replay_n]
    if replay_n:
        metrics["replay_groups"] = float(len(replay))
    for t in trajs:
        t.turn_limit = turn_limit
    metrics["max_turns_seen"] = float(max((t.turns for t in trajs), default=0))
    return Batch(trajs, metrics, replay)


def with_expert_episodes(s: Session, urls: list[str], trajs: list[Trajectory],
                         turn_limit: int) -> tuple[list[Trajectory], float]:
    """algo.expert_groups: every group whose live samples all failed gets the expert's episode of its task (run on
    the step's env servers at ``turn_limit``, kept when it succeeds) as one more member, marked ``expert_demo``.
    Returns the trajectories and how many groups got one."""
    from core.levers import all_failed

    groups = _by_group(trajs)
    failed = [g for g, ts in groups.items() if all_failed([t.success for t in ts], [t.masked for t in ts])]
    if not failed:
        return trajs, 0.0
    demos = _expert_episodes(s, urls, [groups[g][0].task_id for g in failed], turn_limit)
    added = 0
    for g, d in zip(failed, demos):
        if d is None:
            continue
        d.group_id, d.expert_demo, d.turn_limit = g, True, turn_limit
        trajs = trajs + [d]
        added += 1
    return trajs, float(added)


def _expert_episodes(s: Session, urls: list[str], task_ids: list[int], turn_limit: int) -> list[Trajectory | None]:
    """The env expert's episode of each task (None where it did not succeed within ``turn_limit``), through the run's
    env servers and chat framing (``tasks.demos.collect_demos_async``)."""
    from envs.sessions import PooledEpisode, ServerSlots
    from tasks.demos import collect_demos_async, expert_for

    async def go():
        async with env_clients(s, urls) as clients:
            caps, _ = await live_cap(clients, s.cfg.rollout.max_live_episodes)
            slots = ServerSlots(clients, caps)
            return await collect_demos_async(task_ids, lambda i: PooledEpisode(slots), expert_for(s.cfg.env.name),
                                             s.chat, turn_limit, s.cfg.rollout.max_new_tokens,
                                             s.cfg.rollout.token_budget)

    res = asyncio.run(go())
    by_task = {t.task_id: t for t in res.trajectories}
    return [by_task.pop(t, None) for t in task_ids]


def _by_group(trajs: list[Trajectory]) -> dict[int, list[Trajectory]]:
    """The trajectories per group id, in group-id order (a rollout numbers its groups 0..G-1)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    return dict(sorted(groups.items()))


def _solved_flags(trajs: list[Trajectory]) -> list[bool]:
    """Per group (in group-id order), whether all its live samples succeeded (``core.levers.all_succeeded``) and
    none is an expert's episode."""
    from core.levers import all_succeeded

    return [all_succeeded([t.success for t in ts], [t.masked for t in ts]) and not any(t.expert_demo for t in ts)
            for ts in _by_group(trajs).values()]


def _variance_flags(trajs: list[Trajectory]) -> list[bool]:
    """Per group (in group-id order), whether its live samples' rewards differ (``core.levers.group_has_variance``)."""
    from core.levers import group_has_variance

    return [group_has_variance([t.reward for t in ts], [t.masked for t in ts]) for ts in _by_group(trajs).values()]


def _expert(cfg: RunConfig) -> Callable[[str, dict], "str | None"] | None:
    """The env's scripted expert when the expert term is on (algo.expert_coef > 0), else None."""
    if not cfg.algo.expert_coef:
        return None
    from tasks.demos import expert_for

    return expert_for(cfg.env.name)


def local_critic_path(ref: str | None) -> str | None:
    if ref is None:
        return None
    from runtime.backends.model import resolve_model

    return resolve_model(ref)


@task(name="compute-advantages", **TASK_OPTS)
@timed("advantages")
def compute_advantages(key: str, batch: Batch) -> Advantages:
    """Learner-side inputs of ``batch`` (old/ref log-probs, critic values), then the configured estimator."""
    s = get_session(key)
    trajs = batch.trajectories
    a = s.cfg.algo
    spec = get_estimator(a.estimator)
    # the learner's sequences: the episodes, or one per turn under a history window (its own prompt and reply);
    # per-token quantities come back onto the episodes, where the estimator runs as without a window
    samples, where = turn_samples(trajs)
    prepared = s.learner.prepare(samples, old_for_reward=spec.kl_in_reward)
    lengths = [len(t.token_ids) for t in trajs]

    def per_token(which: str) -> list[list[float]]:
        return join_rows(s.learner.per_token(samples, prepared, which), where, lengths)

    params = EstimatorParams.from_algo(a)
    scored = shaped(trajs, a.shaping_coef) if a.shaping_coef else trajs
    if a.invalid_action_penalty:
        scored = penalised(scored, a.invalid_action_penalty)
    advantages, returns, stats = trajectory_advantages(
        a.estimator, params, scored,
        values=per_token("values") if spec.needs_critic else None,
        kl=per_token("kl") if spec.kl_in_reward else None,
        final_values=_last_sample_values(s.learner.final_values(samples, prepared), where, len(trajs))
        if spec.needs_critic else None)
    if a.truncated == "mask":  # truncated episodes leave the policy-gradient loss (DAPO's overlong filtering)
        from core.levers import mask_truncated

        advantages = mask_truncated(advantages, [t.finish_reason for t in trajs])
        stats["truncated_masked"] = float(sum(is_truncated(t) and not t.masked for t in trajs))
        stats["episodes_with_signal"] = float(sum(1 for row in advantages if any(x != 0 for x in row)))
    if a.replay_solved and batch.replay_groups:  # solved groups: a gradient on their own actions
        from core.levers import replay_advantages

        rep = set(batch.replay_groups)
        flags = [t.group_id in rep and not t.masked for t in trajs]
        advantages = replay_advantages(advantages, [t.loss_mask for t in trajs], flags, a.replay_coef)
        stats["replayed_episodes"] = float(sum(flags))
        stats["episodes_with_signal"] = float(sum(1 for row in advantages if any(x != 0 for x in row)))
    return Advantages(advantages, returns, prepared, stats)


def shaped(trajs: list[Trajectory], coef: float) -> list[Trajectory]:
    """The trajectories with the progress reward (``core.levers.potential_shaping``) added to their turn rewards, as
    copies: the episodes' own rewards, success and records stay as the env gave them."""
    from core.levers import potential_shaping

    live = [t for t in trajs if not t.masked and t.turns]
    if live and all(t.expert_remaining is None for t in live):
        raise RuntimeError("algo.shaping_coef is on but the env reports no expert_remaining_turns: run a BabyAI server "
                           "with the option label_remaining=true (the run sets it on servers it spawns), or set "
                           "algo.shaping_coef=0")
    return _plus_turn_rewards(trajs, lambda t: potential_shaping(t.expert_remaining, t.turns, coef)
                              if t.expert_remaining else None)


def penalised(trajs: list[Trajectory], penalty: float) -> list[Trajectory]:
    """The trajectories with ``-penalty`` added to the reward of each turn the env flagged invalid
    (``core.levers.invalid_action_penalties``), as copies: the episodes' own rewards and records stay as they were."""
    from core.levers import invalid_action_penalties

    return _plus_turn_rewards(trajs, lambda t: invalid_action_penalties(t.invalid_actions, t.turns, penalty)
                              if any(t.invalid_actions or []) else None)


def _plus_turn_rewards(trajs: list[Trajectory],
                       extra: Callable[[Trajectory], list[float] | None]) -> list[Trajectory]:
    """Copies of the live trajectories with ``extra(t)`` (a reward per turn; None: nothing to add) added to their
    turn rewards; masked and turnless ones, and those ``extra`` leaves alone, are the same objects."""
    import dataclasses

    out = []
    for t in trajs:
        f = None if t.masked or not t.turns else extra(t)
        out.append(t if f is None else dataclasses.replace(t, turn_rewards=[r + x for r, x in zip(t.turn_rewards, f)]))
    return out


def expert_samples(s: Session, trajs: list[Trajectory]) -> list[tuple[list[int], list[int], int]]:
    """The expert term's relabelled sequences (algo.expert_turns per episode): for each chosen turn, the episode up
    to that turn's reply, then the expert's reply (``tasks.demos.expert_reply_ids``, loss mask 1 on it); with the
    episode's group id (a group's samples share their prompt's forward)."""
    from core.levers import relabel_turns
    from core.trajectory import relabel_sample
    from tasks.demos import expert_reply_ids

    out = []
    for t in trajs:
        if t.masked or not t.expert_replies or not t.replies:
            continue
        for k in relabel_turns(t.replies, t.expert_replies, s.cfg.algo.expert_turns):
            reply = expert_reply_ids(s.tokenizer, t.expert_replies[k], s.cfg.rollout.max_new_tokens)
            if reply is None:
                continue
            ids, mask = relabel_sample(t, k, reply)
            if len(ids) <= s.cfg.rollout.token_budget:
                out.append((ids, mask, t.group_id))
    return out


def _last_sample_values(values: list[float] | None, where: list[tuple[int, int, int]], n: int) -> list[float] | None:
    """Per trajectory, the value after its last sample (the state a truncated episode is bootstrapped from)."""
    if values is None:
        return None
    out = [0.0] * n
    for v, (i, _, _) in zip(values, where):  # samples come in order: a trajectory's last one is written last
        out[i] = float(v)
    return out


@task(name="policy-update", **TASK_OPTS)
@timed("update")
def policy_update(key: str, batch: Batch, adv: Advantages, global_step: int | None = None) -> dict[str, float]:
    """One update of the policy (and critic) on ``batch`` with ``adv``; the generation engine gets the new weights.
    With algo.expert_coef the expert's relabelled replies join the update (weighted by the coefficient at
    ``global_step``); with algo.skip_no_signal a batch without signal changes nothing (no update, no sync)."""
    from core.levers import expert_coef_at, has_signal

    s = get_session(key)
    a = s.cfg.algo
    expert = None
    if a.expert_coef:
        from core.curriculum import total_steps

        coef = expert_coef_at(a.expert_coef, a.expert_decay, global_step or 0,
                              max(total_steps(s.cfg.curriculum.as_phases()), (global_step or 0) + 1))
        relabels = expert_samples(s, batch.trajectories)
        expert = (relabels, coef) if relabels and coef > 0 else None
    if a.skip_no_signal and not has_signal(adv.advantages, len(expert[0]) if expert else 0):
        print("  no advantage and no expert relabel in this batch: update skipped (weights and optimizer unchanged)")
        return {"skipped": 1.0, "expert_samples": 0.0}
    samples, where = turn_samples(batch.trajectories)  # the sequences ``compute_advantages`` prepared, in its order
    if hasattr(s.backend, "sleep"):  # vLLM sleep mode: the engine frees the GPU for the update (no-op otherwise)
        s.backend.sleep()
    out = s.learner.update(samples, split_rows(adv.advantages, where), prepared=adv.prepared,
                           returns=None if adv.returns is None else split_rows(adv.returns, where),
                           **({"expert": expert} if expert else {}))
    out.setdefault("skipped", 0.0)
    kill_point("update")  # test hook (runtime.killpoint): a no-op unless $SCALINGINTER_KILL_AT names it
    trim_heap()  # the update's freed activations go back to the OS before the engine's KV cache comes back
    with timed("weight_sync"):
        s.backend.sync_weights()  # a separate generation engine (vLLM) reloads the new weights; no-op otherwise
    if hasattr(s.backend, "sync_time_s"):
        out["weight_sync_s"] = s.backend.sync_time_s
    if hasattr(s.backend, "restarts"):  # vLLM: how often dead engines were replaced so far
        out["engine_restarts"] = float(sum(s.backend.restarts))
    trim_heap()  # and what the sync freed (runtime.memory)
    return out


@task(name="evaluate", **TASK_OPTS)
@timed("evaluation")
def evaluate_ids(key: str, urls: list[str], task_ids: list[int], turn_limit: int,
                 max_new_tokens: int, episodes_path: str | None = None) -> dict[str, float]:
    """Greedy decoding on the given tasks (held-out by default): success rate, mean reward, mean turns. With
    ``episodes_path``, the episodes are also written there as a rollout Parquet (phase 0; the viewer shows them)."""
    s = get_session(key)
    trajs, m = _rollout(s, urls, task_ids, 1, turn_limit, 0.0, max_new_tokens, "eval")
    if episodes_path:
        write_rollout_parquet(trajs, Path(episodes_path), phase=0, step=0)
    return {"success_rate": m["success_rate"], "mean_reward": m["mean_reward"], "mean_turns": m["mean_turns"],
            "episodes": m["episodes"], "masked_episodes": m["masked_episodes"]}


def score_model(cfg: RunConfig, model_dir: str, task_ids: list[int], turn_limit: int,
                max_new_tokens: int, episodes_path: str | None = None) -> dict[str, float]:
    """Load a model (no learner), spawn env servers, score ``task_ids`` greedily, tear everything down."""
    with _eval_session(cfg, model_dir) as (key, urls):
        return evaluate_ids(key, urls, task_ids, turn_limit, max_new_tokens, episodes_path)


@contextlib.contextmanager
def _eval_session(cfg: RunConfig, model_dir: str):
    """An evaluation's session (model, no learner) and its env servers' URLs, in the open Runtime (whose engine
    stays up after it) or in its own; closed on exit."""
    with Runtime.scope():
        key = open_session(cfg, model_dir, train=False)
        try:
            yield key, spawn_env_servers(key)
        finally:
            close_session(key)


@task(name="evaluate-sweep", **TASK_OPTS)
@timed("evaluation")
def evaluate_sweep(key: str, urls: list[str], task_ids: list[int], turn_limits: list[int], samples: int,
                   temperature: float, max_new_tokens: int, seed: int,
                   episodes_path: str | None = None) -> dict[str, Any]:
    """Every task at every turn budget, ``samples`` times (greedy when ``temperature`` is 0), in ONE rollout call
    on the session's engine. Each episode samples with seeds keyed by (task, sample) only, so the same task and
    sample draw the same seeds at every budget, for every model and whatever else is in the batch (engines with
    per-prompt seeds: vLLM; transformers draws from torch's RNG, seeded here). Returns ``{"outcomes": [{task_id,
    turn_limit, sample, success (None = masked), reward, turns, category, finish_reason}], "stats": {...}}``.
    With ``episodes_path`` the episodes are also written there as a rollout Parquet (phase 0; the viewer)."""
    import torch

    from runtime.rollout import EpisodeSpec

    s = get_session(key)
    specs = [EpisodeSpec(task_id=t, group_id=g, turn_limit=b, seed_key=t * MAX_EVAL_SAMPLES + k)
             for b in turn_limits for g, t in enumerate(task_ids) for k in range(samples)]
    torch.manual_seed(seed)
    trajs, m = _rollout(s, urls, task_ids, samples, max(turn_limits), temperature, max_new_tokens, "eval",
                        seed=seed, specs=specs)
    if episodes_path:
        write_rollout_parquet(trajs, Path(episodes_path), phase=0, step=0)
    outcomes = [{"task_id": sp.task_id, "turn_limit": sp.turn_limit, "sample": sp.seed_key - sp.task_id * MAX_EVAL_SAMPLES,
                 "success": None if t.masked else bool(t.success), "reward": t.reward, "turns": t.turns,
                 "category": t.category, "required_turns": t.required_turns,
                 "finish_reason": t.finish_reason}
                for sp, t in zip(specs, trajs)]
    stats = {k: m[k] for k in ("rollout_time_s", "generated_tokens", "gen_tokens_per_s", "env_steps_per_s",
                               "retried_episodes", "env_servers_replaced") if k in m}
    return {"outcomes": outcomes, "stats": stats}


def score_sweep(cfg: RunConfig, model_dir: str, task_ids: list[int], turn_limits: list[int], samples: int,
                temperature: float, max_new_tokens: int, seed: int, episodes_path: str | None = None) -> dict[str, Any]:
    """Load a model (no learner) and one engine, spawn env servers, ``evaluate_sweep``, tear everything down."""
    with _eval_session(cfg, model_dir) as (key, urls):
        return evaluate_sweep(key, urls, task_ids, turn_limits, samples, temperature, max_new_tokens, seed,
                              episodes_path)


# --- checkpoints ---------------------------------------------------------------------------------------
@task(name="checkpoint", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
@timed("checkpoint")
def save_step_checkpoint(key: str, uri: str, trainer_state: dict[str, Any], latest_of: str | None = None) -> str:
    from storage.checkpoint_store import save_checkpoint, write_latest

    s = get_session(key)
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-"))
    try:
        s.learner.save(tmp, trainer_state)
        out = save_checkpoint(tmp, uri, overwrite=True, move=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if latest_of:
        write_latest(latest_of, out)
    return out


def trajectories_text(trajs: list[Trajectory], k: int) -> str:
    rows = []
    for t in trajs[:k]:
        rows.append({"task_id": t.task_id, "group_id": t.group_id, "reward": t.reward, "success": t.success,
                     "finish_reason": t.finish_reason, "turns": t.turns, "masked": t.masked, "error": t.error,
                     "first_observation": t.first_observation, "replies": t.replies,
                     "observations": t.observations, "num_tokens": len(t.token_ids)})
    return json.dumps(rows, indent=2)


ROLLOUT_ROW_GROUP = 32  # episodes per Parquet row group: the trajectory viewer reads one group to show an episode


def write_rollout_parquet(trajs: list[Trajectory], path: Path, phase: int, step: int,
                          advantages: list[list[float]] | None = None) -> None:
    """One row per episode. Besides the token-exact fields, what the trajectory viewer shows: the episode's
    category, return and turn limit, the token offsets of the turns (``prompt_len``, ``action_ends``; with a history
    window ``segment_starts``, where each turn's own sample begins), the text of
    every turn (first observation, replies, observations), the env's parsed action per turn and whether it was
    invalid, and the per-token advantage the update used (``advantages``, per trajectory; null where the step
    computed none, as in evaluation). Readers must accept
    files without these columns (written before they existed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def col(name: str) -> list[Any]:
        return [getattr(t, name) for t in trajs]

    path.parent.mkdir(parents=True, exist_ok=True)
    ints, strs = pa.list_(pa.int32()), pa.list_(pa.string())
    table = pa.table({
        "task_id": [t.task_id for t in trajs], "group_id": [t.group_id for t in trajs],
        "turns": [t.turns for t in trajs], "token_ids": [t.token_ids for t in trajs],
        "loss_mask": [t.loss_mask for t in trajs], "logprobs": [t.logprobs for t in trajs],
        "turn_rewards": [t.turn_rewards for t in trajs], "finish_reason": [t.finish_reason for t in trajs],
        "success": [t.success for t in trajs], "masked": [t.masked for t in trajs],
        "phase": [phase] * len(trajs), "step": [step] * len(trajs),
        "category": pa.array(col("category"), pa.string()),
        "reward": pa.array([t.reward for t in trajs], pa.float64()),
        "turn_limit": pa.array(col("turn_limit"), pa.int32()),
        "env_truncated": pa.array(col("env_truncated"), pa.bool_()),
        "error": pa.array([t.error for t in trajs], pa.string()),
        "prompt_len": pa.array([t.prompt_len for t in trajs], pa.int32()),
        "action_ends": pa.array([t.action_ends for t in trajs], ints),
        "segment_starts": pa.array([t.segment_starts for t in trajs], ints),
        "first_observation": pa.array(col("first_observation"), pa.string()),
        "replies": pa.array(col("replies"), strs),
        "observations": pa.array(col("observations"), strs),
        "actions": pa.array(col("actions"), strs),
        "invalid_actions": pa.array(col("invalid_actions"), pa.list_(pa.bool_())),
        "advantages": pa.array(advantages if advantages is not None else [None] * len(trajs), pa.list_(pa.float32())),
    })
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp, row_group_size=ROLLOUT_ROW_GROUP)
    os.replace(tmp, path)

