"""MLflow tracking: one parent run per curriculum, one child run per phase.

Uses ``MlflowClient`` with explicit run ids (no global active-run state), so it is safe from Prefect's
task threads. Default store: local sqlite under the run's output dir; ``MLFLOW_TRACKING_URI`` or the
config's ``tracking.uri`` override it. A new sqlite store starts as a copy of an empty one made once per MLflow
version in the cache dir (``seed_sqlite_store``): MLflow would otherwise run its whole migration history on each
new file, 2-4 s of every run with a new output dir on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from core.records import unlogged
from envs.cache import cache_root


def default_tracking_uri(output_dir: str | Path, configured: str | None = None) -> str:
    if configured:
        return configured
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    db = Path(output_dir).resolve() / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def seed_sqlite_store(uri: str) -> bool:
    """Where ``uri`` names a local sqlite file that does not exist yet, create it as a copy of an empty MLflow store
    (its tables migrated to this MLflow's schema, no experiment: MLflow adds its default one on first use, with
    this store's own artifact location). The empty store is made once per MLflow version under
    ``$SCALINGINTER_CACHE/mlflow``. Returns whether it seeded the file; on any failure it leaves the file absent
    and MLflow creates it as it would have."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return False
    db = Path(uri[len("sqlite:///"):])
    if not db.is_absolute() or db.exists() or not db.parent.is_dir():
        return False
    try:
        template = _empty_store()
        tmp = db.with_name(f".{db.name}.{os.getpid()}.seed")
        shutil.copyfile(template, tmp)
        try:
            os.link(tmp, db)  # never over a store another process created meanwhile
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True
    except Exception:  # noqa: BLE001  (a speed-up only: MLflow makes the store itself)
        return False


def _empty_store() -> Path:
    """The cached empty store of this MLflow version, made when missing (atomically: a process that races
    another one keeps whichever file landed)."""
    import mlflow
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    root = cache_root() / "mlflow"
    path = root / f"empty-store-mlflow-{mlflow.__version__}.db"
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{path.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp}")
    try:
        _initialize_tables(engine)  # what MLflow runs on a new database: the tables and every migration
    finally:
        engine.dispose()
    os.replace(tmp, path)
    return path


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            s = json.dumps(v) if not isinstance(v, str) else v
            out[key] = s[:6000]
    return out


class Tracker:
    def __init__(self, uri: str, experiment: str, artifact_root: str | Path | None = None):
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.uri = uri
        seed_sqlite_store(uri)
        self.client = MlflowClient(tracking_uri=uri)
        self._logged: dict[tuple[str, str], set[int]] = {}  # (run, metric) -> steps with a value (log_metrics_once)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            loc = None
            if artifact_root is not None and not uri.startswith(("http://", "https://", "databricks")):
                # a local store keeps artifacts next to it; a server uses its own (proxied) artifact store
                loc = Path(artifact_root).resolve().as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=loc)
        else:
            self.experiment_id = exp.experiment_id

    def find_run(self, run_name: str, parent_id: str | None = None) -> str | None:
        """An existing (unfinished or failed) run with this name, for resume."""
        flt = f"tags.`scalinginter.run_name` = '{run_name}'"
        if parent_id:
            flt += f" and tags.`mlflow.parentRunId` = '{parent_id}'"
        runs = self.client.search_runs([self.experiment_id], filter_string=flt, max_results=5,
                                       order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def start_run(self, run_name: str, params: dict[str, Any] | None = None, parent_id: str | None = None,
                  tags: dict[str, str] | None = None, resume: bool = True) -> str:
        existing = self.find_run(run_name, parent_id) if resume else None
        if existing:
            self.client.update_run(existing, status="RUNNING")
            return existing
        all_tags = {"scalinginter.run_name": run_name, **(tags or {})}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        rid = run.info.run_id
        if params:
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in flatten(params).items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(rid, params=items[i:i + 100])
        return rid

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        if ms:
            self.client.log_batch(run_id, metrics=ms)

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        """The steps at which metric ``key`` of the run has a value: read from MLflow once per tracker, then kept
        up to date by ``log_metrics_once``."""
        if (run_id, key) not in self._logged:
            self._logged[(run_id, key)] = {m.step for m in self.client.get_metric_history(run_id, key)}
        return self._logged[(run_id, key)]

    def log_metrics_once(self, run_id: str, metrics: dict[str, float | None], step: int) -> dict[str, float]:
        """Log the metrics that have no value at ``step`` yet (MLflow keeps every value logged, so a step that
        runs again after a resume would otherwise be recorded twice). Returns what was logged."""
        new = unlogged(metrics, step, {k: self.logged_steps(run_id, k) for k in metrics})
        self.log_metrics(run_id, new, step)
        for k in new:
            self._logged[(run_id, k)].add(step)
        return new

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.client.set_tag(run_id, key, value)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def register_checkpoint(self, env: str, checkpoint_uri: str, run_id: str, tags: dict[str, str]) -> str:
        """Register a checkpoint as a new version of the model ``scalinginter-<env>`` (tags: env, phase, ...).

        The checkpoint URI is the version's source; an MLflow server refuses local paths outside the run's
        artifacts, so there the source is ``runs:/<run_id>/checkpoint`` and the URI is kept in the
        ``scalinginter.checkpoint_uri`` tag (always set; readers use the tag). Returns the version."""
        from mlflow.exceptions import MlflowException

        name = registered_model_name(env)
        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, tags={"env": env},
                                                    description=f"ScalingInter checkpoints for {env}")
            except MlflowException:  # created concurrently
                pass
        all_tags = {"env": env, "scalinginter.checkpoint_uri": checkpoint_uri, **tags}
        try:
            mv = self.client.create_model_version(name, source=checkpoint_uri, run_id=run_id, tags=all_tags)
        except MlflowException as e:
            if "source" not in str(e).lower():
                raise
            mv = self.client.create_model_version(name, source=f"runs:/{run_id}/checkpoint", run_id=run_id,
                                                  tags=all_tags)
        return str(mv.version)

    def ensure_registered(self, env: str, checkpoint_uri: str, run_id: str, tags: dict[str, str]) -> str | None:
        """Register ``checkpoint_uri`` unless a version of ``scalinginter-<env>`` already names it (a run killed
        between writing a phase's final checkpoint and registering it). Returns the new version, or None."""
        from mlflow.exceptions import MlflowException

        try:
            versions = self.client.search_model_versions(f"name='{registered_model_name(env)}'")
        except MlflowException:  # no registered model yet
            versions = []
        if any((v.tags or {}).get("scalinginter.checkpoint_uri") == checkpoint_uri for v in versions):
            return None
        return self.register_checkpoint(env, checkpoint_uri, run_id, tags)


def registered_model_name(env: str) -> str:
    return f"scalinginter-{env}"
