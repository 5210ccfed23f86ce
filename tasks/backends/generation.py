"""Generation backends: token-id prompts in, sampled token ids and their log-probs out.

The rollout loop only sees ``GenerationBackend``; a vLLM backend implements the same protocol.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    # one sampling seed per prompt, for engines with their own RNG (vLLM): a resumed run then samples exactly
    # what the uninterrupted run sampled. None: the engine's own stream (transformers uses torch's global
    # RNG, which the checkpoint restores).
    seeds: tuple[int, ...] | None = None


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution (temperature-scaled)
    finish: str  # "stop" (ended with EOS) or "length"


class GenerationBackend(Protocol):
    eos_token_id: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def sync_weights(self) -> None:
        """Make generation use the learner's latest weights."""
        ...


class TransformersBackend:
    """transformers ``generate`` on CPU, sharing the learner's policy module (no copy, no sync needed)."""

    def __init__(self, model, eos_token_id: int, pad_token_id: int, batch_size: int = 32,
                 bf16_autocast: bool = True):
        self.model = model
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.batch_size = batch_size
        self.bf16_autocast = bf16_autocast

    def sync_weights(self) -> None:  # shares the learner's module
        return None

    def _autocast(self):
        if self.bf16_autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        # sort by length so padding is small, then restore order
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Generation] = {}
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, g in zip(idx, self._generate_batch([prompts[i] for i in idx], params)):
                results[i] = g
        return [results[i] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        att = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            att[r, width - len(p):] = 1
        greedy = params.temperature <= 0
        kwargs = dict(max_new_tokens=params.max_new_tokens, do_sample=not greedy,
                      eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                      return_dict_in_generate=True, output_logits=True)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._autocast():
                res = self.model.generate(input_ids=ids, attention_mask=att, **kwargs)
        finally:
            self.model.train(was_training)
        new = res.sequences[:, width:]  # [B, N]
        logits = torch.stack(res.logits, dim=1).float()  # [B, N, V]
        if not greedy:
            logits = logits / params.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, N]
        gens = []
        for r in range(new.shape[0]):
            toks = new[r].tolist()
            lps = logp[r].tolist()
            if self.eos_token_id in toks:
                end = toks.index(self.eos_token_id) + 1
                gens.append(Generation(toks[:end], lps[:end], "stop"))
            else:
                gens.append(Generation(toks, lps, "length"))
        return gens
