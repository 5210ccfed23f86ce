"""Multi-turn rollout. Two passes with the same result per episode (same seeds, same token budgets, same reply
handling): lock-step, where every live episode advances one turn per round (one generate call per round for all
live episodes, then their env steps concurrently), and per-episode (``async_episodes``, for backends with a
request-level engine such as vLLM's): every episode runs as its own loop and its next turn is submitted the moment
its observation returns; the engine's continuous batching runs whatever is in flight. Token ids are kept exactly
as sampled.

The loop sees two small protocols: a ``GenerationBackend`` and ``envs.base.EpisodeEnv`` sessions (HTTP or
in-process, ``envs.sessions``), so a vLLM backend or another transport slots in without touching it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Iterator

from core.busyclock import BusyClock
from core.chat import ChatFormat
from core.seeds import episode_seed
from core.trajectory import Trajectory
from envs.base import EnvReply, EpisodeEnv
from envs.errors import EnvConfigError, TaskIndexError
from runtime.backends.generation import Generation, GenerationBackend, RequestDriver, SamplingParams


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


@dataclass(frozen=True)
class RolloutRequest:
    """What to roll out: the episodes (tasks x samples, each with its group), the turn limit, the token budgets
    (per turn: ``params.max_new_tokens``; per trajectory: ``token_budget``) and the sampling seed."""

    specs: list[EpisodeSpec]
    turn_limit: int
    params: SamplingParams
    token_budget: int  # per trajectory; with a history window per turn sample (its prompt + its reply)
    seed: int | None = None  # per-episode-turn seeds (``episode_seed``); None: the backend's own RNG
    history_turns: int | None = None  # each turn's prompt shows the last k turns (``ChatFormat.window_prompt_ids``)

    @classmethod
    def for_tasks(cls, task_ids: list[int], samples: int, turn_limit: int, params: SamplingParams,
                  token_budget: int, seed: int | None = None,
                  history_turns: int | None = None) -> "RolloutRequest":
        """``samples`` episodes of each task; the samples of a task form one group."""
        specs = [EpisodeSpec(task_id=t, group_id=g) for g, t in enumerate(task_ids) for _ in range(samples)]
        return cls(specs, turn_limit, params, token_budget, seed, history_turns)


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
    # the env's scripted expert (observation, info) -> its reply or None: when set, every episode records the
    # expert's reply at each state it acted on (``Trajectory.expert_replies``; the expert term's relabels)
    expert: Callable[[str, dict], "str | None"] | None = None


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
            t.attempt = attempt + 1
            t.earlier_errors = trajs[i].earlier_errors + [trajs[i].error]
            trajs[i] = t
        stats.retried_episodes += len(failed)
        stats.recovered_episodes += sum(t.finish_reason != "env_error" for t in again)
        stats.add_work(st)
    return trajs, stats


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


class _Episodes:
    """One pass's episodes: each one's env session, trajectory, reply texts, seed key (``ids``) and turn limit,
    and the pass's stats; and the steps both passes take per episode, written once so the two treat an episode
    alike: start it from its reset reply, its turn's token cap and seed, record the turn's generation, apply the
    env's reply, close its env; then the pass's result."""

    def __init__(self, req: RolloutRequest, rt: RolloutRuntime, episode_ids: list[int] | None,
                 async_episodes: bool = False):
        self.req, self.chat, self.expert = req, rt.chat, rt.expert
        self.ids, self.limits = _plan(req, rt, episode_ids)
        self.n = len(req.specs)
        self.stats = RolloutStats(episodes=self.n, live_cap=rt.max_live, async_episodes=async_episodes)
        self.t_start = time.time()
        self.envs = [rt.make_env(i) for i in range(self.n)]
        self.trajs = [Trajectory(task_id=s.task_id, group_id=s.group_id) for s in req.specs]
        self.texts: list[list[str]] = [[] for _ in req.specs]
        if req.history_turns is not None and req.history_turns < 0:
            raise ValueError("history_turns must be >= 0 (or None for all turns)")
        # history window: each episode's instruction, observations, sampled reply ids and whether each reply stopped
        self.instructions = [""] * self.n
        self.seen: list[list[str]] = [[] for _ in req.specs]
        self.replies: list[list[list[int]]] = [[] for _ in req.specs]
        self.stopped: list[list[bool]] = [[] for _ in req.specs]

    def reset(self, i: int) -> Awaitable[EnvReply]:
        return self.envs[i].reset(self.req.specs[i].task_id)

    def start(self, i: int, r: EnvReply | Exception) -> bool:
        """Start episode ``i`` from its env's reset reply (the prompt, its first observation and task category);
        True if it goes on to its first turn, False once it ended (env error, or a prompt that leaves no room in
        the token budget)."""
        tr = self.trajs[i]
        if isinstance(r, Exception):
            tr.error = f"reset: {type(r).__name__}: {r}"
            tr.finish("env_error")
            return False
        prompt = self.chat.prompt_ids(r.instruction, r.observation)
        self.instructions[i], self.seen[i] = r.instruction, [r.observation]
        tr.first_observation = r.observation
        if r.info.get("category") is not None:  # the env's task category (per-category eval scores)
            tr.category = str(r.info["category"])
        if r.info.get("required_turns") is not None:  # the fewest turns an expert needs (results by horizon)
            tr.required_turns = int(r.info["required_turns"])
        tr.start(prompt)
        if self.expert is not None:
            tr.expert_replies = []
        if "expert_remaining_turns" in r.info:  # the env reports its expert's remaining turns (shaping's potential)
            tr.expert_remaining = []
        self.label(tr, r)
        if len(prompt) + 1 >= self.req.token_budget:
            tr.finish("token_budget")
            return False
        return True

    def turn_cap(self, i: int) -> int:
        """Episode ``i``'s max new tokens this turn: the per-turn cap, or what its token budget has left if less."""
        return min(self.req.params.max_new_tokens, self.req.token_budget - len(self.trajs[i].context_ids))

    def turn_seed(self, i: int) -> int:
        """Episode ``i``'s sampling seed this turn (the request has a seed)."""
        return episode_seed(self.req.seed, self.ids[i], self.trajs[i].turns)

    def turn_params(self, i: int) -> SamplingParams:
        """Episode ``i``'s sampling params this turn, as one request."""
        seeds = None if self.req.seed is None else (self.turn_seed(i),)
        return SamplingParams(self.turn_cap(i), self.req.params.temperature, self.req.params.top_p, seeds)

    def act(self, i: int, g: Generation) -> None:
        """Record episode ``i``'s turn: the sampled ids and log-probs as they are, and the reply's text."""
        self.trajs[i].add_action(g.token_ids, g.logprobs)
        self.replies[i].append(list(g.token_ids))
        self.stopped[i].append(g.finish == "stop")
        self.stats.generated_tokens += len(g.token_ids)
        self.texts[i].append(self.chat.tokenizer.decode(g.token_ids, skip_special_tokens=True))

    def step(self, i: int) -> Awaitable[EnvReply]:
        """Send episode ``i``'s last reply to its env."""
        return self.envs[i].step(self.texts[i][-1])

    def apply_reply(self, i: int, r: EnvReply | Exception, g: Generation) -> bool:
        """Count the env step and apply its reply to episode ``i``'s turn (``g``); True if the episode goes on."""
        self.stats.env_steps += 1
        if not isinstance(r, Exception):
            self.label(self.trajs[i], r)
        k = self.req.history_turns
        if k is None:
            return _apply_reply(self.trajs[i], r, self.limits[i], self.req.token_budget,
                                lambda obs: self.chat.env_turn_ids(obs, g.finish == "stop"))

        def next_sample(obs: str) -> list[int]:  # the next turn's own prompt (a new sample of the trajectory)
            self.seen[i].append(obs)
            return self.chat.window_prompt_ids(self.instructions[i], self.seen[i], self.replies[i], self.stopped[i], k)

        return _apply_reply(self.trajs[i], r, self.limits[i], self.req.token_budget, next_sample, new_sample=True)

    def label(self, tr: Trajectory, r: EnvReply) -> None:
        """Record what the expert says of the state ``r`` shows, where the episode records it: its reply
        (``expert_replies``; none once the episode terminated) and its remaining turns (``expert_remaining``)."""
        if tr.expert_replies is not None:
            tr.expert_replies.append(None if r.terminated else self.ask_expert(r))
        if tr.expert_remaining is not None:
            tr.expert_remaining.append(_turns_or_none(r.info.get("expert_remaining_turns")))

    def ask_expert(self, r: EnvReply) -> str | None:
        """The expert's reply at the state ``r`` shows (None: it has none, or it failed: a relabel is lost, never
        the episode)."""
        try:
            text = self.expert(r.observation, dict(r.info))
        except Exception:  # noqa: BLE001 - the expert is a training aid; the episode goes on without its label
            return None
        return text if isinstance(text, str) and text.strip() else None

    def close(self, i: int) -> Awaitable[EnvReply | Exception]:
        """Close episode ``i``'s env: a finished episode gives its env (and its pool slot) back at once."""
        return _safe(self.envs[i].close())

    def result(self, idle_s: float) -> tuple[list[Trajectory], RolloutStats]:
        """The pass's trajectories (each with its reply texts) and stats (``idle_s``: the generator's idle time)."""
        for i, t in enumerate(self.trajs):
            t.replies = self.texts[i]
        self.stats.waiting = 0
        self.stats.wall_time_s = time.time() - self.t_start
        self.stats.gen_idle_s = max(0.0, idle_s)
        return self.trajs, self.stats


