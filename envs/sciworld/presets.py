"""Run presets of SciWorld (``scalinginter run sciworld --preset NAME``): partial ``RunConfig`` dicts.

Each episode in flight holds one JVM (~500 MB): ``rollout.max_live_episodes`` is ``env.options.max_jvms`` (per
server) times ``env.num_servers``, so larger steps and evals run in waves instead of waiting for a JVM (an
episode that cannot get one within 30 s is masked).
"""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # A few minutes on 2 CPU cores with SmolLM2-135M: 4 episodes per step (4 JVMs, ~2 GB), three short phases.
    "smoke": {
        "env": {"options": {"max_jvms": 4, "jvm_heap_mb": 384}},
        "curriculum": {"phases": [{"turn_limit": 2, "steps": 1}, {"turn_limit": 3, "steps": 1},
                                  {"turn_limit": 4, "steps": 1}]},
        "rollout": {"max_live_episodes": 4,
                    "tasks_per_step": 1, "samples_per_task": 4, "max_new_tokens": 32, "token_budget": 1536,
                    "temperature": 0.7},
        "algo": {"lr": 2e-6, "kl_coef": 0.001, "micro_batch_size": 2},
        "eval": {"n": 4},
    },
    # The paper's SciWorld schedule (GPU scale): 10 -> 20 -> 30 turns, 100 steps each, 256 episodes per step.
    "paper": {
        "env": {"options": {"max_jvms": 64}, "num_servers": 4},  # 64 JVMs per server
        "curriculum": {"phases": [{"turn_limit": 10, "steps": 100}, {"turn_limit": 20, "steps": 100},
                                  {"turn_limit": 30, "steps": 100}]},
        "rollout": {"max_live_episodes": 256,
                    "tasks_per_step": 32, "samples_per_task": 8, "max_new_tokens": 512, "token_budget": 6144,
                    "history_turns": 2},  # 30 turns x 512 tokens overflow an 8,192-token context: a 2-turn window
        "algo": {"lr": 1e-6, "kl_coef": 0.001},
        "eval": {"n": 100},
    },
}
