"""Test helpers: the gradients a learner steps on (the learner frees them after an update's last step), and how
far an optimizer moves the weights."""

from __future__ import annotations


def record_grads(learner) -> dict:
    """Parameter name -> a copy (fp32, on the CPU) of its gradient, filled each time ``learner`` takes an optimizer
    step: call it before ``update``."""
    grads = {}
    real_step = learner._step

    def step():
        grads.update({k: p.grad.detach().float().cpu().clone() for k, p in learner.model.named_parameters()
                      if p.grad is not None})
        return real_step()

    learner._step = step
    return grads


def weight_moves(learner, trajs, advs, updates: int = 4):
    """The change of all of ``learner``'s weights over ``updates`` updates on one batch, as one fp64 vector (dot
    products over 100M+ terms)."""
    import torch

    start = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    for _ in range(updates):
        learner.update(trajs, advs, prepared=learner.prepare(trajs))
    return torch.cat([(p.detach() - start[n]).flatten().double() for n, p in learner.model.named_parameters()])


def cosine_and_norm_ratio(a, b) -> tuple[float, float]:
    """How alike two weight changes are: their cosine, and ``|b| / |a|``."""
    import torch

    return float(torch.dot(a, b) / (a.norm() * b.norm())), float(b.norm() / a.norm())
