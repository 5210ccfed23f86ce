"""model.lora with the vLLM engine (issue 48), on the CPU build: one in-process engine in a child process (its own
process, as the other engine tests: vLLM's start scans every loaded module and binds threads), a tiny random Llama,
fp32 on both sides so log-probs compare to float rounding.

What the child checks, on the product's path (``EnginePool.backend_for`` with a LoRA learner):
- after an update the engine is stale; ``sync_weights`` moves the adapter alone (kilobytes, not the base's
  megabytes) and the engine's log-probs are then the learner's;
- the fallback for engines without LoRA: the adapter merged into the engine's weights gives the same log-probs;
- ``scalinginter export`` output: the adapter folder served as a LoRA request, the merged folder loaded as full
  weights, both give the learner's log-probs;
- an evaluation session of the LoRA checkpoint (no learner) reuses the engine and serves the checkpoint's adapter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_vllm_backend import HAS_VLLM

_CHILD = r"""
import json, sys
from pathlib import Path

def main(work):
    import torch
    from flows.config import build_config
    from runtime.backends.generation import SamplingParams
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.lora import export_checkpoint
    from runtime.backends.vllm_backend import EnginePool
    from tests.test_lora import batch, make_base, maxdiff, sequence

    work = Path(work)
    base = make_base(work / "base", 7)
    # adapter serving asked for: auto merges on the CPU build (its LoRA kernels generate several times slower)
    cfg = build_config("toy", None, [f"model.path={base}", "model.lora.rank=8", "model.lora.engine=adapter",
                                     "model.bf16_autocast=false",
                                     "rollout.vllm_dtype=float32", "rollout.vllm_in_process=true",
                                     "rollout.vllm_kv_cache_gb=0.0625", "rollout.token_budget=256",
                                     "rollout.max_new_tokens=16", "algo.lr=0.05", "algo.micro_batch_size=2"])
    torch.manual_seed(0)
    learner = TorchLearner(base, LearnerConfig.from_run(cfg), reference_path=base)
    seq = sequence(learner.tokenizer)
    pool = EnginePool()
    out = {}
    engine = pool.backend_for(cfg, base, learner.tokenizer, learner)
    out["lora_rank"] = engine.lora_rank
    out["start"] = maxdiff(engine.prompt_logprobs([seq])[0], learner.sequence_logprobs([seq])[0])
    learner.update(*batch(seq))
    want = learner.sequence_logprobs([seq])[0]
    out["stale"] = maxdiff(engine.prompt_logprobs([seq])[0], want)
    engine.sync_weights()
    out["sync"] = dict(engine.last_sync)
    out["base_bytes"] = sum(p.numel() * 4 for p in learner.model.parameters() if not p.requires_grad)
    out["synced"] = maxdiff(engine.prompt_logprobs([seq])[0], want)
    gen = engine.generate([seq[:-8]], SamplingParams(4, 1.0, seeds=(1,)))
    out["generates"] = len(gen[0].token_ids) > 0

    engine.push_merged(learner.lora_source())  # the fallback: merged weights, no LoRA request
    out["merged_kind"] = engine.last_sync["kind"]
    out["merged_request"] = engine.lora_request is None
    out["merged"] = maxdiff(engine.prompt_logprobs([seq])[0], want)

    learner.save(work / "ck", {"global_step": 1})
    export_checkpoint(work / "ck", work / "adapter")
    export_checkpoint(work / "ck", work / "merged", merge=True)
    engine.load_folder(base)
    engine.serve_adapter_folder(work / "adapter")
    out["export_adapter"] = maxdiff(engine.prompt_logprobs([seq])[0], want)
    engine.clear_adapter()
    engine.load_folder(work / "merged")
    out["export_merged"] = maxdiff(engine.prompt_logprobs([seq])[0], want)

    pool.release(engine)  # an evaluation of the LoRA checkpoint: no learner, the same engine
    again = pool.backend_for(cfg, str(work / "ck"), learner.tokenizer, None)
    out["reused"] = again is engine and pool.starts == 1
    out["eval"] = maxdiff(again.prompt_logprobs([seq])[0], want)
    pool.release(again)
    again = pool.backend_for(cfg, base, learner.tokenizer, None)  # the base alone (the run's "before" evaluation)
    out["base_again"] = maxdiff(again.prompt_logprobs([seq])[0],
                                learner.sequence_logprobs([seq], reference=True)[0])
    pool.shutdown()
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main(sys.argv[1])
"""


def _child(source: str, tmp_path: Path, timeout: int) -> dict:
    """Run a child script (its own process: vLLM's start scans every loaded module and binds threads) and return
    the dict it prints on its ``RESULT`` line."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "child.py"
    script.write_text(source)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=root, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)})
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])
    print(out)
    return out


