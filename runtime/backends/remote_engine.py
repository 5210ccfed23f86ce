"""A rollout engine on another host (``rollout.engine_urls``): a vLLM OpenAI-compatible server, started there with
``scalinginter engine-host``, joined to the run's ``EngineSet`` beside the engines the run starts itself.

The server is vLLM's own (``vllm.entrypoints.openai.api_server``) with three of its documented switches on:
``--enable-scale-out`` (its token-in / token-out route, ``POST /inference/v1/generate``: the prompt's token ids in,
the sampled token ids and their log-probs out, so no text is re-tokenized), the dev-mode routes
(``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc`` into the run's worker extension, ``/reset_prefix_cache``) and
``--worker-extension-cls`` naming the local engines' ``WorkerExtension`` with the S3 hand-over added
(``storage.engine_weights.StoreWorkerExtension``). So a remote engine answers the
calls ``EngineSet`` makes on a local one: ``generate`` (one HTTP request per prompt, sent at once), the
request-level interface for per-episode rollouts (``RemoteRequests``: each request its own HTTP call in a thread;
``abort`` through ``/inference/v1/abort_requests``), ``prompt_logprobs``, its weight version (``collective_rpc``),
and a weight load from a folder (vLLM's ``reload_weights`` from a path, as ``VLLMBackend.load_weights`` does).

What does not cross the network: shared memory and NCCL from this process. A remote engine's weights come from a
folder the learner writes (``rollout.engine_sync_dir``), which the engine host must read at the same path (a shared
mount; on one machine, any folder), or from an ``s3://`` URI where the run stores the folder and the host's worker
downloads it (checked by sha256); ``check_reads`` asks the engine's worker whether it sees a probe the run just
wrote there, before the first load, and refuses with the fix when it does not.

Liveness: ``healthy`` is the server's ``/health`` (cached for a second: ``EngineSet`` asks often). An engine whose
server stopped answering is dead to the run; its requests in flight fail, and ``EngineSet`` sends them to the
engines left with the same prompt and seed, as it does for a local engine whose process died. The run never stops a
remote server (the host owns it): ``close`` only forgets it.

Pure helpers (``generation_from_response``, ``prompt_logprobs_from_response``, ``engine_host_command``) are tested
on hand-written replies; the class against a real server in ``tests/test_remote_engine.py`` (slow tier).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from runtime.backends.generation import Generation, SamplingParams, check_prompts

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"


class RemoteEngineError(RuntimeError):
    """A remote engine refused a request or sent a reply the run cannot use."""


def sampling_payload(params: SamplingParams, eos_token_id: int, seed: int | None) -> dict[str, Any]:
    """vLLM sampling parameters for one request, as ``VLLMBackend._sampling`` builds them for a local engine:
    greedy at temperature <= 0 (no seed), the sampled token's log-prob (``logprobs: 0``), EOS stops."""
    greedy = params.temperature <= 0
    out: dict[str, Any] = {"n": 1, "max_tokens": int(params.max_new_tokens),
                           "temperature": 0.0 if greedy else float(params.temperature),
                           "top_p": 1.0 if greedy else float(params.top_p), "top_k": 0, "logprobs": 0,
                           "stop_token_ids": [int(eos_token_id)], "ignore_eos": False, "skip_special_tokens": False,
                           "detokenize": False}
    if not greedy and seed is not None:
        out["seed"] = int(seed)
    return out


def generation_from_response(body: dict[str, Any], eos_token_id: int) -> Generation:
    """A ``Generation`` from one ``/inference/v1/generate`` reply: the sampled token ids, each one's log-prob, the
    reply cut after EOS (as ``to_generation`` does for a local engine)."""
    try:
        choice = body["choices"][0]
        toks = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
    except (KeyError, IndexError, TypeError) as e:
        raise RemoteEngineError(f"remote engine reply without choices[0].token_ids: {str(body)[:200]}") from e
    if len(content) != len(toks):
        raise RemoteEngineError(f"remote engine returned {len(content)} log-probs for {len(toks)} tokens (was the "
                                "server started by `scalinginter engine-host`?)")
    lps = []
    for t, c in zip(toks, content):
        if int(c.get("token_id", t)) != t:
            raise RemoteEngineError(f"remote engine's log-prob is for token {c.get('token_id')}, not {t}")
        lps.append(float(c["logprob"]))
    if eos_token_id in toks:
        end = toks.index(eos_token_id) + 1
        return Generation(toks[:end], lps[:end], "stop")
    return Generation(toks, lps, "stop" if choice.get("finish_reason") == "stop" else "length")


