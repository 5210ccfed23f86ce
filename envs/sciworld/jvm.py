"""ScienceWorld simulators (one JVM each, ~500 MB) in a capped pool shared by all envs of a process.

An env takes a JVM at its first reset and keeps it across its episodes (a new task/variation is loaded
into the same JVM); closing the env -- ``/close``, or the server's reaper when a client disappears --
returns the JVM to the pool, where the next env reuses it. At most ``max_jvms`` JVMs exist at once; an
``acquire`` beyond that waits up to ``timeout_s`` for a release, then fails with a clear error. Idle JVMs
are shut down after ``idle_ttl_s``; a JVM that failed is shut down instead of being reused. All JVMs die
with the process (py4j ``die_on_exit``) and are shut down at interpreter exit.

We launch the JAR shipped in the ``scienceworld`` wheel ourselves (instead of ``ScienceWorldEnv()``) to
pass JVM options: a heap cap and the serial GC keep a JVM's RSS bounded instead of growing toward a quarter
of the machine's RAM (measured, one JVM loading 300 tasks in turn: -Xmx512m plateaus at ~470 MB after ~100
loads, -Xmx256m at ~350 MB; the env's default is 384 MB).
"""

from __future__ import annotations

import atexit
import logging
import tempfile
import threading
import time
import weakref
from typing import Any

log = logging.getLogger("envs.sciworld.jvm")


def _world_class():
    from scienceworld import ScienceWorldEnv

    class World(ScienceWorldEnv):
        """``ScienceWorldEnv`` over a JVM launched with our options (no Python callback server needed)."""

        def __init__(self, java_opts: list[str]):  # noqa: D401  (does not call super().__init__ on purpose)
            from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
            from scienceworld.constants import BASEPATH, JAR_PATH

            port, proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, javaopts=java_opts,
                                        return_proc=True)
            self._gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port),
                                        java_process=proc)
            self.server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
            self.lastStepScore = 0
            self.taskName = None
            self.simplificationStr = ""
            self.variationIdx = 0
            self.envStepLimit = 10**9  # our env enforces its own limit
            self.goldPathGenerated = False
            self.runHistories = {}
            self._obj_tree_tempdir = tempfile.TemporaryDirectory()
            self.closed = False

        def close(self) -> None:
            if getattr(self, "closed", True):
                return
            self.closed = True
            try:
                super().close()
            except Exception:  # noqa: BLE001  (already dead)
                pass
            proc = self._gateway.java_process
            try:
                proc.wait(5)
            except Exception:  # noqa: BLE001
                proc.kill()
                proc.wait(5)

        def alive(self) -> bool:
            return not self.closed and self._gateway.java_process.poll() is None

        @property
        def pid(self) -> int:
            return self._gateway.java_process.pid

    return World


class PoolExhausted(RuntimeError):
    pass


class JvmPool:
    def __init__(self, max_jvms: int = 16, java_opts: list[str] | None = None, idle_ttl_s: float = 120.0):
        if max_jvms < 1:
            raise ValueError(f"max_jvms must be >= 1, got {max_jvms}")
        self.max_jvms = int(max_jvms)
        self.java_opts = list(java_opts or [])
        self.idle_ttl_s = float(idle_ttl_s)
        self._cond = threading.Condition()
        self._idle: list[tuple[Any, float]] = []  # (world, released at)
        self._live = 0  # idle + in use + being started
        self.started_total = 0
        self.closed_total = 0
        self._reaper: threading.Thread | None = None
        self._stopped = False

    @property
    def capacity(self) -> int:
        """Episodes that can hold a JVM at once (an env server advertises it on ``/health``)."""
        return self.max_jvms

    # --- use -----------------------------------------------------------------------------------------
    def acquire(self, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._stopped:
                    raise RuntimeError("the ScienceWorld JVM pool was shut down")
                while self._idle:
                    world, _ = self._idle.pop()
                    if world.alive():
                        return world
                    self._live -= 1
                    self._close(world)
                if self._live < self.max_jvms:
                    self._live += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolExhausted(
                        f"all {self.max_jvms} ScienceWorld JVMs are in use (max_jvms={self.max_jvms}) and none was "
                        f"released within {timeout_s:g} s: raise the env option max_jvms (about 500 MB each) or run "
                        "fewer episodes at once")
                self._cond.wait(left)
        try:
            world = _world_class()(self.java_opts)
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise
        with self._cond:
            self.started_total += 1
        self._ensure_reaper()
        return world

    def release(self, world, broken: bool = False) -> None:
        if broken or not world.alive():
            self._close(world)
            with self._cond:
                self._live -= 1
                self._cond.notify()
            return
        with self._cond:
            if self._stopped:
                self._live -= 1
                close = True
            else:
                self._idle.append((world, time.monotonic()))
                close = False
            self._cond.notify()
        if close:
            self._close(world)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"live": self._live, "idle": len(self._idle), "started_total": self.started_total,
                    "closed_total": self.closed_total, "max_jvms": self.max_jvms}

    def reap_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._cond:
            old = [w for w, t in self._idle if now - t > self.idle_ttl_s]
            self._idle = [(w, t) for w, t in self._idle if now - t <= self.idle_ttl_s]
            self._live -= len(old)
            self._cond.notify_all()
        for w in old:
            self._close(w)
        return len(old)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for w, _ in idle:
            self._close(w)

    # --- internals -------------------------------------------------------------------------------------
    def _close(self, world) -> None:
        try:
            world.close()
        except Exception:  # noqa: BLE001
            log.exception("closing a ScienceWorld JVM failed")
        with self._cond:
            self.closed_total += 1

    def _ensure_reaper(self) -> None:
        if self._reaper is not None:
            return
        ref = weakref.ref(self)
        interval = max(1.0, min(self.idle_ttl_s / 4, 30.0))

        def loop():
            while True:
                time.sleep(interval)
                pool = ref()
                if pool is None or pool._stopped:
                    return
                pool.reap_idle()
                del pool

        self._reaper = threading.Thread(target=loop, name="sciworld-jvm-reaper", daemon=True)
        self._reaper.start()


_POOLS: dict[tuple, JvmPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(max_jvms: int, java_opts: list[str], idle_ttl_s: float) -> JvmPool:
    """The process-wide pool for these settings (one per server process in practice)."""
    key = (int(max_jvms), tuple(java_opts), float(idle_ttl_s))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool._stopped:
            pool = _POOLS[key] = JvmPool(max_jvms, java_opts, idle_ttl_s)
        return pool


@atexit.register
def _shutdown_all() -> None:
    for pool in list(_POOLS.values()):
        try:
            pool.shutdown()
        except Exception:  # noqa: BLE001
            pass
