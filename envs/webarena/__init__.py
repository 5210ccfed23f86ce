"""WebArena-format web tasks in a real browser: ``WebArenaEnv`` in ``envs.webarena.env``."""
