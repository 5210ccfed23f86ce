"""Run presets of the miniwob env (``scalinginter run miniwob --preset NAME``): partial ``RunConfig`` dicts.

Each live episode holds one browser context: ``rollout.max_live_episodes`` is the env's ``max_contexts`` (16 by
default) times ``env.num_servers``, so train steps and evals larger than that run in waves instead of waiting
for a context.
"""

from typing import Any

_EASY = "click-button,click-link,click-test,click-test-2,focus-text,enter-text,click-checkboxes,click-option"

PRESETS: dict[str, dict[str, Any]] = {
    # A few minutes on 2 CPU cores: easy single-page tasks, short horizons, SmolLM2-135M.
    "smoke": {
        "env": {"name": "miniwob", "options": {"tasks": _EASY, "reward": "binary", "max_contexts": 8}},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 1}, {"turn_limit": 3, "steps": 1}]},
        "rollout": {"max_live_episodes": 8,
                    "tasks_per_step": 2, "samples_per_task": 4, "max_new_tokens": 32, "token_budget": 2048,
                    "temperature": 0.7},
        "algo": {"lr": 2e-6, "kl_coef": 0.001, "micro_batch_size": 1},
        "eval": {"n": 8},
    },
    # The default MiniWoB task list with the WebArena-length schedule (GPU scale).
    "paper": {
        "env": {"name": "miniwob", "options": {"max_contexts": 16}},
        "curriculum": {"phases": [{"turn_limit": 4, "steps": 80}, {"turn_limit": 8, "steps": 80},
                                  {"turn_limit": 12, "steps": 80}]},
        "rollout": {"max_live_episodes": 16,
                    "tasks_per_step": 4, "samples_per_task": 4, "max_new_tokens": 256, "token_budget": 8000},
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 96},
    },
}
