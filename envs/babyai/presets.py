"""Run presets of BabyAI (``scalinginter run babyai --preset NAME``): partial ``RunConfig`` dicts."""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # ~10 minutes on 2 CPU cores with SmolLM2-135M: three phases with growing turn limits.
    "smoke": {
        "env": {"options": {"levels": "GoToObj,GoToRedBallGrey,GoToLocal"}},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 2}, {"turn_limit": 3, "steps": 2},
                                  {"turn_limit": 4, "steps": 2}]},
        "rollout": {"tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 32, "token_budget": 1536,
                    "temperature": 0.7},
        "algo": {"lr": 2e-6, "kl_coef": 0.001, "micro_batch_size": 2},
        "eval": {"n": 24},
    },
    # The smallest real run, for end-to-end tests: 1 step per phase, few short episodes.
    "tiny": {
        "env": {"options": {"levels": "GoToObj"}},
        "curriculum": {"phases": [{"turn_limit": 1, "steps": 1}, {"turn_limit": 2, "steps": 1}]},
        # transformers: a vLLM engine's ~20 s start per phase would dominate a run this short
        "rollout": {"tasks_per_step": 2, "samples_per_task": 4, "max_new_tokens": 24, "token_budget": 768,
                    "backend": "transformers"},
        "algo": {"lr": 1e-5, "micro_batch_size": 2},
        "eval": {"n": 2},
        "tracking": {"log_trajectories": 2},
    },
    # The paper's BabyAI schedule (GPU scale): 6 -> 13 -> 20 turns, 100 steps each.
    "paper": {
        "curriculum": {"phases": [{"turn_limit": 6, "steps": 100}, {"turn_limit": 13, "steps": 100},
                                  {"turn_limit": 20, "steps": 100}]},
        "rollout": {"tasks_per_step": 32, "samples_per_task": 8, "max_new_tokens": 512, "token_budget": 14000},
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 90},
    },
}


