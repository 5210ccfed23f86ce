"""Every refusal is one line: the real CLI (a subprocess) refuses a bad config, an env URL nobody answers, an AgentGym
TextCraft server whose goal set differs, a missing model, a failed dry-run, and a run whose evaluation had every
episode masked (an env that answers every reset with an error) with one line on stderr naming the fix, exit code 2,
no traceback; the traceback is in the run's log file (SCALINGINTER_VERBOSE=1 shows it). The in-process pieces
(``flows.refusal``) are tested without a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agentgym_replay import free_port, serve_app as serve
from tests.clirun import side_by_side

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("scalinginter")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "flows.cli"]
    full = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **os.environ, "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1"}
    full.pop("SCALINGINTER_VERBOSE", None)
    full.update(env or {})
    return subprocess.run(cmd + list(args), cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def failing_agentgym_app():
    """An AgentGym-style server that is up (``GET /``, ``/create``) but answers every reset with an error payload,
    as a server whose game cannot load does: every episode is masked."""
    from fastapi import FastAPI

    app = FastAPI()
    app.state.next_id = 0

    @app.get("/")
    def hello():
        return "This is environment BabyAI."

    @app.post("/create")
    def create():
        app.state.next_id += 1
        return {"id": app.state.next_id}

    @app.post("/reset")
    def reset():
        return {"error": "level data missing: BabyAI could not build the level"}

    @app.post("/close")
    def close():
        return True

    return app


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama with the SmolLM2 tokenizer: it loads in a moment; the runs that use it
    stop before it generates anything."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.backends.model import resolve_model

    d = tmp_path_factory.mktemp("tiny-model")
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def assert_one_line(p: subprocess.CompletedProcess, needle: str, max_lines: int) -> str:
    """Exit 2, exactly one 'error:' line on stderr (containing ``needle``), no traceback, at most ``max_lines``
    lines on stderr in all (a run that got as far as the flow also prints Prefect's start lines and its header)."""
    err = [line for line in p.stderr.splitlines() if line.strip()]
    shown = "\n".join(err[-40:])
    assert p.returncode == 2, shown
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], shown
    assert "Traceback" not in p.stderr and "│" not in p.stderr and "Encountered exception" not in p.stderr, shown
    assert "Finished in state Failed" not in p.stderr, shown
    assert len(err) <= max_lines, shown
    return errors[0]


# --- in-process pieces --------------------------------------------------------------------------------------------
def test_refusal_line_knows_the_kinds_and_their_causes():
    from core.config import ConfigError
    from envs.errors import EnvConfigError
    from flows.refusal import Refusal, masked_reason, refusal_line
    from runtime.backends.model import ModelNotFound
    from storage.checkpoint_store import CheckpointCorrupted

    assert refusal_line(ConfigError("rollout.x: bad;\n  set it to 1")) == "rollout.x: bad; set it to 1"
    assert refusal_line(ModelNotFound("model 'x' not found")) == "model 'x' not found"
    assert "is damaged: sha256 differs" in refusal_line(CheckpointCorrupted("/c", "sha256 differs"))
    try:
        try:
            raise EnvConfigError("the server is refused; fix it")
        except EnvConfigError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert refusal_line(wrapped) == "the server is refused; fix it"  # found through __cause__
    assert refusal_line(KeyError("success_rate")) is None  # a fault of ours keeps its traceback
    assert refusal_line(Refusal("x")) == "x"
    assert masked_reason(["reset: boom", "reset: boom", "step 1: other"]) == "reset: boom; 2 of 3 episodes failed so"
    assert masked_reason([]) == "no error recorded"


def test_cli_refusals_prints_one_line_and_logs_the_traceback(tmp_path, capsys, monkeypatch):
    import typer

    from flows.refusal import Refusal, cli_refusals

    log = tmp_path / "engine.log"
    monkeypatch.delenv("SCALINGINTER_VERBOSE", raising=False)
    with pytest.raises(typer.Exit) as e:
        with cli_refusals(log):
            raise Refusal("the env server at http://h:1 does not answer: start it")
    assert e.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: the env server at http://h:1 does not answer: start it"
    assert "Traceback" in log.read_text() and "does not answer" in log.read_text()
    monkeypatch.setenv("SCALINGINTER_VERBOSE", "1")  # verbose: the traceback on the console too
    with pytest.raises(typer.Exit):
        with cli_refusals(None):
            raise Refusal("again")
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("error: again")
    with pytest.raises(KeyError):  # anything else passes unchanged
        with cli_refusals(None):
            raise KeyError("success_rate")


