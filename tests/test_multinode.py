"""The DeepSpeed learner across nodes: two "nodes" on loopback, each a torchrun launcher with one rank, joined by
torchrun's c10d rendezvous at 127.0.0.1 (node 0 is the run's ``DeepSpeedRemoteLearner(nodes=2)``; node 1 is the
``python -m runtime.backends.deepspeed_learner join`` command another machine would run). Their update equals the
one-node two-rank update and the one-rank (``TorchLearner``) update within 1e-6.

Same tiny Llama, batch, SGD config and tolerance as ``tests/test_multirank.py`` (SGD: the step is linear in the
gradient, so a normalisation error shows in the weights).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_multirank import CASES, TOL, _batch, _cfg, _max_diff, _one_rank, tiny_model  # noqa: F401

HAS_DS = importlib.util.find_spec("deepspeed") is not None
pytestmark = pytest.mark.skipif(not HAS_DS, reason="deepspeed not installed")
ROOT = Path(__file__).resolve().parents[1]


def _sgd_config(d: Path) -> str:
    p = d / "sgd_zero2.json"
    p.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {}}, "zero_optimization": {"stage": 2},
                             "steps_per_print": 10**9}))
    return str(p)


def _update(learner, case: str, out: Path) -> dict:
    """prepare + update through the driver, then the weights the ranks hold (saved by rank 0)."""
    from runtime.backends.learner import load_causal_lm

    kw, old_for_reward = CASES[case]
    trajs, advs = _batch()
    prep = learner.prepare(trajs, old_for_reward)
    stats = learner.update(trajs, advs, prepared=prep)
    learner.save_weights(out)
    return {"stats": stats, "weights": load_causal_lm(str(out)).state_dict(), "prepared": prep}


def test_join_command_and_validation(monkeypatch):
    """The node command's torchrun line and the refusals (no secret, node 0 is the run's)."""
    from runtime.backends.deepspeed_learner import LEARNER_TOKEN_ENV, join, node_token, torchrun_command

    cmd = torchrun_command(2, 3, 1, "10.0.0.5", 29500)
    assert "--nnodes=3" in cmd and "--node_rank=1" in cmd and "--nproc_per_node=2" in cmd
    assert "--rdzv_backend=c10d" in cmd and "--rdzv_endpoint=10.0.0.5:29500" in cmd and "--rdzv_conf=is_host=0" in cmd
    assert "--rdzv_conf=is_host=1" in torchrun_command(2, 3, 0, "10.0.0.5", 29500)
    monkeypatch.delenv(LEARNER_TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=LEARNER_TOKEN_ENV):
        node_token()
    with pytest.raises(SystemExit):
        join(["--nodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"])

    from flows.config import ConfigError, build_config

    c = build_config("babyai", "tiny", ["learner.engine=deepspeed", "learner.nodes=2", "learner.master_addr=10.0.0.5",
                                        "rollout.backend=vllm"])
    assert c.learner.nodes == 2 and c.learner.master_port == 29500
    with pytest.raises(ConfigError, match="master_addr"):
        build_config("babyai", "tiny", ["learner.engine=deepspeed", "learner.nodes=2", "rollout.backend=vllm"])
    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        build_config("babyai", "tiny", ["learner.engine=deepspeed", "learner.nodes=2", "learner.master_addr=h",
                                        "rollout.backend=transformers"])


@pytest.mark.slow  # 3 DeepSpeed ranks in 2 torchrun launches + a 2-rank launch: minutes on a busy 2-core machine
def test_two_nodes_on_loopback_equal_one_node_and_one_rank(tiny_model, tmp_path, monkeypatch):
    from envs.spawn import free_port
    from runtime.backends.deepspeed_learner import LEARNER_TOKEN_ENV, DeepSpeedRemoteLearner

    case = "token_mean_one_step"
    kw, old_for_reward = CASES[case]
    ds_config = _sgd_config(tmp_path)
    monkeypatch.setenv(LEARNER_TOKEN_ENV, os.urandom(16).hex())
    port = free_port()  # the rendezvous; node 0's control connection listens on port + 1
    common = dict(zero_stage=2, config_path=ds_config, threads_per_rank=1, startup_timeout_s=600)

    # node 1: what another machine runs (started first: it waits at the rendezvous for node 0)
    log1 = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen([sys.executable, "-m", "runtime.backends.deepspeed_learner", "join", "--nodes", "2",
                              "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                              "--master-port", str(port), "--threads-per-rank", "1"],
                             cwd=str(ROOT), stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        two_nodes = DeepSpeedRemoteLearner(tiny_model, _cfg(kw), ranks=1, nodes=2, master_addr="127.0.0.1",
                                           master_port=port, log_path=str(tmp_path / "node0.log"), **common)
        try:
            got = _update(two_nodes, case, tmp_path / "two-nodes")
        finally:
            two_nodes.close()
        assert node1.wait(120) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        if node1.poll() is None:
            node1.kill()
        log1.close()

    one_node = DeepSpeedRemoteLearner(tiny_model, _cfg(kw), ranks=2, log_path=str(tmp_path / "one-node.log"),
                                      **common)
    try:
        two_ranks = _update(one_node, case, tmp_path / "one-node")
    finally:
        one_node.close()

    trajs, advs = _batch()
    _, stats, one_rank = _one_rank(tiny_model, kw, trajs, advs, old_for_reward)
    from runtime.backends.learner import load_causal_lm

    assert _max_diff(one_rank, load_causal_lm(tiny_model).state_dict()) > 1e-2  # the update moved the weights
    assert _max_diff(got["weights"], two_ranks["weights"]) < TOL
    assert _max_diff(got["weights"], one_rank) < TOL
    for k in ("loss", "pg_loss", "kl", "grad_norm"):
        assert got["stats"][k] == pytest.approx(stats[k], rel=1e-5, abs=1e-7), k
    assert got["stats"]["sequences_trained"] == 5.0 and got["stats"]["padded_for_sharding"] == 1.0
