"""One Prefect API server for the CLI runs of a test session.

Without ``PREFECT_API_URL``, every ``scalinginter`` process a test starts boots Prefect's temporary API server of
its own and stops it when it exits: about 7 s of each toy run on a 2-core machine, even with flows/early_api.py
overlapping the boot with the imports. When the collected tests start the CLI, conftest starts one such server
(Prefect's own ``SubprocessASGIServer``, what its ephemeral mode runs) in a background thread and, once it answers,
sets ``PREFECT_API_URL`` for the processes started after that; the ones started before boot their own, as a user's
run does. The run behind the main end-to-end tests and tests/test_early_api.py keep that path on purpose
(``own_api_env``). ``SCALINGINTER_TEST_SHARED_API=0`` turns it off; with ``PREFECT_API_URL`` already set (the suite
run against a server of the caller's), nothing starts.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

OFF_ENV = "SCALINGINTER_TEST_SHARED_API"
_url: str | None = None  # the shared server's API URL, set once it answered
_stopping = False  # the session ended: a boot still under way was stopped by ``stop``, which is no failure


def runs_the_cli(test_file: Path) -> bool:
    """Whether a test module starts the ``scalinginter`` command (directly or through tests/clirun.py)."""
    try:
        text = test_file.read_text()
    except OSError:
        return False
    return 'with_name("scalinginter")' in text or "tests.clirun" in text


def start(test_files) -> threading.Thread | None:
    """Start the shared server in the background when one of ``test_files`` runs the CLI; None when nothing
    starts (turned off, an API URL set by the caller, or no such test)."""
    if os.environ.get(OFF_ENV, "1") == "0" or os.environ.get("PREFECT_API_URL"):
        return None
    if not any(runs_the_cli(Path(f)) for f in set(test_files)):
        return None
    thread = threading.Thread(target=_boot, name="shared-prefect-api", daemon=True)
    thread.start()
    return thread


def _boot() -> None:
    global _url
    try:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer(port=None)
        server.start(timeout=300)
    except Exception as e:  # noqa: BLE001  (each CLI run then boots its own server, as without this)
        if not _stopping:  # a short session can end while the server still boots: stop() ended it, say nothing
            print(f"tests: no shared Prefect API ({type(e).__name__}: {e}); each CLI run starts its own")
        return
    _url = server.api_url
    os.environ["PREFECT_API_URL"] = _url


def own_api_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the shared server's URL, so the process boots Prefect's temporary server itself (a URL the
    caller set is kept)."""
    if _url is not None and env.get("PREFECT_API_URL") == _url:
        env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    return env


def stop() -> None:
    """Stop the shared server, and any temporary server an in-process flow of the session started: here, while
    pytest's output is open, not in Prefect's exit hook, whose log line would then hit a closed stream."""
    global _url, _stopping
    _stopping = True
    if _url is not None and os.environ.get("PREFECT_API_URL") == _url:
        del os.environ["PREFECT_API_URL"]
    _url = None
    mod = sys.modules.get("prefect.server.api.server")
    if mod is not None:
        for server in list(mod.SubprocessASGIServer._instances.values()):
            server.stop()