@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_adapter_only_sync_merged_fallback_and_exports_in_the_engine(tmp_path):
    from runtime.backends import vllm_backend as vb

    if not vb.is_cpu_build():
        pytest.skip("the CPU build's in-process engine (tests/test_gpu.py covers CUDA)")
    out = _child(_CHILD, tmp_path, 900)
    tol = 1e-4
    assert out["lora_rank"] == 8 and out["start"] < tol and out["generates"]
    assert out["stale"] > 100 * tol, "the update should move the log-probs beyond the engine/learner noise"
    assert out["sync"]["kind"] == "adapter" and out["sync"]["tensors"] == 28
    assert out["sync"]["bytes"] < out["base_bytes"] / 50  # the adapter moved, not the base
    assert out["synced"] < tol
    assert out["merged_kind"] == "merged" and out["merged_request"] and out["merged"] < tol
    assert out["export_adapter"] < tol and out["export_merged"] < tol
    assert out["reused"] and out["eval"] < tol and out["base_again"] < tol


_CHILD_TWO = r"""
import json, sys
from pathlib import Path

def main(work):
    import torch
    from flows.config import build_config
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.vllm_backend import EnginePool, lora_serving
    from tests.test_lora import batch, make_base, maxdiff, sequence

    work = Path(work)
    base = make_base(work / "base", 7)
    cfg = build_config("toy", None, [f"model.path={base}", "model.lora.rank=8", "model.bf16_autocast=false",
                                     "rollout.backend=vllm", "rollout.engines=2", "rollout.vllm_dtype=float32",
                                     "rollout.vllm_kv_cache_gb=0.0625", "rollout.token_budget=256",
                                     "rollout.max_new_tokens=16", "algo.lr=0.05", "algo.micro_batch_size=2"])
    torch.manual_seed(0)
    learner = TorchLearner(base, LearnerConfig.from_run(cfg), reference_path=base)
    seq = sequence(learner.tokenizer)
    out = {"mode": lora_serving(cfg, base, learner).mode}
    pool = EnginePool()
    es = pool.backend_for(cfg, base, learner.tokenizer, learner)
    each = lambda e, want: max(maxdiff(e.prompt_logprobs([seq], engine=i)[0], want) for i in e.live_indices())
    out["engines"] = len(es.live_indices())
    out["start"] = each(es, learner.sequence_logprobs([seq])[0])
    learner.update(*batch(seq))
    want = learner.sequence_logprobs([seq])[0]
    out["stale"] = each(es, want)
    es.sync_weights()  # the learner's weights, the adapter merged in, into both engines
    out["synced"] = each(es, want)
    learner.save(work / "ck", {"global_step": 1})
    pool.shutdown()

    pool = EnginePool()  # a resumed session: new engines, the learner's adapter merged in at the start
    es = pool.backend_for(cfg, base, learner.tokenizer, learner)
    out["resumed"] = each(es, want)
    pool.release(es)  # an evaluation of the LoRA checkpoint: no learner, the same engines
    again = pool.backend_for(cfg, str(work / "ck"), learner.tokenizer, None)
    out["reused"] = again is es and pool.starts == 1
    out["eval"] = each(again, want)
    pool.shutdown()
    print("RESULT " + json.dumps(out))

if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_two_engines_serve_the_adapter_merged(tmp_path):
    """``model.lora`` with ``rollout.engines=2``: both engines get the base with the learner's adapter merged in, at
    each sync, when a session starts from a trained adapter and when a LoRA checkpoint is evaluated (fp32, two CPU
    engines in their own processes). Not in CI's slow groups, which are at their time budget (209 s on an idle 2-core
    AVX2 EPYC, family 25 model 1: every engine/learner difference 1.9e-6 nats, 0.79 before the sync); `pytest -m slow
    tests/test_lora_engine.py` runs it."""
    from runtime.backends import vllm_backend as vb

    if not vb.is_cpu_build():
        pytest.skip("the CPU build's engines (tests/test_gpu.py covers CUDA)")
    out = _child(_CHILD_TWO, tmp_path, 1200)
    tol = 1e-4
    assert out["mode"] == "merged" and out["engines"] == 2 and out["start"] < tol
    assert out["stale"] > 100 * tol, "the update should move the log-probs beyond the engine/learner noise"
    assert out["synced"] < tol and out["resumed"] < tol
    assert out["reused"] and out["eval"] < tol
