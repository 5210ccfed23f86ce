"""DeepSpeed ZeRO learner: ``TorchLearner``'s algorithm with DeepSpeed's engine underneath.

Only the engine-specific parts are overridden — model/optimizer setup (``deepspeed.initialize``), the
``_zero_grad`` / ``_backward`` / ``_step`` hooks, checkpoints — so the loss and the update loop stay the
torch learner's. Configs live in ``infra/deepspeed/zero{1,2,3}.json`` (+ ``zero2_offload.json``:
DeepSpeed's CPU Adam with the optimizer offloaded; its C++ op compiles once, ~60 s).

Checkpoints: the top level of the folder is a world-size-free HF model (ZeRO-3 weights gathered on save),
tokenizer, ``trainer_state.json`` and ``rng.pt`` — what every other part of the system reads. DeepSpeed's
own (partitioned) optimizer state goes to ``deepspeed/`` and is restored only when the world size and ZeRO
stage match; otherwise training continues from the HF weights with a fresh optimizer (a warning says so).

One rank runs in-process (``DeepSpeedLearner``). More ranks: ``DeepSpeedRemoteLearner`` launches
``torchrun --nproc_per_node N -m runtime.backends.deepspeed_learner`` and drives the ranks over a local socket.
Across machines (``learner.nodes``): node 0 (the run's machine) launches its torchrun with ``--nnodes`` and torchrun's
c10d rendezvous at ``master_addr:master_port``; every other node runs ``python -m runtime.backends.deepspeed_learner
join ...`` (the same rendezvous, its own ``--node-rank``); all ranks connect back to the run at
``master_addr:master_port + 1``, authenticated by the shared secret ``$SCALINGINTER_LEARNER_TOKEN``, and receive the
learner spec from it;
each rank trains on an equal share of the batch (data parallel; gradients averaged by DeepSpeed). Each rank also
prepares (old / reference log-probs, critic values) only its share; the shares are gathered into the whole batch's
``Prepared``. PPO's critic is whole on every rank (not ZeRO-sharded: its weights and AdamW state on each), trained on
the rank's share with the same weights as the policy loss; its gradients are averaged over the ranks (an all-reduce
before its clip and step), so every rank's critic takes the one-rank step on the whole batch. The loss of every
mini-batch is normalised by its policy tokens (or sequences) over all ranks, an
all-reduce before the backward passes, scaled by the world size to undo DeepSpeed's averaging (``core.losses``): the
update equals one rank's on the whole batch (``tests/test_multirank.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from core.trajectory import Trajectory
from runtime.backends.learner import (LearnerConfig, Prepared, TorchLearner, live_indices, logprob_mismatch, rng_state,
                                    set_rng_state)
from runtime.backends.safe_load import load_plain

REPO_ROOT = Path(__file__).resolve().parents[2]


def deepspeed_config_dir() -> Path:
    """Where ``infra/deepspeed/*.json`` are: ``$SCALINGINTER_DEEPSPEED_CONFIGS``, else the source tree's (a checkout
    or an editable install), else the copy an installed wheel puts in ``<prefix>/share/scalinginter/deepspeed``
    (pyproject's data-files; the trainer image installs one)."""
    env = os.environ.get("SCALINGINTER_DEEPSPEED_CONFIGS")
    candidates = ([Path(env)] if env else []) + [REPO_ROOT / "infra" / "deepspeed",
                                                 Path(sys.prefix) / "share" / "scalinginter" / "deepspeed"]
    for d in candidates:
        if (d / "zero2.json").exists():
            return d
    raise FileNotFoundError("DeepSpeed configs (zero1/2/3.json) not found in " + ", ".join(map(str, candidates))
                            + ": reinstall the package, or set SCALINGINTER_DEEPSPEED_CONFIGS or learner.config_path")


CONFIG_DIR = REPO_ROOT / "infra" / "deepspeed"  # the source tree's (deepspeed_config_dir() finds an installed copy)


# --- config (pure) ------------------------------------------------------------------------------------------
def ds_config(stage: int, cfg: LearnerConfig, *, offload_optimizer: bool = False, bf16_weights: bool = False,
              path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict: the JSON for ``stage`` (or ``path``) with this run's grad clip, lr and
    precision filled in."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if path is None:
        name = "zero2_offload.json" if offload_optimizer else f"zero{max(stage, 1)}.json"
        path = deepspeed_config_dir() / name
    conf = json.loads(Path(path).read_text())
    conf = copy.deepcopy(conf)
    conf.pop("train_batch_size", None)  # DeepSpeed derives it: micro x accumulation x world size
    conf["gradient_accumulation_steps"] = 1  # the learner accumulates micro-batches itself (one step per mini-batch)
    conf["train_micro_batch_size_per_gpu"] = conf.get("train_micro_batch_size_per_gpu", 1)
    conf["gradient_clipping"] = cfg.grad_clip
    conf.setdefault("zero_optimization", {})["stage"] = stage
    if offload_optimizer:
        conf["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        conf["optimizer"] = {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay}}
    elif "optimizer" in conf:
        conf["optimizer"].setdefault("params", {}).update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    conf["bf16"] = {"enabled": bool(bf16_weights)}
    conf["zero_allow_untested_optimizer"] = True
    return conf


def shard_for_rank(live: list[int], rank: int, world: int) -> list[int]:
    """This rank's share of ``live``, interleaved; shares differ in size by at most one and together hold every
    entry (``shard_padding`` says how many zero-weight copies a short rank adds)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad rank {rank} of world {world}")
    return live[rank::world]


def shard_padding(n: int, rank: int, world: int) -> int:
    """Zero-weight sequences rank ``rank`` adds so every rank trains on ceil(n / world) sequences: the same
    number of micro-batches, so the same collective steps, and no episode left out."""
    size = -(-n // world)
    return size - len(range(rank, n, world))


def zero_weight_copy(t: Trajectory) -> Trajectory:
    """A copy of ``t`` with an all-zero loss mask: it runs forward and backward (keeping the ranks' collective
    steps in line) and contributes nothing to the loss or its normalisation."""
    c = copy.copy(t)
    c.loss_mask = [0] * len(t.loss_mask)
    return c


def shard_prepared(p: Prepared, rank: int, world: int) -> Prepared:
    """This rank's share of a ``Prepared`` batch (padded as ``shard_padding`` says), re-indexed to the sub-list
    of trajectories it trains on."""
    ks = shard_for_rank(list(range(len(p.live))), rank, world)
    ks = ks + [ks[0] if ks else 0] * shard_padding(len(p.live), rank, world)

    def pick(rows):
        return None if rows is None else [rows[k] for k in ks]

    return Prepared(live=list(range(len(ks))), seqs=pick(p.seqs), old=pick(p.old), ref=pick(p.ref),
                    values=pick(p.values), stats=dict(p.stats))


def merge_prepared(shards: list[Prepared]) -> Prepared:
    """The whole batch's ``Prepared`` from the ranks' shares (each with ``live`` = the batch indices of its rows):
    rows in batch order. A field is None when no share has rows of it; ``stats`` are left to the caller."""
    order = sorted((i, r, k) for r, sh in enumerate(shards) for k, i in enumerate(sh.live))
    if len({i for i, _, _ in order}) != len(order):
        raise ValueError("the shares of a prepared batch overlap")

    def rows(field: str):
        have = [sh for sh in shards if sh.live]
        if all(getattr(sh, field) is None for sh in have):
            return None
        if any(getattr(sh, field) is None for sh in have):
            raise ValueError(f"some shares of the prepared batch lack {field!r}")
        return [getattr(shards[r], field)[k] for _, r, k in order]

    return Prepared(live=[i for i, _, _ in order], seqs=rows("seqs") or [], old=rows("old"), ref=rows("ref"),
                    values=rows("values"), final_values=rows("final_values"))


# What DeepSpeed's own checkpoint files (``deepspeed/state/*.pt``) may hold besides tensors and plain values: the
# classes its engine and ZeRO optimizers pickle there (found with torch.serialization.get_unsafe_globals_in_checkpoint
# on ZeRO 1-3 checkpoints of this learner, tests/test_deepspeed_learner.py). Loaded with ``weights_only=True`` these
# are the only globals allowed; anything else refuses the file (``safe_load.UnsafeCheckpointFile``).
DS_CHECKPOINT_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # ZeRO optimizer state: its (static, 1.0) loss scaler
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # the same with fp16 dynamic scaling
    "deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO 1/2: where each parameter's fragment lies
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


def _ds_safe_globals() -> list[Any]:
    import importlib

    out = []
    for qual in DS_CHECKPOINT_GLOBALS:
        mod, _, name = qual.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: that class is not in its files either
            continue
    return out


def safe_checkpoint_loads(engine) -> None:
    """Make ``engine``'s checkpoint loads (``load_checkpoint``: model states, ZeRO optimizer partitions) use
    ``torch.load(weights_only=True)`` with only DeepSpeed's own known classes allowed, instead of its
    ``weights_only=False``: a tampered file is refused with one line naming it, never unpickled."""
    import pickle

    from runtime.backends.safe_load import UnsafeCheckpointFile, refusal_reason

    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or getattr(ce, "_scalinginter_safe", False):
        return
    allowed = _ds_safe_globals()

    def load(path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointFile(
                f"{path} holds objects other than tensors, plain values and DeepSpeed's own checkpoint classes, so "
                f"it is not loaded (weights_only): it was tampered with or not written by this learner: resume from "
                f"another checkpoint or delete this one. ({refusal_reason(exc)})") from exc

    ce.load = load
    ce._scalinginter_safe = True


def _ensure_dist() -> None:
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:  # launched by torchrun / deepspeed: the launcher chose the rendezvous
        deepspeed.init_distributed(dist_backend=backend)
        return
    # a single in-process rank: rendezvous through a fresh file, not a TCP port. A free port picked for the TCP
    # store could be taken (by an outgoing connection, an env server) before the store bound it: EADDRINUSE.
    import tempfile

    store = Path(tempfile.mkdtemp(prefix="si-dist-")) / "store"
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")  # present so DeepSpeed does not go looking for MPI; unused by file://
    deepspeed.init_distributed(dist_backend=backend, init_method=f"file://{store}", rank=0, world_size=1)


class DeepSpeedLearner(TorchLearner):
    cast_linears = False  # ZeRO-3 frees a layer's gathered weights after its forward: the stock linear keeps its copy

    def __init__(self, model_path: str, cfg: LearnerConfig, reference_path: str | None = None, *,
                 zero_stage: int = 2, offload_optimizer: bool = False, bf16_weights: bool = False,
                 config_path: str | None = None):
        import deepspeed

        _ensure_dist()
        if torch.cuda.is_available():  # this rank's GPU is the current device before any model is loaded
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if zero_stage == 3 and cfg.logprob_chunk:  # ZeRO-3 gathers the output weight only inside the module's call
            cfg = dataclasses.replace(cfg, logprob_chunk=0)
        if zero_stage == 3 and cfg.lora is not None:
            raise ValueError("LoRA with the DeepSpeed learner runs on ZeRO 0-2 (the frozen base whole on each rank, "
                             "the adapters' gradients averaged over the ranks): set learner.zero_stage to 2 or lower")
        super().__init__(model_path, cfg, reference_path)  # tokenizer, fp32 policy, frozen reference, AdamW
        self.zero_stage = zero_stage
        self.ds_conf = ds_config(zero_stage, cfg, offload_optimizer=offload_optimizer, bf16_weights=bf16_weights,
                                 path=config_path)
        client_opt = None if "optimizer" in self.ds_conf else self.opt
        trained = [q for q in self.model.parameters() if q.requires_grad]  # LoRA: the adapters only
        self.engine, self.opt, _, _ = deepspeed.initialize(model=self.model, optimizer=client_opt,
                                                           model_parameters=trained if client_opt is None else None,
                                                           config=self.ds_conf)
        self.model = self.engine.module
        if self.engine.device.type != self.device.type:
            raise ValueError(f"model.device resolved to {self.device} but DeepSpeed's accelerator is "
                             f"{self.engine.device.type}: set model.device=auto, or pick DeepSpeed's accelerator with "
                             "DS_ACCELERATOR=cpu|cuda")
        self.device = self.engine.device
        if self.ref is not None:
            self.ref.to(self.device)
        if self.critic is not None:  # PPO: a whole critic on every rank, its gradients averaged over the ranks
            self.critic.net.to(self.device)
            self.critic.device = self.device
            self.critic.data_parallel = self.world_size > 1
        safe_checkpoint_loads(self.engine)

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    # -- data parallel: DeepSpeed averages the ranks' gradients over the world (ZeRO 1-3 alike) -------------
    def _data_parallel_ranks(self) -> int:
        return self.world_size

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        backend = torch.distributed.get_backend()
        if backend == "nccl":
            t = t.to(self.device)
        torch.distributed.all_reduce(t)
        return t.cpu().tolist()

    def prepare(self, trajs: list[Trajectory], old_for_reward: bool = False) -> Prepared:
        """``TorchLearner.prepare`` with each rank computing only its share (``shard_for_rank``); the shares are
        gathered, so every rank returns the whole batch's ``Prepared``. Collective."""
        if self.world_size == 1:
            return super().prepare(trajs, old_for_reward)
        mine = shard_for_rank(live_indices(trajs), self.rank, self.world_size)
        own = super().prepare([trajs[i] for i in mine], old_for_reward)
        own.live = mine  # every trajectory of the share is live: its rows are the share's, in order
        shards: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(shards, own)
        p = merge_prepared(shards)
        if p.old is not None and p.live:
            p.stats["logprob_mismatch"] = logprob_mismatch(trajs, p.live, p.old)
        return p

    # device handling is the torch learner's: the batch tensors go to ``self.device`` (the engine's), the loss is
    # computed there, under ``hardware.autocast`` on that device
    # -- engine hooks -----------------------------------------------------------------------------------
    # The torch learner calls _zero_grad, then _backward once per micro-batch, then _step; how many micro-batches
    # a mini-batch has is its business. So every real micro-batch is a non-boundary DeepSpeed micro-step
    # (gradients accumulate), and _step closes the window with a zero-valued boundary backward of one token
    # (it reaches every parameter, so ZeRO's reduction hooks fire at any stage), then steps.
    def _zero_grad(self) -> None:
        self.engine.zero_grad()

    def _release_grads(self) -> None:
        """The engine's step zeroes its gradients (ZeRO keeps them in its own buffers): nothing to free here."""

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.set_gradient_accumulation_boundary(False)
        self.engine.backward(loss.to(self.device) if loss.device != self.device else loss)

    def _step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        with self._autocast():
            zero = self.model(input_ids=ids).logits.float().sum() * 0.0
        self.engine.backward(zero)
        self.engine.step()  # clips to gradient_clipping, steps, zeroes the grads
        gn = self.engine.get_global_grad_norm()
        return float(gn) if gn is not None else 0.0

    # -- update over this rank's share ----------------------------------------------------------------------
    def update_shard(self, trajs: list[Trajectory], advantages: list[list[float]], prepared: Prepared | None = None,
                     returns: list[list[float]] | None = None) -> dict[str, float]:
        """Every rank gets the whole batch (and its gathered ``Prepared``) and trains on its share; a rank one
        sequence short trains on a zero-weight copy as well, so no episode is dropped and the collectives line up.
        The loss is normalised over all ranks' shares (``TorchLearner.update`` with the data-parallel hooks)."""
        p = prepared if prepared is not None else self.prepare(trajs)
        if not p.live:
            return {"skipped": 1.0}
        sub = shard_prepared(p, self.rank, self.world_size)
        ks = shard_for_rank(list(range(len(p.live))), self.rank, self.world_size)
        pad = shard_padding(len(p.live), self.rank, self.world_size)
        first = p.live[ks[0] if ks else 0]
        idx = [p.live[k] for k in ks]
        t_sub = [trajs[i] for i in idx] + [zero_weight_copy(trajs[first]) for _ in range(pad)]
        a_sub = [advantages[i] for i in idx] + [[0.0] * len(advantages[first]) for _ in range(pad)]
        r_sub = None
        if returns is not None:
            r_sub = [returns[i] for i in idx] + [[0.0] * len(returns[first]) for _ in range(pad)]
        st = self.update(t_sub, a_sub, prepared=sub, returns=r_sub)
        st["padded_for_sharding"] = float(-(-len(p.live) // self.world_size) * self.world_size - len(p.live))
        st["sequences_trained"] = float(len(p.live))
        return st

    # -- weights and checkpoints --------------------------------------------------------------------------
    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (ZeRO-3: gathered from all ranks; every rank must call)."""
        if self.zero_stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
            return sd if self.rank == 0 else None
        return self.model.state_dict() if self.rank == 0 else None

    def in_memory_weights(self):
        """One rank: the whole model's weights here (ZeRO-3 gathers them; LoRA: the adapters merged in, as the torch
        learner gives them); several ranks: None (sync by folder)."""
        if self.world_size != 1:
            return None
        if self.peft is not None:
            return super().in_memory_weights()
        return lambda: self._full_state_dict().items()

    def save_weights(self, directory: Path) -> None:
        """HF folder with the model weights only (for the generation engine to reload; LoRA: the adapters merged
        into the base, written by rank 0, whose module holds the whole model at ZeRO 0-2). Collective."""
        if self.peft is not None:
            if self.rank == 0:
                super().save_weights(directory)
            self._barrier()
            return
        sd = self._full_state_dict()
        if self.rank == 0:
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            self.model.config.use_cache = True
            self.model.save_pretrained(directory, state_dict={k: v.detach().cpu() for k, v in sd.items()})
            self.model.config.use_cache = False
        self._barrier()

    def save(self, directory: Path, trainer_state: dict[str, Any]) -> None:
        """The HF folder (LoRA: the adapter's files and its base record, as the torch learner's checkpoint), the
        tokenizer, RNG and trainer state from rank 0; DeepSpeed's own checkpoint of the trained weights and their
        optimizer state from every rank (LoRA: the frozen base left out). Collective."""
        directory = Path(directory)
        if self.peft is None:
            self.save_weights(directory)
        elif self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self._save_adapter(directory)
        if self.rank == 0:
            self.tokenizer.save_pretrained(directory)
            torch.save(rng_state(self.device), directory / "rng.pt")
            (directory / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False,
                                    exclude_frozen_parameters=self.peft is not None)
        if self.rank == 0:
            (directory / "deepspeed" / "layout.json").write_text(json.dumps(self._layout()))
            if self.critic is not None:  # PPO: the value model and its optimizer (every rank holds the same), as the
                self.critic.save(directory)  # torch learner's
        self._barrier()

    def load_training_state(self, directory: Path, weights: bool = True) -> dict[str, Any]:
        directory = Path(directory)
        ds_dir = directory / "deepspeed"
        layout_file = ds_dir / "layout.json"
        layout = json.loads(layout_file.read_text()) if layout_file.exists() else None
        if self.peft is not None and weights:  # the adapter's files, refused on another base (the torch learner's)
            self._load_adapter(directory)
        if layout == self._layout():
            self.engine.load_checkpoint(str(ds_dir), tag="state", load_optimizer_states=True,
                                        load_lr_scheduler_states=False, load_module_only=False,
                                        load_module_strict=self.peft is None)  # LoRA: the base was left out
        else:
            if weights:
                self._load_hf_weights(directory)
            if layout is not None or (directory / "optimizer.pt").exists():
                warnings.warn(f"optimizer state in {directory} is for another layout ({layout or 'torch learner'}, "
                              f"here world_size={self.world_size}, zero_stage={self.zero_stage}): continuing with "
                              f"the checkpoint's weights and a fresh optimizer", stacklevel=2)
        if self.critic is not None:
            self.critic.load(directory)
        rng_file = directory / "rng.pt"
        if rng_file.exists():
            set_rng_state(load_plain(rng_file))
        state_file = directory / "trainer_state.json"
        return json.loads(state_file.read_text()) if state_file.exists() else {}

    def _layout(self) -> dict[str, Any]:
        """What a DeepSpeed checkpoint's optimizer state fits: the ranks, the ZeRO stage, and LoRA (adapters only)."""
        return {"world_size": self.world_size, "zero_stage": self.zero_stage,
                **({"lora": True} if self.peft is not None else {})}

    def _load_hf_weights(self, directory: Path) -> None:
        """The folder's weights into the module (LoRA: its adapter, which load_training_state loaded already), then
        ZeRO's fp32 copies refreshed from the module."""
        from runtime.backends.learner import load_causal_lm

        if self.peft is None and self.zero_stage == 3:
            fresh = load_causal_lm(str(directory)).state_dict()
            import deepspeed

            params = dict(self.model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
                if self.rank == 0:
                    for n, p in params.items():
                        p.data.copy_(fresh[n])
        elif self.peft is None:
            self.model.load_state_dict(load_causal_lm(str(directory)).state_dict())
        restore = getattr(self.engine.optimizer, "_restore_from_bit16_weights", None)
        if restore is not None:  # ZeRO keeps its own fp32 partitions: refresh them from the module
            restore()

    def _barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        self.engine = None


# --- multi-rank: torchrun workers driven over a local socket -------------------------------------------------


class DeepSpeedRemoteLearner:
    """The learner protocol (update / save / save_weights / load_training_state) over ``ranks`` torchrun
    processes on this machine. The driver holds no model: generation must use its own engine (vLLM)."""

    def __init__(self, model_path: str, cfg: LearnerConfig, reference_path: str | None = None, *, ranks: int = 2,
                 zero_stage: int = 2, offload_optimizer: bool = False, bf16_weights: bool = False,
                 config_path: str | None = None, threads_per_rank: int | None = None,
                 startup_timeout_s: float = 600.0, log_path: str | None = None, nodes: int = 1,
                 master_addr: str | None = None, master_port: int = 29500):
        from multiprocessing.connection import Listener

        from envs.spawn import free_port
        from transformers import AutoTokenizer

        self.world = ranks * nodes
        if self.world < 2:
            raise ValueError("DeepSpeedRemoteLearner is for ranks x nodes >= 2; use DeepSpeedLearner in-process for 1")
        if nodes > 1 and not master_addr:
            raise ValueError("learner.nodes > 1 needs learner.master_addr: node 0's address the other nodes reach")
        self.cfg = cfg
        self.ranks = ranks
        self.nodes = nodes
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = None  # lives in the ranks
        authkey = node_token() if nodes > 1 else os.urandom(16)
        # one node: the ranks connect over loopback; several: at master_addr:master_port + 1, from the other nodes
        self._listener = (Listener((master_addr, master_port + 1), authkey=authkey) if nodes > 1
                          else Listener(("127.0.0.1", 0), authkey=authkey))
        self._spec = {"model_path": model_path, "reference_path": reference_path, "cfg": cfg,  # pickled whole
                      "zero_stage": zero_stage, "offload_optimizer": offload_optimizer, "bf16_weights": bf16_weights,
                      "config_path": config_path}
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // ranks)
        if nodes > 1:
            cmd = torchrun_command(ranks, nodes, 0, master_addr, master_port)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   f"--master_port={free_port()}", "-m", "runtime.backends.deepspeed_learner", "--worker"]
        env = worker_env(list(self._listener.address), authkey, threads)
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT if log_path else None,
                                     start_new_session=True)
        self._conns: dict[int, Any] = {}
        self._listener._listener._socket.settimeout(5.0)
        deadline = time.monotonic() + startup_timeout_s
        while len(self._conns) < self.world:
            if self.proc.poll() is not None:
                raise RuntimeError(f"DeepSpeed ranks exited with code {self.proc.returncode} during startup")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"DeepSpeed ranks not ready after {startup_timeout_s:g} s")
            try:
                conn = self._listener.accept()
            except (socket.timeout, TimeoutError):
                continue
            rank = conn.recv()
            conn.send(self._spec)  # what to build (a rank on another node has only the connection)
            self._conns[int(rank)] = conn
        for c in self._conns.values():  # every rank reports after deepspeed.initialize
            self._recv(c)

    def _recv(self, conn):
        while not conn.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"DeepSpeed ranks exited with code {self.proc.returncode}")
        ok, value = conn.recv()
        if not ok:
            raise RuntimeError(f"DeepSpeed rank failed: {value}")
        return value

    def _call(self, cmd: str, *args):
        for c in self._conns.values():
            c.send((cmd, args))
        results = {r: self._recv(c) for r, c in self._conns.items()}
        return results[0]

    def prepare(self, trajs: list[Trajectory], old_for_reward: bool = False) -> Prepared:
        return self._call("prepare", trajs, old_for_reward)  # each rank computes its share, all keep the whole

    def per_token(self, trajs: list[Trajectory], p: Prepared, which: str) -> list[list[float]]:
        return TorchLearner.per_token(self, trajs, p, which)  # pure over ``p``

    def final_values(self, trajs: list[Trajectory], p: Prepared) -> list[float] | None:
        return TorchLearner.final_values(self, trajs, p)  # pure over ``p`` (PPO: the ranks' critic values)

    def update(self, trajs: list[Trajectory], advantages: list[list[float]], prepared: Prepared | None = None,
               returns: list[list[float]] | None = None) -> dict[str, float]:
        return self._call("update", trajs, advantages, prepared is not None, returns)

    def save_weights(self, directory: Path) -> None:
        self._call("save_weights", str(directory))

    def in_memory_weights(self) -> None:
        return None  # the model lives in the ranks: the engine syncs through a folder

    def save(self, directory: Path, trainer_state: dict[str, Any]) -> None:
        self._call("save", str(directory), trainer_state)

    def load_training_state(self, directory: Path, weights: bool = True) -> dict[str, Any]:
        return self._call("load_training_state", str(directory), weights)

    def sequence_logprobs(self, seqs: list[list[int]], reference: bool = False) -> list[list[float]]:
        return self._call("sequence_logprobs", seqs, reference)

    def close(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        try:
            if self.proc.poll() is None:
                for c in self._conns.values():
                    try:
                        c.send(("close", ()))
                    except OSError:
                        pass
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.terminate()
                    self.proc.wait(10)
        finally:
            for c in self._conns.values():
                c.close()
            self._listener.close()
            if self._log is not subprocess.DEVNULL:
                self._log.close()
            self.proc = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


LEARNER_TOKEN_ENV = "SCALINGINTER_LEARNER_TOKEN"  # the shared secret of a learner across nodes


def node_token() -> bytes:
    """The secret every node of a multi-node learner shares (``$SCALINGINTER_LEARNER_TOKEN``): the ranks on other
    nodes authenticate to the run's control connection with it (``multiprocessing.connection``'s HMAC handshake)."""
    tok = os.environ.get(LEARNER_TOKEN_ENV, "")
    if len(tok) < 16:
        raise ValueError(f"a learner across nodes needs a shared secret: set {LEARNER_TOKEN_ENV} to the same string of 16+ "
                         f"characters on every node (e.g. {LEARNER_TOKEN_ENV}=$(openssl rand -hex 16))")
    return tok.encode()


def torchrun_command(ranks: int, nodes: int, node_rank: int, master_addr: str, master_port: int) -> list[str]:
    """torchrun for node ``node_rank`` of ``nodes``: ``ranks`` workers joined through the c10d rendezvous at
    ``master_addr:master_port`` (hosted by node 0's agent; the run id is fixed, one learner per rendezvous port)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node_rank}",
            f"--nproc_per_node={ranks}", "--rdzv_backend=c10d", f"--rdzv_endpoint={master_addr}:{master_port}",
            "--rdzv_id=scalinginter-learner", f"--rdzv_conf=is_host={1 if node_rank == 0 else 0}",
            "-m", "runtime.backends.deepspeed_learner", "--worker"]


def worker_env(address: list, authkey: bytes, threads: int) -> dict[str, str]:
    """The environment of a node's torchrun: where the run's control connection listens, its key, the threads per
    rank, and this repository on the path."""
    worker = {"address": list(address), "authkey": authkey.hex(), "threads": int(threads)}
    return dict(os.environ, SCALINGINTER_DS_WORKER=json.dumps(worker), OMP_NUM_THREADS=str(threads),
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]]
                                                               if os.environ.get("PYTHONPATH") else [])))


def join(argv: list[str] | None = None) -> int:
    """``python -m runtime.backends.deepspeed_learner join``: run this machine's ranks of a multi-node learner (node
    ``--node-rank`` of ``--nodes``) until the run closes the learner. Blocks; returns torchrun's exit code."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m runtime.backends.deepspeed_learner join",
                                 description="Join a ScalingInter run's DeepSpeed learner from another node "
                                             f"(the same ${LEARNER_TOKEN_ENV} as the run's machine).")
    ap.add_argument("--nodes", type=int, required=True, help="learner.nodes of the run")
    ap.add_argument("--node-rank", type=int, required=True, help="this node: 1 .. nodes-1")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="learner.ranks of the run (ranks per node)")
    ap.add_argument("--master-addr", required=True, help="learner.master_addr of the run (node 0)")
    ap.add_argument("--master-port", type=int, default=29500, help="learner.master_port of the run")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    a = ap.parse_args(argv)
    if not 0 < a.node_rank < a.nodes:
        ap.error(f"--node-rank must be 1 .. {a.nodes - 1} (node 0 is the run's machine)")
    threads = a.threads_per_rank or max(1, (os.cpu_count() or 1) // a.nproc_per_node)
    env = worker_env([a.master_addr, a.master_port + 1], node_token(), threads)
    cmd = torchrun_command(a.nproc_per_node, a.nodes, a.node_rank, a.master_addr, a.master_port)
    return subprocess.call(cmd, cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL)


def _connect(address: tuple, authkey: bytes, timeout_s: float = 300.0):
    """The control connection to the run, retried while it is not listening yet (a node may start first)."""
    from multiprocessing.connection import Client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _worker() -> None:
    """One torchrun rank: connect to the run, receive the learner spec, build the learner, then serve the driver's
    commands until ``close``."""
    worker = json.loads(os.environ["SCALINGINTER_DS_WORKER"])
    torch.set_num_threads(int(worker["threads"]))
    conn = _connect(tuple(worker["address"]), bytes.fromhex(worker["authkey"]))
    conn.send(int(os.environ["RANK"]))
    spec = conn.recv()
    try:
        learner = DeepSpeedLearner(spec["model_path"], spec["cfg"], spec["reference_path"],
                                   zero_stage=spec["zero_stage"], offload_optimizer=spec["offload_optimizer"],
                                   bf16_weights=spec["bf16_weights"], config_path=spec["config_path"])
        conn.send((True, None))
    except Exception as e:  # noqa: BLE001
        conn.send((False, f"{type(e).__name__}: {e}"))
        raise
    prepared = None
    while True:
        cmd, args = conn.recv()
        if cmd == "close":
            break
        try:
            if cmd == "prepare":
                prepared = out = learner.prepare(*args)
            elif cmd == "update":
                trajs, advs, use_prepared, returns = args
                out = learner.update_shard(trajs, advs, prepared if use_prepared else None, returns)
                prepared = None
            elif cmd == "save":
                out = learner.save(Path(args[0]), args[1])
            elif cmd == "save_weights":
                out = learner.save_weights(Path(args[0]))
            elif cmd == "load_training_state":
                out = learner.load_training_state(Path(args[0]), args[1])
            elif cmd == "sequence_logprobs":
                out = learner.sequence_logprobs(*args)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send((True, out))
        except Exception as e:  # noqa: BLE001
            import traceback

            conn.send((False, f"rank {os.environ.get('RANK')}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    conn.close()


def make_learner(model_path: str, cfg: LearnerConfig, reference_path: str | None, section) -> Any:
    """The DeepSpeed learner for a ``LearnerEngineConfig`` (``core.config``): in-process for one rank, torchrun
    ranks otherwise."""
    kw = dict(zero_stage=section.zero_stage, offload_optimizer=section.offload_optimizer,
              config_path=section.config_path)
    nodes = getattr(section, "nodes", 1)
    if nodes > 1 and section.node_rank != 0:
        raise ValueError(f"learner.node_rank={section.node_rank}: a run is node 0; on the other nodes run "
                         "`python -m runtime.backends.deepspeed_learner join --nodes N --node-rank K ...` instead")
    if section.ranks * nodes > 1:
        if nodes > 1:
            kw.update(nodes=nodes, master_addr=section.master_addr, master_port=section.master_port)
        return DeepSpeedRemoteLearner(model_path, cfg, reference_path, ranks=section.ranks, **kw)
    return DeepSpeedLearner(model_path, cfg, reference_path, **kw)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
elif __name__ == "__main__" and sys.argv[1:2] == ["join"]:
    sys.exit(join(sys.argv[2:]))
