"""Generation backends: token-id prompts in, sampled token ids and their log-probs out.

The rollout loop only sees ``GenerationBackend``; a vLLM backend implements the same protocol. A backend that
also offers ``request_engine()`` (a ``StepEngine``: requests added one at a time, advanced together step by step,
as vLLM's continuous batching does) lets the rollout run every episode as its own loop; ``RequestDriver`` steps
such an engine in a worker thread and hands each request's ``Generation`` back to the event loop as it finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    # one sampling seed per prompt, for engines with their own RNG (vLLM): a resumed run then samples exactly
    # what the uninterrupted run sampled. None: the engine's own stream (transformers uses torch's global
    # RNG, which the checkpoint restores).
    seeds: tuple[int, ...] | None = None


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution (temperature-scaled)
    finish: str  # "stop" (ended with EOS) or "length"


class GenerationBackend(Protocol):
    eos_token_id: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def sync_weights(self) -> None:
        """Make generation use the learner's latest weights."""
        ...


class StepEngine(Protocol):
    """A request-level engine, driven by one thread at a time: ``add`` a request (``params.seeds`` is None or one
    seed), ``step`` advances every unfinished request and returns the ones that finished, as ``(key, Generation)``
    in the shape ``GenerationBackend.generate`` returns; ``abort`` drops unfinished requests."""

    def add(self, key: str, prompt: list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[tuple[str, Generation]]: ...

    def abort(self, keys: list[str]) -> None: ...


_STOP = object()


def drain(q: queue.Queue, items: list | None = None) -> list:
    """``items`` (default: a new list) with everything ``q`` holds now appended in order, without waiting."""
    items = [] if items is None else items
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class RequestDriver:
    """Runs a ``StepEngine`` in its own thread for an asyncio loop: ``submit`` (on the loop) queues a request and
    returns a future the thread resolves when the request finishes. The thread adds queued requests between steps
    and steps while any is in flight, so the loop (env calls) runs meanwhile and a request submitted mid-flight
    joins the running batch at the next step. ``busy_time()``: seconds with at least one request in flight."""

    def __init__(self, engine: StepEngine):
        self.engine = engine
        self._q: queue.Queue = queue.Queue()
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._busy_done = 0.0
        self._busy_since: float | None = None
        self._error: BaseException | None = None
        self.steps = 0

    def start(self) -> "RequestDriver":
        if self._thread is not None:
            raise RuntimeError("RequestDriver already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="request-driver", daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt: list[int], params: SamplingParams) -> "asyncio.Future[Generation]":
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"RequestDriver is not running{f' (the engine failed: {self._error!r})' if self._error else ''}")
        if params.seeds is not None and len(params.seeds) != 1:
            raise ValueError(f"one request takes one seed, got {len(params.seeds)}")
        key = f"req-{next(self._keys)}"
        fut = self._loop.create_future()
        fut.add_done_callback(lambda f: f.cancelled() and self._q.put(("abort", key)))
        self._q.put(("add", key, list(prompt), params, fut))
        return fut

    def busy_time(self) -> float:
        with self._lock:
            open_s = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self._busy_done + open_s

    async def close(self) -> None:
        """Stop the thread; requests still in flight are aborted in the engine and their futures cancelled."""
        if self._thread is None:
            return
        self._q.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # -- the worker thread ----------------------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        def set_it():
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        try:
            self._loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _set_busy(self, busy: bool) -> None:
        with self._lock:
            now = time.monotonic()
            if busy and self._busy_since is None:
                self._busy_since = now
            elif not busy and self._busy_since is not None:
                self._busy_done += now - self._busy_since
                self._busy_since = None

    def _run(self) -> None:
        inflight: dict[str, asyncio.Future] = {}
        stop = False
        try:
            while not stop:
                # idle: sleep until something is submitted
                for it in drain(self._q, [] if inflight else [self._q.get()]):
                    if it is _STOP:
                        stop = True
                    elif it[0] == "add":
                        _, key, prompt, params, fut = it
                        if fut.cancelled():
                            continue
                        try:
                            self.engine.add(key, prompt, params)
                        except Exception as e:  # noqa: BLE001 - a bad request fails its own future only
                            self._resolve(fut, error=e)
                            continue
                        inflight[key] = fut
                        self._set_busy(True)
                    elif it[0] == "abort" and it[1] in inflight:
                        inflight.pop(it[1])
                        self.engine.abort([it[1]])
                if stop:
                    break
                if inflight:
                    done = self.engine.step()
                    self.steps += 1
                    for key, gen in done:
                        fut = inflight.pop(key, None)
                        if fut is not None:
                            self._resolve(fut, gen)
                if not inflight:
                    self._set_busy(False)
        except BaseException as e:  # noqa: BLE001 - the engine broke: every waiting episode hears of it
            self._error = e
        finally:
            if inflight:
                try:
                    self.engine.abort(list(inflight))
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            for it in drain(self._q):  # requests queued but never added: nobody may wait on them forever
                if it is not _STOP and it[0] == "add":
                    inflight[it[1]] = it[4]
            for fut in inflight.values():
                if self._error is not None:
                    e = self._error
                    self._resolve(fut, error=RuntimeError(f"generation engine failed: {type(e).__name__}: {e}"))
                else:
                    try:
                        self._loop.call_soon_threadsafe(fut.cancel)
                    except RuntimeError:
                        pass
            self._set_busy(False)


class TransformersBackend:
    """transformers ``generate`` on the device the model is on (the learner's: CUDA or CPU), sharing the learner's
    policy module (no copy, no sync needed)."""

    def __init__(self, model, eos_token_id: int, pad_token_id: int, batch_size: int = 32,
                 bf16_autocast: bool = True, kv_reuse_bytes: int = 0):
        self.model = model
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.batch_size = batch_size
        self.bf16_autocast = bf16_autocast
        self.kv = KVReuse(kv_reuse_bytes) if kv_reuse_bytes > 0 else None

    def sync_weights(self) -> None:  # shares the learner's module: nothing to load; kept keys and values are stale
        self.clear_cache()

    def clear_cache(self) -> None:
        """Forget the kept keys and values (a rollout starts with none, so what it samples does not depend on
        what ran before it)."""
        if self.kv is not None:
            self.kv.clear()

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (a learner's module may have moved since this backend was made)."""
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _autocast(self):
        from runtime.backends.hardware import autocast

        return autocast(self.device, self.bf16_autocast)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        # sort by length so padding is small, then restore order
        # (the batches do not depend on what is cached: with or without kept keys and values, the same rows are
        # sampled together, so torch's RNG draws the same numbers for them)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if self.kv is not None:
            self.kv.check_weights(self.model)
        results: dict[int, Generation] = {}
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, g in zip(idx, self._generate_batch([prompts[i] for i in idx], params)):
                results[i] = g
        return [results[i] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        use_kv = self.kv is not None and self._kv_usable()
        hits = self.kv.lookup(prompts) if use_kv else [(None, 0)] * len(prompts)
        # each row: its kept prefix (right-aligned at the longest kept one), then its new tokens (left-padded); with
        # nothing kept, the plain left-padded batch
        cached = max(n for _, n in hits)
        news = [p[n:] for p, (_, n) in zip(prompts, hits)]
        width = cached + max(len(t) for t in news)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        att = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, (p, (_, n), t) in enumerate(zip(prompts, hits, news)):
            ids[r, cached - n:cached] = torch.tensor(p[:n], dtype=torch.long)
            att[r, cached - n:cached] = 1
            ids[r, width - len(t):] = torch.tensor(t, dtype=torch.long)
            att[r, width - len(t):] = 1
        greedy = params.temperature <= 0
        kwargs = dict(max_new_tokens=params.max_new_tokens, do_sample=not greedy,
                      eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                      return_dict_in_generate=True, output_logits=True)
        if use_kv:  # the kept prefixes, or an empty cache: either way the rows' keys and values come back to be kept
            kwargs["past_key_values"] = self.kv.batch_cache(hits, cached, self.device)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        was_training = self.model.training
        self.model.eval()
        dev = self.device
        try:
            with self._autocast():
                res = self.model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), **kwargs)
        finally:
            self.model.train(was_training)
        new = res.sequences[:, width:]  # [B, N]
        logits = torch.stack(res.logits, dim=1).float()  # [B, N, V]
        if not greedy:
            logits = logits / params.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, N]
        gens = []
        for r in range(new.shape[0]):
            toks = new[r].tolist()
            lps = logp[r].tolist()
            if self.eos_token_id in toks:
                end = toks.index(self.eos_token_id) + 1
                gens.append(Generation(toks[:end], lps[:end], "stop"))
            else:
                gens.append(Generation(toks, lps, "length"))
        if use_kv and getattr(res, "past_key_values", None) is not None:
            self.kv.keep(prompts, [g.token_ids for g in gens], att, res.past_key_values, hits)
        del res
        return gens

    def _kv_usable(self) -> bool:
        """Kept keys and values need a padding mask with holes (kept prefix | padding | new tokens), which the
        eager and SDPA attention take; the flash and flex kernels are left to full prompts."""
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None) or "sdpa"
        return impl in ("sdpa", "eager")


