"""Quiet console: library logging and a child process's output go to the run's engine.log, and it is undone."""

import logging
import os
import subprocess
import sys

from runtime.console import ENV_LOG, quiet_console, redirect_fds, restore_console


def test_library_logs_go_to_the_run_log_and_restore_undoes_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SCALINGINTER_VERBOSE", raising=False)
    lg = logging.getLogger("transformers.modeling_utils")
    console = logging.StreamHandler(sys.stderr)
    logging.getLogger("transformers").addHandler(console)
    try:
        before_env = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
        path = quiet_console(tmp_path)
        assert path == tmp_path.resolve() / "engine.log" and os.environ[ENV_LOG] == str(path)
        lg.warning("chatter from a library")
        assert "chatter from a library" in path.read_text()
        assert "chatter from a library" not in capsys.readouterr().err
        restore_console()
        assert os.environ.get(ENV_LOG) is None and os.environ.get("VLLM_LOGGING_CONFIG_PATH") == before_env
        lg.warning("after the run")
        assert "after the run" in capsys.readouterr().err and "after the run" not in path.read_text()
    finally:
        logging.getLogger("transformers").removeHandler(console)
        restore_console()


def test_verbose_keeps_the_console(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALINGINTER_VERBOSE", "1")
    assert quiet_console(tmp_path) is None and not (tmp_path / "engine.log").exists()


def test_a_child_started_inside_redirect_fds_writes_to_the_file(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with redirect_fds(str(log)):
        subprocess.run([sys.executable, "-c", "import sys; print('engine says hi'); "
                        "print('engine warns', file=sys.stderr)"], check=True)
    print("ours")
    out = capfd.readouterr()
    assert "engine says hi" in log.read_text() and "engine warns" in log.read_text()
    assert "engine says hi" not in out.out and "ours" in out.out
