"""Weights for rollout engines on other hosts through S3 (``rollout.engine_sync_dir=s3://bucket/prefix``), both
sides of the hand-over on the checkpoint store (``storage.checkpoint_store``: manifest written last, every file's
sha256 checked on download):

- ``StoreHandover`` (the run's side, given to ``runtime.backends.engine_set.EngineSet`` by the step that builds the
  session's engines): ``put`` stores a weight folder under the URI, ``delete`` removes it once every engine loaded it.
- ``StoreWorkerExtension`` (the engine host's side: ``scalinginter engine-host`` names it as vLLM's
  ``--worker-extension-cls``): the run's worker extension plus ``reload_from_store`` (download, check, reload in place,
  remove) and an ``s3://``-aware ``sees_path`` (the probe the run stores before the first load).

S3 settings come from each machine's own AWS environment, as for checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

from runtime.backends.vllm_backend import WorkerExtension
from storage.checkpoint_store import checkpoint_exists, delete_checkpoint, join_uri, load_checkpoint, save_checkpoint


class StoreHandover:
    """Stores weight folders for engines on other hosts (``EngineSet``'s ``weight_store``)."""

    def put(self, folder: str | os.PathLike, base_uri: str, name: str | None = None) -> str:
        """``folder`` stored at ``base_uri``/``name`` (default: a fresh name); returns its URI."""
        return save_checkpoint(folder, join_uri(base_uri, name or f"weights-{uuid.uuid4().hex[:12]}"))

    def delete(self, uri: str) -> None:
        delete_checkpoint(uri)


class StoreWorkerExtension(WorkerExtension):
    """vLLM worker methods of an engine host, called by the run through ``collective_rpc``."""

    def sees_path(self, path: str) -> bool:
        if str(path).startswith("s3://"):
            return checkpoint_exists(str(path))
        return super().sees_path(path)

    def reload_from_store(self, uri: str) -> int:
        """Reload the weights from the folder stored at ``uri``: downloaded and checked against its manifest (sizes
        and sha256) into a temp folder, loaded in place (vLLM's ``reload_weights`` from the path), then removed.
        Returns the safetensors files loaded."""
        tmp = tempfile.mkdtemp(prefix="engine-weights-")
        try:
            folder = load_checkpoint(str(uri), tmp, verify_sha256=True)
            self.reload_weights(weights_path=str(folder))  # the worker's own, in its vLLM config
            return sum(1 for _ in folder.glob("*.safetensors"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
