"""ScalingInter environments: the ``TextEnv`` contract (``envs.base``), envs, and the HTTP env server."""

from envs.base import register_env

# Built-in test env: tiny, deterministic, no dependencies (see envs/toy.py).
register_env("toy", "envs.toy:ToyEnv")