@dataclass
class _KeptRow:
    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [heads, tokens, head_dim]
    size: int  # bytes
    used: int  # the lookup call that last used it


class KVReuse:
    """The transformers engine's kept keys and values: per prompt row it ran, its tokens and, per layer, its keys and
    values, at most ``budget`` bytes (the least recently used dropped first). Kept rows are only valid for the
    weights they were computed with: ``check_weights`` forgets them all when any parameter changed (replaced, or
    updated in place, as an optimizer step does)."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.rows: list[_KeptRow] = []
        self.calls = 0
        self.weights: tuple | None = None
        self.reused_tokens = 0  # tokens served from kept rows (for the tests and benchmarks)
        self.prompt_tokens = 0

    def clear(self) -> None:
        self.rows = []

    def check_weights(self, model) -> None:
        now = tuple((id(p), p._version) for p in model.parameters())
        if now != self.weights:
            self.clear()
            self.weights = now

    def lookup(self, prompts: list[list[int]]) -> list[tuple[int | None, int]]:
        from core.kvcache import best_cached_prefix

        self.calls += 1
        hits = [best_cached_prefix(p, [row.tokens for row in self.rows]) for p in prompts]
        for i, n in hits:
            if i is not None:
                self.rows[i].used = self.calls
            self.reused_tokens += n
        self.prompt_tokens += sum(len(p) for p in prompts)
        return hits

    def batch_cache(self, hits: list[tuple[int | None, int]], width: int, device):
        """A ``DynamicCache`` of the rows' kept prefixes, right-aligned at ``width`` (zeros where masked); an empty
        one when nothing is kept for them."""
        from transformers import DynamicCache

        if not width:
            return DynamicCache()
        some = next(self.rows[i].kv for i, _ in hits if i is not None)
        layers = []
        for li, (k0, v0) in enumerate(some):
            k = torch.zeros((len(hits), k0.shape[0], width, k0.shape[2]), dtype=k0.dtype, device=device)
            v = torch.zeros((len(hits), v0.shape[0], width, v0.shape[2]), dtype=v0.dtype, device=device)
            for r, (i, n) in enumerate(hits):
                if i is not None and n:
                    k[r, :, width - n:] = self.rows[i].kv[li][0][:, :n]
                    v[r, :, width - n:] = self.rows[i].kv[li][1][:, :n]
            layers.append((k, v))
        return DynamicCache(layers)

    def keep(self, prompts: list[list[int]], replies: list[list[int]], att: torch.Tensor, cache,
             hits: list[tuple[int | None, int]]) -> None:
        """Keep each row's keys and values: its prompt and all of its reply but the last token (whose keys and
        values the model has not computed). A kept row this one continued whole is replaced by it."""
        from core.kvcache import evict_to_budget

        layers = [(layer.keys, layer.values) for layer in cache.layers]
        width = att.shape[1]
        replaced = {i for i, n in hits if i is not None and n == len(self.rows[i].tokens)}
        for r, (p, g) in enumerate(zip(prompts, replies)):
            pos = torch.nonzero(att[r]).squeeze(1)
            if pos.numel() != len(p):
                raise RuntimeError(f"kept KV row {r}: {pos.numel()} prompt positions for a prompt of {len(p)} tokens")
            pos = torch.cat([pos, torch.arange(width, width + max(len(g) - 1, 0))]).to(layers[0][0].device)
            kv = [(k[r].index_select(1, pos), v[r].index_select(1, pos)) for k, v in layers]
            size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
            self.rows.append(_KeptRow(list(p) + list(g[:-1]), kv, size, self.calls))
        drop = replaced | set(evict_to_budget([row.size for row in self.rows], [row.used for row in self.rows],
                                              self.budget))
        self.rows = [row for i, row in enumerate(self.rows) if i not in drop]

    @property
    def bytes(self) -> int:
        return sum(row.size for row in self.rows)


def check_prompts(prompts: list[list[int]], params: SamplingParams, max_model_len: int, engine: str, fix: str) -> None:
    """Refuse an empty prompt, or one whose prompt + max new tokens exceeds ``max_model_len`` (``engine`` names the
    engine in the message, ``fix`` says what to raise)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    too_long = [len(p) for p in prompts if len(p) + params.max_new_tokens > max_model_len]
    if too_long:
        raise ValueError(f"prompt of {max(too_long)} tokens + {params.max_new_tokens} new tokens exceeds the "
                         f"{engine}'s max_model_len {max_model_len}: {fix}")