def _turns_or_none(v) -> int | None:
    """A reported turn count as an int (None: unknown or not a count)."""
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def _apply_reply(tr: Trajectory, r: EnvReply | Exception, limit: int, token_budget: int,
                 next_ids: Callable[[str], list[int]], new_sample: bool = False) -> bool:
    """Record the env's reply to the episode's last action; True if the episode goes on to another turn, False
    once it ended (env error, terminated, turn limit, the env's own step budget, or no room left in the token
    budget). The episode goes on with ``next_ids(observation)``: the observation's env tokens appended to the
    sequence, or (``new_sample``, a history window) the next turn's own prompt, which starts a new sample and
    alone counts against the token budget."""
    if isinstance(r, Exception):
        tr.error = f"step {tr.turns}: {type(r).__name__}: {r}"
        tr.finish("env_error")
        return False
    tr.set_turn_reward(r.reward)
    act = r.info.get("action")  # the env's parsed action, per turn (the trajectory viewer highlights it)
    tr.record_env_reply(r.observation, act if isinstance(act, str) else None, bool(r.info.get("invalid_action", False)))
    if isinstance(r.info.get("episode_metrics"), dict):  # e.g. SciWorld's score, deep search's F1
        tr.episode_metrics = {k: float(v) for k, v in r.info["episode_metrics"].items()}
    success = bool(r.info.get("success", False))
    if r.terminated:
        tr.finish("success" if success else "failure", success)
        return False
    if tr.turns >= limit:
        tr.finish("turn_limit")
        return False
    if r.truncated:  # the env's own step budget ran out
        tr.finish("failure")
        tr.env_truncated = True
        return False
    env_ids = next_ids(r.observation)
    if (0 if new_sample else len(tr.token_ids)) + len(env_ids) + 1 > token_budget:
        tr.finish("token_budget")
        return False
    if new_sample:
        tr.start_segment(env_ids)
    else:
        tr.add_env(env_ids)
    return True


