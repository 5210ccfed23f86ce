"""The weights of several rollout engines (``rollout.engines``): each engine's weight version, and the GPU broadcast.

Worker side (``EngineWeightsWorker``, mixed into ``vllm_backend.WorkerExtension``, so every engine's worker has these
methods through ``collective_rpc``):

- ``set_weight_version`` / ``weight_version``: the version of the weights the worker holds, written by the
  trainer after each load and read back before a rollout (``core.engines.stale_engines``): what the engine process
  itself says, so an engine that restarted or missed a load is seen, not assumed.
- ``init_weight_group`` / ``receive_broadcast``: vLLM's documented RLHF weight update (its ``rlhf`` examples): the
  learner and every engine worker join one NCCL group outside torch.distributed's global state (vLLM's
  ``StatelessProcessGroup`` rendezvous on a TCP store, its ``PyNcclCommunicator`` on the worker's GPU); the learner
  (rank 0) broadcasts each tensor in the engine's dtype and the workers receive them one at a time straight into
  vLLM's in-place reload (``model_runner.reload_weights`` with an iterator), so a worker holds one received tensor
  beside its weights, not a second copy of the model.

Trainer side: ``WeightBroadcaster`` opens rank 0 of that group on the learner's GPU and sends. ``free_port`` finds
the rendezvous port. Nothing here imports vLLM or CUDA at module import (the worker imports this module)."""

from __future__ import annotations

import socket
from typing import Any, Iterable


class EngineWeightsWorker:
    """Methods for vLLM workers (``worker_extension_cls``), called through ``collective_rpc``."""

    def set_weight_version(self, version: int) -> int:
        self._weight_version = int(version)
        return self._weight_version

    def weight_version(self) -> int | None:
        return getattr(self, "_weight_version", None)

    def sees_path(self, path: str) -> bool:
        """Whether this worker's host sees the local ``path`` (an engine on another host must read the folder the
        learner writes its weights into: ``remote_engine.RemoteEngine.check_reads``; an ``s3://`` one:
        ``storage.engine_weights.StoreWorkerExtension``)."""
        import os

        return os.path.exists(str(path))

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> int:
        """Join the learner's weight-broadcast group as rank ``rank_offset`` + this worker's rank in its engine.
        Blocks until every member joined. Returns the rank taken."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import StatelessProcessGroup

        rank = get_world_group().rank + int(rank_offset)
        group = StatelessProcessGroup.create(host=host, port=int(port), rank=rank, world_size=int(world_size))
        self._weight_group = PyNcclCommunicator(group, device=self.device)
        return rank

    def receive_broadcast(self, layout) -> int:
        """Receive ``layout``'s tensors (``(name, dtype, shape)`` in the learner's send order) from rank 0 and load
        them in place as they arrive. Returns the tensors loaded."""
        import torch

        comm = getattr(self, "_weight_group", None)
        if comm is None:
            raise RuntimeError("receive_broadcast before init_weight_group: the engine is not in a weight group")
        n = [0]

        def arriving():
            for name, dtype, shape in layout:
                t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=self.device)
                comm.broadcast(t, src=0, stream=torch.cuda.current_stream())
                n[0] += 1
                yield name, t

        self.model_runner.reload_weights(weights_iterator=arriving())
        torch.cuda.synchronize()
        if hasattr(self, "refresh_cpu_heads"):
            self.refresh_cpu_heads()
        return n[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous of a weight group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WeightBroadcaster:
    """Rank 0 of a weight-broadcast group on the learner's GPU (``device``): ``open`` blocks until every engine
    worker joined (``EngineWeightsWorker.init_weight_group``, called at the same time); ``send`` broadcasts
    ``(name, tensor)`` pairs cast to ``dtype`` and returns their layout (what the workers are told to receive)."""

    def __init__(self, host: str, port: int, world_size: int, device: Any):
        self.host, self.port, self.world_size, self.device = host, int(port), int(world_size), device
        self.comm = None

    def open(self) -> "WeightBroadcaster":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=self.host, port=self.port, rank=0, world_size=self.world_size)
        self.comm = PyNcclCommunicator(group, device=self.device)
        return self

    @staticmethod
    def layout(named: Iterable[tuple[str, Any]], dtype) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, str(dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]

    def send(self, named: list[tuple[str, Any]], dtype) -> int:
        import torch

        if self.comm is None:
            raise RuntimeError("WeightBroadcaster.send before open()")
        for _, t in named:
            x = t.detach().to(self.device, dtype).contiguous()
            self.comm.broadcast(x, src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        return len(named)
