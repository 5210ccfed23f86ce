"""``scalinginter`` command line: run a curriculum, evaluate a checkpoint, serve an environment."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

app = typer.Typer(help="ScalingInter: multi-turn agent RL with growing turn limits, as Prefect flows.",
                  no_args_is_help=True, add_completion=False)
env_app = typer.Typer(help="Environment servers.", no_args_is_help=True)
app.add_typer(env_app, name="env")


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def run(
    env: str = typer.Argument(..., help="Environment name (babyai)."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Preset: smoke, tiny, paper."),
    set_: list[str] = typer.Option([], "--set", "-s", help="Override a config value: key.path=value (repeatable)."),
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Run name; the same name resumes a run."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
):
    """Run a ScalingInter curriculum (e.g. `scalinginter run babyai --preset smoke`)."""
    from core.config import ConfigError, build_config
    from envs.base import env_names

    if env not in env_names():
        _fail(f"unknown environment {env!r}; available: {', '.join(env_names())}")
    overrides = list(set_) + ([f"run_name={run_name}"] if run_name else [])
    try:
        cfg = build_config(env, preset, overrides)
    except ConfigError as e:
        _fail(str(e))
    if print_config:
        typer.echo(cfg.model_dump_json(indent=2))
        return
    from flows.scalinginter import scalinginter

    summary = scalinginter(config=cfg)
    if summary is None:
        raise typer.Exit(1)


@app.command("eval")
def eval_(
    checkpoint: str = typer.Argument(..., help="Checkpoint URI (local dir or s3://...) or model ('smollm2-135m')."),
    env: str = typer.Argument(..., help="Environment name."),
    split: str = typer.Option("test", "--split", help="Task split: test (held-out) or train."),
    n: int = typer.Option(16, "--n", min=1, help="Number of tasks."),
    turn_limit: int = typer.Option(20, "--turn-limit", min=1, help="Max turns per episode."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the metrics as JSON here."),
    set_: list[str] = typer.Option([], "--set", "-s", help="Config override key.path=value (e.g. env options)."),
):
    """Score a checkpoint on held-out tasks with greedy decoding."""
    from core.config import ConfigError, build_config
    from envs.base import env_names

    if env not in env_names():
        _fail(f"unknown environment {env!r}; available: {', '.join(env_names())}")
    if split not in ("test", "train"):
        _fail(f"--split must be 'test' or 'train', got {split!r}")
    try:
        cfg = build_config(env, None, list(set_) + [f"rollout.max_new_tokens={max_new_tokens}"])
    except ConfigError as e:
        _fail(str(e))
    from flows.evaluate import run_eval

    try:
        metrics = run_eval(cfg, checkpoint, split=split, n=n, turn_limit=turn_limit)
    except FileNotFoundError as e:
        _fail(str(e))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{env} {split} split, n={n}, greedy, {turn_limit} turns")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in ("success_rate", "mean_reward", "mean_turns", "episodes", "masked_episodes"):
        table.add_row(k, f"{metrics[k]:.3f}" if isinstance(metrics[k], float) else str(metrics[k]))
    Console().print(table)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"checkpoint": checkpoint, "env": env, "split": split, "n": n,
                                         "turn_limit": turn_limit, **metrics}, indent=2))
        typer.echo(f"wrote {json_path}")


@env_app.command("serve")
def env_serve(
    env: str = typer.Argument(..., help="Environment name."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    option: list[str] = typer.Option([], "--option", "-o", help="Env constructor option key=value (repeatable)."),
    max_envs: int = typer.Option(256, "--max-envs"),
    idle_ttl: float = typer.Option(600.0, "--idle-ttl", help="Seconds before an idle env is reaped."),
):
    """Serve one environment over HTTP (AgentGym-style endpoints)."""
    from envs.base import env_names
    from envs.server import main as server_main

    if env not in env_names():
        _fail(f"unknown environment {env!r}; available: {', '.join(env_names())}")
    argv = ["--env", env, "--host", host, "--port", str(port), "--max-envs", str(max_envs),
            "--idle-ttl", str(idle_ttl)]
    for o in option:
        argv += ["--option", o]
    typer.echo(f"serving {env} on http://{host}:{port}")
    server_main(argv)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
