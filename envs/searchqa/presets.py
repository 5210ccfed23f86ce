"""Run presets of deep search (``scalinginter run searchqa --preset NAME``): partial ``RunConfig`` dicts.

The default data is the embedded country-facts set (3160 train / 641 test questions); train task indices
wrap around the train questions, so ``env.task_pool`` only sets how many distinct tasks are drawn from.
"""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Minutes on 2 CPU cores with SmolLM2-135M: three one-step phases with growing turn limits; two passages
    # of at most 300 characters per search keep the trajectories short.
    "smoke": {
        "env": {"options": {"topk": 2, "max_passage_chars": 300, "progress": False}, "task_pool": 3160},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 1}, {"turn_limit": 3, "steps": 1},
                                  {"turn_limit": 4, "steps": 1}]},
        "rollout": {"tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 48, "token_budget": 1536,
                    "temperature": 0.7},
        "algo": {"lr": 2e-6, "kl_coef": 0.001, "micro_batch_size": 2},
        "eval": {"n": 16},
    },
    # The paper's deep-search schedule (GPU scale): 5 -> 8 -> 10 turns, 100 steps each; top-3 passages as in
    # Search-R1; one final answer, evaluated at 10 turns.
    "paper": {
        "env": {"options": {"topk": 3}, "task_pool": 3160},
        "curriculum": {"phases": [{"turn_limit": 5, "steps": 100}, {"turn_limit": 8, "steps": 100},
                                  {"turn_limit": 10, "steps": 100}]},
        "rollout": {"tasks_per_step": 32, "samples_per_task": 8, "max_new_tokens": 512, "token_budget": 8000,
                    "temperature": 1.0},
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 500, "turn_limit": 10},
    },
}
