"""Prefect's ephemeral API, started while a command still imports its libraries.

Without a Prefect server (no ``PREFECT_API_URL``), Prefect starts a temporary one in a subprocess when the first
flow runs, and waits for it: about 20 s on a 2-core machine, after the 10-15 s the command spent importing torch,
transformers and MLflow. ``start_early()`` starts that same server (Prefect's own ``SubprocessASGIServer``, the
singleton its client uses) as soon as a command knows it will run a flow, and waits for it to answer in a thread,
so the two overlap; the first flow then waits only for what is left. Where an API URL is set, or the ephemeral
mode is off, it does nothing. ``SCALINGINTER_EARLY_API=0`` turns it off.
"""

from __future__ import annotations

import os
import threading


def start_early() -> threading.Thread | None:
    """Start Prefect's ephemeral API server now, in the background; returns the thread waiting for it (None when
    nothing was started). The server's ``start`` waits for that thread, so a flow never sees a server not yet up;
    if the start failed, Prefect's own start runs again and reports the failure as it would have."""
    if os.environ.get("SCALINGINTER_EARLY_API", "1") == "0":
        return None
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's client takes (one per port; None: any free port)
    if server.running or "start" in vars(server):
        return None
    cls_start = type(server).start
    thread = threading.Thread(target=_start_quietly, args=(cls_start, server), name="prefect-api-start",
                              daemon=True)

    def start_after_thread(timeout: int | None = None) -> None:
        thread.join()
        cls_start(server, timeout)  # a no-op when the thread's start succeeded, else Prefect's start again

    server.start = start_after_thread  # the client's ``server.start()`` (prefect.client.orchestration.get_client)
    thread.start()
    return thread


def _start_quietly(cls_start, server) -> None:
    try:
        cls_start(server)
    except Exception:  # noqa: BLE001  (the flow's own start runs again and raises it where it is seen)
        server.running = False
