"""MiniWoB++ tasks (the ``miniwob`` PyPI package's HTML) in the web env: ``MiniWoBEnv`` in ``envs.miniwob.env``."""
