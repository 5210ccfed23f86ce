"""Expert demonstrations through the real env and the rollout's own chat framing, and the behaviour-cloning warm
start built on them (``scalinginter warmstart``).

A demonstration is an ordinary rollout (``runtime.rollout.rollout``) whose generation backend is the env's scripted
expert (``envs/<env>/contract.py: expert_action(observation, info)``): ``ExpertEpisode`` wraps each episode's env
session and asks the expert for the next reply after every reset and step; ``ExpertBackend`` answers the rollout's
generate call with that reply, tokenized as a model would have sampled it (``Action: <action>`` + EOS, cut at the
turn's token cap like a sampled reply). To know which episode a prompt belongs to, the backend inverts the
rollout's per-episode-turn sampling seeds (``runtime.rollout.episode_seed``): the demo rollout gives every
episode-turn its own seed, so each prompt's seed names its episode and turn. Token ids, loss mask, turn offsets,
rewards and finish reasons are therefore exactly what the rollout builds for a model that replied with the
expert's text (``tests/test_demos.py`` checks it against a rollout with a scripted model).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from core.demos import action_reply
from core.redact import redact
from core.trajectory import Trajectory
from envs.base import EnvReply, EpisodeEnv
from runtime.backends.generation import Generation, SamplingParams
from runtime.rollout import EpisodeSpec, RolloutRequest, RolloutRuntime, episode_seed, rollout

Expert = Callable[[str, dict], "str | None"]


class DemoError(ValueError):
    """A warm start that cannot run (no expert, bad counts, no successful demo); the message says the fix."""


def expert_for(env: str) -> Expert:
    """The env's scripted expert: ``expert_action`` of ``envs.<env>.contract`` (or ``envs.<env>_contract``)."""
    for mod in (f"envs.{env}.contract", f"envs.{env}_contract"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name is not None and mod.startswith(e.name):
                continue
            raise
        fn = getattr(m, "expert_action", None)
        if fn is not None:
            return fn
    raise DemoError(f"env {env!r} has no scripted expert (envs/{env}/contract.py defines no expert_action): a "
                    "warm start needs one; pick an env that has it (babyai, textcraft, ...)")


class _Pending:
    """Per episode (the rollout's index): the expert's next reply text (None: the expert gave up) and the turn it
    is for."""

    def __init__(self) -> None:
        self.reply: dict[int, tuple[int, str | None]] = {}
        self.gave_up: set[int] = set()


class ExpertEpisode:
    """An env session whose observations (and info) also go to the expert: after reset and every step it stores
    the expert's next reply for this episode."""

    def __init__(self, inner: EpisodeEnv, index: int, expert: Expert, pending: _Pending):
        self.inner, self.index, self.expert, self.pending = inner, index, expert, pending
        self.steps = 0

    def _ask(self, r: EnvReply) -> EnvReply:
        text = None if r.terminated else self.expert(r.observation, dict(r.info))
        self.pending.reply[self.index] = (self.steps, text)
        return r

    async def reset(self, data_idx: int) -> EnvReply:
        self.steps = 0
        return self._ask(await self.inner.reset(data_idx))

    async def step(self, reply_text: str) -> EnvReply:
        r = await self.inner.step(reply_text)
        self.steps += 1
        return self._ask(r)

    async def close(self) -> None:
        await self.inner.close()


class ExpertBackend:
    """A ``GenerationBackend`` that replies with the expert's text (``Action: <action>`` + EOS). Each prompt's
    per-episode-turn seed (the demo rollout always sets one) names its episode and turn."""

    def __init__(self, tokenizer: Any, pending: _Pending, seed: int, n_episodes: int, max_turns: int):
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pending = pending
        self.owner = {episode_seed(seed, e, t): (e, t) for e in range(n_episodes) for t in range(max_turns + 1)}
        if len(self.owner) != n_episodes * (max_turns + 1):
            raise ValueError("episode seeds collide: use fewer episodes or turns per demo rollout")

    def sync_weights(self) -> None:
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if params.seeds is None or len(params.seeds) != len(prompts):
            raise ValueError("the expert backend needs one per-episode seed per prompt (RolloutRequest.seed)")
        out = []
        for s in params.seeds:
            if s not in self.owner:
                raise ValueError(f"seed {s} belongs to no episode of this demo rollout")
            e, turn = self.owner[s]
            at, text = self.pending.reply.get(e, (None, None))
            if at != turn:
                raise RuntimeError(f"episode {e}: the expert's reply is for turn {at}, the rollout asks for {turn}")
            if text is None:  # the expert gave up: an empty reply (EOS only) ends nothing, the demo is dropped
                self.pending.gave_up.add(e)
                out.append(Generation([self.eos_token_id], [0.0], "stop"))
                continue
            ids, finish = expert_reply_tokens(self.tokenizer, text, params.max_new_tokens)
            out.append(Generation(ids, [0.0] * len(ids), finish))
        return out


def expert_reply_tokens(tokenizer: Any, text: str, max_new_tokens: int) -> tuple[list[int], str]:
    """The expert's text as the ids a model would have sampled: ``Action: <action>`` + EOS ("stop"), or cut at the
    turn's token cap without EOS ("length")."""
    ids = list(tokenizer(action_reply(text), add_special_tokens=False)["input_ids"]) + [int(tokenizer.eos_token_id)]
    if len(ids) > max_new_tokens:
        return ids[:max_new_tokens], "length"
    return ids, "stop"


def expert_reply_ids(tokenizer: Any, text: str | None, max_new_tokens: int) -> list[int] | None:
    """The expert's reply ids for a relabel (``expert_reply_tokens``); None when it has no usable reply."""
    if text is None:
        return None
    try:
        return expert_reply_tokens(tokenizer, text, max_new_tokens)[0]
    except ValueError:  # a text that names no single action: nothing to imitate at this state
        return None


@dataclass
class DemoResult:
    trajectories: list[Trajectory]  # the successful demos, in task order
    task_ids: list[int]  # every attempted task
    attempted: int
    succeeded: int
    gave_up: int  # episodes where the expert had no next action
    finish_reasons: dict[str, int] = field(default_factory=dict)
    wall_time_s: float = 0.0


async def collect_demos_async(task_ids: list[int], make_env: Callable[[int], EpisodeEnv], expert: Expert, chat: Any,
                              turn_limit: int, max_new_tokens: int, token_budget: int, seed: int = 0) -> DemoResult:
    """One expert episode per task (the rollout's framing, loss mask 1 on the expert's replies); keeps the
    successful ones."""
    t0 = time.time()
    pending = _Pending()
    backend = ExpertBackend(chat.tokenizer, pending, seed, len(task_ids), turn_limit)
    specs = [EpisodeSpec(task_id=t, group_id=i) for i, t in enumerate(task_ids)]
    req = RolloutRequest(specs, turn_limit, SamplingParams(max_new_tokens, 0.0), token_budget, seed)
    trajs, _ = await rollout(req, RolloutRuntime(backend, chat, lambda i: ExpertEpisode(make_env(i), i, expert,
                                                                                         pending)))
    reasons: dict[str, int] = {}
    for t in trajs:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    keep = [t for i, t in enumerate(trajs) if t.success and not t.masked and i not in pending.gave_up]
    return DemoResult(keep, list(task_ids), len(trajs), len(keep), len(pending.gave_up), reasons, time.time() - t0)


def collect_demos(*args: Any, **kwargs: Any) -> DemoResult:
    """``collect_demos_async`` from synchronous code."""
    return asyncio.run(collect_demos_async(*args, **kwargs))


def demo_task_ids(cfg: Any, n: int, train_size: int | None) -> list[int]:
    """``n`` train task ids drawn as a training step draws them (``tasks.steps.train_tasks_for_step`` at step 0
    with ``n`` tasks), from ``[0, min(env.task_pool, train split size))``: an env that wraps larger indices onto
    its split (TextCraft) then gives ``n`` distinct tasks while ``n`` <= the split size."""
    from tasks.steps import train_tasks_for_step

    pool = cfg.env.task_pool if train_size is None else min(cfg.env.task_pool, int(train_size))
    c = cfg.model_copy(update={"env": cfg.env.model_copy(update={"task_pool": pool}),
                               "rollout": cfg.rollout.model_copy(update={"tasks_per_step": n})})
    return train_tasks_for_step(c, 0)


def warmstart(cfg: Any, demos: int, epochs: int, lr: float, out: str | Path, batch_size: int = 8,
              turn_limit: int | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """``scalinginter warmstart``: ``demos`` expert episodes of train tasks (in-process env with the config's env
    options; turn limit: the curriculum's largest unless given), ``epochs`` of behaviour cloning on the
    successful ones from ``cfg.model.path``, saved as an HF folder (model + tokenizer, ``warmstart.json``, and a
    ``trainer_state.json`` whose config gives ``scalinginter eval`` the env options). Returns the record. Runs
    inside a ``Runtime`` (the open one, or its own)."""
    from runtime.context import Runtime

    with Runtime.scope():
        return _warmstart(cfg, demos, epochs, lr, out, batch_size, turn_limit, echo)


def _warmstart(cfg: Any, demos: int, epochs: int, lr: float, out: str | Path, batch_size: int,
               turn_limit: int | None, echo: Callable[[str], None]) -> dict[str, Any]:
    from core.chat import ChatFormat
    from envs.base import make_env
    from runtime.backends.hardware import resolve_bf16
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model
    from envs.sessions import local_factory

    if isinstance(demos, bool) or int(demos) != demos or demos < 1:
        raise DemoError(f"--demos must be a whole number >= 1, got {demos!r}")
    if isinstance(epochs, bool) or int(epochs) != epochs or epochs < 1:
        raise DemoError(f"--epochs must be a whole number >= 1, got {epochs!r}")
    if not lr > 0:
        raise DemoError(f"--lr must be > 0, got {lr!r}")
    if batch_size < 1:
        raise DemoError(f"--batch-size must be >= 1, got {batch_size!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DemoError(f"--out {str(out)!r} exists and is not an empty folder: pick another --out or delete it")
    expert = expert_for(cfg.env.name)
    limit = int(turn_limit or max(p.turn_limit for p in cfg.curriculum.as_phases()))
    if limit < 1:
        raise DemoError(f"--turn-limit must be >= 1, got {limit}")
    t0 = time.time()
    echo(f"warm start: {cfg.env.name}, {demos} expert demos of train tasks ({limit} turns, env options "
         f"{json.dumps(cfg.env.options, sort_keys=True)}), {epochs} epoch(s) of behaviour cloning at lr {lr:g}, "
         f"batch {batch_size}, from {cfg.model.path} -> {out}")

    import torch

    torch.set_num_threads(cfg.model.threads or max(1, os.cpu_count() or 1))
    torch.manual_seed(cfg.seed)
    from transformers import AutoTokenizer

    model_dir = resolve_model(cfg.model.path)
    chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(model_dir), cfg.env.prompt)
    probe = make_env(cfg.env.name, **cfg.env.options)
    try:
        train_size = probe.num_tasks("train")
    except Exception:  # noqa: BLE001 - an env that cannot say: draw from env.task_pool as training does
        train_size = None
    finally:
        probe.close()
    ids = demo_task_ids(cfg, int(demos), train_size)
    res = collect_demos(ids, local_factory(cfg.env.name, cfg.env.options), expert, chat, limit,
                        cfg.rollout.max_new_tokens, cfg.rollout.token_budget, seed=cfg.seed)
    tokens = sum(t.num_policy_tokens for t in res.trajectories)
    distinct = len({t.task_id % train_size if train_size else t.task_id for t in res.trajectories})
    echo(f"demos: {res.succeeded}/{res.attempted} succeeded ({distinct} distinct tasks; expert gave up on "
         f"{res.gave_up}; endings {json.dumps(res.finish_reasons, sort_keys=True)}), {tokens} expert tokens to "
         f"imitate, {res.wall_time_s:.1f} s")
    if not res.trajectories:
        raise DemoError(f"no expert demo succeeded ({json.dumps(res.finish_reasons, sort_keys=True)}): raise "
                        f"--turn-limit (now {limit}) or rollout.max_new_tokens (now {cfg.rollout.max_new_tokens}), "
                        "or check the env options")

    learner = TorchLearner(model_dir, LearnerConfig(
        lr=lr, weight_decay=cfg.algo.weight_decay, kl_coef=0.0, grad_clip=cfg.algo.grad_clip,
        micro_batch_size=cfg.algo.micro_batch_size, micro_batch_tokens=cfg.algo.micro_batch_tokens,
        bf16_autocast=resolve_bf16(cfg.model.bf16_autocast),
        temperature=1.0, share_prefix=False, device=cfg.model.device))

    def progress(epoch: int, loss: float, st: dict[str, Any]) -> None:
        echo(f"epoch {epoch}/{epochs}: mean NLL {loss:.4f} over {st['tokens']} tokens, {st['optimizer_steps']} "
             f"optimizer steps, grad norm {st['grad_norm']:.2f}, {st['time_s']:.1f} s")

    losses = learner.sft(res.trajectories, int(epochs), float(lr), batch_size, seed=cfg.seed, on_epoch=progress)
    wall = time.time() - t0
    record = {"env": cfg.env.name, "env_options": cfg.env.options, "source_model": cfg.model.path,
              "demos_requested": int(demos), "demos_succeeded": res.succeeded, "expert_gave_up": res.gave_up,
              "demo_finish_reasons": res.finish_reasons, "demo_task_ids": ids,
              "demo_turn_limit": limit, "max_new_tokens": cfg.rollout.max_new_tokens, "expert_tokens": tokens,
              "epochs": int(epochs), "lr": float(lr), "batch_size": batch_size,
              "micro_batch_size": cfg.algo.micro_batch_size, "seed": cfg.seed, "epoch_losses": losses,
              "wall_time_s": round(wall, 1)}
    out.mkdir(parents=True, exist_ok=True)
    learner.model.config.use_cache = True
    learner.model.save_pretrained(out)
    learner.tokenizer.save_pretrained(out)
    (out / "warmstart.json").write_text(json.dumps(record, indent=2))
    # the env options the demos used, where `scalinginter eval` looks for a checkpoint's training options
    (out / "trainer_state.json").write_text(json.dumps({"warmstart": record, "turn_limit": limit,
                                                        "config": redact(cfg.model_dump(mode="json"))}, indent=2))
    echo(f"warm start done: {res.succeeded}/{res.attempted} demos succeeded, loss {losses[0]:.4f} -> "
         f"{losses[-1]:.4f}, wall time {wall:.0f} s; saved {out} (use --set model.path={out})")
    return record
