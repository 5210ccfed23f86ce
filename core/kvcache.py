"""Sizing the generation engine's KV cache from the batch, within a memory budget (pure).

A sequence of ``n`` tokens holds ``ceil(n / block) * block`` tokens of cache (vLLM allocates whole blocks); a token
costs ``2 (keys and values) x layers x kv_heads x head_dim x bytes per element``. The cache is sized so every live
episode fits at its longest (``max_seq_len``), but never above the budget; when the budget binds, the live episodes
are capped to what fits, so the engine never preempts and recomputes (thrashing).

The transformers engine keeps the keys and values of each prompt it ran, for the next turn's prompt that starts with
it: which kept row a prompt continues, and which rows to drop when they outgrow their budget, are decided here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from core.prefix import common_prefix_len

GiB = 2**30


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    if min(layers, kv_heads, head_dim, dtype_bytes) < 1:
        raise ValueError("layers, kv_heads, head_dim and dtype_bytes must all be >= 1")
    return 2 * layers * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVPlan:
    cache_bytes: int  # what to give the engine
    live_cap: int | None  # episodes that fit at once (None: all of them)
    episodes: int
    fits: int  # episodes the cache holds at max_seq_len

    @property
    def capped(self) -> bool:
        return self.live_cap is not None


def plan_kv_cache(episodes: int, max_seq_len: int, bytes_per_token: int, budget_bytes: int,
                  fixed_bytes: int | None = None, block: int = 16) -> KVPlan:
    """The cache for ``episodes`` live sequences of up to ``max_seq_len`` tokens: their need, at most
    ``budget_bytes`` (``fixed_bytes``, when given, is used as is). At least one sequence must fit."""
    if episodes < 1 or max_seq_len < 1 or bytes_per_token < 1 or block < 1:
        raise ValueError("episodes, max_seq_len, bytes_per_token and block must be >= 1")
    per_seq = -(-max_seq_len // block) * block * bytes_per_token
    if fixed_bytes is not None:
        cache = int(fixed_bytes)
    else:
        if budget_bytes <= 0:
            raise ValueError("the KV cache budget must be > 0: raise rollout.vllm_kv_budget_gb")
        cache = min(episodes * per_seq, int(budget_bytes))
    fits = cache // per_seq
    if fits < 1:
        raise ValueError(f"the KV cache ({cache / GiB:.3f} GiB) cannot hold one sequence of {max_seq_len} tokens "
                         f"({per_seq / GiB:.3f} GiB): raise rollout.vllm_kv_budget_gb or lower rollout.token_budget")
    return KVPlan(cache_bytes=cache, live_cap=fits if fits < episodes else None, episodes=episodes, fits=fits)


# --- reusing a prompt's KV cache across turns (the transformers engine) -------------------------------------------
# A multi-turn episode's next prompt is its last prompt + the reply as sampled + the env's observation, so all but
# the new tokens were already run through the model on the previous turn. The engine keeps each row's keys and
# values; a later prompt that starts with a kept row's tokens runs only its tail through the model. Keys and values
# at a position depend only on the tokens up to it (causal attention), so any common prefix of the two can be used.


def best_cached_prefix(prompt: Sequence[int], cached: Sequence[Sequence[int]],
                       min_tokens: int = 1) -> tuple[int | None, int]:
    """The kept row whose tokens share the longest prefix with ``prompt``, as ``(index, tokens usable)``;
    ``(None, 0)`` when none shares ``min_tokens``. At most ``len(prompt) - 1`` tokens are usable: the prompt's last
    token must run through the model, its logits predict the first new token. The earliest row wins a tie."""
    if min_tokens < 1:
        raise ValueError("min_tokens must be >= 1")
    cap = len(prompt) - 1
    best, best_n = None, 0
    for i, toks in enumerate(cached):
        if best_n >= cap:
            break
        if not toks or not prompt or toks[0] != prompt[0]:
            continue
        n = min(common_prefix_len([prompt, toks]), cap)
        if n > best_n:
            best, best_n = i, n
    return (best, best_n) if best_n >= min_tokens else (None, 0)


def evict_to_budget(sizes: Sequence[int], last_used: Sequence[int], budget: int) -> list[int]:
    """Which kept rows to drop (indices) so the rest fit ``budget`` bytes: the least recently used first (the
    lower index first among equals)."""
    total = sum(sizes)
    drop = []
    for i in sorted(range(len(sizes)), key=lambda i: (last_used[i], i)):
        if total <= budget:
            break
        drop.append(i)
        total -= sizes[i]
    return sorted(drop)