async def _lockstep_pass(req: RolloutRequest, rt: RolloutRuntime,
                         episode_ids: list[int] | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """Rounds: one generate call for every live episode's next turn, then all their env steps."""
    ep = _Episodes(req, rt, episode_ids)
    live_clock = BusyClock()  # episodes live: the generator is idle for this time less its generate calls
    pending = list(range(ep.n))[::-1]  # popped from the end: episodes start in spec order
    cap = ep.n if rt.max_live is None else rt.max_live
    live: list[int] = []

    async def admit() -> None:
        """Reset pending episodes until ``cap`` are live (an env server with a bounded pool — browser contexts,
        JVMs — then never sees more episodes than it can hold)."""
        batch = [pending.pop() for _ in range(min(cap - len(live), len(pending)))]
        ep.stats.waiting = len(pending)
        if not batch:
            return
        t0 = time.time()
        resets = await asyncio.gather(*[_safe(ep.reset(i)) for i in batch])
        ep.stats.env_time_s += time.time() - t0
        ended = []
        for i, r in zip(batch, resets):
            (live if ep.start(i, r) else ended).append(i)
        live_clock.set(len(live))
        await asyncio.gather(*[ep.close(i) for i in ended])

    await admit()
    rnd = 0
    while live or pending:
        if not live:  # every admitted episode ended at reset: admit the next ones
            await admit()
            continue
        rnd += 1
        live[:] = await _lockstep_round(ep, rt.backend, live)
        live_clock.set(len(live))
        if rt.on_round is not None:
            rt.on_round(rnd, len(live) + len(pending), ep.stats)
        await admit()
    return ep.result(idle_s=live_clock.total() - ep.stats.gen_time_s)


async def _lockstep_round(ep: _Episodes, backend: GenerationBackend, live: list[int]) -> list[int]:
    """One round of the lock-step pass: the next turn of every ``live`` episode generated together, then their env
    steps sent concurrently and the replies applied; returns the episodes that go on (the others' envs closed)."""
    t0 = time.time()
    gens = _generate_round(backend, ep, live)
    ep.stats.gen_time_s += time.time() - t0
    for i in live:
        ep.act(i, gens[i])
    t0 = time.time()
    replies = await asyncio.gather(*[_safe(ep.step(i)) for i in live])
    ep.stats.env_time_s += time.time() - t0
    still = [i for i, r in zip(live, replies) if ep.apply_reply(i, r, gens[i])]
    await asyncio.gather(*[ep.close(i) for i in sorted(set(live) - set(still))])
    return still


def _generate_round(backend: GenerationBackend, ep: _Episodes, live: list[int]) -> dict[int, Generation]:
    """One turn's generation for every live episode: one generate call per distinct max_new_tokens (all equal
    unless an episode's token budget binds), each episode-turn with its own seed when the request has one."""
    by_cap: dict[int, list[int]] = {}
    for i in live:
        by_cap.setdefault(ep.turn_cap(i), []).append(i)
    gens = {}
    for n_new, idx in by_cap.items():
        seeds = None if ep.req.seed is None else tuple(ep.turn_seed(i) for i in idx)
        p = SamplingParams(n_new, ep.req.params.temperature, ep.req.params.top_p, seeds)
        for i, g in zip(idx, backend.generate([ep.trajs[i].context_ids for i in idx], p)):
            gens[i] = g
    return gens


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


ROUND_CALLBACK_EVERY_S = 5.0  # per-episode pass: on_round at each new furthest turn, else at most this often


class _Progress:
    """The per-episode pass's ``on_round(turn, remaining, stats)``: called with the furthest turn any episode has
    finished, when that grows, when the last episode ends, and otherwise at most every ``ROUND_CALLBACK_EVERY_S``; the
    stats' generation and env times are brought up to date (``times()``) first."""

    def __init__(self, n: int, on_round: Callable[[int, int, RolloutStats], None] | None, stats: RolloutStats,
                 times: Callable[[], tuple[float, float]]):
        self.n, self.on_round, self.stats, self.times = n, on_round, stats, times
        self.turn, self.at, self.ended = 0, time.monotonic(), 0

    def report(self, turn: int) -> None:
        remaining = self.n - self.ended
        now = time.monotonic()
        if turn > self.turn or remaining == 0 or now - self.at >= ROUND_CALLBACK_EVERY_S:
            self.turn, self.at = max(turn, self.turn), now
            if self.on_round is not None:
                self.stats.gen_time_s, self.stats.env_time_s = self.times()
                self.on_round(self.turn, remaining, self.stats)

    def episode_ended(self, turns: int) -> None:
        self.ended += 1
        self.report(turns)


async def _episodes_pass(req: RolloutRequest, rt: RolloutRuntime,
                         episode_ids: list[int] | None = None) -> tuple[list[Trajectory], RolloutStats]:
    """Every episode as its own loop: reset, then (submit its turn -> await its Generation -> env step -> apply the
    reply) until it ends. A ``RequestDriver`` steps the backend's request-level engine in a worker thread, so env
    calls run meanwhile and an episode's next turn joins the running batch as soon as its observation is back.

    Per episode this is the lock-step pass: the same seeds (``episode_seed`` of its index and turn), per-turn
    token caps, reply handling (``_Episodes``) and admission order; only which episodes share an engine step
    differs. ``stats.gen_time_s`` is the time a request was in flight (the engine busy), ``gen_idle_s`` the time
    with episodes live and none in flight, ``env_time_s`` the time an env call was outstanding. ``rt.on_round``
    reports progress (``_Progress``)."""
    ep = _Episodes(req, rt, episode_ids, async_episodes=True)
    gate = _AdmitGate(ep.n if rt.max_live is None else rt.max_live)
    live_clock, flight_clock, env_clock = BusyClock(), BusyClock(), BusyClock()
    driver = RequestDriver(rt.backend.request_engine())
    progress = _Progress(ep.n, rt.on_round, ep.stats, lambda: (driver.busy_time(), env_clock.total()))

    async def env_call(coro: Awaitable[EnvReply]) -> EnvReply | Exception:
        with _busy(env_clock):
            return await _safe(coro)

    async def generate(i: int) -> Generation:
        p = ep.turn_params(i)
        with _busy(flight_clock):
            return await driver.submit(list(ep.trajs[i].context_ids), p)

    async def play(i: int) -> None:
        """Episode ``i`` from its reset to its end, one turn after another."""
        if not ep.start(i, await env_call(ep.reset(i))):
            return
        with _busy(live_clock):
            while True:
                g = await generate(i)
                ep.act(i, g)
                if not ep.apply_reply(i, await env_call(ep.step(i)), g):
                    return
                progress.report(ep.trajs[i].turns)

    async def episode(i: int) -> None:
        await gate.enter(i)
        ep.stats.waiting = ep.n - gate.next
        try:
            await play(i)
        finally:
            await ep.close(i)
            await gate.leave()
        progress.episode_ended(ep.trajs[i].turns)

    driver.start()
    try:
        await _all_or_cancel([episode(i) for i in range(ep.n)])
    finally:
        await driver.close()
    ep.stats.gen_time_s, ep.stats.env_time_s = driver.busy_time(), env_clock.total()
    return ep.result(idle_s=live_clock.total() - flight_clock.total())


@contextlib.contextmanager
def _busy(clock: BusyClock) -> Iterator[None]:
    """``clock`` counts one more user for the block."""
    clock.enter()
    try:
        yield
    finally:
        clock.exit()


async def _all_or_cancel(coros: list[Awaitable[None]]) -> None:
    """Run ``coros`` as tasks to their end; if one fails (or this is cancelled), cancel the others, wait for them
    to wind down, and raise."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
    async_episodes: bool = True,
    *,
    heal: Callable[[], Awaitable[int]] | None = None,
    retries: int = 0,
) -> tuple[list[Trajectory], RolloutStats]:
    """``rollout`` in the positional form kept for tests and benches: one pass, or with ``retries`` that many more
    passes over the episodes an env failure masked, after ``heal()``."""
    return await rollout(RolloutRequest(specs, turn_limit, params, token_budget, seed),
                         RolloutRuntime(backend, chat, make_env, max_live, retries, heal, on_round, async_episodes))
