"""Multi-turn rollout. Two passes with the same result per episode (same seeds, same token budgets, same reply
handling): lock-step, where every live episode advances one turn per round (one generate call per round for all
live episodes, then their env steps concurrently), and per-episode (``async_episodes``, for backends with a
request-level engine such as vLLM's): every episode runs as its own loop and its next turn is submitted the moment
its observation returns; the engine's continuous batching runs whatever is in flight. Token ids are kept exactly
as sampled.

The loop sees two small protocols: a ``GenerationBackend`` and ``EpisodeEnv`` sessions (HTTP or
in-process), so a vLLM backend or another transport slots in without touching it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Protocol

from core.busyclock import BusyClock
from core.chat import ChatFormat
from core.trajectory import Trajectory
from envs.errors import TaskIndexError
from tasks.backends.generation import GenerationBackend, RequestDriver, SamplingParams


@dataclass
class EnvReply:
    observation: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    instruction: str = ""


class EpisodeEnv(Protocol):
    async def reset(self, data_idx: int) -> EnvReply: ...

    async def step(self, reply_text: str) -> EnvReply: ...

    async def close(self) -> None: ...


class EnvInfraError(RuntimeError):
    """The environment failed (server down, 5xx, timeout): the episode is masked, not scored."""


class EnvConfigError(ValueError):
    """The env refused what the run asked of it (e.g. a task index outside its split): a configuration error,
    raised at once rather than masked, since every episode would fail the same way."""


@dataclass
class EpisodeSpec:
    task_id: int  # data_idx
    group_id: int
    turn_limit: int | None = None  # this episode's own turn budget (an eval sweep); None: the rollout's
    seed_key: int | None = None  # the episode's index in its sampling seed (default: its position in the batch)


@dataclass
class RolloutStats:
    episodes: int = 0
    generated_tokens: int = 0
    env_steps: int = 0
    gen_time_s: float = 0.0
    env_time_s: float = 0.0
    wall_time_s: float = 0.0
    retried_episodes: int = 0  # masked by an env failure, then run again
    recovered_episodes: int = 0  # ... and not masked the second time
    servers_replaced: int = 0
    live_cap: int | None = None  # at most this many episodes live at once (None: all)
    waiting: int = 0  # episodes not started yet because the cap is reached (waiting for env capacity)
    gen_idle_s: float = 0.0  # time with episodes live but no generation running (all waiting on envs)
    async_episodes: bool = False  # the per-episode pass ran (else lock-step)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.gen_time_s if self.gen_time_s else 0.0

    @property
    def env_steps_per_s(self) -> float:
        return self.env_steps / self.env_time_s if self.env_time_s else 0.0

    @property
    def gen_idle_frac(self) -> float:
        """The share of the rollout's wall time the generator sat idle while episodes were live."""
        return self.gen_idle_s / self.wall_time_s if self.wall_time_s else 0.0

    def add_work(self, other: "RolloutStats") -> None:
        """Add another pass's work (tokens, env steps, times) to this one; the episode count stays."""
        for name in ("generated_tokens", "env_steps", "gen_time_s", "env_time_s", "wall_time_s", "gen_idle_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_metrics(self) -> dict[str, float]:
        return {"gen_tokens_per_s": self.tokens_per_s, "env_steps_per_s": self.env_steps_per_s,
                "rollout_time_s": self.wall_time_s, "generated_tokens": float(self.generated_tokens),
                "gen_idle_frac": self.gen_idle_frac,
                "retried_episodes": float(self.retried_episodes), "recovered_episodes": float(self.recovered_episodes),
                "env_servers_replaced": float(self.servers_replaced)}


async def _safe(coro: Awaitable[EnvReply]) -> EnvReply | Exception:
    try:
        return await coro
    except EnvConfigError:
        raise
    except TaskIndexError as e:  # an in-process env refusing the index: the run's config, not the env, is wrong
        raise EnvConfigError(f"{e}. The run draws train tasks from [0, env.task_pool): set env.task_pool to at "
                             "most the env's train split size (--set env.task_pool=N)") from e
    except Exception as e:  # noqa: BLE001 - any env failure masks the episode
        return e


def episode_seed(base: int, episode: int, turn: int) -> int:
    """The sampling seed of one episode's turn: a pure function of the step's base seed, the episode's index in
    the batch and the turn, so it does not depend on which other episodes are still running."""
    return (base * 1_000_003 + episode * 10_007 + turn) % (2**31 - 1)


@dataclass(frozen=True)
class RolloutRequest:
    """What to roll out: the episodes (tasks x samples, each with its group), the turn limit, the token budgets
    (per turn: ``params.max_new_tokens``; per trajectory: ``token_budget``) and the sampling seed."""

    specs: list[EpisodeSpec]
    turn_limit: int
    params: SamplingParams
    token_budget: int
    seed: int | None = None  # per-episode-turn seeds (``episode_seed``); None: the backend's own RNG

    @classmethod
    def for_tasks(cls, task_ids: list[int], samples: int, turn_limit: int, params: SamplingParams,
                  token_budget: int, seed: int | None = None) -> "RolloutRequest":
        """``samples`` episodes of each task; the samples of a task form one group."""
        specs = [EpisodeSpec(task_id=t, group_id=g) for g, t in enumerate(task_ids) for _ in range(samples)]
        return cls(specs, turn_limit, params, token_budget, seed)


@dataclass(frozen=True)
class RolloutRuntime:
    """What runs it: the generation backend and chat framing, the env sessions (``make_env(i)`` for the request's
    episode ``i``), the cap on live episodes, and the retry policy for episodes an env failure masked
    (``heal()`` replaces dead env servers and returns how many)."""

    backend: GenerationBackend
    chat: ChatFormat
    make_env: Callable[[int], EpisodeEnv]
    max_live: int | None = None
    retries: int = 0
    heal: Callable[[], Awaitable[int]] | None = None
    on_round: Callable[[int, int, RolloutStats], None] | None = None
    # run each episode as its own loop when the backend has a request-level engine (``request_engine()``, vLLM);
    # other backends (transformers) run lock-step whatever this says
    async_episodes: bool = True


async def rollout(req: RolloutRequest, rt: RolloutRuntime) -> tuple[list[Trajectory], RolloutStats]:
    """The rollout entry point: every episode of ``req`` to its end, trajectories in the order of ``req.specs``;
    then up to ``rt.retries`` times: ``rt.heal()`` and the episodes an env failure masked run again, from their
    start, with their own seeds. An episode still failing after that stays masked (never scored). Each pass is
    per-episode or lock-step as ``uses_async_episodes`` says."""
    if rt.retries < 0:
        raise ValueError("retries must be >= 0")
    trajs, stats = await _rollout_pass(req, rt)
    for attempt in range(1, rt.retries + 1):
        failed = [i for i, t in enumerate(trajs) if t.finish_reason == "env_error"]
        if not failed:
            break
        if rt.heal is not None:
            stats.servers_replaced += await rt.heal()
        again, st = await _rollout_pass(replace(req, specs=[req.specs[i] for i in failed]),
                                        replace(rt, make_env=lambda j: rt.make_env(failed[j])), episode_ids=failed)
        for i, t in zip(failed, again):
            t.info["attempt"] = attempt + 1
            t.info["earlier_errors"] = trajs[i].info.get("earlier_errors", []) + [trajs[i].error]
            trajs[i] = t
        stats.retried_episodes += len(failed)
        stats.recovered_episodes += sum(t.finish_reason != "env_error" for t in again)
        stats.add_work(st)
    return trajs, stats


async def run_rollout(
    specs: list[EpisodeSpec],
    make_env: Callable[[int], EpisodeEnv],
    backend: GenerationBackend,
    chat: ChatFormat,
    params: SamplingParams,
    turn_limit: int,
    token_budget: int,
    on_round: Callable[[int, int, RolloutStats], None] | None = None,
    seed: int | None = None,
    max_live: int | None = None,
    episode_ids: list[int] | None = None,
    async_episodes: bool = True,
) -> tuple[list[Trajectory], RolloutStats]:
    """One pass, no retries (the positional form kept for tests and benches): ``rollout`` with ``retries=0``."""
    return await _rollout_pass(RolloutRequest(specs, turn_limit, params, token_budget, seed),
                               RolloutRuntime(backend, chat, make_env, max_live, on_round=on_round,
                                              async_episodes=async_episodes),
                               episode_ids=episode_ids)


def uses_async_episodes(rt: RolloutRuntime) -> bool:
    """The per-episode pass runs when asked for and the backend has a request-level engine."""
    return bool(rt.async_episodes) and callable(getattr(rt.backend, "request_engine", None))


def _plan(req: RolloutRequest, rt: RolloutRuntime, episode_ids: list[int] | None) -> tuple[list[int], list[int]]:
    """Check the request; the episodes' seed indices and turn limits."""
    specs = req.specs
    if req.turn_limit < 1 or any(s.turn_limit is not None and s.turn_limit < 1 for s in specs):
        raise ValueError("turn_limit must be >= 1")
    if rt.max_live is not None and rt.max_live < 1:
        raise ValueError("max_live must be >= 1 (or None for all episodes at once)")
    ids = list(range(len(specs))) if episode_ids is None else list(episode_ids)
    if len(ids) != len(specs):
        raise ValueError(f"episode_ids has {len(ids)} entries for {len(specs)} specs")
    ids = [i if s.seed_key is None else s.seed_key for i, s in zip(ids, specs)]
    limits = [req.turn_limit if s.turn_limit is None else s.turn_limit for s in specs]
    return ids, limits


async def _rollout_pass(req: RolloutRequest, rt: RolloutRuntime,
                        episode_ids: list[int] | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """Run every episode of ``req`` once. With ``req.seed``, each episode's turn is sampled with its own seed
    (``episode_seed``), for backends that take per-prompt seeds; ``episode_ids`` (default 0..n-1) are the episodes'
    indices in that seed, so a re-run of some episodes samples as they would have. With ``rt.max_live``, at most
    that many episodes run at once; the next start (in spec order) as others finish."""
    if uses_async_episodes(rt):
        return await _episodes_pass(req, rt, episode_ids)
    return await _lockstep_pass(req, rt, episode_ids)


async def _lockstep_pass(req: RolloutRequest, rt: RolloutRuntime,
                         episode_ids: list[int] | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """Rounds: one generate call for every live episode's next turn, then all their env steps."""
    specs, make_env, backend, chat, on_round, max_live = req.specs, rt.make_env, rt.backend, rt.chat, rt.on_round, rt.max_live
    params, token_budget, seed = req.params, req.token_budget, req.seed
    ids, limits = _plan(req, rt, episode_ids)
    stats = RolloutStats(episodes=len(specs))
    live_clock = BusyClock()  # episodes live: the generator is idle for this time less its generate calls
    t_start = time.time()
    envs = [make_env(i) for i in range(len(specs))]
    trajs = [Trajectory(task_id=s.task_id, group_id=s.group_id) for s in specs]
    texts: list[list[str]] = [[] for _ in specs]

    pending = list(range(len(specs)))[::-1]  # popped from the end: episodes start in spec order
    cap = len(specs) if max_live is None else max_live
    stats.live_cap = max_live
    live: list[int] = []

    async def admit() -> None:
        """Reset pending episodes until ``cap`` are live (an env server with a bounded pool — browser contexts,
        JVMs — then never sees more episodes than it can hold)."""
        batch = [pending.pop() for _ in range(min(cap - len(live), len(pending)))]
        stats.waiting = len(pending)
        if not batch:
            return
        t0 = time.time()
        resets = await asyncio.gather(*[_safe(envs[i].reset(specs[i].task_id)) for i in batch])
        stats.env_time_s += time.time() - t0
        ended = []
        for i, r in zip(batch, resets):
            if isinstance(r, Exception):
                trajs[i].error = f"reset: {type(r).__name__}: {r}"
                trajs[i].finish("env_error")
                ended.append(i)
                continue
            prompt = chat.prompt_ids(r.instruction, r.observation)
            trajs[i].info["first_observation"] = r.observation
            if r.info.get("category") is not None:  # the env's task category (per-category eval scores)
                trajs[i].info["category"] = str(r.info["category"])
            trajs[i].start(prompt)
            if len(prompt) + 1 >= token_budget:
                trajs[i].finish("token_budget")
                ended.append(i)
                continue
            live.append(i)
        live_clock.set(len(live))
        await close(ended)

    async def close(idx: list[int]) -> None:  # a finished episode gives its env (and its pool slot) back at once
        await asyncio.gather(*[_safe(envs[i].close()) for i in idx])

    await admit()
    rnd = 0
    while live or pending:
        if not live:  # every admitted episode ended at reset: admit the next ones
            await admit()
            continue
        rnd += 1
        t0 = time.time()
        gens = _generate_round(backend, trajs, live, params, token_budget, seed, ids)
        stats.gen_time_s += time.time() - t0
        for i in live:
            g = gens[i]
            trajs[i].add_action(g.token_ids, g.logprobs)
            stats.generated_tokens += len(g.token_ids)
            texts[i].append(chat.tokenizer.decode(g.token_ids, skip_special_tokens=True))

        t0 = time.time()
        replies = await asyncio.gather(*[_safe(envs[i].step(texts[i][-1])) for i in live])
        stats.env_time_s += time.time() - t0
        stats.env_steps += len(live)
        still = [i for i, r in zip(live, replies)
                 if _apply_reply(trajs[i], r, limits[i], token_budget, chat, gens[i].finish == "stop")]
        await close(sorted(set(live) - set(still)))
        live[:] = still
        live_clock.set(len(live))
        if on_round is not None:
            on_round(rnd, len(live) + len(pending), stats)
        await admit()

    for i, t in enumerate(trajs):
        t.info["replies"] = texts[i]
    stats.wall_time_s = time.time() - t_start
    stats.gen_idle_s = max(0.0, live_clock.total() - stats.gen_time_s)
    return trajs, stats


class _AdmitGate:
    """Episodes start in spec order, at most ``cap`` live at once: ``enter(i)`` waits for episode ``i``'s turn and
    a free slot, ``leave()`` frees the slot."""

    def __init__(self, cap: int):
        self.cap, self.next, self.live = cap, 0, 0
        self.cond = asyncio.Condition()

    async def enter(self, i: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.next == i and self.live < self.cap)
            self.next += 1
            self.live += 1
            self.cond.notify_all()

    async def leave(self) -> None:
        async with self.cond:
            self.live -= 1
            self.cond.notify_all()


PROGRESS_EVERY_S = 5.0  # per-episode pass: on_round at each new furthest turn, else at most this often


async def _episodes_pass(req: RolloutRequest, rt: RolloutRuntime,
                         episode_ids: list[int] | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """Every episode as its own loop: reset, then (submit its turn -> await its Generation -> env step -> apply the
    reply) until it ends. A ``RequestDriver`` steps the backend's request-level engine in a worker thread, so env
    calls run meanwhile and an episode's next turn joins the running batch as soon as its observation is back.

    Per episode this is the lock-step pass: the same seeds (``episode_seed`` of its index and turn), per-turn
    token caps, ``_apply_reply`` and admission order; only which episodes share an engine step differs.
    ``stats.gen_time_s`` is the time a request was in flight (the engine busy), ``gen_idle_s`` the time with
    episodes live and none in flight, ``env_time_s`` the time an env call was outstanding. ``rt.on_round`` is
    called with the furthest turn any episode has finished, when that grows, when the last episode ends, and
    otherwise at most every ``PROGRESS_EVERY_S``."""
    specs, chat, params, token_budget, seed = req.specs, rt.chat, req.params, req.token_budget, req.seed
    ids, limits = _plan(req, rt, episode_ids)
    n = len(specs)
    stats = RolloutStats(episodes=n, live_cap=rt.max_live, async_episodes=True)
    t_start = time.time()
    envs = [rt.make_env(i) for i in range(n)]
    trajs = [Trajectory(task_id=s.task_id, group_id=s.group_id) for s in specs]
    texts: list[list[str]] = [[] for _ in specs]
    gate = _AdmitGate(n if rt.max_live is None else rt.max_live)
    live_clock, flight_clock, env_clock = BusyClock(), BusyClock(), BusyClock()
    driver = RequestDriver(rt.backend.request_engine())
    progress = {"turn": 0, "at": time.monotonic(), "ended": 0}

    def report(turn: int) -> None:
        remaining = n - progress["ended"]
        now = time.monotonic()
        if turn > progress["turn"] or remaining == 0 or now - progress["at"] >= PROGRESS_EVERY_S:
            progress["turn"], progress["at"] = max(turn, progress["turn"]), now
            if rt.on_round is not None:
                stats.gen_time_s, stats.env_time_s = driver.busy_time(), env_clock.total()
                rt.on_round(progress["turn"], remaining, stats)

    async def env_call(coro: Awaitable[EnvReply]) -> EnvReply | Exception:
        env_clock.enter()
        try:
            return await _safe(coro)
        finally:
            env_clock.exit()

    async def play(i: int) -> None:
        tr = trajs[i]
        r = await env_call(envs[i].reset(specs[i].task_id))
        if isinstance(r, Exception):
            tr.error = f"reset: {type(r).__name__}: {r}"
            tr.finish("env_error")
            return
        prompt = chat.prompt_ids(r.instruction, r.observation)
        tr.info["first_observation"] = r.observation
        if r.info.get("category") is not None:
            tr.info["category"] = str(r.info["category"])
        tr.start(prompt)
        if len(prompt) + 1 >= token_budget:
            tr.finish("token_budget")
            return
        live_clock.enter()
        try:
            while True:
                p = SamplingParams(min(params.max_new_tokens, token_budget - len(tr.token_ids)), params.temperature,
                                   params.top_p, None if seed is None else (episode_seed(seed, ids[i], tr.turns),))
                flight_clock.enter()
                try:
                    g = await driver.submit(list(tr.token_ids), p)
                finally:
                    flight_clock.exit()
                tr.add_action(g.token_ids, g.logprobs)
                stats.generated_tokens += len(g.token_ids)
                texts[i].append(chat.tokenizer.decode(g.token_ids, skip_special_tokens=True))
                r = await env_call(envs[i].step(texts[i][-1]))
                stats.env_steps += 1
                if not _apply_reply(tr, r, limits[i], token_budget, chat, g.finish == "stop"):
                    return
                report(tr.turns)
        finally:
            live_clock.exit()

    async def episode(i: int) -> None:
        await gate.enter(i)
        stats.waiting = n - gate.next
        try:
            await play(i)
        finally:
            await _safe(envs[i].close())  # a finished episode gives its env (and its pool slot) back at once
            await gate.leave()
        progress["ended"] += 1
        report(trajs[i].turns)

    driver.start()
    tasks = [asyncio.create_task(episode(i)) for i in range(n)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        await driver.close()

    for i, t in enumerate(trajs):
        t.info["replies"] = texts[i]
    stats.waiting = 0
    stats.gen_time_s, stats.env_time_s = driver.busy_time(), env_clock.total()
    stats.wall_time_s = time.time() - t_start
    stats.gen_idle_s = max(0.0, live_clock.total() - flight_clock.total())
    return trajs, stats


def _generate_round(backend: GenerationBackend, trajs: list[Trajectory], live: list[int], params: SamplingParams,
                    token_budget: int, seed: int | None, ids: list[int]) -> dict[int, Any]:
    """One turn's generation for every live episode: one generate call per distinct max_new_tokens (all equal
    unless an episode's token budget binds), each episode-turn with its own seed when ``seed`` is set."""
    by_cap: dict[int, list[int]] = {}
    for i in live:
        by_cap.setdefault(min(params.max_new_tokens, token_budget - len(trajs[i].token_ids)), []).append(i)
    gens = {}
    for n_new, idx in by_cap.items():
        seeds = None if seed is None else tuple(episode_seed(seed, ids[i], trajs[i].turns) for i in idx)
        p = SamplingParams(n_new, params.temperature, params.top_p, seeds)
        for i, g in zip(idx, backend.generate([trajs[i].token_ids for i in idx], p)):
            gens[i] = g
    return gens


def _apply_reply(tr: Trajectory, r: EnvReply | Exception, limit: int, token_budget: int, chat: ChatFormat,
                 stopped: bool) -> bool:
    """Record the env's reply to the episode's last action; True if the episode goes on to another turn (its
    observation appended as env tokens), False once it ended (env error, terminated, turn limit, the env's own
    step budget, or no room left in the token budget)."""
    if isinstance(r, Exception):
        tr.error = f"step {tr.turns}: {type(r).__name__}: {r}"
        tr.finish("env_error")
        return False
    tr.set_turn_reward(r.reward)
    tr.info.setdefault("observations", []).append(r.observation)
    act = r.info.get("action")  # the env's parsed action, per turn (the trajectory viewer highlights it)
    tr.info.setdefault("actions", []).append(act if isinstance(act, str) else None)
    tr.info.setdefault("invalid_actions", []).append(bool(r.info.get("invalid_action", False)))
    if isinstance(r.info.get("episode_metrics"), dict):  # e.g. SciWorld's score, deep search's F1
        tr.info["episode_metrics"] = {k: float(v) for k, v in r.info["episode_metrics"].items()}
    success = bool(r.info.get("success", False))
    if r.terminated:
        tr.finish("success" if success else "failure", success)
        return False
    if tr.turns >= limit:
        tr.finish("turn_limit")
        return False
    if r.truncated:  # the env's own step budget ran out
        tr.finish("failure")
        tr.info["env_truncated"] = True
        return False
    env_ids = chat.env_turn_ids(r.observation, stopped)
    if len(tr.token_ids) + len(env_ids) + 1 > token_budget:
        tr.finish("token_budget")
        return False
    tr.add_env(env_ids)
    return True


async def run_rollout_retrying(
    specs: list[EpisodeSpec],
    make_env: Callable[[int], EpisodeEnv],
    backend: GenerationBackend,
    chat: ChatFormat,
    params: SamplingParams,
    turn_limit: int,
    token_budget: int,
    on_round: Callable[[int, int, RolloutStats], None] | None = None,
    seed: int | None = None,
    max_live: int | None = None,
    *,
    heal: Callable[[], Awaitable[int]] | None = None,
    retries: int = 1,
) -> tuple[list[Trajectory], RolloutStats]:
    """``rollout`` in the positional form: ``run_rollout`` plus ``retries`` passes over the episodes an env failure
    masked, after ``heal()``."""
    return await rollout(RolloutRequest(specs, turn_limit, params, token_budget, seed),
                         RolloutRuntime(backend, chat, make_env, max_live, retries, heal, on_round))
