"""``EpisodeEnv`` adapters (``envs.base``) for the rollout loop: over HTTP (the env server) or in-process (tests,
notebooks)."""

from __future__ import annotations

import asyncio
from typing import Any

from envs.base import EnvReply, TextEnv
from envs.client import AsyncEnvClient
from envs.errors import EnvConfigError, EnvError, EnvInfraError


class HttpEpisode:
    """One episode on an env server; ``create`` happens lazily at reset."""

    def __init__(self, client: AsyncEnvClient):
        self.client = client
        self.env_id: int | None = None

    async def reset(self, data_idx: int) -> EnvReply:
        try:
            if self.env_id is None:
                self.env_id = await self.client.create()
            r = await self.client.reset(self.env_id, data_idx)
        except EnvError as e:
            if e.code == "split_refused":  # the env has no held-out split to give (e.g. an AgentGym server)
                raise EnvConfigError(str(e)) from e
            if e.code == "bad_data_idx":
                raise EnvConfigError(f"{e}. The run draws train tasks from [0, env.task_pool): set env.task_pool "
                                     "to at most the env's train split size (--set env.task_pool=N)") from e
            raise EnvInfraError(str(e)) from e
        return EnvReply(observation=r.observation, info=dict(r.info), instruction=r.instruction)

    async def step(self, reply_text: str) -> EnvReply:
        assert self.env_id is not None, "reset first"
        try:
            r = await self.client.step(self.env_id, reply_text)
        except EnvError as e:
            raise EnvInfraError(str(e)) from e
        return EnvReply(r.observation, float(r.reward), bool(r.terminated), bool(r.truncated), dict(r.info))

    async def close(self) -> None:
        if self.env_id is not None:
            try:
                await self.client.close(self.env_id)
            except EnvError:
                pass  # the server reaps idle envs anyway


class ServerSlots:
    """The rollout's env servers and their capacities (``None``: unbounded): which server a new episode goes to
    (``core.capacity.pick_server``: the most free slots), and its slot back when the episode closes. With the
    rollout's live cap at most the sum of the capacities, no server is ever asked for more than it holds."""

    def __init__(self, clients: list[Any], capacities: list[int | None]):
        if len(clients) != len(capacities) or not clients:
            raise ValueError("one capacity per client, at least one client")
        self.clients, self.capacities = list(clients), list(capacities)
        self.live = [0] * len(clients)

    def take(self) -> int:
        from core.capacity import pick_server

        i = pick_server(self.capacities, self.live)
        self.live[i] += 1
        return i

    def give_back(self, i: int) -> None:
        self.live[i] -= 1


class PooledEpisode(HttpEpisode):
    """An ``HttpEpisode`` whose server is chosen when it starts (``ServerSlots.take``) and freed when it closes."""

    def __init__(self, slots: ServerSlots):
        super().__init__(None)  # type: ignore[arg-type]
        self.slots = slots
        self.slot: int | None = None

    async def reset(self, data_idx: int) -> EnvReply:
        if self.slot is None:
            self.slot = self.slots.take()
            self.client = self.slots.clients[self.slot]
        return await super().reset(data_idx)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self.slot is not None:
                self.slots.give_back(self.slot)
                self.slot = None


class LocalEpisode:
    """An in-process TextEnv driven through the same interface (steps run in a worker thread)."""

    def __init__(self, env: TextEnv):
        self.env = env

    async def reset(self, data_idx: int) -> EnvReply:
        obs, info = await asyncio.to_thread(self.env.reset, data_idx)
        return EnvReply(observation=obs, info=dict(info), instruction=self.env.instruction())

    async def step(self, reply_text: str) -> EnvReply:
        r = await asyncio.to_thread(self.env.step, reply_text)
        return EnvReply(r.observation, float(r.reward), r.terminated, r.truncated, dict(r.info))

    async def close(self) -> None:
        await asyncio.to_thread(self.env.close)


def local_factory(name: str, options: dict[str, Any] | None = None):
    from envs.base import make_env

    def make(_i: int) -> LocalEpisode:
        return LocalEpisode(make_env(name, **(options or {})))

    return make


__all__ = ["HttpEpisode", "LocalEpisode", "PooledEpisode", "ServerSlots", "local_factory"]
