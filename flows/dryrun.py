"""``scalinginter run ENV --dry-run``: the run's context, KV cache and memory plan (``core.preflight``) from its
config and the model's ``config.json``, without loading a model or starting anything. With ``model.lora`` the
memory plan counts the frozen base once (no reference copy: the reference is the base with the adapters off) and
gradients and optimizer state for the adapters only (``lora_memory``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from core.config import RunConfig
from core.kvcache import GiB, plan_kv_cache
from core.preflight import (ACT_BYTES_PER_HIDDEN_LAYER, ACT_BYTES_PER_VOCAB, OPTIMIZER_STATE_BYTES, RUNTIME_BYTES,
                            ModelShape, Plan, RunShape, check_run)


def _model_config(ref: str) -> dict:
    """The model's ``config.json``: an embedded default (materialised as an HF folder), a local folder, or a hub id
    (from the hub cache, or the hub when online)."""
    from runtime.backends.model import resolve_model

    path = resolve_model(ref)
    if Path(path).is_dir() and not (Path(path) / "config.json").exists():  # a LoRA adapter: its base's config
        from runtime.backends.lora import is_adapter_dir, read_base_record

        if is_adapter_dir(path):
            path = resolve_model(read_base_record(path).get("base_dir") or path)
    if Path(path).is_dir():
        return json.loads((Path(path) / "config.json").read_text())
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(path, "config.json")).read_text())


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def run_shape(cfg: RunConfig) -> RunShape:
    from runtime.backends.hardware import resolve_vllm_dtype

    r, a = cfg.rollout, cfg.algo
    turn_limit = max([p.turn_limit for p in cfg.curriculum.phases] + [cfg.eval.turn_limit or 0])
    episodes = max(r.tasks_per_step * r.samples_per_task, cfg.eval.n)
    if r.max_live_episodes is not None:
        episodes = min(episodes, r.max_live_episodes)
    return RunShape(turn_limit=turn_limit, max_new_tokens=r.max_new_tokens, token_budget=r.token_budget,
                    history_turns=r.history_turns, episodes=episodes,
                    kv_budget_bytes=int(r.vllm_kv_budget_gb * GiB),
                    kv_fixed_bytes=None if r.vllm_kv_cache_gb is None else int(r.vllm_kv_cache_gb * GiB),
                    engine_bytes_per_elem=4 if resolve_vllm_dtype(r.vllm_dtype) == "float32" else 2,
                    micro_batch_tokens=a.micro_batch_tokens, micro_batch_size=a.micro_batch_size,
                    reference=a.kl_coef > 0, critic=a.estimator == "ppo", vllm=r.backend == "vllm",
                    optimizer_bytes_per_param=OPTIMIZER_STATE_BYTES[a.optimizer],
                    ranks=cfg.learner.ranks if cfg.learner.engine == "deepspeed" else 1,
                    zero_stage=cfg.learner.zero_stage if cfg.learner.engine == "deepspeed" else 0)


@dataclasses.dataclass(frozen=True)
class LoraMemory:
    """The learner side of a LoRA run's memory (bytes), from ``lora_memory``."""

    base: int  # the frozen base: fp32 embeddings, linear layers in bf16 under bf16 autocast (else fp32)
    adapters: int  # adapter weights, gradients and optimizer state
    adapter_params: int
    critic: int  # PPO: the critic's frozen backbone copy, its adapters and value head (0 without a critic)
    engine_adapter: int  # the adapter's copy in the engine


