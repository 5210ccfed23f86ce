"""GPU checks anyone with a CUDA machine can run: ``pytest -m gpu tests/test_gpu.py`` after ``infra/install.sh``
(which picks the CUDA builds where ``nvidia-smi`` lists a GPU). Each is marked ``gpu`` (deselected by default) and
skips where torch sees no CUDA device:

- the learner on CUDA gives the CPU learner's loss and gradients: fp32 on both within 1e-4 (relative); bf16
  autocast on CUDA within bf16 tolerance: no further from the fp32 CPU gradients than twice what bf16 autocast on the
  CPU is (measured in the test; 6.4e-2 relative on SmolLM2-135M on an AVX512-BF16 CPU), the loss within 1e-2;
- vLLM's CUDA engine after an in-memory weight sync gives the learner's log-probs (bf16 engine vs the fp32 learner
  under bf16 autocast: mean |diff| < 0.1 nats, the CPU bf16 test's bound), in sleep mode: the engine sleeps during
  the update (its GPU memory is freed) and wakes for the sync;
- ``algo.optimizer=adamw8bit`` (bitsandbytes' CUDA kernels) moves the weights as torch's AdamW does over four
  updates (cosine > 0.98, norms within 10 %, the CPU test's bounds) with under 30 % of its optimizer state;
- a one-step smoke run (``scalinginter run babyai``, vLLM engine on the GPU, learner on the GPU) completes.

The tests without the ``gpu`` mark check, here on the CPU, the GPU code paths that need no GPU: device resolution,
the refusals of GPU-only settings on the CPU build, and the sleep/wake order around a weight sync (on a fake
engine that records the calls vLLM's ``LLM.sleep`` / ``LLM.wake_up`` would receive).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")


# --- CPU-checkable pieces of the GPU paths ----------------------------------------------------------------------
def test_device_resolution():
    import torch

    from runtime.backends.hardware import autocast, check_device_setting, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert check_device_setting(" CUDA:1 ") == "cuda:1"
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        check_device_setting("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
    with autocast(torch.device("cpu"), True):
        assert torch.is_autocast_enabled("cpu")
    with autocast(torch.device("cpu"), False):
        assert not torch.is_autocast_enabled("cpu")


def test_model_device_config():
    from flows.config import ConfigError, build_config

    assert build_config("babyai", "tiny").model.device == "auto"
    assert build_config("babyai", "tiny", ["model.device=cuda:0"]).model.device == "cuda:0"
    with pytest.raises(ConfigError, match="model.device"):
        build_config("babyai", "tiny", ["model.device=gpu"])
    c = build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.6",
                                        "rollout.tensor_parallel_size=2"])
    assert c.rollout.gpu_memory_utilization == 0.6 and c.rollout.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        build_config("babyai", "tiny", ["rollout.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.tensor_parallel_size=2",
                                        "rollout.vllm_in_process=true"])
    with pytest.raises(ConfigError, match="vllm_sleep"):
        build_config("babyai", "tiny", ["rollout.backend=transformers", "rollout.vllm_sleep=true"])


def test_gpu_only_engine_settings_are_refused_on_the_cpu_build():
    from runtime.backends.vllm_backend import check_gpu_settings

    with pytest.raises(ValueError, match="CPU build"):
        check_gpu_settings(True, 2, False, False)
    with pytest.raises(ValueError, match="CUDA build"):
        check_gpu_settings(True, 1, True, False)
    with pytest.raises(ValueError, match="vllm_in_process=false"):
        check_gpu_settings(False, 2, False, True)
    check_gpu_settings(False, 4, True, False)  # CUDA: fine
    check_gpu_settings(True, 1, False, True)  # the CPU default: fine


@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_sleep_mode_default_follows_the_build_and_the_device():
    from flows.config import build_config
    from runtime.backends.vllm_backend import is_cpu_build, sleep_mode_for

    cfg = build_config("babyai", "tiny", ["rollout.backend=vllm"])
    if is_cpu_build():
        assert sleep_mode_for(cfg) is False  # no sleep mode on the CPU build
    else:
        assert sleep_mode_for(cfg) is _cuda()
    assert sleep_mode_for(build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.vllm_sleep=false"])) is False
    assert sleep_mode_for(build_config("babyai", "tiny", ["rollout.backend=vllm", "rollout.vllm_sleep=true"])) is True


class _FakeLLM:
    """Records what ``VLLMBackend`` asks of ``vllm.LLM`` in sleep mode (the real calls' signatures)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        woken = set(self.asleep) if tags is None else set(tags)
        assert woken <= self.asleep, f"woke {woken - self.asleep} twice"
        self.asleep -= woken
        return not self.asleep

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(("rpc", method, "weights" in self.asleep))
        return [123 if method == "release_kv_cache" else None]

    def reset_prefix_cache(self, *a, **k):
        self.calls.append(("reset_prefix_cache",))
        return True


def _fake_backend(sleep_mode: bool, release_kv: bool = False, release_weights: bool = False):
    import torch

    from runtime.backends.vllm_backend import VLLMBackend

    b = VLLMBackend.__new__(VLLMBackend)  # no engine: the fake LLM stands in for vllm.LLM
    b._llm, b.sleep_mode, b._asleep_tags, b.sleeps = _FakeLLM(), sleep_mode, set(), 0
    b.release_kv, b.release_weights = release_kv, release_weights
    b.dtype, b.transport, b._shm, b.syncs, b.export_weights = "float32", "rpc", None, 0, None
    b.adapter = b.merged = b.lora_request = None  # model.lora off: full weights are synced
    b.lora_rank, b._lora_ids, b.last_sync = 0, 0, {}
    w = torch.nn.Linear(2, 2)
    b.named_weights = lambda: w.named_parameters()
    return b


def test_sleep_before_the_update_and_wake_around_the_sync():
    b = _fake_backend(sleep_mode=True)
    assert b.sleep() is True and b.asleep and b.sleep() is False  # one sleep per update
    b.sync_weights()
    calls = b._llm.calls
    assert calls[0] == ("sleep", 1)
    assert calls[1] == ("wake_up", ("weights",))  # the weights first (no KV cache allocated during the copy)
    assert ("rpc", "load_named_tensors", False) in calls  # loaded while the weights are resident
    assert calls[-1] == ("wake_up", ("kv_cache",)) and not b.asleep and not b._llm.asleep
    assert b.syncs == 1
    b.wake()  # awake: nothing more to wake
    assert b._llm.calls == calls


def test_without_sleep_mode_nothing_sleeps():
    b = _fake_backend(sleep_mode=False)
    assert b.sleep() is False and not b.asleep
    b.sync_weights()
    assert [c[0] for c in b._llm.calls] == ["rpc", "reset_prefix_cache"]


def test_cpu_release_kv_frees_the_cache_for_the_update_and_restores_it_after_the_sync():
    """The CPU build's stand-in for sleep mode (``release_kv``): the worker releases its KV cache before the update;
    the sync loads the weights, then the cache comes back and its stale prefix blocks are forgotten."""
    b = _fake_backend(sleep_mode=False, release_kv=True)
    assert b.sleep() is True and b.asleep and b.kv_released_bytes == 123 and b.sleep() is False
    b.sync_weights()
    names = [c[1] if c[0] == "rpc" else c[0] for c in b._llm.calls]
    assert names == ["release_kv_cache", "load_named_tensors", "reset_prefix_cache", "restore_kv_cache",
                     "reset_prefix_cache"]
    assert not b.asleep and b.syncs == 1 and b.sleeps == 1
    b.sleep()
    b.wake()  # generation wakes it too
    assert [c[1] for c in b._llm.calls[-3:-1]] == ["release_kv_cache", "restore_kv_cache"] and not b.asleep


def test_cpu_release_weights_drops_the_packed_copies_until_the_sync_loads_new_ones():
    """With ``release_weights`` the worker also drops its packed weights and parameters before the update; the sync
    gives the parameters their memory back, its load fills them and rebuilds the packed copies, then the KV cache
    comes back. Generation without a sync in between loads the
    learner's weights first; with no learner to take them from it is refused with the fix."""
    b = _fake_backend(sleep_mode=False, release_kv=True, release_weights=True)
    assert b.sleep() is True and b._asleep_tags == {"kv_cache", "cpu_weights"}
    b.sync_weights()
    names = [c[1] if c[0] == "rpc" else c[0] for c in b._llm.calls]
    assert names == ["release_kv_cache", "release_cpu_weights", "restore_cpu_params", "load_named_tensors",
                     "reset_prefix_cache", "restore_kv_cache", "reset_prefix_cache"]
    assert not b.asleep
    b.sleep()
    b.wake()  # generation right after an update without its sync: the learner's weights are loaded first
    names = [c[1] if c[0] == "rpc" else c[0] for c in b._llm.calls[len(names):]]
    assert names == ["release_kv_cache", "release_cpu_weights", "restore_cpu_params", "load_named_tensors",
                     "reset_prefix_cache", "restore_kv_cache", "reset_prefix_cache"] and not b.asleep
    b.named_weights = None
    b.sleep()
    with pytest.raises(RuntimeError, match="sync_weights"):
        b.wake()


def test_a_sleeping_engine_wakes_for_generation():
    b = _fake_backend(sleep_mode=True)
    b.sleep()
    b.wake()  # what generate / prompt_logprobs / request_engine call first
    assert b._llm.calls[-1] == ("wake_up", None) and not b.asleep


# --- on a GPU ----------------------------------------------------------------------------------------------------
def _batch():
    """Four random 48-token episodes with advantages of different sizes (so the loss is not 0 at ratio 1)."""
    from tests.test_deepspeed_learner import _batch as batch

    trajs, advs = batch(n=4, length=48)
    return trajs, [[(1.0 + 0.5 * i) * a for a in row] for i, row in enumerate(advs)]


def _rel(a, b) -> float:
    import torch

    num = sum(float(torch.sum((a[k] - b[k]) ** 2)) for k in a)
    den = sum(float(torch.sum(b[k] ** 2)) for k in b)
    return (num / den) ** 0.5


def _update_matches(learner, grads: dict, cpu_stats: dict, cpu_grads: dict, grad_tol: float, loss_tol: float,
                    label: str) -> dict:
    """One update of ``learner`` on ``_batch()`` (``grads``: its gradients, recorded at the optimizer step) against
    the CPU learner's (``cpu_stats``, ``cpu_grads``): the same tensors get gradients, the loss is within
    ``loss_tol`` (relative, absolute below 1) and the gradients within ``grad_tol`` (relative). Returns its stats."""
    stats = learner.update(*_batch())
    assert set(grads) == set(cpu_grads)
    rel = _rel(grads, cpu_grads)
    print(f"\n{label}: loss cpu {cpu_stats['loss']:.6f} cuda {stats['loss']:.6f}; grad rel diff {rel:.2e}; "
          f"grad norm cpu {cpu_stats['grad_norm']:.4f} cuda {stats['grad_norm']:.4f}")
    assert abs(stats["loss"] - cpu_stats["loss"]) <= loss_tol * max(1.0, abs(cpu_stats["loss"]))
    assert rel < grad_tol
    return stats


@pytest.mark.gpu
@needs_cuda
def test_cuda_learner_matches_cpu_learner():
    """One update at lr 0 (its gradients recorded at the optimizer step; AdamW with lr 0 leaves the weights): the CUDA
    learner's loss and gradients are the CPU learner's, in fp32 tightly (also on bucketed lengths: algo.length_buckets)
    and under bf16 autocast within bf16 noise."""
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model
    from tests.grads import record_grads

    path = os.environ.get("SCALINGINTER_TEST_MODEL") or resolve_model("smollm2-135m")
    kw = dict(lr=0.0, kl_coef=0.01, micro_batch_size=2, grad_clip=1e9, temperature=1.0)
    cpu = TorchLearner(path, LearnerConfig(bf16_autocast=False, device="cpu", **kw))
    g_cpu = record_grads(cpu)
    s_cpu = cpu.update(*_batch())
    assert g_cpu, "no gradients recorded"
    cpu_bf16 = TorchLearner(path, LearnerConfig(bf16_autocast=True, device="cpu", **kw))
    g_cpu_bf16 = record_grads(cpu_bf16)
    s_cpu_bf16 = cpu_bf16.update(*_batch())
    bf16_noise = _rel(g_cpu_bf16, g_cpu)  # what bf16 autocast alone moves the gradients, on the CPU
    bf16_norm = abs(s_cpu_bf16["grad_norm"] - s_cpu["grad_norm"]) / s_cpu["grad_norm"]
    print(f"\nCPU bf16 vs fp32: grad rel diff {bf16_noise:.2e}, grad norm rel diff {bf16_norm:.2e}")
    del cpu_bf16
    # 3 buckets per doubling: the 48-token rows run padded to 50 (8 would leave 48, a bucket, as it is)
    for bf16, buckets, grad_tol, loss_tol in ((False, 0, 1e-4, 1e-4), (False, 3, 1e-4, 1e-4),
                                              (True, 0, max(2 * bf16_noise, 2e-2), 1e-2)):
        gpu = TorchLearner(path, LearnerConfig(bf16_autocast=bf16, device="cuda", length_buckets=buckets, **kw))
        assert next(gpu.model.parameters()).device.type == "cuda" and gpu.ref is not None
        assert next(gpu.ref.parameters()).device.type == "cuda"
        assert gpu.cfg.share_prefix is False  # the default (None) on a GPU; the CPU learners above share the prompt
        s_gpu = _update_matches(gpu, record_grads(gpu), s_cpu, g_cpu, grad_tol, loss_tol,
                                f"bf16={bf16}, length buckets {buckets}")
        assert s_gpu["grad_norm"] == pytest.approx(s_cpu["grad_norm"], rel=1e-4 if not bf16 else max(2 * bf16_norm, 1e-2))
        del gpu
        import torch

        torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda
def test_cuda_lora_learner_matches_cpu_lora_learner():
    """``model.lora`` (issue 48) on CUDA: one update at lr 0 of rank-16 adapters on all linear layers gives the CPU
    LoRA learner's loss and adapter gradients (fp32: 1e-4 relative; bf16 autocast with the frozen base stored in
    bf16: within twice what bf16 alone moves them on the CPU), only adapter tensors get gradients, and the KL
    reference (the base with the adapters off) equals the base's log-probs on the GPU too."""
    import torch

    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.lora import LoraSpec
    from runtime.backends.model import resolve_model
    from tests.grads import record_grads

    path = os.environ.get("SCALINGINTER_TEST_MODEL") or resolve_model("smollm2-135m")
    kw = dict(lr=0.0, kl_coef=0.01, micro_batch_size=2, grad_clip=1e9, temperature=1.0,
              lora=LoraSpec(rank=16, alpha=32.0))

    def make(device: str, bf16: bool):
        learner = TorchLearner(path, LearnerConfig(bf16_autocast=bf16, device=device, **kw))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the same adapters on both devices, B != 0 (fresh B = 0: A's gradients would be 0)
            for n, p in learner.model.named_parameters():
                if ".lora_" in n:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
        return learner, record_grads(learner)

    cpu, g_cpu = make("cpu", False)
    s_cpu = cpu.update(*_batch())
    assert g_cpu and all(".lora_A." in k or ".lora_B." in k for k in g_cpu)
    assert any(float(v.abs().max()) > 0 for k, v in g_cpu.items() if ".lora_A." in k)
    cpu_bf16, g_cpu_bf16 = make("cpu", True)
    s_cpu_bf16 = cpu_bf16.update(*_batch())
    bf16_noise = _rel(g_cpu_bf16, g_cpu)
    print(f"\nLoRA, CPU bf16 vs fp32: grad rel diff {bf16_noise:.2e}; "
          f"loss {s_cpu['loss']:.6f} vs {s_cpu_bf16['loss']:.6f}")
    del cpu_bf16
    seq = _batch()[0][0].token_ids
    for bf16, grad_tol, loss_tol in ((False, 1e-4, 1e-4), (True, max(2 * bf16_noise, 2e-2), 1e-2)):
        gpu, g_gpu = make("cuda", bf16)
        assert gpu.ref is None and next(gpu.model.parameters()).device.type == "cuda"
        if not bf16:  # the reference is the base with the adapters off: the CPU learner's reference, on the GPU
            want = cpu.sequence_logprobs([seq], reference=True)[0]
            got = gpu.sequence_logprobs([seq], reference=True)[0]
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
        _update_matches(gpu, g_gpu, s_cpu, g_cpu, grad_tol, loss_tol, f"LoRA bf16={bf16}")
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        del gpu
        torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
def test_cuda_adamw8bit_tracks_adamw():
    """``algo.optimizer=adamw8bit`` on CUDA (bitsandbytes' CUDA kernels): from the same weights and batch, four
    updates move the weights as torch's AdamW moves them (cosine of the two weight changes > 0.98, norms within
    10 %: the CPU test's bounds, tests/test_learning.py) while its moments take under 30 % of the bytes."""
    import torch

    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model
    from tests.grads import cosine_and_norm_ratio, weight_moves

    path = os.environ.get("SCALINGINTER_TEST_MODEL") or resolve_model("smollm2-135m")
    moved, state_bytes = {}, {}
    for opt in ("adamw", "adamw8bit"):
        torch.manual_seed(0)
        learner = TorchLearner(path, LearnerConfig(lr=1e-4, kl_coef=0.0, micro_batch_size=4, bf16_autocast=False,
                                                   device="cuda", optimizer=opt))
        assert next(learner.model.parameters()).device.type == "cuda"
        moved[opt] = weight_moves(learner, *_batch())
        state = [t for st in learner.opt.state.values() for t in st.values() if torch.is_tensor(t)]
        assert all(t.device.type == "cuda" for t in state if t.numel() > 1), opt
        state_bytes[opt] = learner.optimizer_state_bytes()
        del learner, state
        torch.cuda.empty_cache()
    cos, ratio = cosine_and_norm_ratio(moved["adamw"], moved["adamw8bit"])
    print(f"\nadamw8bit vs adamw on CUDA, 4 updates: weight-change cosine {cos:.4f}, norm ratio {ratio:.4f}; "
          f"optimizer state {state_bytes['adamw8bit'] / 2**20:.1f} MiB vs {state_bytes['adamw'] / 2**20:.1f} MiB")
    assert cos > 0.98 and abs(ratio - 1) < 0.1, (cos, ratio)
    assert state_bytes["adamw8bit"] < 0.3 * state_bytes["adamw"], state_bytes


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_cuda_vllm_logprobs_equal_the_learner_after_in_memory_sync_in_sleep_mode():
    import torch

    from core.trajectory import Trajectory
    from runtime.backends.generation import SamplingParams
    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.model import resolve_model
    from runtime.backends.vllm_backend import VLLMBackend, is_cpu_build, named_weights_fn
    from tests.test_vllm_backend import _fixed_sequence, _max_mean_diff

    if is_cpu_build():
        pytest.skip("vLLM's CPU build is installed: infra/install.sh --gpu installs the CUDA build")
    path = resolve_model("smollm2-135m")
    torch.manual_seed(0)
    learner = TorchLearner(path, LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=2, bf16_autocast=True,
                                               device="cuda"))
    seq = _fixed_sequence(learner.tokenizer)
    with VLLMBackend(path, learner.tokenizer.eos_token_id, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                     gpu_memory_utilization=0.3, sleep_mode=True, named_weights=named_weights_fn(learner)) as engine:
        prompt = seq[:-12]
        gens = engine.generate([prompt] * 4, SamplingParams(16, 1.0))
        trajs, advs = [], []
        for i, g in enumerate(gens):
            t = Trajectory(task_id=0, group_id=0)
            t.start(prompt)
            t.add_action(g.token_ids, g.logprobs)
            trajs.append(t)
            advs.append([(1.0 if i % 2 else -1.0) * m for m in t.loss_mask])
        mx0, mean0 = _max_mean_diff(engine.prompt_logprobs([seq])[0], learner.sequence_logprobs([seq])[0])
        free_awake = torch.cuda.mem_get_info()[0]
        assert engine.sleep()  # what policy_update does before the update
        free_asleep = torch.cuda.mem_get_info()[0]
        learner.update(trajs, advs)
        want = learner.sequence_logprobs([seq])[0]
        engine.sync_weights()  # wakes the weights, loads the learner's in memory, wakes the KV cache
        assert not engine.asleep
        mx, mean = _max_mean_diff(engine.prompt_logprobs([seq])[0], want)
        print(f"\nbefore update: max {mx0:.3f} mean {mean0:.4f}; after sleep + update + sync: max {mx:.3f} "
              f"mean {mean:.4f}; GPU memory freed by sleep: {(free_asleep - free_awake) / 2**30:.2f} GiB")
        assert free_asleep > free_awake  # the engine gave its memory back during the update
        assert mean < 0.1 and mx < 1.5  # bf16 engine vs the learner under bf16 autocast (as the CPU bf16 test)
        gens2 = engine.generate([prompt] * 2, SamplingParams(8, 1.0))  # and it generates again
        assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens2)


@pytest.mark.gpu
@needs_cuda
def test_one_step_smoke_run_on_gpu(tmp_path):
    """The CLI end to end on the GPU: one phase of one step (vLLM when its CUDA build is installed, else
    transformers generation on the GPU), learner on CUDA, a checkpoint and the summary written."""
    backend = "vllm" if HAS_VLLM else "transformers"
    sets = ["model.device=cuda", f"rollout.backend={backend}", f"output_dir={tmp_path}",
            'curriculum.phases=[{"turn_limit":2,"steps":1}]', "eval.n=4"]
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    cmd += ["run", "babyai", "--preset", "tiny", "--run-name", "gpu-one-step"]
    for s in sets:
        cmd += ["--set", s]
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", **os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu-one-step" / "summary.json").read_text())
    assert summary["final_checkpoint"] and summary["wall_time_s"] > 0
    metrics = [json.loads(x) for x in (tmp_path / "gpu-one-step" / "metrics.jsonl").read_text().splitlines() if x]
    assert metrics, "no training step recorded"
