"""Test helper: the gradients a learner steps on (the learner frees them after an update's last step)."""

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