def lora_memory(c: dict, m: ModelShape, r: RunShape, rank: int, targets, bf16: bool) -> LoraMemory:
    """The learner's memory with ``rank``-``targets`` adapters on a frozen base (``c``: its ``config.json``): the base
    once (the KL reference is the base with the adapters off, no copy), fp32 weights and gradients plus the
    optimizer's state for the adapters only."""
    from runtime.backends.lora import adapter_param_count

    tc = c.get("text_config", c)
    emb = m.vocab * m.hidden * (1 if tc.get("tie_word_embeddings", True) else 2)
    base = 4 * emb + (2 if bf16 else 4) * (m.params - emb)
    a = adapter_param_count(c, rank, targets)
    per_adapter = 8 + r.optimizer_bytes_per_param
    critic = (base + 16 * a + 16 * m.hidden) if r.critic else 0  # its own frozen copy, adapters and head (AdamW)
    return LoraMemory(base, per_adapter * a, a, critic, r.engine_bytes_per_elem * a if r.vllm else 0)


def _lora_plan(plan: Plan, cfg: RunConfig, c: dict, m: ModelShape, r: RunShape, machine: int | None) -> None:
    """Replace ``check_run``'s memory line (and its memory error) with the LoRA learner's."""
    from runtime.backends.hardware import resolve_bf16

    lo = cfg.model.lora
    try:
        lm = lora_memory(c, m, r, lo.rank, lo.target_modules, resolve_bf16(cfg.model.bf16_autocast))
    except ValueError as e:
        plan.errors.append(f"model.lora.target_modules: {e}")
        return
    kv = 0
    if r.vllm:  # the engine's KV cache as check_run sized it
        try:
            kv = plan_kv_cache(max(1, r.episodes), r.token_budget + 1,
                               m.kv_bytes_per_token_16 * r.engine_bytes_per_elem // 2, r.kv_budget_bytes,
                               r.kv_fixed_bytes).cache_bytes
        except ValueError:  # check_run reported it
            kv = 0
    engine = (r.engine_bytes_per_elem * m.params + kv + lm.engine_adapter) if r.vllm else 0
    tokens = r.micro_batch_tokens or r.micro_batch_size * r.token_budget
    acts = tokens * (m.layers * m.hidden * ACT_BYTES_PER_HIDDEN_LAYER + m.vocab * ACT_BYTES_PER_VOCAB)
    n = max(1, r.ranks)  # DeepSpeed ranks on this machine: each holds the base, the adapters, a critic, activations
    total = n * (lm.base + lm.adapters + lm.critic + acts) + engine + RUNTIME_BYTES
    plan.memory_bytes = total
    learner = [f"frozen base {lm.base / GiB:.1f}",
               f"adapters {lm.adapters / GiB:.2f} ({lo.rank}-rank, {lm.adapter_params / 1e6:.1f} M parameters with "
               "gradients and optimizer state; no reference copy)",
               f"activations {acts / GiB:.1f} ({tokens} tokens per micro-batch)"]
    if lm.critic:
        learner.append(f"critic {lm.critic / GiB:.1f} (frozen backbone copy and its adapters)")
    parts = [f"each of {n} DeepSpeed ranks: " + "; ".join(learner)] if n > 1 else learner
    if engine:
        parts.append(f"engine {engine / GiB:.1f}")
    parts.append(f"runtime {RUNTIME_BYTES / GiB:.1f}")
    plan.lines = [x for x in plan.lines if not x.startswith("memory:")]
    plan.lines.append(f"memory: at least {total / GiB:.1f} GiB with LoRA ({', '.join(parts)})"
                      + (f" of {machine / GiB:.0f} GiB" if machine else ""))
    plan.errors = [e for e in plan.errors if not e.startswith("the run needs at least")]
    if machine and total > machine:
        plan.errors.append(f"the run needs at least {total / GiB:.1f} GiB, more than this machine's "
                           f"{machine / GiB:.1f} GiB: lower algo.micro_batch_tokens or model.lora.rank, or use a "
                           "smaller model")


def local_engine_host():
    """The run's machine as an engine host (``core.engines.EngineHost``): its CUDA GPUs and its cores."""
    from core.engines import LOCAL, EngineHost

    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return EngineHost(LOCAL, gpus, cores)


