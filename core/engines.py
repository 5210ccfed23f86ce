"""Several rollout engines in one run (``rollout.engines``): the pure choices, without vLLM, processes or disk.

- ``pick_engine``: which engine takes an episode's next turn: the engine that served the episode's previous turn
  (its prefix is in that engine's prefix cache) while it is alive and has room for the request, else the engine with
  the most free KV-cache room (tokens not reserved by requests in flight), then the fewest requests in flight, then
  the lowest index.
- ``PrefixAffinity``: recognises an episode's next turn by its prompt, which starts with the tokens of its previous
  request and reply (the rollout appends the env's observation after them), so turns of one episode stay on one
  engine without the rollout naming episodes to the engines.
- ``stale_engines``: the engines whose loaded weight version is not the run's: a rollout never starts on a mix.
- ``engines_to_restart``: which dead engines the run replaces (its own ones, each up to ``rollout.engine_restarts``
  times) and why the others stay dead.
- ``broadcast_ranks``: the ranks of a learner -> engines weight-broadcast group (learner rank 0, then every engine's
  tensor-parallel workers in order).
- ``split_cores``: CPU engines on one machine get disjoint core ranges.
- ``plan_engines``: the layout of the engines over the run's machine and ``rollout.engine_hosts``, with one-line
  errors for a layout that cannot be (more tensor-parallel GPUs than any host has, more engines than the hosts hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


class NoEngineLeft(RuntimeError):
    """Every rollout engine of the run is dead."""


@dataclass(frozen=True)
class EngineRoom:
    """What the router knows of one engine: alive or not, requests in flight, KV-cache tokens not reserved."""

    alive: bool
    live: int = 0
    free_tokens: int = 0


def pick_engine(rooms: Sequence[EngineRoom], preferred: int | None = None, need: int = 0) -> int:
    """The engine for a request that reserves ``need`` tokens of KV cache: ``preferred`` (the engine holding the
    episode's prefix) when it is alive and has ``need`` tokens free, else the alive engine with the most free tokens,
    then the fewest requests in flight, then the lowest index. Raises ``NoEngineLeft`` when none is alive."""
    alive = [i for i, r in enumerate(rooms) if r.alive]
    if not alive:
        raise NoEngineLeft(f"all {len(rooms)} rollout engines are dead")
    if preferred is not None and 0 <= preferred < len(rooms) and rooms[preferred].alive \
            and rooms[preferred].free_tokens >= need:
        return preferred
    return max(alive, key=lambda i: (rooms[i].free_tokens, -rooms[i].live, -i))


class PrefixAffinity:
    """Which engine served a token sequence: ``remember(engine, seq)`` after a request finished (its prompt and
    reply), ``lookup(prompt)`` finds the longest remembered sequence the prompt starts with and returns its engine
    (the entry is used up: the next turn remembers its own). Equal sequences (the samples of one task, greedy) are
    kept once each, handed out first in, first out. At most ``capacity`` entries (the oldest go first);
    ``forget_engine`` drops a dead engine's entries."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._by_len: dict[int, dict[Hashable, list[int]]] = {}
        self._order: list[tuple[int, Hashable]] = []

    def __len__(self) -> int:
        return sum(len(v) for d in self._by_len.values() for v in d.values())

    def _drop(self, n: int, key: Hashable, engine: int | None = None) -> int | None:
        """Remove one entry of (``n``, ``key``): the oldest, or the oldest of ``engine``. Returns its engine."""
        d = self._by_len.get(n)
        v = None if d is None else d.get(key)
        if not v:
            return None
        k = 0 if engine is None else (v.index(engine) if engine in v else -1)
        if k < 0:
            return None
        e = v.pop(k)
        if not v:
            del d[key]
            if not d:
                del self._by_len[n]
        return e

    def remember(self, engine: int, seq: Sequence[int]) -> None:
        n = len(seq)
        if n == 0:
            return
        key = hash(tuple(seq))
        self._by_len.setdefault(n, {}).setdefault(key, []).append(engine)
        self._order.append((n, key))
        while len(self._order) > self.capacity:
            self._drop(*self._order.pop(0))

    def lookup(self, prompt: Sequence[int]) -> int | None:
        for n in sorted((n for n in self._by_len if n <= len(prompt)), reverse=True):
            e = self._drop(n, hash(tuple(prompt[:n])))
            if e is not None:
                return e
        return None

    def forget_engine(self, engine: int) -> None:
        for n in list(self._by_len):
            for key in list(self._by_len.get(n, {})):
                while self._drop(n, key, engine) is not None:
                    pass


def stale_engines(versions: Sequence[int | None], want: int) -> list[int]:
    """The engines (indices) whose loaded weight version is not ``want`` (None: the engine cannot say)."""
    return [i for i, v in enumerate(versions) if v != want]


def engines_to_restart(dead: Sequence[bool], remote: Sequence[bool], restarts: Sequence[int], limit: int,
                       can_load: bool = True, broadcast: bool = False) -> tuple[list[int], dict[int, str]]:
    """The dead engines to replace with new ones, and why each other dead engine stays dead.

    ``dead[i]``: engine i is gone; ``remote[i]``: it serves on another host (the run joins such engines, it does
    not start them); ``restarts[i]``: how often engine i was replaced already, at most ``limit`` times;
    ``can_load``: a new engine can be given the run's current weights (a learner to load them from, or the run is
    still at the folder's weights); ``broadcast``: the weights go over an NCCL group, whose members are fixed."""
    if not len(dead) == len(remote) == len(restarts):
        raise ValueError("one dead flag, remote flag and restart count per engine")
    if limit < 0:
        raise ValueError(f"the restart limit is >= 0, got {limit}")
    restart: list[int] = []
    why: dict[int, str] = {}
    for i, (d, r, n) in enumerate(zip(dead, remote, restarts)):
        if not d:
            continue
        if r:
            why[i] = "it serves on another host: restart it there, the run joins engines it did not start"
        elif broadcast:
            why[i] = "rollout.engine_sync=broadcast: the NCCL group's members are fixed"
        elif n >= limit:
            why[i] = f"replaced {n} times already (rollout.engine_restarts={limit})"
        elif not can_load:
            why[i] = "no learner to give a new engine the run's current weights"
        else:
            restart.append(i)
    return restart, why


def broadcast_ranks(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """A weight-broadcast group of the learner (rank 0) and every engine's tensor-parallel workers: each engine's
    first rank (its workers take that rank plus their own TP rank) and the group's size."""
    if any(t < 1 for t in tp_sizes):
        raise ValueError("every engine has at least one worker")
    offsets, nxt = [], 1
    for t in tp_sizes:
        offsets.append(nxt)
        nxt += t
    return offsets, nxt


def split_cores(cores: int, engines: int) -> list[str]:
    """Disjoint core ranges for ``engines`` CPU engines on ``cores`` cores, as ``VLLM_CPU_OMP_THREADS_BIND`` takes
    them ("0-3", "4"): the first ``cores % engines`` engines get one core more. Needs ``cores >= engines``."""
    if engines < 1 or cores < engines:
        raise ValueError(f"{engines} CPU engines need at least {engines} cores (one each); this machine has {cores}")
    base, extra = divmod(cores, engines)
    out, start = [], 0
    for i in range(engines):
        n = base + (1 if i < extra else 0)
        out.append(str(start) if n == 1 else f"{start}-{start + n - 1}")
        start += n
    return out


@dataclass(frozen=True)
class EngineHost:
    """A machine that runs engines: its name (node 0 is the run's own machine) and its GPUs (0: a CPU host)."""

    name: str
    gpus: int
    cores: int | None = None  # known for the run's own machine


def parse_engine_host(spec: str) -> EngineHost:
    """``HOST:GPUS`` (``gpu-b:8``), or ``HOST`` for a CPU host. Raises ValueError saying the form."""
    s = spec.strip()
    name, sep, n = s.rpartition(":")
    if not sep:
        name, n = s, "0"
    if not name or not n.isdigit():
        raise ValueError(f"rollout.engine_hosts entry {spec!r}: write HOST:GPUS (e.g. gpu-b:8) or HOST for a CPU host")
    return EngineHost(name, int(n))


@dataclass(frozen=True)
class EnginePlacement:
    engine: int
    host: str  # "node 0" for the run's own machine
    gpus: tuple[int, ...] = ()  # the host's GPU indices the engine takes (empty: a CPU engine)
    cores: str | None = None  # a CPU engine's cores on the run's machine ("0-1")

    @property
    def local(self) -> bool:
        return self.host == LOCAL


LOCAL = "node 0"


def plan_engines(engines: int, tensor_parallel: int, local: EngineHost,
                 hosts: Sequence[EngineHost] = ()) -> tuple[list[EnginePlacement], list[str]]:
    """Where ``engines`` engines of ``tensor_parallel`` GPUs each run: the run's machine (``local``) first when it
    has GPUs or no other host is named, then ``hosts`` in order; each engine takes ``tensor_parallel`` GPUs of one
    host (a CPU host: one engine per core on the run's machine, one per named CPU host; tensor_parallel must be 1).
    Returns (placements, errors); errors are one line each, naming the fix."""
    errors: list[str] = []
    if engines < 1 or tensor_parallel < 1:
        return [], ["rollout.engines and rollout.tensor_parallel_size must be >= 1"]
    candidates = ([local] if local.gpus > 0 or not hosts else []) + list(hosts)
    gpu_hosts = [h for h in candidates if h.gpus > 0]
    if tensor_parallel > 1 and (not gpu_hosts or tensor_parallel > max(h.gpus for h in gpu_hosts)):
        most = max(gpu_hosts, key=lambda h: h.gpus) if gpu_hosts else None
        where = f"the largest host ({most.name}) has {most.gpus}" if most else "no engine host has a GPU"
        return [], [f"rollout.tensor_parallel_size={tensor_parallel} needs {tensor_parallel} GPUs on one host for each "
                    f"engine, but {where}: lower rollout.tensor_parallel_size or add a larger host to "
                    "rollout.engine_hosts (HOST:GPUS)"]
    out: list[EnginePlacement] = []
    room: list[str] = []
    for h in candidates:
        if len(out) == engines:
            break
        if h.gpus > 0:
            fit = h.gpus // tensor_parallel
            room.append(f"{h.name}: {h.gpus} GPUs -> {fit}")
            for k in range(min(fit, engines - len(out))):
                out.append(EnginePlacement(len(out), h.name, tuple(range(k * tensor_parallel, (k + 1) * tensor_parallel))))
        elif h is local:
            cores = h.cores or 1
            n = min(cores, engines - len(out))
            room.append(f"{h.name}: {cores} cores -> {cores}")
            for c in split_cores(cores, n):
                out.append(EnginePlacement(len(out), h.name, (), c))
        else:
            room.append(f"{h.name}: CPU -> 1")
            out.append(EnginePlacement(len(out), h.name))
    if len(out) < engines:
        need = f"{engines} engines of {tensor_parallel} GPUs" if gpu_hosts else f"{engines} CPU engines"
        errors.append(f"rollout.engines={engines}: {need} do not fit the hosts ({'; '.join(room)} engines): lower "
                      "rollout.engines or add hosts to rollout.engine_hosts (HOST:GPUS)")
    return out, errors