def prompt_logprobs_from_response(seq: list[int], body: dict[str, Any]) -> list[float]:
    """log p(token_t | tokens_<t) of ``seq`` from a reply to ``prompt_logprobs: 0`` (position 0 gets 0), the layout
    of ``VLLMBackend.prompt_logprobs``."""
    rows = body.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(seq):
        raise RemoteEngineError(f"remote engine returned {len(rows) if isinstance(rows, list) else 'no'} prompt "
                                f"log-probs for a {len(seq)}-token sequence")
    out = [0.0]
    for t, d in zip(seq[1:], rows[1:]):
        lp = (d or {}).get(str(t))
        if lp is None:
            raise RemoteEngineError(f"remote engine's prompt log-probs leave out token {t}")
        out.append(float(lp["logprob"] if isinstance(lp, dict) else lp))
    return out


def kv_tokens_from_metrics(text: str) -> int | None:
    """The engine's KV cache in tokens, from its Prometheus ``vllm:cache_config_info`` line: ``num_gpu_blocks`` x
    ``block_size`` (what a local engine's ``cache_config`` holds: ``engine_set.engine_kv_tokens``, so the router
    compares the same measure on both), else ``kv_cache_size_tokens``; None when the server does not publish it."""
    for line in text.splitlines():
        if not line.startswith("vllm:cache_config_info{"):
            continue
        labels = dict(kv.split("=", 1) for kv in _split_labels(line[line.index("{") + 1:line.rindex("}")]))
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("num_gpu_blocks", "None").isdigit() and labels.get("block_size", "None").isdigit():
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        if labels.get("kv_cache_size_tokens", "None").isdigit():
            return int(labels["kv_cache_size_tokens"])
    return None


def _split_labels(s: str) -> list[str]:
    """``a="x",b="y,z"`` -> ``['a="x"', 'b="y,z"']`` (commas inside quotes kept)."""
    out, cur, quoted = [], [], False
    for ch in s:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [x for x in out if "=" in x]


def engine_host_command(python: str, model: str, *, host: str = "0.0.0.0", port: int = 8100, dtype: str = "bfloat16",
                        max_model_len: int = 4097, seed: int = 0, kv_cache_gb: float = 1.0, cpu: bool = True,
                        gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                        enforce_eager: bool = True) -> list[str]:
    """The vLLM server command an engine host runs (``scalinginter engine-host``): the engine settings of the run's
    own engines (``VLLMBackend``: sampled tokens' log-probs after processing, the run's worker extension, on the
    CPU build a KV cache in bytes and no partial prefills) plus the token-in / token-out route."""
    if port <= 0 or port > 65535:
        raise ValueError(f"--port {port}: a TCP port is 1-65535")
    if max_model_len < 2:
        raise ValueError(f"--max-model-len {max_model_len}: at least 2 tokens")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
           "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
           "--worker-extension-cls", "storage.engine_weights.StoreWorkerExtension", "--enable-scale-out"]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if cpu:
        if kv_cache_gb <= 0:
            raise ValueError(f"--kv-cache-gb {kv_cache_gb}: must be > 0")
        if tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size: the CPU build runs one engine per process (1)")
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30)), "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", str(max(8192, max_model_len))]
    else:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization),
                "--tensor-parallel-size", str(tensor_parallel_size)]
    return cmd


class _RemoteLLM:
    """The part of ``vllm.LLM`` that ``EngineSet`` calls on an engine, over HTTP: ``collective_rpc`` (the dev-mode
    route; arguments travel as strings, the worker methods it calls read them back) and ``reset_prefix_cache``."""

    llm_engine = None

    def __init__(self, engine: "RemoteEngine"):
        self.engine = engine

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None):
        body = {"method": method, "args": [str(a) for a in args],
                "kwargs": {k: str(v) for k, v in (kwargs or {}).items()}}
        if timeout is not None:
            body["timeout"] = timeout
        r = self.engine._post("/collective_rpc", body)
        if not r.content:
            return []
        return r.json().get("results", [])

    def reset_prefix_cache(self) -> None:
        self.engine._post("/reset_prefix_cache", None)