def _engine_plan(plan: Plan, cfg: RunConfig, m: ModelShape, r: RunShape, machine: int | None, local) -> None:
    """``rollout.engines`` / ``rollout.engine_hosts``: where each engine runs (``core.engines.plan_engines``), the
    memory of the engines beyond the first on this machine (a copy of the weights each; the KV cache is split
    between them), and a one-line error for a layout that cannot be, or that needs other hosts (the run starts
    engines on its own machine only)."""
    from core.engines import parse_engine_host, plan_engines

    ro = cfg.rollout
    if ro.engines == 1 and not ro.engine_hosts:
        return
    joined = [u.rstrip("/") for u in ro.engine_urls]  # serving already (scalinginter engine-host): not placed here
    placed, errors = plan_engines(ro.engines - len(joined), ro.tensor_parallel_size, local,
                                  [parse_engine_host(h) for h in ro.engine_hosts])
    plan.errors += errors
    if not placed:
        return
    where = "; ".join(f"{p.engine}: {p.host} " + (f"GPUs {','.join(map(str, p.gpus))}" if p.gpus else
                                                   f"cores {p.cores}" if p.cores else "CPU") for p in placed)
    where += "".join(f"; {len(placed) + k}: {u} (joined)" for k, u in enumerate(joined))
    sync = "memory" if ro.engine_sync == "auto" else ro.engine_sync
    kind = (f"{len(placed)} of {ro.tensor_parallel_size} GPU(s) each" if any(p.gpus for p in placed) else
            f"{len(placed)} on CPUs") + (f" + {len(joined)} on other hosts" if joined else "")
    plan.lines.append(f"rollout engines ({kind}; weights synced by {sync}"
                      + (f", folder {ro.engine_sync_dir or '(temp)'} for the joined" if joined else "") + f"): {where}")
    here = sum(p.local for p in placed)
    if here > 1 and r.vllm:
        extra = (here - 1) * r.engine_bytes_per_elem * m.params
        plan.memory_bytes += extra
        plan.lines.append(f"memory: + {extra / GiB:.1f} GiB for {here - 1} more engine(s) on this machine (a copy of the "
                          f"weights each; the KV cache is split between the {here} engines)")
        if local.gpus == 0 and machine and plan.memory_bytes > machine:
            plan.errors.append(f"{here} engines need at least {plan.memory_bytes / GiB:.1f} GiB with the learner, more "
                               f"than this machine's {machine / GiB:.1f} GiB: lower rollout.engines")
    remote = sorted({p.host for p in placed if not p.local})
    if remote:
        plan.errors.append(f"rollout.engine_hosts: the layout puts engines on {', '.join(remote)}, but a run starts "
                           "rollout engines on its own machine only (remote engines are planned, not started): lower "
                           "rollout.engines to what this machine holds or drop rollout.engine_hosts")


def dry_run(cfg: RunConfig, local_host=None) -> Plan:
    """The plan of ``cfg`` (its ``errors`` empty when the run would start). ``local_host``: this machine as an engine
    host (``core.engines.EngineHost``; default: its GPUs and cores)."""
    try:
        config = _model_config(cfg.model.path)
        shape = ModelShape.from_hf_config(config)
    except Exception as e:  # noqa: BLE001 - any failure to read the model's config is the one thing to report
        p = Plan()
        p.errors.append(f"cannot read the config of model {cfg.model.path!r} ({type(e).__name__}: {e}): pass a local "
                        "HF folder or a hub id reachable from here (--set model.path=...)")
        return p
    shape_r, machine = run_shape(cfg), machine_memory()
    plan = check_run(shape, shape_r, machine, model_name=cfg.model.path)
    if cfg.model.lora.enabled:
        _lora_plan(plan, cfg, config, shape, shape_r, machine)
    _engine_plan(plan, cfg, shape, shape_r, machine, local_host or local_engine_host())
    plan.lines.insert(0, f"model {cfg.model.path}: {shape.params / 1e6:.0f} M parameters, context "
                         f"{shape.context or 'unknown'}")
    return plan
