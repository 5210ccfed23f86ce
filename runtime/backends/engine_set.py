"""Several data-parallel vLLM rollout engines behind one generation backend (``rollout.engines`` > 1).

Why our own engine processes and not vLLM's data-parallel deployment: the run drives its engine request by request
(``VLLMRequests``: add / step / abort on the ``LLMEngine`` inside ``vllm.LLM``), loads weights in place through its
worker extension (``collective_rpc``), releases the KV cache while the learner updates, and must know which engine
holds which episode, which engine died and which weight version each engine holds. vLLM's data-parallel mode is
built for its API server and ``AsyncLLM`` (one front end balancing over DP ranks it hides; the offline ``LLM`` class
runs one DP rank per process), so none of that would be addressable per engine. Here each engine is the run's
existing ``VLLMBackend`` started with its engine core in its own process (``in_process=False``): N engines are N
engine-core processes working at once, each bound to its own CPU cores (``core.engines.split_cores``) or GPUs
(``CUDA_VISIBLE_DEVICES`` per engine), each with its own KV cache sized for its share of the batch.

Routing (``core.engines.pick_engine``): an episode's first turn goes to the engine with the most free KV-cache room
(the cache's tokens less those reserved by requests in flight: prompt + max new tokens each), then the fewest
requests in flight; its later turns go back to the engine that served the previous one (``PrefixAffinity``: the
new prompt starts with the previous prompt and reply, which that engine's prefix cache holds) while it is alive and
has room. Lock-step rounds (``generate``) split the round's prompts the same way and run every engine's share at
once; the per-episode pass (``request_engine``) steps each engine in its own thread.

An engine that dies (its engine-core process gone, an engine error): its turns in flight are dropped there and sent
again, with the same prompt and the same per-request seed, to the engines left (the same weights, checked below),
so the episode goes on where it was and is neither lost nor scored; the rollout's own env-failure masking and retry
are untouched. With no engine left the rollout fails (``NoEngineLeft``), which is no score either. Before the next
weight sync or rollout round, an engine the run started and that died is replaced (``restart_dead``): a new engine
in its slot (the same cores or GPUs, the same settings) gets the run's current weights, up to
``rollout.engine_restarts`` times per slot (``core.engines.engines_to_restart`` says which are not and why: engines
on other hosts, an NCCL broadcast group, the limit).

Weights: every engine loads the same weights after each update and records their version in its worker
(``weight_broadcast.EngineWeightsWorker``); before a rollout uses the set, every engine's version is read back and an
engine that holds another one is loaded again from the learner (or the rollout is refused): a step never mixes
weights. ``rollout.engine_sync``: ``memory`` (the learner's tensors cast once into one shared-memory segment; every
engine's worker loads from it, all at once), ``folder`` (the learner writes an HF folder once; every engine reloads
from it: engines that share a file system), ``broadcast`` (GPUs: vLLM's RLHF route, an NCCL group of the learner and
every engine worker; ``weight_broadcast``).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from core.engines import (LOCAL, EngineHost, EngineRoom, NoEngineLeft, PrefixAffinity, engines_to_restart,
                          parse_engine_host, pick_engine, plan_engines, stale_engines)
from runtime.backends.generation import Generation, SamplingParams, drain
from runtime.backends.vllm_backend import VLLMBackend, VLLMRequests, safetensors_files
from runtime.console import restore_env

_STOP = object()


def local_host() -> EngineHost:
    """The run's machine as an engine host: its GPUs (CUDA devices torch sees; none on the CPU build) and cores."""
    gpus = 0
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            import torch

            gpus = torch.cuda.device_count()
    except ImportError:
        pass
    return EngineHost(LOCAL, gpus, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def engine_pids(engine: VLLMBackend) -> list[int]:
    """The engine-core process ids of an engine started with ``in_process=False``."""
    core = getattr(getattr(engine._llm, "llm_engine", None), "engine_core", None)
    mgr = getattr(getattr(core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(mgr, "processes", None) or []]


def engine_dead(engine: VLLMBackend) -> bool:
    """Whether an engine is gone: closed, marked dead by vLLM's client, or its engine-core process exited (an engine
    on another host: its server stopped answering)."""
    if engine._llm is None:
        return True
    if getattr(engine, "remote", False):
        return not engine.healthy()
    core = getattr(engine._llm.llm_engine, "engine_core", None)
    res = getattr(core, "resources", None)
    if res is not None and getattr(res, "engine_dead", False):
        return True
    procs = getattr(getattr(res, "engine_manager", None), "processes", None) or []
    return any(not p.is_alive() for p in procs)


def engine_kv_tokens(engine: VLLMBackend, fallback: int) -> int:
    """A local engine's KV cache in tokens as vLLM sized it (its blocks x block size, the measure a remote engine
    publishes in its metrics), else ``fallback`` (the plan's bytes over the bytes per token)."""
    try:
        cc = engine._llm.llm_engine.vllm_config.cache_config
        return int(cc.num_gpu_blocks) * int(cc.block_size) if cc.num_gpu_blocks else int(fallback)
    except (AttributeError, TypeError):
        return int(fallback)


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        restore_env(saved)


class EngineSet:
    """N ``VLLMBackend`` engines as one generation backend (the ``GenerationBackend`` protocol, ``request_engine``,
    the weight loads and sleep/wake the run's ``EnginePool`` and steps call). ``capacity_tokens``: each engine's KV
    cache in tokens (the router's room). ``restart``: ``restart(i)`` starts a new engine for slot ``i`` and returns it
    with its KV capacity in tokens (None: dead engines stay dead); ``restart_limit``: how often each slot may be
    replaced."""

    def __init__(self, engines: list[VLLMBackend], capacity_tokens: list[int], sync: str = "memory",
                 named_weights: Callable[[], Iterable[tuple[str, Any]]] | None = None,
                 export_weights: Callable[[Path], None] | None = None, broadcast_device: Any = None,
                 sync_dir: str | os.PathLike | None = None, weight_store: Any = None,
                 restart: Callable[[int], tuple[VLLMBackend, int]] | None = None, restart_limit: int = 0):
        if not engines or len(capacity_tokens) != len(engines):
            raise ValueError("one KV capacity per engine")
        if sync not in ("memory", "folder", "broadcast"):
            raise ValueError(f"unknown engine sync {sync!r}: memory, folder or broadcast")
        self.engines = engines
        self.capacity = [int(c) for c in capacity_tokens]
        self.sync_mode = sync
        self.alive = [True] * len(engines)
        self.reserved = [0] * len(engines)
        self.live = [0] * len(engines)
        self.routed = [0] * len(engines)  # requests (turns) each engine took
        self.first_turns = [0] * len(engines)  # requests that continued no remembered prefix (an episode's first)
        self.resubmitted = 0  # turns sent again to another engine after theirs died
        self._restart, self.restart_limit = restart, int(restart_limit)
        self.restarts = [0] * len(engines)  # times each slot's engine was replaced
        self.restart_time_s = 0.0
        self._kept_dead: set[int] = set()  # dead engines already said to stay dead
        self.affinity = PrefixAffinity()
        self.lock = threading.RLock()
        self.version = 0  # the weights every engine must hold (0: the folder they started from)
        self.broadcast_device = broadcast_device
        self.sync_dir = str(sync_dir) if sync_dir else None  # where weight folders are written (None: temp folder)
        # an s3:// sync_dir: put(folder, base_uri) -> uri / delete(uri) (storage.engine_weights.StoreHandover)
        self.weight_store = weight_store
        if self._s3 and weight_store is None:
            raise ValueError("an s3:// engine sync dir needs a weight store (storage.engine_weights.StoreHandover)")
        if sync == "broadcast" and any(self.is_remote(i) for i in range(len(engines))):
            raise ValueError("rollout.engine_sync=broadcast reaches engines on this machine only: engines on other "
                             "hosts (rollout.engine_urls) reload a folder")
        self._broadcaster = None
        self._active: RoutedRequests | None = None
        e0 = engines[0]
        self.eos_token_id, self.max_model_len, self.dtype = e0.eos_token_id, e0.max_model_len, e0.dtype
        # the hooks and counters EnginePool and the steps read or set on a backend
        self.named_weights, self.export_weights = named_weights, export_weights
        self.adapter = self.merged = self.lora_request = None
        self.transport, self.keep_sync_segment = "shm", False
        self.max_live_episodes: int | None = None
        self.sync_time_s, self.syncs, self.base_sha256, self.last_sync = 0.0, 0, None, {}
        self.start_time_s = sum(getattr(e, "start_time_s", 0.0) for e in engines)
        # an engine on another host holds whatever it last loaded: it gets the run's weights in join_remote
        self._set_versions([i for i in range(len(engines)) if not self.is_remote(i)], 0)

    def is_remote(self, i: int) -> bool:
        return bool(getattr(self.engines[i], "remote", False))

    @property
    def _s3(self) -> bool:
        return bool(self.sync_dir) and self.sync_dir.startswith("s3://")

    def _folder(self) -> Path:
        """A fresh folder for one weight load: in ``sync_dir`` when it is a shared folder (engines on other hosts
        read it there), else in the temp folder (with an ``s3://`` sync_dir it is uploaded from there)."""
        local = self.sync_dir if self.sync_dir and not self._s3 else None
        if local:
            Path(local).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="vllm-sync-", dir=local))

    @contextmanager
    def _remote_source(self, folder: str | os.PathLike) -> Iterator[str]:
        """Where the engines on other hosts load ``folder`` from: with an ``s3://`` sync_dir, the folder stored there
        (uploaded once, checked by its manifest on download, deleted afterwards); else the folder itself when it lies
        in the shared sync_dir, or a copy made there."""
        if self._s3:
            uri = self.weight_store.put(folder, self.sync_dir)
            try:
                yield uri
            finally:
                self.weight_store.delete(uri)
            return
        path = Path(folder).resolve()
        shared = Path(self.sync_dir).resolve() if self.sync_dir else Path(tempfile.gettempdir()).resolve()
        if shared in path.parents:
            yield str(path)
            return
        copy = self._folder()
        try:
            for f in path.iterdir():
                if f.is_file():
                    shutil.copy2(f, copy / f.name)
            yield str(copy)
        finally:
            shutil.rmtree(copy, ignore_errors=True)

    def join_remote(self, model_dir: str | os.PathLike) -> list[int]:
        """The engines on other hosts get the run's weights (version 0): each must read what the run writes into
        ``sync_dir`` (a probe written there; refused with the fix otherwise), then the learner's weights (with no
        learner, the model folder's) are handed over the way every later sync hands them. Returns the engines
        joined."""
        idx = [i for i in self.live_indices() if self.is_remote(i)]
        if not idx:
            return []
        probe = self._folder()
        (probe / "probe.txt").write_text("engine host probe\n")
        uri = self.weight_store.put(probe, self.sync_dir, f"probe-{uuid.uuid4().hex[:12]}") if self._s3 else None
        try:
            for i in idx:
                self.engines[i].check_reads(uri or str(probe / "probe.txt"), self.sync_dir)
        finally:
            shutil.rmtree(probe, ignore_errors=True)
            if uri:
                self.weight_store.delete(uri)
        if self.named_weights is not None or self.export_weights is not None:
            self._load_learner(idx, 0)
        else:
            self._load_dir(idx, model_dir, 0)
        return idx

    # -- what the pool and the steps look at ----------------------------------------------------------------
    @property
    def _llm(self):
        """A live engine's ``LLM`` (None once every engine is closed or dead): the pool's liveness check."""
        for i in self.live_indices():
            return self.engines[i]._llm
        return None

    def live_indices(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a and self.engines[i]._llm is not None]

    def stats(self) -> dict[str, Any]:
        return {"engines": len(self.engines), "alive": sum(self.alive), "routed": list(self.routed),
                "first_turns": list(self.first_turns), "resubmitted": self.resubmitted, "version": self.version,
                "restarts": list(self.restarts)}

    def is_dead(self, i: int) -> bool:
        return not self.alive[i] or engine_dead(self.engines[i])

    def mark_dead(self, i: int, why: object) -> None:
        with self.lock:
            if not self.alive[i]:
                return
            self.alive[i] = False
            self.affinity.forget_engine(i)
        print(f"warning: rollout engine {i} died ({why}): its turns in flight go to the "
              f"{len(self.live_indices())} engines left", flush=True)

    def restart_dead(self, load: bool = True) -> list[int]:
        """Dead engines the run started replaced by new ones in their slots (``core.engines.engines_to_restart``);
        with ``load``, each new engine then gets the run's current weights (the learner's; at version 0 it already
        holds them: it started from the same folder). A start that fails leaves the slot dead (said, not raised:
        the engines left carry on). Returns the slots replaced."""
        if self._restart is None:
            return []
        dead = [self.is_dead(i) for i in range(len(self.engines))]
        if not any(dead):
            return []
        for i in (i for i, d in enumerate(dead) if d):
            self.mark_dead(i, "found dead before the next rollout")
        can_load = self.version == 0 or self.named_weights is not None or self.export_weights is not None
        idx, why = engines_to_restart(dead, [self.is_remote(i) for i in range(len(self.engines))], self.restarts,
                                      self.restart_limit, can_load, self.sync_mode == "broadcast")
        for i, reason in why.items():
            if i not in self._kept_dead:
                self._kept_dead.add(i)
                print(f"warning: rollout engine {i} stays dead ({reason}); the {len(self.live_indices())} engines "
                      "left carry on", flush=True)
        replaced = []
        for i in idx:
            t0 = time.time()
            try:
                self.engines[i].close()  # what is left of it: its client, its sockets
            except Exception:  # noqa: BLE001 - the engine is dead: its close may fail too
                pass
            self.restarts[i] += 1
            engine = None
            try:
                engine, cap = self._restart(i)
                engine._llm.collective_rpc("set_weight_version", args=(0,))
            except Exception as e:  # noqa: BLE001 - a start that fails leaves the slot dead, the others carry on
                if engine is not None:
                    try:
                        engine.close()
                    except Exception:  # noqa: BLE001
                        pass
                print(f"warning: rollout engine {i} could not be replaced ({type(e).__name__}: {e}); the "
                      f"{len(self.live_indices())} engines left carry on", flush=True)
                continue
            with self.lock:
                self.engines[i], self.capacity[i] = engine, int(cap)
                self.reserved[i] = self.live[i] = 0
                self.alive[i] = True
                self._kept_dead.discard(i)
            self.restart_time_s += time.time() - t0
            replaced.append(i)
            print(f"rollout engine {i} replaced by a new engine in {time.time() - t0:.1f} s (replacement "
                  f"{self.restarts[i]} of at most {self.restart_limit})", flush=True)
        if replaced and load and self.version != 0:
            self._load_learner(replaced)
        return replaced

    # -- routing ------------------------------------------------------------------------------------------
    def rooms(self) -> list[EngineRoom]:
        return [EngineRoom(self.alive[i] and not engine_dead(self.engines[i]), self.live[i],
                           self.capacity[i] - self.reserved[i]) for i in range(len(self.engines))]

    def route(self, prompt: list[int], need: int) -> int:
        """The engine for a request of ``need`` KV tokens (``core.engines.pick_engine``), its room reserved."""
        with self.lock:
            preferred = self.affinity.lookup(prompt)
            i = pick_engine(self.rooms(), preferred, need)
            self.reserved[i] += need
            self.live[i] += 1
            self.routed[i] += 1
            if preferred is None:
                self.first_turns[i] += 1
            return i

    def finished(self, i: int, need: int, seq: list[int] | None = None) -> None:
        """A request on engine ``i`` is over: its room freed; ``seq`` (prompt + reply) remembered for the next turn."""
        with self.lock:
            self.reserved[i] -= need
            self.live[i] -= 1
            if seq is not None and self.alive[i]:
                self.affinity.remember(i, seq)

    # -- generation ---------------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self.engines[0]._check_prompts(prompts, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One lock-step round: each prompt routed, every engine's share generated at once; the share of an engine
        that dies meanwhile goes to the others (same prompts, same seeds)."""
        if not prompts:
            return []
        self._check_prompts(prompts, params)
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(f"{len(params.seeds)} seeds for {len(prompts)} prompts")
        self._close_active()
        self.check_versions()
        need = [len(p) + params.max_new_tokens for p in prompts]
        out: list[Generation | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        with cf.ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="engine-set") as pool:
            while todo:
                shares: dict[int, list[int]] = {}
                for j in todo:
                    shares.setdefault(self.route(prompts[j], need[j]), []).append(j)
                futs = {pool.submit(self._generate_on, i, [prompts[j] for j in idx], params, idx): i
                        for i, idx in shares.items()}
                todo = []
                pending = set(futs)
                while pending:
                    done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                    for f in done:
                        i, idx = futs[f], shares[futs[f]]
                        try:
                            gens = f.result()
                        except Exception as e:  # noqa: BLE001 - an engine error: dead engines hand over their share
                            for j in idx:
                                self.finished(i, need[j])
                            if not self.is_dead(i):
                                raise
                            self.mark_dead(i, f"{type(e).__name__}: {e}")
                            self.resubmitted += len(idx)
                            todo += idx
                            continue
                        for j, g in zip(idx, gens):
                            out[j] = g
                            self.finished(i, need[j], list(prompts[j]) + list(g.token_ids))
                    for f in list(pending):  # an engine whose process died without its call returning
                        i = futs[f]
                        if self.is_dead(i) and not f.done():
                            pending.discard(f)
                            for j in shares[i]:
                                self.finished(i, need[j])
                            self.mark_dead(i, "engine process gone")
                            self.resubmitted += len(shares[i])
                            todo += shares[i]
        return out  # type: ignore[return-value]

    def _generate_on(self, i: int, prompts: list[list[int]], params: SamplingParams, idx: list[int]) -> list[Generation]:
        seeds = None if params.seeds is None else tuple(params.seeds[j] for j in idx)
        return self.engines[i].generate(prompts, SamplingParams(params.max_new_tokens, params.temperature,
                                                                params.top_p, seeds))

    def request_engine(self) -> "RoutedRequests":
        """The request-level interface over every live engine (a ``StepEngine``), after the version check."""
        self._close_active()
        self.check_versions()
        for i in self.live_indices():
            self.engines[i].wake()
        self._active = RoutedRequests(self)
        return self._active

    def _close_active(self) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.close()

    def prompt_logprobs(self, seqs: list[list[int]], engine: int | None = None) -> list[list[float]]:
        """``VLLMBackend.prompt_logprobs`` on engine ``engine`` (default: the first live one)."""
        self._close_active()
        i = self.live_indices()[0] if engine is None else engine
        return self.engines[i].prompt_logprobs(seqs)

    # -- weights ------------------------------------------------------------------------------------------
    def weight_versions(self) -> list[int | None]:
        """Each engine's weight version as its worker reports it (None: dead, or its workers disagree)."""
        out: list[int | None] = []
        for i, e in enumerate(self.engines):
            if self.is_dead(i):
                out.append(None)
                continue
            try:  # an engine on another host answers in strings ("3", "None")
                got = {None if v in (None, "None") else int(v) for v in e._llm.collective_rpc("weight_version")}
            except Exception as exc:  # noqa: BLE001 - an engine that cannot answer is dead to the rollout
                if not self.is_dead(i):
                    raise
                self.mark_dead(i, f"{type(exc).__name__}: {exc}")
                out.append(None)
                continue
            out.append(got.pop() if len(got) == 1 else None)
        return out

    def check_versions(self) -> None:
        """Every live engine must hold version ``self.version``: an engine that does not is loaded again from the
        learner (its weights now are that version: nothing updated them since the sync) and read back; refused
        when there is nothing to load from, or when it still differs. Dead engines are replaced first
        (``restart_dead``)."""
        self.restart_dead()
        versions = self.weight_versions()
        stale = [i for i in stale_engines(versions, self.version) if not self.is_dead(i)]
        if not stale:
            return
        if self.named_weights is None and self.export_weights is None:
            raise RuntimeError(f"rollout engines {stale} hold weight versions {[versions[i] for i in stale]}, the "
                               f"run's is {self.version}, and there is no learner to load them from: refusing to "
                               "roll out on mixed weights")
        print(f"warning: rollout engines {stale} hold weight versions {[versions[i] for i in stale]}, not "
              f"{self.version}: loading the learner's weights into them again", flush=True)
        self._load_learner(stale)
        versions = self.weight_versions()
        still = [i for i in stale_engines(versions, self.version) if not self.is_dead(i)]
        if still:
            raise RuntimeError(f"rollout engines {still} still hold weight versions {[versions[i] for i in still]} "
                               f"after a reload, not {self.version}: refusing to roll out on mixed weights")

    def _set_versions(self, idx: Iterable[int], v: int) -> None:
        for i in idx:
            self.engines[i]._llm.collective_rpc("set_weight_version", args=(v,))

    def _each(self, idx: list[int], fn: Callable[[int], Any]) -> None:
        """``fn(i)`` for every engine in ``idx`` at once; an engine that died meanwhile is marked dead, any other
        failure raised."""
        if not idx:
            raise NoEngineLeft("no live rollout engine to load weights into")
        with cf.ThreadPoolExecutor(max_workers=len(idx), thread_name_prefix="engine-load") as pool:
            futs = {pool.submit(fn, i): i for i in idx}
            for f in cf.as_completed(futs):
                i = futs[f]
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001
                    if not self.is_dead(i):
                        raise
                    self.mark_dead(i, f"{type(e).__name__}: {e}")

    def _load_entries(self, idx: list[int], entries, version: int) -> None:
        """``(name, shape, fetch)`` entries cast once into one shared-memory segment, loaded by every engine in
        ``idx`` at once (the single engine's in-memory path, ``VLLMBackend._push_entries``, written once for all);
        engines on other hosts get them as a safetensors folder in ``sync_dir``."""
        import torch
        from multiprocessing import shared_memory

        dt = getattr(torch, self.dtype)
        remote = [i for i in idx if self.is_remote(i)]
        if remote:
            from safetensors.torch import save_file

            folder = self._folder()
            try:
                save_file({n: fetch().to(dt).contiguous() for n, _, fetch in entries},
                          str(folder / "model.safetensors"))
                self._load_dir(remote, folder, version)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            idx = [i for i in idx if not self.is_remote(i)]
            if not idx:
                return
        esize = torch.empty((), dtype=dt).element_size()
        layout, off = [], 0
        for n, shape, _ in entries:
            layout.append((n, self.dtype, tuple(shape), off))
            off += (math.prod(shape) * esize + 63) // 64 * 64
        shm = shared_memory.SharedMemory(create=True, size=max(off, 1))
        try:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8)
            for (n, shape, fetch), (_, _, _, o) in zip(entries, layout):
                t = fetch()
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"weight {n}: shape {tuple(t.shape)}, expected {tuple(shape)}")
                flat[o:o + math.prod(shape) * esize].view(dt).view(shape).copy_(t)
                del t
            del flat

            def load(i: int) -> None:
                llm = self.engines[i]._llm
                llm.collective_rpc("load_shared_weights", args=(shm.name, layout))
                llm.collective_rpc("drop_shared_weights")
                llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
                llm.collective_rpc("set_weight_version", args=(version,))

            self._each(idx, load)
        finally:
            try:
                shm.close()
            except BufferError:
                pass
            shm.unlink()

    def _load_dir(self, idx: list[int], folder: str | os.PathLike, version: int) -> None:
        """Every engine in ``idx`` reloads an HF folder (vLLM's ``reload_weights`` from the path) at once; engines on
        other hosts from where ``_remote_source`` puts it."""
        remote = [i for i in idx if self.is_remote(i)]
        with ExitStack() as stack:
            source = stack.enter_context(self._remote_source(folder)) if remote else None

            def load(i: int) -> None:
                self.engines[i].load_weights(source if self.is_remote(i) else folder)
                self.engines[i]._llm.collective_rpc("set_weight_version", args=(version,))

            self._each(idx, load)

    def _load_broadcast(self, idx: list[int], named: list[tuple[str, Any]], version: int) -> None:
        """The learner broadcasts to every engine worker (``weight_broadcast``); the group is made at the first
        sync, over the engines then alive."""
        import torch

        from core.engines import broadcast_ranks
        from runtime.backends.weight_broadcast import WeightBroadcaster, free_port

        dt = getattr(torch, self.dtype)
        with cf.ThreadPoolExecutor(max_workers=len(self.engines) + 1, thread_name_prefix="engine-bcast") as pool:
            if self._broadcaster is None:
                tps = [len(self.engines[i]._llm.collective_rpc("weight_version")) for i in idx]
                offsets, world = broadcast_ranks(tps)
                host = "127.0.0.1"
                port = free_port(host)
                joins = [pool.submit(self.engines[i]._llm.collective_rpc, "init_weight_group",
                                     args=(host, port, off, world)) for i, off in zip(idx, offsets)]
                self._broadcaster = WeightBroadcaster(host, port, world, self.broadcast_device).open()
                for f in joins:
                    f.result()
                self._broadcast_members = list(idx)
            members = self._broadcast_members
            if any(self.is_dead(i) for i in members):
                raise RuntimeError("an engine of the weight-broadcast group died: NCCL groups cannot lose a member; "
                                   "restart the run (it resumes) or use rollout.engine_sync=memory/folder")
            layout = WeightBroadcaster.layout(named, dt)
            recvs = [pool.submit(self.engines[i]._llm.collective_rpc, "receive_broadcast", args=(layout,))
                     for i in members]
            self._broadcaster.send(named, dt)
            for f in recvs:
                f.result()
        for i in members:
            self.engines[i]._llm.reset_prefix_cache()
        self._set_versions(members, version)

    def _load_learner(self, idx: list[int], version: int | None = None) -> None:
        """The learner's current weights into engines ``idx`` by ``self.sync_mode`` (a folder when the learner's
        weights are not in this process), recorded as ``version`` (default: the set's)."""
        v = self.version if version is None else version
        for i in idx:
            self.engines[i]._wake_for_load()
        if self.named_weights is not None and self.sync_mode == "memory":
            named = [(n, t.detach()) for n, t in self.named_weights()]
            self._load_entries(idx, [(n, tuple(t.shape), (lambda t=t: t)) for n, t in named], v)
        elif self.named_weights is not None and self.sync_mode == "broadcast":
            self._load_broadcast(idx, list(self.named_weights()), v)
        elif self.export_weights is not None:
            tmp = self._folder()
            try:
                self.export_weights(tmp)
                self._load_dir(idx, tmp, v)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise RuntimeError("EngineSet.sync_weights needs named_weights or export_weights (from a learner)")

    def sync_weights(self) -> None:
        """The learner's new weights into every live engine (the next version), then their KV caches woken."""
        t0 = time.time()
        self._close_active()
        self.restart_dead(load=False)  # a new engine gets the new weights with the others, below
        live = self.live_indices()
        self.version += 1
        self._load_learner(live)
        for i in self.live_indices():
            self.engines[i].wake(["kv_cache"])
        self.sync_time_s = time.time() - t0
        self.syncs += 1
        self.last_sync = {"kind": "full", "engines": len(live), "mode": self.sync_mode}

    def _load_all(self, entries) -> None:
        """``(name, shape, fetch)`` entries into every live engine as the next weight version (after the rollout in
        flight is closed and every engine woken for the load)."""
        self._close_active()
        live = self.live_indices()
        for i in live:
            self.engines[i]._wake_for_load()
        self.version += 1
        self._load_entries(live, entries, self.version)

    def push_weights(self, named, transport: str = "shm") -> float:
        """``(name, tensor)`` pairs into every live engine (a kept engine set getting a session's weights)."""
        t0 = time.time()
        named = [(n, t.detach()) for n, t in named]
        self._load_all([(n, tuple(t.shape), (lambda t=t: t)) for n, t in named])
        return time.time() - t0

    def load_folder(self, model_dir: str | os.PathLike) -> float:
        """An HF folder's safetensors into every live engine through the shared segment, read once."""
        from safetensors import safe_open

        t0 = time.time()
        with ExitStack() as stack:
            entries = []
            for f in safetensors_files(model_dir):
                h = stack.enter_context(safe_open(str(f), framework="pt"))
                for name in h.keys():
                    entries.append((name, tuple(h.get_slice(name).get_shape()), (lambda h=h, n=name: h.get_tensor(n))))
            self._load_all(entries)
        return time.time() - t0

    def load_weights(self, weights_path: str | os.PathLike) -> float:
        """Every live engine reloads an HF folder in place (vLLM's own reload from the path)."""
        t0 = time.time()
        self._close_active()
        self.version += 1
        self._load_dir(self.live_indices(), weights_path, self.version)
        return time.time() - t0

    def push_merged(self, source) -> float:
        """``source``'s weights with its LoRA adapter merged in (``merged_entries``: an adapter folder, or the learner's
        live adapter) into every live engine through the shared segment: several engines serve LoRA merged, never as
        a LoRA request (``vllm_backend.lora_serving``)."""
        t0 = time.time()
        self._load_all(source.merged_entries())
        self.lora_request = None
        return time.time() - t0

    def clear_adapter(self) -> None:  # several engines hold full (merged) weights: no LoRA request to clear
        self.lora_request = None

    # -- sleep (the learner's memory during the update) -------------------------------------------------------
    def sleep(self) -> bool:
        self._close_active()
        slept = [self.engines[i].sleep() for i in self.live_indices()]
        return any(slept)

    @property
    def asleep(self) -> bool:
        return any(self.engines[i].asleep for i in self.live_indices())

    def wake(self, tags: list[str] | None = None) -> None:
        for i in self.live_indices():
            self.engines[i].wake(tags)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self._close_active()
        finally:
            for e in self.engines:
                try:
                    e.close()
                except Exception:  # noqa: BLE001 - every engine gets its close
                    pass

    def __enter__(self) -> "EngineSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _EngineThread:
    """Steps one engine's ``VLLMRequests`` in its own thread: adds and aborts come through its queue (one thread
    per engine touches it), finished requests go to the shared ``out`` queue as ("done", engine, key, generation);
    an engine failure as ("dead", engine, error), after which the thread ends."""

    def __init__(self, i: int, requests: VLLMRequests, out: queue.Queue):
        self.i, self.requests, self.out = i, requests, out
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"engine-{i}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        inflight: set[str] = set()
        try:
            while True:
                for it in drain(self.q, [] if inflight else [self.q.get()]):
                    if it is _STOP:
                        if inflight:
                            self.requests.abort(list(inflight))
                        return
                    if it[0] == "add":
                        self.requests.add(it[1], it[2], it[3])
                        inflight.add(it[1])
                    elif it[0] == "abort":
                        keys = [k for k in it[1] if k in inflight]
                        self.requests.abort(keys)
                        inflight.difference_update(keys)
                if inflight:
                    for key, gen in self.requests.step():
                        if key in inflight:
                            inflight.discard(key)
                            self.out.put(("done", self.i, key, gen))
        except BaseException as e:  # noqa: BLE001 - the router decides: a dead engine hands its turns over
            self.out.put(("dead", self.i, e))


