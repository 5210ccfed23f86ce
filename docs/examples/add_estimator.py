"""A new advantage estimator: the group's median as baseline (docs/extending/add-estimator.md).

Each episode's advantage is its reward minus the median reward of its group (the live samples of the same task
in the same step), on every policy token and 0 elsewhere. With binary rewards the median is a robust "does this
sample beat a typical one" signal. tests/test_docs_examples.py runs ``demo()``.
"""

from __future__ import annotations

import torch

from core.advantages import AdvantageBatch, AdvantageResult, EstimatorParams, get_estimator, register


@register("median-baseline", needs_groups=True, description="reward minus the group's median reward")
def median_baseline(batch: AdvantageBatch, p: EstimatorParams) -> AdvantageResult:
    rewards = batch.rewards.sum(dim=1)  # [B]: an episode's rewards sit on its turns' last action tokens
    score = torch.zeros_like(rewards)
    for g in batch.groups.unique():
        members = (batch.groups == g) & batch.live  # masked episodes (env failures) never enter a baseline
        if int(members.sum()) >= 2:
            score[members] = rewards[members] - rewards[members].median()
    return AdvantageResult(score[:, None] * batch.mask)  # policy tokens only


def demo() -> dict:
    """Two tasks x 3 samples; sample 5 was masked by an env failure."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1]] * 6, dtype=torch.float)  # prompt, turn 1, env reply, turn 2
    rewards = torch.zeros(6, 7)
    for b, r in enumerate([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]):
        rewards[b, 6] = r  # the outcome reward on the last action token
    batch = AdvantageBatch(rewards=rewards, mask=mask, groups=torch.tensor([0, 0, 0, 1, 1, 1]),
                           live=torch.tensor([True, True, True, True, True, False]))

    spec = get_estimator("median-baseline")  # how the learner finds it by algo.estimator's value
    adv = spec.fn(batch, EstimatorParams()).advantages

    assert spec.needs_groups
    assert adv[0, 2].item() == 1.0 and adv[1, 2].item() == 0.0  # group 0: median 0, the success stands out
    assert adv[3:5].abs().sum().item() == 0.0  # group 1: all live samples succeeded, no signal
    assert adv[5].abs().sum().item() == 0.0  # the masked sample gets nothing
    assert (adv * (1 - mask)).abs().sum().item() == 0.0  # nothing on prompt or env tokens
    return {"advantages": adv[:, -1].tolist()}


if __name__ == "__main__":
    print(demo())