def test_an_evaluation_masked_throughout_stops_with_the_envs_reason(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flows.evaluate import check_scored
    from flows.refusal import Refusal

    path = tmp_path / "episodes.parquet"
    pq.write_table(pa.table({"error": ["reset: EnvInfraError: server says no"] * 2}), path)
    sweep = {"outcomes": [{"success": None}, {"success": None}]}
    with pytest.raises(Refusal, match=r"every one of the 2 evaluation episodes of the model was masked .*server says no"):
        check_scored(sweep, "model", path)
    check_scored({"outcomes": [{"success": None}, {"success": False}]}, "model", path)  # one scored: goes on


# --- through the real CLI -----------------------------------------------------------------------------------------
def test_refusals_before_the_flow_starts_are_one_line(tmp_path):
    from tests.agentgym_replay import textcraft_app
    from envs.agentgym import textcraft_goals

    out = f"output_dir={tmp_path / 'runs'}"
    p = cli("run", "toy", "--set", "rollout.temperature=-1", cwd=tmp_path)
    assert_one_line(p, "rollout.temperature", 1)
    p = cli("run", "toy", "--set", out, "--set", f"env.url=http://127.0.0.1:{free_port()}", cwd=tmp_path)
    assert_one_line(p, "does not answer", 1)
    p = cli("run", "toy", "--dry-run", "--set", "model.path=/no/such/model", cwd=tmp_path)
    assert_one_line(p, "/no/such/model", 1)
    goals = list(textcraft_goals())
    goals[5] = "golden teapot"  # one goal missing, one extra
    with serve(textcraft_app(goals)) as url:
        p = cli("run", "textcraft", "--set", out, "--set", "env.dialect=agentgym", "--set", f"env.url={url}",
                cwd=tmp_path)
    line = assert_one_line(p, "goal set differs", 1)
    assert f"missing 1: {textcraft_goals()[5]!r}" in line and "extra 1: 'golden teapot'" in line


def test_refusals_from_inside_the_flows_are_one_line(tmp_path, tiny_model):
    """A run whose env fails every reset: the held-out evaluation before training has every episode masked, and the
    run stops with the env's reason (it used to die with KeyError: 'success_rate'). A run whose model is missing
    stops inside the flow as well."""
    base = ["--set", "rollout.backend=transformers", "--set", 'curriculum.phases=[{"turn_limit": 1, "steps": 1}]',
            "--set", "rollout.tasks_per_step=1", "--set", "rollout.samples_per_task=2", "--set", "eval.n=2",
            "--set", "rollout.max_new_tokens=4", "--set", "rollout.token_budget=512", "--set",
            f"output_dir={tmp_path / 'runs'}"]
    with serve(failing_agentgym_app()) as url:  # the two runs side by side, each with its own output folder
        p, nomodel = side_by_side(
            ("run", "babyai", "--run-name", "masked", *base, "--set", f"model.path={tiny_model}",
             "--set", "env.dialect=agentgym", "--set", f"env.url={url}"),
            ("run", "toy", "--run-name", "nomodel", *base, "--set", "model.path=/no/such/model",
             "--set", "eval.before=false", "--set", f"output_dir={tmp_path / 'runs-nomodel'}"),
            cwd=tmp_path, run=cli)
    line = assert_one_line(p, "every one of the 2 evaluation episodes", 14)
    assert "could not build the level" in line, line
    log = (tmp_path / "runs" / "masked" / "engine.log").read_text()
    assert "Traceback" in log and "Refusal" in log  # the traceback is in the run's log
    assert_one_line(nomodel, "model '/no/such/model' not found", 14)
    assert "Traceback" in (tmp_path / "runs-nomodel" / "nomodel" / "engine.log").read_text()
