"""Will this run start and fit? The checks of ``scalinginter run ... --dry-run`` (pure: numbers in, a plan out).

Three questions, each answered from the config and the model's ``config.json`` before anything loads:

- **context**: the generation engine holds sequences of ``token_budget + 1`` tokens, which must fit the model's
  context; an episode's replies alone (turn limit x ``max_new_tokens``) must fit too, or, with a history window of
  k turns, the k + 1 replies a turn's sample can hold must fit the token budget;
- **KV cache**: ``core.kvcache.plan_kv_cache`` for the run's largest batch (what the engine will be given, and
  how many episodes run at once);
- **memory**: a rough lower bound of the trainer's resident memory (weights and gradients in fp32, Adam state (fp32,
  or 8-bit with algo.optimizer=adamw8bit),
  the reference and critic copies, the engine's weights and KV cache, activations of one micro-batch, the
  runtime), against the machine's memory. With several DeepSpeed ranks on the machine every rank holds its part:
  ZeRO 1 shards the optimizer state over them, 2 the gradients too, 3 the weights too; each rank holds a whole
  reference, a whole critic (its weights, gradients and AdamW state: it is not sharded) and its micro-batch's
  activations.

An error names the setting to change; a note is a fact the user should know (e.g. a live-episode cap).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.kvcache import GiB, plan_kv_cache

# activations of the update per padded token (bytes): the transformer's saved activations (~34 bytes per
# hidden unit per layer with autocast) plus the log-softmax over the vocabulary (~12 bytes per entry); fitted to
# bench/bench_learner_memory.py on SmolLM2-135M (2048 padded tokens: 4.5 GB peak, 2.2 GB of it weights and Adam)
ACT_BYTES_PER_HIDDEN_LAYER = 34
ACT_BYTES_PER_VOCAB = 12
RUNTIME_BYTES = int(1.5 * GiB)  # torch, transformers, vLLM, Prefect and MLflow imported
# optimizer state per parameter (algo.optimizer): AdamW's two fp32 moments, or bitsandbytes' two 8-bit ones
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2}


@dataclass(frozen=True)
class ModelShape:
    context: int | None  # max_position_embeddings (None: unknown)
    params: int  # parameter count
    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token_16: int  # KV cache bytes per token at 2 bytes per element

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> "ModelShape":
        """From a ``config.json`` dict (a ``text_config`` inside is used when present)."""
        c = c.get("text_config", c)
        h, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        inter = int(c.get("intermediate_size") or 4 * h)
        attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o; k, v
        per_layer = attn + 3 * h * inter + 2 * h  # gated MLP, two norms
        emb = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)
        ctx = c.get("max_position_embeddings")
        return cls(int(ctx) if ctx else None, layers * per_layer + emb + h, layers, h, vocab,
                   2 * layers * kv_heads * head_dim * 2)


@dataclass(frozen=True)
class RunShape:
    turn_limit: int  # the largest of training and evaluation
    max_new_tokens: int
    token_budget: int
    history_turns: int | None
    episodes: int  # the largest batch (training step or evaluation), capped by max_live_episodes
    kv_budget_bytes: int
    kv_fixed_bytes: int | None
    engine_bytes_per_elem: int  # 2 (bf16) or 4 (fp32)
    micro_batch_tokens: int | None
    micro_batch_size: int
    reference: bool  # a frozen reference model (kl_coef > 0)
    critic: bool  # PPO's critic
    vllm: bool  # a vLLM engine (else transformers generation on the learner's model)
    optimizer_bytes_per_param: int = 8  # OPTIMIZER_STATE_BYTES of algo.optimizer
    ranks: int = 1  # learner ranks on this machine (DeepSpeed's learner.ranks; 1: the torch learner)
    zero_stage: int = 0  # DeepSpeed ZeRO stage of those ranks (0: nothing sharded)


@dataclass
class Plan:
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    memory_bytes: int = 0
    live_cap: int | None = None


def check_run(m: ModelShape, r: RunShape, machine_bytes: int | None, model_name: str = "the model") -> Plan:
    """The dry-run plan of a run shaped ``r`` on model ``m`` (``machine_bytes``: physical memory, None: unknown)."""
    p = Plan()
    ctx = m.context
    # context
    if ctx is not None and r.token_budget + 1 > ctx:
        p.errors.append(f"rollout.token_budget {r.token_budget} does not fit the context of {model_name} ({ctx} "
                        f"tokens): set --set rollout.token_budget={ctx - 1} or less"
                        + ("" if r.history_turns is not None else
                           " (with --set rollout.history_turns=2 each turn's prompt holds only the last 2 turns)"))
    replies = r.turn_limit * r.max_new_tokens
    if r.history_turns is None:
        if ctx is not None and replies > ctx:
            p.errors.append(f"{r.turn_limit} turns x {r.max_new_tokens} reply tokens = {replies} tokens exceed the "
                            f"context of {model_name} ({ctx}): set --set rollout.history_turns=2 (each turn's prompt "
                            "then holds the last 2 turns) or lower rollout.max_new_tokens")
        elif replies > r.token_budget:
            p.lines.append(f"note: {r.turn_limit} turns x {r.max_new_tokens} reply tokens = {replies} > "
                           f"token_budget {r.token_budget}: long episodes end at the token budget")
        p.lines.append(f"context: one sequence per episode, at most {r.token_budget} tokens"
                       + (f" (model context {ctx})" if ctx else ""))
    else:
        shown = min(r.history_turns, r.turn_limit - 1) + 1
        need = shown * r.max_new_tokens
        if need >= r.token_budget:
            p.errors.append(f"a turn's sample holds {shown} replies x {r.max_new_tokens} tokens = {need}, not less than "
                            f"rollout.token_budget {r.token_budget}: lower rollout.history_turns or "
                            "rollout.max_new_tokens, or raise rollout.token_budget")
        p.lines.append(f"context: history window of {r.history_turns} turns, one sample per turn of at most "
                       f"{r.token_budget} tokens ({shown} replies x {r.max_new_tokens} = {need} of them)"
                       + (f"; model context {ctx}" if ctx else ""))
    # KV cache
    kv_bytes = 0
    if r.vllm:
        per_tok = m.kv_bytes_per_token_16 * r.engine_bytes_per_elem // 2
        try:
            kv = plan_kv_cache(max(1, r.episodes), r.token_budget + 1, per_tok, r.kv_budget_bytes, r.kv_fixed_bytes)
        except ValueError as e:
            p.errors.append(str(e))
        else:
            kv_bytes, p.live_cap = kv.cache_bytes, kv.live_cap
            p.lines.append(f"KV cache: {kv.cache_bytes / GiB:.2f} GiB for {r.episodes} episodes of up to "
                           f"{r.token_budget + 1} tokens" + (f"; at most {kv.live_cap} live at once (raise "
                                                             "rollout.vllm_kv_budget_gb for more)" if kv.capped else
                                                             "; all live at once"))
    # memory
    n = max(1, r.ranks)
    stage = r.zero_stage if n > 1 else 0

    def shard(nbytes: int, from_stage: int) -> int:  # a rank's part of what ZeRO shards from that stage on
        return -(-nbytes // n) if stage >= from_stage else nbytes

    # fp32 weights and gradients, Adam's two moments, on each rank
    learner = n * (shard(4 * m.params, 3) + shard(4 * m.params, 2) + shard(r.optimizer_bytes_per_param * m.params, 1))
    extra = n * ((4 * m.params if r.reference else 0) + (16 * m.params if r.critic else 0))
    engine = r.engine_bytes_per_elem * m.params + kv_bytes if r.vllm else 0
    tokens = r.micro_batch_tokens or r.micro_batch_size * r.token_budget
    acts = n * tokens * (m.layers * m.hidden * ACT_BYTES_PER_HIDDEN_LAYER + m.vocab * ACT_BYTES_PER_VOCAB)
    p.memory_bytes = learner + extra + engine + acts + RUNTIME_BYTES
    each = " on each rank" if n > 1 else ""
    parts = [f"learner {learner / GiB:.1f}" + (f" ({n} ranks, ZeRO-{stage})" if n > 1 else ""),
             f"activations {acts / GiB:.1f} ({tokens} tokens per micro-batch{each})"]
    if extra:
        parts.append(f"reference/critic {extra / GiB:.1f}" + (f" (whole{each})" if n > 1 else ""))
    if engine:
        parts.append(f"engine {engine / GiB:.1f}")
    parts.append(f"runtime {RUNTIME_BYTES / GiB:.1f}")
    p.lines.append(f"memory: at least {p.memory_bytes / GiB:.1f} GiB ({', '.join(parts)})"
                   + (f" of {machine_bytes / GiB:.0f} GiB" if machine_bytes else ""))
    if machine_bytes and p.memory_bytes > machine_bytes:
        p.errors.append(f"the run needs at least {p.memory_bytes / GiB:.1f} GiB, more than this machine's "
                        f"{machine_bytes / GiB:.1f} GiB: lower algo.micro_batch_tokens, use a smaller model, or "
                        "learner.engine=deepspeed with optimizer offload")
    return p