def _requests(engine) -> Any:
    """An engine's request-level interface: ``VLLMRequests`` on a local engine (woken already), ``RemoteRequests`` on
    one on another host."""
    return engine.request_engine() if getattr(engine, "remote", False) else VLLMRequests(engine)


class RoutedRequests:
    """``StepEngine`` over an ``EngineSet``: ``add`` routes the request (``EngineSet.route``) to its engine's thread,
    ``step`` returns what any engine finished (waiting a little for it), and sends the turns of an engine that died
    to the others with the same key, prompt and seed."""

    POLL_S = 0.05

    def __init__(self, es: EngineSet):
        self.es = es
        self.out: queue.Queue = queue.Queue()
        self.threads = {i: _EngineThread(i, _requests(es.engines[i]), self.out) for i in es.live_indices()}
        self.pending: dict[str, tuple[int, list[int], SamplingParams, int]] = {}

    def add(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.es._check_prompts([prompt], params)
        self._send(key, list(prompt), params)

    def _send(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        need = len(prompt) + params.max_new_tokens
        while True:
            i = self.es.route(prompt, need)
            if i in self.threads:
                break
            self.es.finished(i, need)  # an engine this rollout did not start on (dead then): not a choice now
            self.es.mark_dead(i, "not part of this rollout")
        self.pending[key] = (i, prompt, params, need)
        self.threads[i].q.put(("add", key, prompt, params))

    def step(self) -> list[tuple[str, Generation]]:
        items = []
        try:
            items.append(self.out.get(timeout=self.POLL_S))
        except queue.Empty:
            pass
        items = drain(self.out, items)
        done = []
        for it in items:
            if it[0] == "done":
                _, i, key, gen = it
                p = self.pending.pop(key, None)
                if p is not None:
                    self.es.finished(i, p[3], p[1] + list(gen.token_ids))
                    done.append((key, gen))
            elif it[0] == "dead":
                self._lost(it[1], f"{type(it[2]).__name__}: {it[2]}")
        for i in {p[0] for p in self.pending.values()}:  # a process gone while its thread still waits on it
            if self.es.is_dead(i):
                self._lost(i, "engine process gone")
        return done

    def _lost(self, i: int, why: str) -> None:
        """Engine ``i`` failed (its process gone, or an error stepping it: either way it is not used again in this
        run): its turns in flight go to the others."""
        self.es.mark_dead(i, why)
        t = self.threads.pop(i, None)
        if t is not None:
            t.q.put(_STOP)
        keys = [k for k, p in self.pending.items() if p[0] == i]
        for k in keys:
            _, prompt, params, need = self.pending.pop(k)
            self.es.finished(i, need)
            self._send(k, prompt, params)
            self.es.resubmitted += 1

    def abort(self, keys: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for k in keys:
            p = self.pending.pop(k, None)
            if p is not None:
                self.es.finished(p[0], p[3])
                by_engine.setdefault(p[0], []).append(k)
        for i, ks in by_engine.items():
            if i in self.threads:
                self.threads[i].q.put(("abort", ks))

    def close(self) -> None:
        """Stop the engine threads (requests still in flight are aborted in their engines)."""
        for t in self.threads.values():
            t.q.put(_STOP)
        for t in self.threads.values():
            t.thread.join(timeout=10)
        self.threads = {}
        for k in list(self.pending):
            p = self.pending.pop(k)
            self.es.finished(p[0], p[3])


def engine_hosts(cfg) -> list[EngineHost]:
    return [parse_engine_host(h) for h in cfg.rollout.engine_hosts]


def start_engine_set(cfg, model_dir: str, tokenizer, learner, dtype: str, plan, weight_store: Any = None) -> EngineSet:
    """The run's ``rollout.engines`` engines on this machine (``core.engines.plan_engines``: their cores or GPUs),
    each with ``plan``'s KV cache (sized for its share of the batch), started one after another (each start reads
    its binding from the environment), every one at weight version 0 (the folder's weights)."""
    from core.kvcache import GiB
    from runtime.backends.vllm_backend import (export_fn, is_cpu_build, model_kv_bytes_per_token, named_weights_fn,
                                               release_kv_for, release_weights_for, sleep_mode_for)

    r = cfg.rollout
    sync = "memory" if r.engine_sync == "auto" else r.engine_sync
    cpu = is_cpu_build()
    here, device, skip = local_host(), None, None
    if sync == "broadcast":
        device = next(learner.model.parameters()).device if learner is not None else None
        if cpu or device is None or device.type != "cuda":
            raise ValueError("rollout.engine_sync=broadcast sends the weights over NCCL from a learner on a GPU to "
                             "CUDA engines: use rollout.engine_sync=memory (or folder) here")
        # NCCL takes one rank per GPU: the engines get this machine's GPUs other than the learner's
        skip = device.index or 0
        here = EngineHost(here.name, max(0, here.gpus - 1), here.cores)
    urls = [u.rstrip("/") for u in r.engine_urls]  # engines serving on other hosts, joined below
    layout, errors = plan_engines(r.engines - len(urls), r.tensor_parallel_size, here, engine_hosts(cfg))
    if errors:
        raise ValueError(errors[0])
    remote = [p for p in layout if not p.local]
    if remote:
        raise ValueError(f"rollout.engine_hosts: the layout puts engines {[p.engine for p in remote]} on "
                         f"{sorted({p.host for p in remote})}, but a run starts engines on its own machine only: "
                         "lower rollout.engines to what this machine holds (scalinginter run ... --dry-run shows it)")
    if skip is not None:
        layout = [replace(p, gpus=tuple(g if g < skip else g + 1 for g in p.gpus)) for p in layout]
    visible = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    engines: list[VLLMBackend] = []
    per_token = model_kv_bytes_per_token(model_dir, dtype)

    def start(p) -> VLLMBackend:
        """The engine of placement ``p`` (its GPUs through CUDA_VISIBLE_DEVICES, its cores), from the model folder."""
        env = {}
        if p.gpus:
            ids = [visible[g] if g < len(visible) else str(g) for g in p.gpus]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        with _env(env):
            return VLLMBackend(
                model_dir, tokenizer.eos_token_id, dtype=dtype, enforce_eager=r.vllm_enforce_eager,
                max_model_len=r.token_budget + 1, seed=cfg.seed, threads=cfg.model.threads,
                kv_cache_gb=plan.cache_bytes / GiB, gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_parallel_size, sleep_mode=sleep_mode_for(cfg),
                release_kv=release_kv_for(cfg), release_weights=release_weights_for(cfg), in_process=False,
                cpu_cores=p.cores)

    def restart(i: int) -> tuple[VLLMBackend, int]:  # slot i of the layout again (the local engines come first)
        e = start(layout[i])
        return e, engine_kv_tokens(e, plan.cache_bytes // per_token)

    try:
        for p in layout:
            engines.append(start(p))
        capacity = [engine_kv_tokens(e, plan.cache_bytes // per_token) for e in engines]
        for u in urls:
            from runtime.backends.remote_engine import RemoteEngine

            e = RemoteEngine(u, tokenizer.eos_token_id, dtype=engines[0].dtype if engines else dtype)
            engines.append(e)
            if e.max_model_len < r.token_budget + 1:
                raise ValueError(f"the rollout engine at {u} takes {e.max_model_len} tokens per sequence, the run's "
                                 f"episodes up to {r.token_budget + 1} (rollout.token_budget + 1): start it with "
                                 f"`scalinginter engine-host --max-model-len {r.token_budget + 1}`")
            capacity.append(e.kv_tokens or capacity[0])
        es = EngineSet(engines, capacity, sync, named_weights_fn(learner), export_fn(learner), device,
                       sync_dir=r.engine_sync_dir or None, weight_store=weight_store, restart=restart,
                       restart_limit=r.engine_restarts)
        es.join_remote(model_dir)
    except BaseException:
        for e in engines:
            e.close()
        raise
    where = ", ".join(f"cores {p.cores}" if p.cores else f"GPUs {','.join(map(str, p.gpus))}" for p in layout)
    where += "".join(f", {u}" for u in urls)
    print(f"vLLM: {len(engines)} rollout engines ({where}), each with a {plan.cache_bytes / GiB:.2f} GiB KV cache for "
          f"{plan.episodes} episodes; weights synced by {sync}; started in {es.start_time_s:.1f} s", flush=True)
    if plan.capped and cpu:
        es.max_live_episodes = plan.live_cap * len(engines)
        print(f"warning: each engine's KV cache holds {plan.fits} episodes of {r.token_budget} tokens: at most "
              f"{es.max_live_episodes} run at once (raise rollout.vllm_kv_budget_gb to run more)", flush=True)
    return es
