"""The ``scalinginter`` command as the end-to-end tests run it: the installed entry point when there is one (else
``python -m flows.cli``), this checkout on PYTHONPATH, and a longer start for Prefect's ephemeral API, whose default
20 s is too short on a busy 2-core machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.sharedapi import own_api_env

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path, timeout: int = 900, popen: bool = False, own_api: bool = False):
    """Run ``scalinginter ARGS`` in ``cwd``: the finished process (output captured as text), or with ``popen`` the
    running one (stdout and stderr merged into its ``stdout`` pipe). The session's shared Prefect API serves it
    once up (tests/sharedapi.py); ``own_api``: Prefect's temporary server of its own, as a user's run starts."""
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = ([str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]) + list(args)
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", **os.environ, "PYTHONPATH": str(ROOT)}
    if own_api:
        env = own_api_env(env)
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
