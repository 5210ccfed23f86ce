"""BabyAI (minigrid) levels as a text environment: ``BabyAIEnv`` in ``envs.babyai.env``."""

from envs.babyai.parse import ParseResult, parse_action

__all__ = ["ParseResult", "parse_action"]
