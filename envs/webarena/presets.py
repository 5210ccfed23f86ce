"""Run presets of the webarena env (``scalinginter run webarena --preset NAME``): partial ``RunConfig`` dicts.

Each live episode holds one browser context: ``rollout.max_live_episodes`` is the env's ``max_contexts`` (16 by
default) times ``env.num_servers``, so train steps and evals larger than that run in waves instead of waiting
for a context.
"""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # A few minutes on 2 CPU cores: the local shop + forum, short horizons, SmolLM2-135M.
    "smoke": {
        "env": {"name": "webarena", "options": {"max_obs_chars": 1600, "max_contexts": 8}, "task_pool": 75},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 1}, {"turn_limit": 3, "steps": 1}]},
        "rollout": {"max_live_episodes": 8,
                    "tasks_per_step": 2, "samples_per_task": 4, "max_new_tokens": 32, "token_budget": 3072,
                    "temperature": 0.7},
        "algo": {"lr": 2e-6, "kl_coef": 0.001, "micro_batch_size": 1},
        "eval": {"n": 4},
    },
    # The paper's WebArena schedule (GPU scale): 8 -> 12 -> 15 turns, 80 steps per phase, 15-turn evaluation.
    "paper": {
        "env": {"name": "webarena", "options": {"max_obs_chars": 6000, "max_contexts": 16}, "task_pool": 75},
        "curriculum": {"phases": [{"turn_limit": 8, "steps": 80}, {"turn_limit": 12, "steps": 80},
                                  {"turn_limit": 15, "steps": 80}]},
        "rollout": {"max_live_episodes": 16,
                    "tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 512, "token_budget": 8000,
                    "history_turns": 2},  # pages of up to 6,000 characters: the last 2 turns fit an 8,192 context
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 18},
    },
}
