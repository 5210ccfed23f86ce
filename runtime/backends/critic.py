"""PPO critic: a scalar value head on its own copy of a causal-LM backbone (the policy's initial model by
default, or any smaller HF model sharing the tokenizer), trained with the clipped value loss.

``values[b, t]`` is the value of the state *before* token t (read from the hidden state at t - 1), so it
lines up with ``logp[b, t]`` = log p(token t | tokens < t): the value of the decision that produced token t.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from core.losses import clipped_value_loss
from runtime.backends.safe_load import load_plain


class ValueModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def after(self, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=ids, attention_mask=att).last_hidden_state
        return self.head(h.float()).squeeze(-1)  # value of the state after token t

    def forward(self, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        v = self.after(ids, att)
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # shift: state before token t


def _load_backbone(path: str):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    backbone = lm.base_model
    backbone.config.use_cache = False
    return backbone, int(lm.config.hidden_size)


class Critic:
    def __init__(self, model_path: str, lr: float, value_clip: float = 0.2, micro_batch_size: int = 4,
                 bf16_autocast: bool = True, grad_clip: float = 1.0, pad_id: int = 0, device: Any = None):
        backbone, hidden = _load_backbone(model_path)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.net = ValueModel(backbone, hidden).to(self.device)
        self.net.train()
        self.lr, self.value_clip, self.mb, self.bf16, self.grad_clip, self.pad_id = (
            lr, value_clip, micro_batch_size, bf16_autocast, grad_clip, pad_id)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=0.0)
        # data-parallel ranks (the DeepSpeed learner over several): each rank's gradient is its share of the batch's
        # loss times the ranks (the policy's weights, ``core.losses``), so their mean is the whole batch's gradient
        self.data_parallel = False

    def _autocast(self):
        from runtime.backends.hardware import autocast

        return autocast(self.device, self.bf16, cache=False)  # training: hardware.autocast

    def _pad(self, seqs: Sequence[Sequence[int]]):
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            att[r, : len(s)] = 1
        return ids.to(self.device), att.to(self.device)

    @torch.no_grad()
    def values_and_final(self, seqs: Sequence[Sequence[int]]) -> tuple[list[list[float]], list[float]]:
        """Per-token values (state before each token) and, per sequence, the value of the state after its last
        token: V(s_T) of an episode a turn limit or token budget truncated (GAE bootstraps from it)."""
        out: list[list[float]] = []
        final: list[float] = []
        for s in range(0, len(seqs), self.mb):
            chunk = seqs[s:s + self.mb]
            ids, att = self._pad(chunk)
            with self._autocast():
                after = self.net.after(ids, att).float()
            for r, c in enumerate(chunk):
                n = len(c)
                out.append([0.0] + after[r, : n - 1].tolist() if n else [])
                final.append(float(after[r, n - 1]) if n else 0.0)
        return out, final

    def values(self, seqs: Sequence[Sequence[int]]) -> list[list[float]]:
        return self.values_and_final(seqs)[0]

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def accumulate(self, seqs, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor
                   ) -> dict[str, float]:
        """Forward/backward one micro-batch (tensors padded to the micro-batch width)."""
        ids, att = self._pad(seqs)
        with self._autocast():
            v = self.net(ids, att).float()
        dev = self.device
        loss, st = clipped_value_loss(v, old_values.to(dev), returns.to(dev), weights.to(dev), self.value_clip)
        loss.backward()
        return st

    def _average_over_ranks(self) -> None:
        """The ranks' gradients averaged in place (one all-reduce over a flat copy), so every rank steps alike."""
        import torch.distributed as dist

        world = dist.get_world_size()
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def step(self) -> float:
        if self.data_parallel:
            self._average_over_ranks()
        gn = torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)
        self.opt.step()
        return float(gn)

    # -- checkpoints: <dir>/critic/{model.pt, optimizer.pt} -------------------------------------------
    def save(self, directory: Path) -> None:
        d = Path(directory) / "critic"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.net.state_dict(), d / "model.pt")
        self._save_optimizer(d)

    def _save_optimizer(self, d: Path) -> None:
        """The optimizer's state keyed by parameter name (``d/optimizer.pt``)."""
        names = {id(p): n for n, p in self.net.named_parameters()}
        torch.save({names[id(p)]: self.opt.state[p] for g in self.opt.param_groups for p in g["params"]
                    if p in self.opt.state}, d / "optimizer.pt")

    def _load_optimizer(self, d: Path) -> None:
        """The optimizer's state from ``d/optimizer.pt`` where there is one, onto the parameters of the same names."""
        if (d / "optimizer.pt").exists():
            from runtime.backends.learner import optimizer_state_on

            by_name = dict(self.net.named_parameters())
            for n, st in load_plain(d / "optimizer.pt", map_location="cpu").items():
                if n in by_name:
                    self.opt.state[by_name[n]] = optimizer_state_on(st, by_name[n].device)

    def load(self, directory: Path) -> bool:
        d = Path(directory) / "critic"
        if not (d / "model.pt").exists():
            return False
        self.net.load_state_dict(load_plain(d / "model.pt", map_location="cpu"))
        self._load_optimizer(d)
        return True