class RemoteEngine:
    """One vLLM server on an engine host, with the attributes and methods ``EngineSet`` uses on a ``VLLMBackend``.
    Nothing here sleeps or wakes: the remote engine keeps its memory (its host runs nothing else of the run)."""

    remote = True
    HEALTH_TTL_S = 1.0

    def __init__(self, url: str, eos_token_id: int, *, dtype: str = "bfloat16", timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, max_workers: int = 64):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rollout.engine_urls entry {url!r}: write http://HOST:PORT")
        self.url = url.rstrip("/")
        self.eos_token_id = int(eos_token_id)
        self.dtype = dtype
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                   limits=httpx.Limits(max_connections=max_workers + 4))
        self.pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="remote-engine")
        self._health = (0.0, True)
        self._lock = threading.Lock()
        t0 = time.time()
        try:
            models = self._get("/v1/models").json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            self.close()
            raise RemoteEngineError(f"rollout engine at {self.url} does not answer as a vLLM server ({e}): start it "
                                    "there with `scalinginter engine-host --model PATH --port PORT`") from e
        self.model = models[0].get("root") or models[0]["id"]
        self.max_model_len = int(models[0]["max_model_len"])
        self.kv_tokens = kv_tokens_from_metrics(self._get("/metrics").text)
        probe = self.client.post(GENERATE, json={"token_ids": [0], "sampling_params": {"max_tokens": 1}})
        if probe.status_code in (403, 404):
            self.close()
            raise RemoteEngineError(f"rollout engine at {self.url} has no token-in / token-out route ({GENERATE}, "
                                    f"HTTP {probe.status_code}): start it with `scalinginter engine-host`, which turns "
                                    "on --enable-scale-out and the dev-mode routes")
        self._llm: _RemoteLLM | None = _RemoteLLM(self)
        try:
            self._llm.collective_rpc("weight_version")
        except (httpx.HTTPError, RemoteEngineError) as e:
            self.close()
            raise RemoteEngineError(f"rollout engine at {self.url} refused a call into the run's worker extension "
                                    f"({e}): start it with `scalinginter engine-host` (VLLM_SERVER_DEV_MODE=1, "
                                    "--worker-extension-cls storage.engine_weights.StoreWorkerExtension)") from e
        self.start_time_s = time.time() - t0
        self.lora_request = None

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _get(self, path: str) -> httpx.Response:
        r = self.client.get(path)
        r.raise_for_status()
        return r

    def _post(self, path: str, body: Any) -> httpx.Response:
        try:
            r = self.client.post(path, json=body) if body is not None else self.client.post(path)
        except httpx.HTTPError:
            self._health = (0.0, True)  # the next liveness check asks the server again
            raise
        if r.status_code >= 400:
            raise RemoteEngineError(f"rollout engine at {self.url}: {path} answered HTTP {r.status_code}: "
                                    f"{r.text[:300]}")
        return r

    def healthy(self) -> bool:
        """The server answers ``/health`` (read at most once a second; a failed read is not cached)."""
        if self._llm is None:
            return False
        t, ok = self._health
        if time.time() - t < self.HEALTH_TTL_S and ok:
            return True
        try:
            ok = self.client.get("/health", timeout=httpx.Timeout(5.0, connect=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        self._health = (time.time(), ok)
        return ok

    # -- generation ---------------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        check_prompts(prompts, params, self.max_model_len, f"remote engine ({self.url})",
                      "start it with a larger --max-model-len")

    def generate_one(self, prompt: list[int], params: SamplingParams, seed: int | None = None,
                     request_id: str | None = None) -> Generation:
        body = {"token_ids": [int(t) for t in prompt], "sampling_params": sampling_payload(params, self.eos_token_id,
                                                                                          seed)}
        if request_id is not None:
            body["request_id"] = request_id
        return generation_from_response(self._post(GENERATE, body).json(), self.eos_token_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        self._check_prompts(prompts, params)
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(f"{len(params.seeds)} seeds for {len(prompts)} prompts")
        seeds = params.seeds or [None] * len(prompts)
        futs = [self.pool.submit(self.generate_one, p, params, s) for p, s in zip(prompts, seeds)]
        return [f.result() for f in futs]

    def request_engine(self) -> "RemoteRequests":
        if self._llm is None:
            raise RuntimeError(f"the remote engine at {self.url} is closed")
        return RemoteRequests(self)

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        def one(s: list[int]) -> list[float]:
            body = {"token_ids": [int(t) for t in s], "sampling_params": {"max_tokens": 1, "temperature": 0.0,
                                                                          "prompt_logprobs": 0, "detokenize": False}}
            return prompt_logprobs_from_response(s, self._post(GENERATE, body).json())

        return list(self.pool.map(one, seqs))

    # -- weights ------------------------------------------------------------------------------------------
    def check_reads(self, probe: str, sync_dir: str | None) -> None:
        """Refuse a sync folder the engine host cannot read: ``probe`` is what the run just wrote into it (a file, or
        with an ``s3://`` sync_dir a stored folder); the engine's worker is asked whether it sees it."""
        seen = self._llm.collective_rpc("sees_path", args=(str(probe),))
        if seen and all(str(x).lower() == "true" for x in seen):
            return
        if str(probe).startswith("s3://"):
            raise RemoteEngineError(f"the rollout engine at {self.url} cannot read {sync_dir}, where the learner "
                                    "stores the weights it loads after each update: give the engine host the "
                                    "bucket's AWS settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) before "
                                    "`scalinginter engine-host`")
        raise RemoteEngineError(f"the rollout engine at {self.url} cannot read {sync_dir or Path(probe).parent}, where "
                                "the learner writes the weights it loads after each update: set "
                                "rollout.engine_sync_dir to a folder the engine host mounts at the same path, or to "
                                "an s3:// URI both reach")

    def load_weights(self, weights_path: str | os.PathLike) -> float:
        """Reload the remote engine's weights in place from an HF folder it can read (vLLM's ``reload_weights``), or
        from one stored at an ``s3://`` URI (downloaded and checked by the worker)."""
        t0 = time.time()
        if str(weights_path).startswith("s3://"):
            self._llm.collective_rpc("reload_from_store", args=(str(weights_path),))
        else:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
        self._llm.collective_rpc("refresh_cpu_heads")
        self._llm.reset_prefix_cache()
        return time.time() - t0

    # -- what EngineSet calls on every engine ----------------------------------------------------------------
    def sleep(self) -> bool:
        return False

    asleep = False

    def wake(self, tags: list[str] | None = None) -> None:
        return None

    def _wake_for_load(self) -> None:
        return None

    def close(self) -> None:
        """Forget the server (its host owns it and keeps it running for the next run)."""
        self._llm = None
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


class RemoteRequests:
    """``StepEngine`` on a remote engine: ``add`` sends the request in a thread of the engine's pool, ``step``
    returns what finished (waiting a little for it), ``abort`` tells the server to drop requests and forgets them.
    An HTTP failure surfaces from ``step`` as the exception (``EngineSet``'s engine thread then hands the engine's
    turns to the others)."""

    WAIT_S = 0.05

    def __init__(self, engine: RemoteEngine):
        self.engine = engine
        self.futures: dict[cf.Future, str] = {}
        self.ids: dict[str, str] = {}

    def add(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.engine._check_prompts([prompt], params)
        if params.seeds is not None and len(params.seeds) != 1:
            raise ValueError(f"one request takes one seed, got {len(params.seeds)}")
        rid = f"{key}-{uuid.uuid4().hex[:8]}"
        self.ids[key] = rid
        seed = None if params.seeds is None else params.seeds[0]
        self.futures[self.engine.pool.submit(self.engine.generate_one, list(prompt), params, seed, rid)] = key

    def step(self) -> list[tuple[str, Generation]]:
        if not self.futures:
            return []
        done, _ = cf.wait(list(self.futures), timeout=self.WAIT_S, return_when=cf.FIRST_COMPLETED)
        out = []
        for f in done:
            key = self.futures.pop(f)
            self.ids.pop(key, None)
            out.append((key, f.result()))  # an HTTP error raises here: the engine is failing
        return out

    def abort(self, keys: list[str]) -> None:
        rids = []
        for f, k in list(self.futures.items()):
            if k in keys:
                self.futures.pop(f)
                f.cancel()
                rids.append(self.ids.pop(k, None))
        rids = [r for r in rids if r]
        if rids:
            try:  # the server keeps the vLLM request id it was given, with its route's prefix
                self.engine._post(ABORT, {"request_ids": rids + [f"generate-tokens-{r}" for r in rids]})
            except (httpx.HTTPError, RemoteEngineError):
                pass  # an engine that cannot abort is failing: the next step or health check sees it
