"""A new sqlite MLflow store seeded from the cached empty store (storage/tracking.py::seed_sqlite_store) is the
store MLflow would have made: the same schema and migration head, its default experiment created by MLflow with
this store's artifact location, runs and the model registry working; an existing store is never replaced, and
where the empty store cannot be made MLflow creates the file as before."""

import sqlite3

from mlflow.tracking import MlflowClient

from storage.tracking import Tracker, seed_sqlite_store


def schema(db):
    """Tables and indexes with their columns and constraints (each statement's lines sorted: MLflow's migrations
    do not emit a table's constraints in one fixed order), and the migration head."""
    with sqlite3.connect(db) as c:
        rows = c.execute("select type, name, sql from sqlite_master where name not like 'sqlite_%'")
        objects = sorted((t, n, tuple(sorted(line.strip(" ,") for line in (sql or "").splitlines())))
                         for t, n, sql in rows)
        head = c.execute("select version_num from alembic_version").fetchall()
    return objects, head


def test_a_seeded_store_is_the_store_mlflow_makes(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    seeded, fresh = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    assert seed_sqlite_store(f"sqlite:///{seeded}") and seeded.exists()
    assert list((tmp_path / "cache" / "mlflow").glob("empty-store-mlflow-*.db"))  # made once, kept
    with sqlite3.connect(seeded) as c:
        assert c.execute("select count(*) from experiments").fetchone() == (0,)  # MLflow adds its default
    MlflowClient(tracking_uri=f"sqlite:///{fresh}").search_experiments()  # MLflow's own new store
    a, b = MlflowClient(tracking_uri=f"sqlite:///{seeded}"), MlflowClient(tracking_uri=f"sqlite:///{fresh}")
    ea, eb = a.get_experiment("0"), b.get_experiment("0")
    assert (ea.name, ea.artifact_location) == (eb.name, eb.artifact_location)
    assert schema(seeded) == schema(fresh)

    t = Tracker(f"sqlite:///{seeded}", "exp", artifact_root=tmp_path / "arts")
    rid = t.start_run("r", params={"x": 1})
    t.log_metrics(rid, {"m": 0.5}, step=1)
    assert a.get_run(rid).data.metrics == {"m": 0.5}
    assert a.get_experiment(t.experiment_id).artifact_location == (tmp_path / "arts").resolve().as_uri()
    a.create_registered_model("scalinginter-x")
    assert [m.name for m in a.search_registered_models()] == ["scalinginter-x"]


def test_an_existing_store_is_kept_and_a_failure_leaves_it_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "mlflow.db"
    t = Tracker(f"sqlite:///{db}", "exp")
    rid = t.start_run("r")
    assert not seed_sqlite_store(f"sqlite:///{db}")  # exists: untouched
    assert MlflowClient(tracking_uri=f"sqlite:///{db}").get_run(rid).info.run_name == "r"
    assert not seed_sqlite_store("http://127.0.0.1:5000") and not seed_sqlite_store("sqlite:///relative.db")

    (tmp_path / "blocked").write_text("a file where the cache dir would be")
    monkeypatch.setenv("SCALINGINTER_CACHE", str(tmp_path / "blocked"))
    other = tmp_path / "other.db"
    assert not seed_sqlite_store(f"sqlite:///{other}") and not other.exists()
    assert not list(tmp_path.glob(".other.db*"))  # no partial copy left
    t = Tracker(f"sqlite:///{other}", "exp")  # MLflow makes it itself
    assert t.start_run("r2") and other.exists()
