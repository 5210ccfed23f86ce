"""Plain-torch learner: policy + frozen reference, GRPO clipped loss with k3 KL, AdamW.

Runs on ``LearnerConfig.device`` (``model.device``: a CUDA GPU when there is one, else the CPU; one code path, the
batch tensors are built on the CPU and moved there). bf16 autocast over fp32 master weights (pure bf16 weights drop
updates at RL learning rates).
Checkpoints are HF folders (world-size independent) plus ``optimizer.pt`` keyed by parameter name and
``trainer_state.json`` / ``rng.pt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import random
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from core.advantages import pad_rows
from core.losses import batch_totals, micro_batches, nll_loss, policy_loss, sequence_weights
from core.buckets import bucket_floor, bucket_length
from core.prefix import plan_shared_prefixes
from core.trajectory import Trajectory
from runtime.backends.cast_linear import set_recast, use_cast_linears
from runtime.backends.logprobs import chunked_token_logprobs
from runtime.backends.safe_load import load_plain


@dataclass
class LearnerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # or "adamw8bit" (bitsandbytes): make_optimizer
    grad_dtype: str = "fp32"  # or "bf16": the policy's gradients accumulate in bf16 (_hold_bf16)
    kl_coef: float = 0.001
    clip: float = 0.2
    grad_clip: float = 1.0
    micro_batch_size: int = 4
    skip_zero_advantage: bool = False  # episodes with an all-zero advantage skip the forward when nothing reads them
    micro_batch_tokens: int | None = None  # padded tokens per forward/backward (core.losses.micro_batches)
    mini_batches: int = 1
    ppo_epochs: int = 1
    bf16_autocast: bool = True
    temperature: float = 1.0  # log-probs are computed for the distribution the rollout sampled from
    loss_agg: str = "token-mean"  # or "seq-mean"
    kl_in_loss: bool = True  # False when the estimator puts the KL penalty in the reward (REINFORCE++)
    critic: bool = False  # PPO: train a value model
    critic_path: str | None = None  # None: a copy of the policy's initial model
    critic_lr: float = 1e-5
    value_clip: float = 0.2
    share_prefix: bool | None = None  # a group's common prompt runs once per forward (core.prefix); None: CPU only
    min_shared_prefix: int = 16
    logprob_chunk: int = 512  # policy positions projected onto the vocabulary at once (0: all at once)
    expert_branches: bool = True  # relabels attend to their episode's cached keys and values (_attach_relabels)
    length_buckets: int | None = 0  # > 0: forwards on bucketed lengths (bucket_length); None: CPU_BUCKETS on the CPU
    activation_checkpointing: int = 0  # N > 0: every N-th decoder layer recomputes its activations in the backward
    activation_checkpointing_min_tokens: int = 0  # > 0: only micro-batches of at least this many padded tokens do
    device: str = "auto"  # model.device: auto (CUDA when available, else CPU), cpu, cuda, cuda:N
    lora: Any = None  # model.lora: a runtime.backends.lora.LoraSpec (adapters on a frozen base), None: full weights

    @classmethod
    def from_run(cls, cfg: Any, critic_path: str | None = None) -> "LearnerConfig":
        """A run's learner settings, read from its config types (``core.config.RunConfig``): every field named like
        an ``algo`` setting is that setting; the rest come from ``model``, ``rollout`` and the estimator's needs.
        ``critic_path``: the critic model's local folder (None: a copy of the policy)."""
        from core.advantages import get_estimator
        from runtime.backends.hardware import resolve_bf16
        from runtime.backends.lora import LoraSpec

        a = cfg.algo
        spec = get_estimator(a.estimator)
        other = dict(bf16_autocast=resolve_bf16(cfg.model.bf16_autocast), device=cfg.model.device,
                     temperature=cfg.rollout.temperature, kl_in_loss=not spec.kl_in_reward, critic=spec.needs_critic,
                     critic_path=critic_path, critic_lr=a.critic.lr or 1e-5, value_clip=a.critic.value_clip,
                     lora=LoraSpec.from_config(cfg.model.lora))
        same = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls)
                if f.name in type(a).model_fields and f.name not in other}  # algo.critic is the critic's section
        return cls(**same, **other)


@dataclass
class Prepared:
    live: list[int]  # indices of the trajectories that enter the loss
    seqs: list[list[int]]
    old: list[list[float]] | None = None
    ref: list[list[float]] | None = None
    values: list[list[float]] | None = None
    final_values: list[float] | None = None  # critic's value of the state after each sequence's last token
    stats: dict[str, float] = field(default_factory=dict)


# algo.length_buckets' default on the CPU: with exact lengths every step's new set of sequence lengths left oneDNN's
# per-shape kernels and a more fragmented heap behind (the learner alone, 5 updates of varying lengths: held memory
# 1.63 -> 2.14 GiB, update peak 3.24 -> 4.23; on few lengths flat at ~1.5 / 3.3). On a GPU padding costs time
# instead: equal-length rows then need an attention mask (inferred; H200, 1.5B paper step: 32.5 -> 37.8 s padded)
CPU_BUCKETS = 8

# config attributes of models whose logits are post-processed after the output projection (soft-capping,
# scaling): the positions-only projection would skip that, so those models take the full forward
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def mismatch_sums(rollout: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Sum of |rollout - learner| log-prob over the policy tokens (``mask``), and their count: the pieces of
    ``logprob_mismatch`` (sampling engine vs learner: kernels, bf16)."""
    return float(((rollout - learner).abs() * mask).sum()), int(mask.sum())


def live_indices(trajs: list[Trajectory]) -> list[int]:
    """Indices of the trajectories that enter the loss: not masked, with at least one policy token."""
    return [i for i, t in enumerate(trajs) if not t.masked and t.num_policy_tokens > 0]


def logprob_mismatch(trajs: list[Trajectory], live: list[int], old: list[list[float]]) -> float:
    """Mean |rollout - learner| log-prob over the policy tokens of ``trajs[live]`` (``old``: the learner's rows)."""
    total, n = mismatch_sums(pad_rows([trajs[i].logprobs for i in live]), pad_rows(old),
                             pad_rows([sampled_mask(trajs[i]) for i in live]))
    return total / max(1, n)


def sampled_mask(t: Trajectory) -> list[int]:
    """The policy tokens the rollout engine sampled (an expert's episode put into a group was not: no mismatch)."""
    return [0] * len(t.loss_mask) if t.expert_demo else t.loss_mask


@dataclass
class _UpdateBatch:
    """What one ``update`` trains on: the batch (``trajs`` and the per-token ``advantages`` / critic ``returns``
    aligned with them) and its ``prepared`` rows, addressed by position ``k`` in ``prepared.live``; whether the old
    log-probs are the training forward's own (``own_old``), and the KL coefficient of the loss."""

    trajs: list[Trajectory]
    advantages: list[list[float]]
    returns: list[list[float]] | None
    prepared: Prepared
    own_old: bool
    kl_coef: float
    # the expert term (algo.expert_coef): relabelled sequences (ids, loss mask, group id) and their weight
    expert: tuple[list[tuple[list[int], list[int], int]], float] | None = None

    def traj(self, k: int) -> Trajectory:
        return self.trajs[self.prepared.live[k]]


@dataclass
class _ExpertShare:
    """An optimizer step's share of the expert term: its relabels, their reply tokens (the mean's denominator), the
    NLL summed so far over those that ran as branches of their episodes, and how many did."""

    rows: list[tuple[list[int], list[int], int]]
    denom: int
    nll: float = 0.0
    branched: int = 0


@dataclass
class _UpdateTally:
    """What an update accumulates: per-micro-batch stats, the log-prob mismatch's pieces, the tokens it ran, and
    one gradient norm per optimizer step (policy, and critic when there is one)."""

    agg: dict[str, list[float]] = field(default_factory=dict)
    mismatch_sum: float = 0.0
    mismatch_n: int = 0
    n_tokens: int = 0
    grad_norms: list[float] = field(default_factory=list)
    critic_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # sequences whose forward and backward skip_zero_advantage left out (over all mini-batches)
    skipped_tokens: int = 0  # and their tokens
    weight_share: float = 1.0  # the current mini-batch's trained sequences' share of its policy-token weight


def rng_state(device: torch.device) -> dict[str, Any]:
    """What ``rng.pt`` holds: torch's CPU and Python's RNG, and on a CUDA learner the CUDA generators too (a CPU
    learner's file is as before)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore ``rng_state``'s RNGs (CUDA's where the file has them and this machine has as many GPUs)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    cuda = rng.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def optimizer_state_on(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One parameter's AdamW state with its moment tensors on the parameter's device; ``step`` stays on the CPU
    (where torch keeps it for a non-capturable optimizer). On the CPU the tensors are returned as they are."""
    return {k: v.to(device) if torch.is_tensor(v) and k != "step" else v for k, v in state.items()}


def load_causal_lm(path: str, device: Any = None):
    """An fp32 causal LM from an HF folder (or hub id), on ``device`` (None: where transformers puts it, the CPU).
    A LoRA adapter folder (a LoRA checkpoint, an export) loads as its base with the adapter merged."""
    from transformers import AutoModelForCausalLM

    from runtime.backends.lora import is_adapter_dir, load_merged_causal_lm

    if is_adapter_dir(path):
        model = load_merged_causal_lm(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model if device is None else model.to(device)


class Learner(Protocol):
    """What the tasks and the generation engine use of a learner (``TorchLearner``, the DeepSpeed learners)."""

    model: Any  # the policy module in this process (None where it lives in other ranks)
    tokenizer: Any

    def prepare(self, trajs: list[Trajectory], old_for_reward: bool = False) -> Prepared: ...

    def update(self, trajs: list[Trajectory], advantages: list[list[float]], prepared: Prepared | None = None,
               returns: list[list[float]] | None = None) -> dict[str, float]: ...

    def save(self, directory: Path, trainer_state: dict[str, Any]) -> None: ...

    def save_weights(self, directory: Path) -> None:
        """The current weights as an HF folder (a generation engine reloads them from there)."""

    def in_memory_weights(self) -> "Callable[[], Iterable[tuple[str, torch.Tensor]]] | None":
        """A function giving the current weights as ``(hf_name, tensor)`` pairs in this process (the in-memory
        sync), or None where they live in other processes."""

    def load_training_state(self, directory: Path, weights: bool = True) -> dict[str, Any]: ...


def make_optimizer(params, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The policy's optimizer (``algo.optimizer``): ``adamw`` (torch; fp32 first and second moments) or ``adamw8bit``
    (bitsandbytes: both moments block-wise quantised to 8 bits, tensors under 4,096 elements in fp32; the same
    AdamW update, read from and written back to the quantised state; on the CPU a large tensor is stepped a slice at
    a time, bit-identical: ``runtime.backends.optim8bit``)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw8bit":
        import logging

        quiet = logging.getLogger("bitsandbytes")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # its import warns about optional 4-bit GEMM kernels this learner never uses
        try:
            from runtime.backends.optim8bit import SlicedAdamW8bit
        except ImportError as e:
            raise RuntimeError("algo.optimizer=adamw8bit needs bitsandbytes: pip install 'bitsandbytes>=0.48'") from e
        finally:
            quiet.setLevel(level)
        return SlicedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: adamw or adamw8bit")


def bf16_linears(model: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Store the weights of ``model``'s ``nn.Linear`` layers (but ``skip``) in bf16; returns how many. For a frozen
    model that only runs under bf16 autocast (the KL reference): autocast casts an fp32 weight to bf16 at every
    linear, so the stored bf16 copy gives the same outputs with half the bytes. Embeddings and norms keep fp32
    (autocast runs those in fp32); the output projection is skipped here because it is tied to the input embedding
    in small models. The parameters left in fp32 are copied too: transformers leaves loaded weights on the
    checkpoint file's memory mapping, and one tensor still on it keeps the whole file's pages that the conversion
    read resident (SmolLM2-135M's reference after a forward of each model: 1.59 GiB RSS unconverted, 1.79 converted
    with the embedding left on the mapping, 1.39 with it copied)."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not any(m is s for s in skip):
            m.to(torch.bfloat16)
            n += 1
    for p in model.parameters():
        if p.dtype != torch.bfloat16:
            p.data = p.data.clone()
    return n


class TorchLearner:
    cast_linears = True  # bf16 autocast: linear layers save fp32 weights, not bf16 copies (runtime.backends.cast_linear)

    def __init__(self, model_path: str, cfg: LearnerConfig, reference_path: str | None = None):
        from transformers import AutoTokenizer

        from runtime.backends.hardware import resolve_device

        self.device = resolve_device(cfg.device)
        if cfg.length_buckets is None:  # few shapes matter to the CPU's oneDNN; a GPU's attention wants no padding
            cfg = dataclasses.replace(cfg, length_buckets=CPU_BUCKETS if self.device.type == "cpu" else 0)
        if cfg.share_prefix is None:  # the CPU pays per FLOP; a GPU per forward (small blocks leave it idle)
            cfg = dataclasses.replace(cfg, share_prefix=self.device.type == "cpu")
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.lora = cfg.lora
        self.peft = None  # model.lora: PEFT's wrapper around self.model (which holds the injected adapter layers)
        self.base_dir = self.base_sha256 = None
        if self.lora is not None:
            self._load_lora(model_path, reference_path)
        else:
            self.model = load_causal_lm(model_path, self.device)
        self.model.config.use_cache = False
        if cfg.bf16_autocast and self.cast_linears:  # the backward recasts the fp32 weights (runtime.backends.cast_linear)
            use_cast_linears(self.model, skip=(self.model.get_output_embeddings(),))
        every = cfg.activation_checkpointing or (1 if cfg.activation_checkpointing_min_tokens else 0)
        if every:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                                     every_n_layers=every)
        # the checkpointed layers: with a token threshold, switched on and off per micro-batch (_checkpoint_for)
        self._ckpt_layers = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False)]
        for m in self._ckpt_layers:
            set_recast(m, False)
        self.model.train()
        self.ref = None
        if cfg.kl_coef > 0 and self.peft is None:  # with LoRA the reference is the base with the adapters off
            self.ref = load_causal_lm(reference_path or model_path, self.device)
            self.ref.eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
            if cfg.bf16_autocast:  # every forward casts them to bf16 anyway: store them so (the same values)
                bf16_linears(self.ref, skip=(self.ref.get_output_embeddings(),))
        params = self.model.parameters() if self.peft is None else [p for p in self.model.parameters()
                                                                      if p.requires_grad]
        self.opt = make_optimizer(params, cfg.optimizer, cfg.lr, cfg.weight_decay)
        if cfg.grad_dtype not in ("fp32", "bf16"):
            raise ValueError(f"unknown grad_dtype {cfg.grad_dtype!r}: fp32 or bf16")
        self._bf16_grads: dict[torch.nn.Parameter, torch.Tensor] = {}  # grad_dtype=bf16: a parameter's gradient
        self._head_rows: dict[torch.nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}  # _sink_head_grad
        if cfg.grad_dtype == "bf16":
            # the hook reaches the learner through a weak reference: autograd keeps hooks on the C++ side, where the
            # garbage collector cannot see a cycle learner -> model -> hook -> learner, so a strong one would keep
            # a closed learner (its weights and optimizer state) alive for the rest of the process
            me = weakref.ref(self)

            def hold(p: torch.nn.Parameter) -> None:
                learner = me()
                if learner is not None:
                    learner._hold_bf16(p)

            for q in self.model.parameters():
                if q.requires_grad:
                    q.register_post_accumulate_grad_hook(hold)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.critic = None
        if cfg.critic and self.peft is not None:
            from runtime.backends.lora import LoraCritic

            self.critic = LoraCritic(cfg.critic_path or self.base_dir, self.lora, cfg.critic_lr, cfg.value_clip,
                                     cfg.micro_batch_size, cfg.bf16_autocast, cfg.grad_clip, self.pad_id,
                                     device=self.device)
        elif cfg.critic:
            from runtime.backends.critic import Critic

            self.critic = Critic(cfg.critic_path or reference_path or model_path, cfg.critic_lr, cfg.value_clip,
                                 cfg.micro_batch_size, cfg.bf16_autocast, cfg.grad_clip, self.pad_id,
                                 device=self.device)

    def _load_lora(self, model_path: str, reference_path: str | None) -> None:
        """``model.lora``: the base model (``model_path``; for an adapter folder, the base it records, or
        ``reference_path`` checked against the record's sha256), frozen, with PEFT's adapters injected (the ones
        saved in ``model_path`` when it is an adapter folder, else fresh: B = 0, so the policy starts as the base).
        Under bf16 autocast the frozen linear layers are stored in bf16 (the values every forward casts to)."""
        from runtime.backends.lora import attach_adapters, base_of, freeze_base_bf16, is_adapter_dir, weights_sha256

        adapter_dir = model_path if is_adapter_dir(model_path) else None
        base = base_of(adapter_dir, reference_path) if adapter_dir else model_path
        self.base_dir, self.base_sha256 = str(base), weights_sha256(base)
        self.model = load_causal_lm(self.base_dir, self.device)
        self.peft = attach_adapters(self.model, self.lora, adapter_dir)
        if self.cfg.bf16_autocast:
            freeze_base_bf16(self.model, skip=(self.model.get_output_embeddings(),))

    def lora_source(self):
        """The live adapter the engine serves (``runtime.backends.lora.PolicyAdapter``), None without LoRA."""
        from runtime.backends.lora import PolicyAdapter

        return None if self.peft is None else PolicyAdapter(self.peft, self.model)

    @property
    def has_reference(self) -> bool:
        """Whether the KL reference's log-probs are computed: a reference model, or with LoRA the base with its
        adapters off (kl_coef > 0)."""
        return self.ref is not None or (self.peft is not None and self.cfg.kl_coef > 0)

    # -- log-probs --------------------------------------------------------------------------------------
    def _autocast(self):
        from runtime.backends.hardware import autocast

        return autocast(self.device, self.cfg.bf16_autocast, cache=False)  # training: hardware.autocast

    def _dev(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` on the learner's device (the same tensor on the CPU)."""
        return None if t is None else t.to(self.device)

    def _pad(self, seqs: list[list[int]]):
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
            att[r, : len(s)] = 1
        return ids, att

    def _hidden(self, core, ids, att, need, groups: list[int] | None, kv: dict | None = None):
        """The last hidden states that predict tokens 1..T-1 ([B, T-1, H]). With ``groups`` (and
        ``share_prefix``), the rows of a group run their common prompt once (``core.prefix``): its keys and
        values, repeated per row, serve the rest of each row; positions inside the prompt (no policy token
        there) are left 0 except the last, which predicts each row's first own token. With ``kv`` (a dict), each
        row's keys and values are kept there as ``row: (cache, its row in the cache)`` (``_branch_hidden``)."""
        lens = att.sum(1).tolist()
        blocks = []
        # a checkpointed layer in training mode drops the key/value cache the shared prompt hands on (transformers)
        checkpointed = getattr(core, "is_gradient_checkpointing", False) and core.training
        if groups is not None and self.cfg.share_prefix and len(lens) > 1 and not checkpointed:
            seqs = [ids[r, :n].tolist() for r, n in enumerate(lens)]
            masks = [need[r, :n].int().tolist() for r, n in enumerate(lens)]
            blocks = plan_shared_prefixes(seqs, masks, groups, self.cfg.min_shared_prefix)
        blocks = [self._bucket_prefix(b) for b in blocks]
        if not any(b.prefix_len for b in blocks):
            return self._plain_hidden(core, ids, att, kv=kv)
        T = ids.shape[1]
        parts, order = [], []
        for b in blocks:
            rows = list(b.rows)
            width = max(lens[r] for r in rows)
            sub_ids, sub_att = ids[rows, :width], att[rows, :width]
            if b.prefix_len == 0:
                sub_kv = None if kv is None else {}
                h = self._plain_hidden(core, sub_ids, sub_att, kv=sub_kv)
                if kv is not None:
                    kv.update({r: sub_kv[j] for j, r in enumerate(rows)})
            else:
                L, G = b.prefix_len, len(rows)
                pre = core.base_model(input_ids=sub_ids[:1, :L], use_cache=True)
                cache = pre.past_key_values
                cache.batch_repeat_interleave(G)
                rest_ids, rest_att = self._padded(sub_ids[:, L:], sub_att, width - L)
                rest = core.base_model(input_ids=rest_ids, attention_mask=rest_att, past_key_values=cache,
                                       use_cache=True).last_hidden_state
                if kv is not None:  # the cache now holds each row's whole length: the prompt's, then its own
                    kv.update({r: (cache, j) for j, r in enumerate(rows)})
                last = pre.last_hidden_state[:, L - 1:L].expand(G, 1, -1)
                h = torch.cat([last.new_zeros((G, L - 1, last.shape[-1])), last, rest[:, :width - L - 1]], dim=1)
            parts.append(torch.nn.functional.pad(h, (0, 0, 0, T - width)))
            order += rows
        h = torch.cat(parts)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return h[inverse.to(h.device)]

    def _bucket_len(self, n: int) -> int:
        """``n`` rounded up to its length bucket (``bucket_length``; ``length_buckets`` 0: ``n``)."""
        return bucket_length(n, self.cfg.length_buckets)

    def _padded(self, ids: torch.Tensor, att: torch.Tensor, n: int):
        """``ids`` ([B, n] tokens) and ``att`` (their attention mask, possibly with more columns in front: a cached
        prefix) padded on the right to their length bucket. Causal attention keeps the padding out of every real
        position's output, so only the shapes change: the CPU's matmul library (oneDNN) keeps a compiled kernel and
        its buffers per shape, and a heap that serves ever new sizes fragments (issue 31: held memory grew with
        every new set of sequence lengths)."""
        extra = self._bucket_len(n) - n
        if extra:
            ids = torch.nn.functional.pad(ids, (0, extra), value=self.pad_id)
            att = torch.nn.functional.pad(att, (0, extra), value=0)
        return ids, att

    def _plain_hidden(self, core, ids, att, kv: dict | None = None):
        """The last hidden states predicting tokens 1..T-1 of ``ids`` ([B, T]), one forward, bucketed length (with
        ``kv``: the forward's keys and values kept there per row, as ``_hidden`` says).

        Rows padded on the right only (as ``_pad`` and ``_padded`` pad) run without an attention mask: causal
        attention already keeps every real position off the padding after it, so the real positions' outputs are
        the masked forward's, and SDPA then takes its causal kernel, which skips the blocks above the diagonal,
        instead of the masked one, which computes them all (about a quarter of the update's time on the CPU for
        ~1,000-token episodes: bench/bench_multistep.py). The padding positions' outputs differ and are never read."""
        T = ids.shape[1]
        ids, att = self._padded(ids, att, T)
        right_padded = bool((att[:, 1:] <= att[:, :-1]).all())
        out = core.base_model(input_ids=ids, attention_mask=None if right_padded else att,
                              **({} if kv is None else {"use_cache": True}))
        if kv is not None:
            kv.update({r: (out.past_key_values, r) for r in range(ids.shape[0])})
        return out.last_hidden_state[:, :T - 1]

    @staticmethod
    def _branch_hidden(core, h: torch.Tensor, kv: dict, branches: list[tuple[int, int, list[int]]]):
        """The hidden states that predict each branch's tokens, and those tokens ([n, H], [n]). A branch ``(row,
        P, tokens)`` continues row ``row``'s first ``P`` tokens with ``tokens`` instead of the row's own: its first
        token is predicted by the row's hidden state at ``P - 1`` (the same context), the others by a forward of
        ``tokens[:-1]`` at positions ``P..`` attending to the row's cached keys and values of positions ``< P``
        (``kv``, from ``_hidden``). The gradient flows back into the row's forward through both."""
        from transformers import DynamicCache

        hs, targets = [], []
        for r, P, toks in branches:
            parts = [h[r, P - 1:P]]
            if len(toks) > 1:
                cache, j = kv[r]
                past = DynamicCache(ddp_cache_data=[(layer.keys[j:j + 1, :, :P], layer.values[j:j + 1, :, :P])
                                                    for layer in cache.layers])
                x = torch.tensor([toks[:-1]], device=h.device)
                parts.append(core.base_model(input_ids=x, past_key_values=past, use_cache=True).last_hidden_state[0])
            hs.append(torch.cat(parts))
            targets += toks
        return torch.cat(hs), torch.tensor(targets, device=h.device)

    def _bucket_prefix(self, b):
        """A shared-prefix block with its prefix cut down to a bucketed length (``bucket_floor``: the rest of each row
        then runs the cut tokens; 0: no sharing), so the prefix's forward sees bucketed shapes too."""
        if not self.cfg.length_buckets or not b.prefix_len:
            return b
        cut = bucket_floor(b.prefix_len, self.cfg.length_buckets)
        return dataclasses.replace(b, prefix_len=cut if cut >= self.cfg.min_shared_prefix else 0)

    def _token_logp(self, model, ids, att, with_entropy: bool = False, need: torch.Tensor | None = None,
                    groups: list[int] | None = None, branches: list[tuple[int, int, list[int]]] | None = None):
        """log p(token_t | tokens_<t) at position t ([B, T], position 0 gets 0).

        ``need`` ([B, T] bool, optional) marks the tokens whose log-prob is wanted (the policy tokens): the
        vocabulary projection then runs only at those positions (elsewhere the result is 0), which saves
        most of the time and memory on long prompts and env replies. ``groups`` (the rows' group ids, with
        ``need``) lets the rows of a group share their prompt's forward pass (see ``_hidden``).

        With ``branches`` (``_branch_hidden``'s: ``(row, P, tokens)``), a third result: the log-probs of each
        branch's tokens, one after another ([n]), from the same projection (the temperature must be 1)."""
        ids, att, need = self._dev(ids), self._dev(att), self._dev(need)
        core = getattr(model, "module", model)  # unwrap engine wrappers (DeepSpeed)
        fast = need is not None and not any(getattr(core.config, a, None) for a in _LOGIT_POSTPROCESSING)
        if branches and not (fast and self._branchable_head(core)):
            raise ValueError("relabel branches need the positions-only projection at temperature 1")
        bh = bt = None
        if fast:
            sel = need[:, 1:].bool()  # the token at t is predicted from the hidden state at t - 1
            head = core.get_output_embeddings()
            kv = {} if branches else None
            with self._autocast():
                h = self._hidden(core, ids, att, need, groups, kv)
                if branches:
                    bh, bt = self._branch_hidden(core, h, kv, branches)
            n_pol = int(sel.sum())
            if self.cfg.logprob_chunk and getattr(head, "bias", None) is None:  # a chunk of positions at a time
                dtype = torch.bfloat16 if self.cfg.bf16_autocast else None
                hs, targets = h[sel], ids[:, 1:][sel]
                if bh is not None:
                    hs, targets = torch.cat([hs, bh]), torch.cat([targets, bt])
                n = hs.shape[0]
                extra = self._bucket_len(n) - n  # the vocabulary projection's shapes bucketed too: zero rows, sliced
                if extra:  # off (their log-probs get no gradient, so they add none)
                    hs = torch.nn.functional.pad(hs, (0, 0, 0, extra))
                    targets = torch.nn.functional.pad(targets, (0, extra))
                sink = None  # bf16 gradients: the output weight's goes to its buffer when the projection has it
                if self.cfg.grad_dtype == "bf16" and model is self.model and head.weight.requires_grad:
                    inputs = ids if bt is None else torch.cat([ids.flatten(), bt])  # a branch's tokens are inputs too
                    sink = functools.partial(self._sink_head_grad, head.weight, torch.unique(inputs))
                tok, ent = chunked_token_logprobs(hs, head.weight, targets, self.cfg.temperature,
                                                  self.cfg.logprob_chunk, with_entropy, dtype, sink)
                out = self._scatter_rows(tok[:n_pol], None if ent is None else ent[:n_pol], sel, ids.shape)
                return out if bt is None else (*out, tok[n_pol:n])
            with self._autocast():
                logits = head(h[sel] if bh is None else torch.cat([h[sel], bh]))
            logits = logits.float()
        else:
            with self._autocast():
                logits = model(input_ids=ids, attention_mask=att).logits
            logits = logits[:, :-1].float()
        if self.cfg.temperature > 0:
            logits = logits / self.cfg.temperature
        logz = torch.logsumexp(logits, dim=-1)
        tok_ids = ids[:, 1:][sel] if fast else ids[:, 1:]
        if bt is not None:
            tok_ids = torch.cat([tok_ids, bt])
        tok = logits.gather(-1, tok_ids.unsqueeze(-1)).squeeze(-1) - logz
        ent = None
        if with_entropy:
            with torch.no_grad():
                p = torch.softmax(logits, dim=-1)
                ent = logz - (p * logits).sum(-1)
        if fast:
            out = self._scatter_rows(tok[:n_pol], None if ent is None else ent[:n_pol], sel, ids.shape)
            return out if bt is None else (*out, tok[n_pol:])
        logp = torch.cat([torch.zeros_like(tok[:, :1]), tok], dim=1)
        if ent is not None:
            ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
        return logp, ent

    @staticmethod
    def _scatter_rows(tok: torch.Tensor, ent: torch.Tensor | None, sel: torch.Tensor, shape):
        """The selected positions' values (``sel``: [B, T-1]) back into [B, T] rows, 0 elsewhere and at t = 0."""
        B, T = shape
        out = []
        for v in (tok, ent):
            if v is not None:
                v = torch.zeros((B, T - 1), dtype=v.dtype, device=v.device).masked_scatter(sel, v)
                v = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
            out.append(v)
        return out[0], out[1]

    @torch.no_grad()
    def sequence_logprobs(self, seqs: list[list[int]], reference: bool = False,
                          masks: list[list[int]] | None = None,
                          groups: list[int] | None = None) -> list[list[float]]:
        """Per-token log-probs of ``seqs``; with ``masks``, only on the masked-in tokens (0 elsewhere); with
        ``groups`` too, rows of a group share their prompt's forward pass."""
        model = self.model if not reference or self.peft is not None else self.ref  # LoRA: _lora_forward
        out: list[list[float]] = []
        with self._lora_forward(reference):
            for s, e in self._micro([len(x) for x in seqs]):
                chunk = seqs[s:e]
                ids, att = self._pad(chunk)
                need = pad_rows(masks[s:e], ids.shape[1]).bool() if masks is not None else None
                logp, _ = self._token_logp(model, ids, att, need=need, groups=groups[s:e] if groups else None)
                out += [logp[r, : len(c)].tolist() for r, c in enumerate(chunk)]
        return out

    @contextlib.contextmanager
    def _lora_forward(self, reference: bool):
        """With LoRA: the reference's forward runs the policy's model with its adapters off (the frozen base), and
        a log-prob forward with adapter dropout runs in eval mode (the log-probs of the policy, not of a dropout
        sample). Without LoRA: nothing."""
        if self.peft is None:
            yield
            return
        was_training = self.model.training
        if self.lora.dropout:
            self.model.eval()
        try:
            if reference:
                with self.peft.disable_adapter():
                    yield
            else:
                yield
        finally:
            self.model.train(was_training)

    def _micro(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Consecutive micro-batches over sequences of these lengths: ``micro_batch_size`` sequences at most, and
        ``micro_batch_tokens`` padded tokens at most (a longer sequence alone)."""
        return micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)

    # -- update -----------------------------------------------------------------------------------------
    def single_step(self) -> bool:
        """True when an update is one optimizer step over the whole batch (one epoch, one mini-batch): the
        policy that computes the loss is then the policy that would compute PPO's "old" log-probs, so the
        training forward's own (detached) log-probs are the old ones, exactly, and a forward pass is saved."""
        return self.cfg.ppo_epochs == 1 and self.cfg.mini_batches == 1

    def prepare(self, trajs: list[Trajectory], old_for_reward: bool = False) -> Prepared:
        """What the estimators need before the update: the learner's own log-probs (PPO's "old" log-probs),
        the reference log-probs, and the critic's values. Computed once per step, reused by ``update``.

        The old log-probs are computed here only when the update takes several optimizer steps, or when
        ``old_for_reward`` (the estimator puts the KL penalty in the reward and needs them before the
        update); otherwise ``update`` takes them from its own forward pass (see ``single_step``)."""
        live = live_indices(trajs)
        seqs = [trajs[i].token_ids for i in live]
        p = Prepared(live=live, seqs=seqs)
        if not live:
            return p
        masks = [trajs[i].loss_mask for i in live]
        groups = [trajs[i].group_id for i in live]
        if old_for_reward or not self.single_step():
            p.old = self.sequence_logprobs(seqs, masks=masks, groups=groups)
            p.stats["logprob_mismatch"] = logprob_mismatch(trajs, live, p.old)
        p.ref = (self.sequence_logprobs(seqs, reference=True, masks=masks, groups=groups)
                 if self.has_reference else None)
        if self.critic is not None:
            p.values, p.final_values = self.critic.values_and_final(seqs)
        return p

    def final_values(self, trajs: list[Trajectory], p: Prepared) -> list[float] | None:
        """The critic's value of the state after each trajectory's last token (0 for masked ones), aligned with
        ``trajs``; None without a critic. ``core.advantages.bootstrap_values`` keeps it for truncated episodes."""
        if p.final_values is None:
            return None
        out = [0.0] * len(trajs)
        for k, i in enumerate(p.live):
            out[i] = float(p.final_values[k])
        return out

    def per_token(self, trajs: list[Trajectory], p: Prepared, which: str) -> list[list[float]]:
        """A prepared per-token quantity (``old``, ``ref``, ``values``, ``kl``) for every trajectory (0 for
        masked ones), aligned with ``trajs``."""
        rows = [[0.0] * len(t.token_ids) for t in trajs]
        if which == "kl":
            if p.ref is None:
                return rows
            if p.old is None:
                raise ValueError("the KL per token needs the old log-probs: prepare(..., old_for_reward=True)")
            src = [[a - b for a, b in zip(o, r)] for o, r in zip(p.old, p.ref)]
        else:
            src = getattr(p, which)
            if src is None:
                return rows
        for k, i in enumerate(p.live):
            rows[i] = list(src[k])
        return rows

    def update(self, trajs: list[Trajectory], advantages: list[list[float]], prepared: Prepared | None = None,
               returns: list[list[float]] | None = None,
               expert: tuple[list[tuple[list[int], list[int], int]], float] | None = None) -> dict[str, float]:
        """One training step over the batch. ``advantages[i]`` (and the critic targets ``returns[i]``) are per
        token of ``trajs[i]``. PPO epochs and mini-batches are honoured as configured. ``expert``: relabelled
        sequences ``(ids, loss mask, group id)`` and a weight mu; each optimizer step adds mu x the token-mean NLL
        of its share of them (split like the mini-batches) to the policy loss (``_train_expert``)."""
        p = prepared if prepared is not None else self.prepare(trajs)
        if not p.live:
            return {"skipped": 1.0}
        if self.critic is not None and returns is None:
            raise ValueError("this learner has a critic: pass the estimator's returns to update()")
        own_old = p.old is None  # single-step update: old log-probs = this forward's, detached
        if own_old and not self.single_step():
            raise ValueError("an update of several optimizer steps needs prepared old log-probs")
        t0 = time.time()
        batch = _UpdateBatch(trajs, advantages, returns, p, own_old,
                             self.cfg.kl_coef if self.cfg.kl_in_loss else 0.0, expert)
        tally = _UpdateTally()
        self.model.train()
        for mini in self._mini_batches(len(p.live)):
            self._train_mini_batch(batch, mini, tally)
        self._release_grads()
        return self._update_stats(batch, tally, t0)

    def _expert_share(self, batch: "_UpdateBatch", tally: "_UpdateTally") -> list[tuple[list[int], list[int], int]]:
        """The expert sequences of the optimizer step about to run: the relabels split into as many near-equal parts
        as an epoch has mini-batches, the step's own part (every epoch goes over all of them once)."""
        if batch.expert is None:
            return []
        rows = batch.expert[0]
        n_parts = max(1, min(self.cfg.mini_batches, len(batch.prepared.live)))
        j = len(tally.grad_norms) % n_parts
        return rows[j * len(rows) // n_parts:(j + 1) * len(rows) // n_parts]

    def _train_expert(self, rows: list[tuple[list[int], list[int], int]], coef: float, tally: "_UpdateTally",
                      share: "_ExpertShare") -> None:
        """Forward and backward of the expert term over ``rows``: coef x the token-mean NLL of their masked-in
        tokens (the expert's replies), under the model's own distribution (temperature 1, as behaviour cloning),
        accumulated into the optimizer step's gradients. ``rows`` are what is left of the step's ``share`` after
        those its episodes' forwards ran as branches (``_attach_relabels``): the mean is over the whole share's
        tokens and the stats are the whole share's."""
        if not share.rows or share.denom <= 0:
            return
        nll = share.nll
        if rows:
            saved, self.cfg = self.cfg, dataclasses.replace(self.cfg, temperature=1.0)
            try:
                parts = self._nll_backward([r[0] for r in rows], [r[1] for r in rows], share.denom, scale=coef,
                                           groups=[r[2] for r in rows])
            finally:
                self.cfg = saved
            for st in parts:
                nll += st["nll"]
                tally.n_tokens += st["attended"]
        for k, v in (("expert_nll", nll), ("expert_samples", float(len(share.rows))),
                     ("expert_tokens", float(share.denom)), ("expert_coef", float(coef)),
                     ("expert_branched", float(share.branched))):
            tally.agg.setdefault(k, []).append(v)

    def _can_branch(self) -> bool:
        """Whether relabels can run as branches of their episodes' forwards (``algo.expert_branches``): one rank,
        full weights, no checkpointed layers (they drop the cache), a plain output projection at temperature 1
        (the expert term's), as ``_token_logp``'s positions-only path computes it."""
        return (self.cfg.expert_branches and self.peft is None and not self._ckpt_layers
                and self._data_parallel_ranks() == 1
                and self._branchable_head(getattr(self.model, "module", self.model)))

    def _branchable_head(self, core) -> bool:
        """A plain output projection (no logit post-processing) at temperature 1: the policy tokens' projection is
        then the expert term's too, so branch tokens can share it (``_token_logp``)."""
        return ((self.cfg.temperature <= 0 or self.cfg.temperature == 1.0)
                and not any(getattr(core.config, a, None) for a in _LOGIT_POSTPROCESSING))

    def _attach_relabels(self, batch: "_UpdateBatch", run: list[int],
                         rows: list[tuple[list[int], list[int], int]]) -> tuple[dict[int, list], list]:
        """The relabels that can run as branches of a sequence the optimizer step trains (``run``): a relabel's
        context (its tokens before the expert's reply) must be the start of a sequence of its group, which then
        serves it (``k: [(P, reply), ...]``); the others, returned second, run as their own sequences."""
        if not rows or not self._can_branch():
            return {}, list(rows)
        p = batch.prepared
        by_group: dict[int, list[int]] = {}
        for k in run:
            by_group.setdefault(batch.traj(k).group_id, []).append(k)
        attached: dict[int, list[tuple[int, list[int]]]] = {}
        rest = []
        for row in rows:
            ids, mask, g = row
            P = next((i for i, m in enumerate(mask) if m), len(mask))
            home = None
            if 0 < P < len(ids) and all(mask[P:]):
                home = next((k for k in by_group.get(g, ()) if len(p.seqs[k]) > P and p.seqs[k][:P] == ids[:P]),
                            None)
            if home is None:
                rest.append(row)
            else:
                attached.setdefault(home, []).append((P, ids[P:]))
        return attached, rest

    def _nll_backward(self, seqs: list[list[int]], masks: list[list[int]], denom: float, scale: float = 1.0,
                      groups: list[int] | None = None) -> list[dict[str, float]]:
        """Forward and backward, a micro-batch at a time, of ``scale`` x the NLL of the masked-in tokens of ``seqs``
        divided by ``denom`` (``core.losses.nll_loss``; the whole batch's token count makes the micro-batches add up
        to its token-mean), gradients accumulated. Returns each micro-batch's ``nll_loss`` stats with the tokens
        it attended (``attended``)."""
        out = []
        for s, e in self._micro([len(x) for x in seqs]):
            ids, att = self._pad(seqs[s:e])
            mask = self._dev(pad_rows(masks[s:e], ids.shape[1]))
            self._checkpoint_for(ids.numel())
            logp, _ = self._token_logp(self.model, ids, att, need=mask.bool(),
                                       groups=None if groups is None else groups[s:e])
            loss, st = nll_loss(logp, mask, denom)
            self._backward(scale * loss)
            out.append({**st, "attended": int(att.sum())})
        return out

    def _mini_batches(self, n_live: int) -> Iterator[list[int]]:
        """The update's mini-batches (positions in ``Prepared.live``), epoch after epoch: exactly ``mini_batches``
        near-equal parts (fewer only when fewer episodes are live than mini-batches). With several, each epoch
        splits a fresh permutation, drawn when the epoch starts (lazily, so the torch RNG is consumed in the same
        order as the training forwards; it is checkpointed, so resume is exact)."""
        n_parts = min(self.cfg.mini_batches, n_live)
        bounds = [j * n_live // n_parts for j in range(n_parts + 1)]
        for _epoch in range(self.cfg.ppo_epochs):
            order = list(range(n_live))
            if self.cfg.mini_batches > 1:
                order = torch.randperm(n_live).tolist()
            for m0, m1 in zip(bounds, bounds[1:]):
                yield order[m0:m1]

    def _train_mini_batch(self, batch: "_UpdateBatch", mini: list[int], tally: "_UpdateTally") -> None:
        """One optimizer step (and one critic step) over the mini-batch ``mini``: gradients accumulated over its
        micro-batches, each sequence weighted by its share of the whole mini-batch's loss."""
        w_seq = self._mini_batch_weights([batch.traj(k).num_policy_tokens for k in mini])
        self._zero_grad()
        if self.critic is not None:
            self.critic.zero_grad()
        run, w_run = self._trained_rows(batch, mini, w_seq, tally)
        share = None
        if batch.expert is not None:
            rows = self._expert_share(batch, tally)
            attached, rest = self._attach_relabels(batch, run, rows)
            share = _ExpertShare(rows=rows, denom=sum(sum(m) for _, m, _ in rows), branched=len(rows) - len(rest))
        for s, e in self._micro([len(batch.prepared.seqs[k]) for k in run]):
            branches = None if share is None else [(j, P, reply) for j, k in enumerate(run[s:e])
                                                   for P, reply in attached.get(k, ())]
            self._train_micro_batch(batch, run[s:e], w_run[s:e], tally, branches, share)
        if share is not None:
            self._train_expert(rest, batch.expert[1], tally, share)
        tally.grad_norms.append(self._step())
        if self.critic is not None:
            tally.critic_norms.append(self.critic.step())

    def _trained_rows(self, batch: "_UpdateBatch", mini: list[int], w_seq: list[float],
                      tally: "_UpdateTally") -> tuple[list[int], list[float]]:
        """The mini-batch's sequences that run a forward and backward, and their weights: all of them, or with
        ``skip_zero_advantage`` those with a nonzero advantage on a policy token. Skipping the others is exact when
        nothing else in the loss reads them: the clipped policy loss of a token with advantage 0 is 0 whatever its
        ratio, and their policy tokens stay in the weights' denominator (``w_seq`` is the whole mini-batch's). A KL
        term in the loss, a critic (its values of every sequence) and data-parallel ranks (each rank's micro-batch
        count) read them, and so does a mini-batch with no sequence left (its optimizer step must still see zero
        gradients: AdamW's momentum moves the weights). The trained ones' share of the policy-token weight goes to
        ``tally.weight_share`` (the entropy is rescaled by it: the token-mean over the trained sequences)."""
        tally.weight_share = 1.0
        if (not self.cfg.skip_zero_advantage or self.critic is not None or self._data_parallel_ranks() > 1
                or (batch.kl_coef and batch.prepared.ref is not None)):
            return mini, w_seq
        p = batch.prepared
        keep = [j for j, k in enumerate(mini)
                if any(a != 0 and m for a, m in zip(batch.advantages[p.live[k]], batch.traj(k).loss_mask))]
        if not keep or len(keep) == len(mini):
            return mini, w_seq
        weight = [w * batch.traj(k).num_policy_tokens for k, w in zip(mini, w_seq)]
        total = sum(weight)
        tally.weight_share = sum(weight[j] for j in keep) / total if total else 1.0
        kept = set(keep)
        skipped = [k for j, k in enumerate(mini) if j not in kept]
        tally.skipped += len(skipped)
        tally.skipped_tokens += sum(len(p.seqs[k]) for k in skipped)
        return [mini[j] for j in keep], [w_seq[j] for j in keep]

    def _mini_batch_weights(self, n_pol: list[int]) -> list[float]:
        """Each sequence's loss weight, normalised by the whole mini-batch over all data-parallel ranks
        (``core.losses``; ``n_pol``: the sequences' policy-token counts). A rank's share of only zero-weight
        sharding padding still runs, with weight 0, for the collectives."""
        totals = tuple(int(x) for x in self._sum_over_ranks(list(batch_totals(n_pol))))
        if not totals[0]:
            return [0.0] * len(n_pol)
        return sequence_weights(n_pol, self.cfg.loss_agg, totals=totals, ranks=self._data_parallel_ranks())

    def _checkpoint_for(self, padded_tokens: int) -> None:
        """With ``activation_checkpointing_min_tokens``: the checkpointed layers recompute their activations for
        this forward only when it runs at least that many padded tokens (the long episodes whose activations set the
        update's peak memory; the short ones keep theirs, and their shared-prompt forward)."""
        threshold = self.cfg.activation_checkpointing_min_tokens
        if threshold and self._ckpt_layers:
            on = padded_tokens >= threshold
            for m in self._ckpt_layers:
                m.gradient_checkpointing = on
                set_recast(m, not on)  # a checkpointed layer's linears take the stock path (cast_linear.set_recast)

    def _train_micro_batch(self, batch: "_UpdateBatch", ks: list[int], w_seq: list[float],
                           tally: "_UpdateTally", branches: list[tuple[int, int, list[int]]] | None = None,
                           share: "_ExpertShare | None" = None) -> None:
        """Forward and backward of the micro-batch ``ks`` (positions in ``Prepared.live``; ``w_seq`` their
        sequence weights): the clipped policy loss (and the critic's value loss); its stats go to ``tally``. With
        ``branches`` (``(j, P, reply)``: a relabel of the expert's ``share`` served by the micro-batch's row
        ``j``), coef x their replies' NLL over the share's tokens joins the loss (``_branch_hidden``)."""
        p = batch.prepared
        ids, att = self._pad([p.seqs[k] for k in ks])
        T = ids.shape[1]
        mask = self._dev(pad_rows([batch.traj(k).loss_mask for k in ks], T))
        weights = mask * self._dev(torch.tensor(w_seq))[:, None]
        adv = self._dev(pad_rows([batch.advantages[p.live[k]] for k in ks], T))
        ref_t = self._dev(pad_rows([p.ref[k] for k in ks], T)) if p.ref is not None and batch.kl_coef else None
        self._checkpoint_for(ids.numel())
        out = self._token_logp(self.model, ids, att, with_entropy=True, need=mask.bool(),
                               groups=[batch.traj(k).group_id for k in ks], branches=branches or None)
        logp, ent = out[0], out[1]
        if batch.own_old:
            old_t = logp.detach()
            sampled = self._dev(pad_rows([sampled_mask(batch.traj(k)) for k in ks], T))
            total, n = mismatch_sums(self._dev(pad_rows([batch.traj(k).logprobs for k in ks], T)), old_t, sampled)
            tally.mismatch_sum, tally.mismatch_n = tally.mismatch_sum + total, tally.mismatch_n + n
        else:
            old_t = self._dev(pad_rows([p.old[k] for k in ks], T))
        # the KL estimate holds on the policy's own samples: an expert episode's tokens stay out of it
        kl_w = None
        if ref_t is not None and any(batch.traj(k).expert_demo for k in ks):
            kl_w = weights * self._dev(pad_rows([sampled_mask(batch.traj(k)) for k in ks], T))
        loss, st = policy_loss(logp, old_t, ref_t, adv, weights, self.cfg.clip, batch.kl_coef, kl_weights=kl_w)
        total = loss
        if branches:  # the expert term of the relabels this micro-batch's rows serve (as _nll_backward's loss)
            nll = -out[2].sum() / share.denom
            total = loss + batch.expert[1] * nll
            share.nll += float(nll.detach())
            tally.n_tokens += sum(len(reply) - 1 for _, _, reply in branches)
        self._backward(total)
        st["entropy"] = float((ent * weights).sum()) / tally.weight_share  # token-mean over the trained sequences
        st["loss"] = float(loss.detach())
        if self.critic is not None:
            st.update(self.critic.accumulate(
                [p.seqs[k] for k in ks], pad_rows([p.values[k] for k in ks], T),
                pad_rows([batch.returns[p.live[k]] for k in ks], T), weights))
        for k, v in st.items():  # each micro-batch stat is already weighted within its mini-batch
            tally.agg.setdefault(k, []).append(v)
        tally.n_tokens += int(att.sum())

    def _update_stats(self, batch: "_UpdateBatch", tally: "_UpdateTally", t0: float) -> dict[str, float]:
        """The update's stats: ``prepare``'s, then the micro-batch stats summed within each mini-batch and
        averaged over mini-batches; each rank's sum is ``ranks`` times its part of the whole mini-batch's (the
        weights are), so the ranks' mean is the whole mini-batch's. Then the log-prob mismatch (when the old
        log-probs were this update's own), gradient norms, optimizer steps and throughput since ``t0``."""
        ranks = self._data_parallel_ranks()
        stats: dict[str, float] = dict(batch.prepared.stats)
        n_mini = len(tally.grad_norms)
        keys = sorted(tally.agg)
        summed = self._sum_over_ranks([sum(tally.agg[k]) / n_mini for k in keys]
                                      + [tally.mismatch_sum, tally.mismatch_n, tally.n_tokens])
        for k, v in zip(keys, summed):
            stats[k] = v / ranks
        mismatch_sum, mismatch_n, n_tokens = summed[len(keys):]
        if batch.own_old:
            stats["logprob_mismatch"] = mismatch_sum / max(1, mismatch_n)
        stats["grad_norm"] = sum(tally.grad_norms) / len(tally.grad_norms)
        if tally.critic_norms:
            stats["critic_grad_norm"] = sum(tally.critic_norms) / len(tally.critic_norms)
        stats["optimizer_steps"] = float(n_mini)
        stats["skipped_episodes"] = float(tally.skipped) / max(1, self.cfg.ppo_epochs)
        stats["skipped_tokens"] = float(tally.skipped_tokens) / max(1, self.cfg.ppo_epochs)
        dt = time.time() - t0
        stats["update_tokens_per_s"] = n_tokens / dt if dt > 0 else 0.0
        stats["update_time_s"] = dt
        return stats

    # -- supervised warm start (behaviour cloning) ----------------------------------------------------------
    def sft(self, trajs: list[Trajectory], epochs: int, lr: float, batch_size: int = 8, seed: int = 0,
            on_epoch: Any = None) -> list[float]:
        """Behaviour cloning: ``epochs`` passes over ``trajs`` (each pass in a fresh seeded order), one optimizer
        step per ``batch_size`` trajectories at learning rate ``lr``, minimising the token-mean NLL of their
        loss-masked (policy) tokens (``core.losses.nll_loss``). Micro-batches of ``micro_batch_size`` accumulate
        exactly (each is divided by its batch's token count), under the same autocast as ``update``; log-probs are
        the model's own distribution (temperature 1, whatever the rollout's). ``on_epoch(epoch, mean_nll, stats)``
        is called after every pass. Returns the mean NLL per epoch (token-weighted, measured during the pass)."""
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        live = live_indices(trajs)
        if not live:
            raise ValueError("no trajectory to imitate: every one is masked or has no policy token")
        for g in self.opt.param_groups:
            g["lr"] = float(lr)
        saved, self.cfg = self.cfg, dataclasses.replace(self.cfg, temperature=1.0)
        gen = torch.Generator().manual_seed(int(seed))
        losses: list[float] = []
        self.model.train()
        try:
            for epoch in range(epochs):
                t0 = time.time()
                order = [live[k] for k in torch.randperm(len(live), generator=gen).tolist()]
                nll_sum, n_tok, norms = 0.0, 0, []
                for b0 in range(0, len(order), batch_size):
                    batch = order[b0:b0 + batch_size]
                    denom = sum(trajs[i].num_policy_tokens for i in batch)
                    self._zero_grad()
                    for st in self._nll_backward([trajs[i].token_ids for i in batch],
                                                 [trajs[i].loss_mask for i in batch], denom):
                        nll_sum += st["nll"] * denom
                        n_tok += int(st["tokens"])
                    norms.append(self._step())
                losses.append(nll_sum / n_tok)
                if on_epoch is not None:
                    on_epoch(epoch + 1, losses[-1], {"tokens": n_tok, "optimizer_steps": len(norms),
                                                     "grad_norm": sum(norms) / len(norms),
                                                     "time_s": time.time() - t0})
        finally:
            self.cfg = saved
        return losses

    # -- engine hooks (a DeepSpeed learner overrides these) --------------------------------------------------
    def _data_parallel_ranks(self) -> int:
        """How many ranks' gradients the engine averages (1: no data parallelism)."""
        return 1

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """``values`` summed elementwise over the data-parallel ranks (one rank: as they are). Collective."""
        return list(values)

    def _zero_grad(self) -> None:
        self._bf16_grads.clear()
        self._head_rows.clear()
        self.opt.zero_grad(set_to_none=True)

    def _release_grads(self) -> None:
        """After the update's last optimizer step: the gradients are spent, free them now (not at the next update's
        first step), so the rollout and evaluation between updates run without them in memory."""
        self._zero_grad()
        if self.critic is not None:
            self.critic.zero_grad()

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _hold_bf16(self, p: torch.nn.Parameter) -> None:
        """``grad_dtype=bf16``, called by autograd as soon as a backward has written ``p``'s gradient: it goes into
        ``p``'s bf16 buffer (created from the first micro-batch's, added to by the next ones) and the fp32 one is
        freed, so the update holds 2 bytes per parameter of gradients instead of 4 (and one fp32 gradient at a time
        while the backward runs). A bf16-autocast matmul's weight gradient is a bf16 value already; what rounds is
        the norms' and the embedding's gradients and the sum over micro-batches (relative 2^-9 per addition)."""
        pending = self._head_rows.pop(p, None)
        if pending is not None:  # the tied output weight's rows kept in fp32 by _sink_head_grad
            rows, side = pending
            p.grad[rows] += side
        self._add_bf16(p, p.grad)
        p.grad = None

    def _sink_head_grad(self, w: torch.nn.Parameter, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad_dtype=bf16``: the output projection's fp32 gradient ``grad``, taken in its backward (so autograd
        does not hold it, 0.1 GiB for SmolLM2-135M's tied embedding, through the rest of the backward). Into ``w``'s
        bf16 buffer now, except the ``rows`` of the forward's input tokens: with tied weights the embedding's
        gradient lands there at the backward's end, and those rows are kept in fp32 until then (``_hold_bf16``), so
        each gets one rounding of the sum, as when autograd adds the two parts."""
        side = grad[rows]
        grad[rows] = 0
        self._add_bf16(w, grad)
        prev = self._head_rows.pop(w, None)
        if prev is not None:  # the embedding is not tied to the head (or took no gradient): these rows go in now
            self._add_bf16_rows(w, *prev)
        self._head_rows[w] = (rows, side)

    def _add_bf16_rows(self, p: torch.nn.Parameter, rows: torch.Tensor, side: torch.Tensor) -> None:
        """Add fp32 ``side`` to rows ``rows`` of ``p``'s bf16 buffer (which exists)."""
        held = self._bf16_grads[p]
        held[rows] = (held[rows].float() + side).to(held.dtype)

    def _add_bf16(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (fp32) to ``p``'s bf16 gradient buffer (made from it when there is none)."""
        held = self._bf16_grads.get(p)
        if held is None:
            self._bf16_grads[p] = grad.to(torch.bfloat16)
        else:
            held.add_(grad)

    def _step(self) -> float:
        """Clip gradients, take an optimizer step; returns the pre-clip gradient norm."""
        if self.cfg.grad_dtype == "bf16":
            return self._step_bf16()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return float(gn)

    def _step_bf16(self) -> float:
        """The optimizer step from the bf16 gradients: the pre-clip norm over all of them (in fp32, as
        ``clip_grad_norm_`` computes it), then one parameter at a time its gradient in fp32, scaled by the clip
        coefficient, stepped and freed with its bf16 buffer (the optimizer's update is per parameter: the same step
        as over all at once), so at most one fp32 gradient exists."""
        for p, pending in list(self._head_rows.items()):  # an untied head's rows (no embedding gradient came)
            self._add_bf16_rows(p, *pending)
        self._head_rows.clear()
        held = self._bf16_grads
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in held.values()]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        coef = torch.clamp(self.cfg.grad_clip / (total + 1e-6), max=1.0)
        for group in self.opt.param_groups:
            for p in group["params"]:
                g = held.pop(p, None)
                if g is None:
                    continue
                p.grad = g.float().mul_(coef)
                del g
                self.opt.step()
                p.grad = None
        held.clear()
        return float(total)

    # -- weights and checkpoints ---------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """The bytes the policy's optimizer state holds now (moments, and the 8-bit optimizer's scales)."""
        return sum(t.nbytes for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t))

    def save_weights(self, directory: Path) -> None:
        if self.peft is not None:  # the policy as a plain HF folder: the adapters merged into the base
            from runtime.backends.lora import save_merged

            save_merged(self.model, directory)
            return
        self.model.save_pretrained(directory)

    def in_memory_weights(self):
        if self.peft is not None:  # the adapters merged in, one tensor at a time (an engine that serves no LoRA)
            from runtime.backends.lora import merged_entries

            return lambda: ((n, fetch()) for n, _, fetch in merged_entries(self.model))
        return lambda: self.model.named_parameters()

    def save(self, directory: Path, trainer_state: dict[str, Any]) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.peft is not None:  # the adapter (PEFT's files) and the base it belongs to, not the base's weights
            self._save_adapter(directory)
        else:
            self.model.config.use_cache = True
            self.model.save_pretrained(directory)
            self.model.config.use_cache = False
        self.tokenizer.save_pretrained(directory)
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt_state = {
            names[id(p)]: self.opt.state[p] for g in self.opt.param_groups for p in g["params"] if p in self.opt.state
        }
        torch.save({"state": opt_state, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                         for g in self.opt.param_groups],
                    "optimizer": self.cfg.optimizer}, directory / "optimizer.pt")
        torch.save(rng_state(self.device), directory / "rng.pt")
        if self.critic is not None:
            self.critic.save(directory)
        (directory / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))

    def _save_adapter(self, directory: Path) -> None:
        """PEFT's adapter files (``adapter_config.json``, ``adapter_model.safetensors``: what ``PeftModel``,
        transformers and vLLM load) and ``lora_base.json`` (the base's folder and weights sha256)."""
        from safetensors.torch import save_file

        from runtime.backends.lora import ADAPTER_NAME, ADAPTER_WEIGHTS, adapter_tensors, write_base_record

        self.peft.peft_config[ADAPTER_NAME].save_pretrained(str(directory))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_tensors(self.peft).items()}
        save_file(tensors, str(Path(directory) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_base_record(directory, self.base_dir, self.base_sha256)

    def _load_adapter(self, directory: Path) -> None:
        """LoRA: the adapter's weights from a checkpoint folder, refused when its base is not this learner's."""
        from runtime.backends.lora import check_base, load_adapter_weights

        check_base(directory, self.base_dir)
        load_adapter_weights(self.peft, directory)

    def load_training_state(self, directory: Path, weights: bool = True) -> dict[str, Any]:
        """Load (model weights,) optimizer state and RNG from a checkpoint folder; returns trainer_state. With LoRA
        the weights are the adapter's, refused when the checkpoint's base is not this learner's."""
        directory = Path(directory)
        if weights and self.peft is not None:
            self._load_adapter(directory)
        elif weights:
            fresh = load_causal_lm(str(directory))
            self.model.load_state_dict(fresh.state_dict())
            del fresh
        opt_file = directory / "optimizer.pt"
        if opt_file.exists():
            saved = load_plain(opt_file, map_location="cpu")  # a checkpoint is device-free: CPU or GPU made it
            kind = saved.get("optimizer", "adamw")  # checkpoints before algo.optimizer: torch's AdamW
            if kind != self.cfg.optimizer:
                raise ValueError(f"{opt_file} holds {kind} state but this learner's optimizer is "
                                 f"{self.cfg.optimizer}: resume with algo.optimizer={kind}")
            by_name = dict(self.model.named_parameters())
            for n, st in saved["state"].items():
                if n in by_name:
                    self.opt.state[by_name[n]] = optimizer_state_on(st, by_name[n].device)
            for g, sg in zip(self.opt.param_groups, saved["param_groups"]):
                g.update(sg)
        rng_file = directory / "rng.pt"
        if rng_file.exists():
            set_rng_state(load_plain(rng_file))
        if self.critic is not None:
            self.critic.load(directory)
        state_file = directory / "trainer_state.json"
        return json.loads(state_file.read_text()) if state_file.exists() else {}
