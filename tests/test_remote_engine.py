"""Rollout engines on other hosts (``rollout.engine_urls``, ``runtime.backends.remote_engine``).

Fast tier: the pure parts on hand-written server replies (tokens and log-probs, prompt log-probs, the KV size from
the metrics, the server command), the config's checks and the ``--dry-run`` layout.

Slow tier (real servers, no mock): ``scalinginter engine-host`` started as its own process on loopback with the tiny
toy policy (tests/toypolicy.py) — a second "host" — joined to an engine the test starts in-process, as a run does:
- episodes split across the local and the remote engine, and a lock-step greedy rollout over both equals the
  one-engine result token for token (the per-episode pass too);
- after a weight sync (the local engine by shared memory, the remote one from a folder the learner wrote) both give
  the learner's log-probs on the same tokens within bf16 rounding and report the new weight version;
- killing the engine host's processes mid-rollout loses no episode: its turns in flight finish on the local engine;
- with an ``s3://`` sync_dir (moto's server on loopback) the weights reach the host through S3, checked by sha256;
- a sync folder the engine host cannot read is refused with the fix;
- ``scalinginter run toy`` with the host in ``rollout.engine_urls`` runs end to end.

Left out of CI's slow list (.ci/run), which is at its time budget: the file starts a vLLM server and an engine
(561 s at load average 4 on the 2-core machine; docs/guides/multi-engine.md has what it measured). CI runs the
fast tier's checks here and the two-engine loopback tests (tests/test_engine_set.py) the remote engine builds on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ROOT = Path(__file__).resolve().parents[1]

from tests.test_engine_set import LONG_WAITS, _capacity, _dtype, _rollout, _tokens  # noqa: E402 - the same rollouts


# -- pure parts ------------------------------------------------------------------------------------------------
def _reply(tokens, lps, finish="length"):
    return {"choices": [{"token_ids": tokens, "finish_reason": finish,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, lps)]}}]}


def test_generation_from_a_reply_keeps_tokens_and_logprobs_and_cuts_after_eos():
    from runtime.backends.remote_engine import generation_from_response

    g = generation_from_response(_reply([5, 6, 2, 9], [-0.5, -1.0, -0.25, -3.0]), eos_token_id=2)
    assert g.token_ids == [5, 6, 2] and g.logprobs == [-0.5, -1.0, -0.25] and g.finish == "stop"
    g = generation_from_response(_reply([5, 6], [-0.5, -1.0]), eos_token_id=2)
    assert g.token_ids == [5, 6] and g.finish == "length"
    assert generation_from_response(_reply([5], [-0.5], "stop"), eos_token_id=2).finish == "stop"


def test_a_reply_without_logprobs_or_with_another_tokens_logprob_is_refused():
    from runtime.backends.remote_engine import RemoteEngineError, generation_from_response

    with pytest.raises(RemoteEngineError, match="2 tokens"):
        generation_from_response({"choices": [{"token_ids": [5, 6], "logprobs": None}]}, 2)
    bad = _reply([5, 6], [-0.5, -1.0])
    bad["choices"][0]["logprobs"]["content"][1]["token_id"] = 7
    with pytest.raises(RemoteEngineError, match="token 7, not 6"):
        generation_from_response(bad, 2)
    with pytest.raises(RemoteEngineError, match="choices"):
        generation_from_response({"error": "x"}, 2)


def test_prompt_logprobs_from_a_reply():
    from runtime.backends.remote_engine import RemoteEngineError, prompt_logprobs_from_response

    body = {"prompt_logprobs": [None, {"8": {"logprob": -1.5, "rank": 3}}, {"9": {"logprob": -0.25, "rank": 1}}]}
    assert prompt_logprobs_from_response([7, 8, 9], body) == [0.0, -1.5, -0.25]
    with pytest.raises(RemoteEngineError, match="leave out token 9"):
        prompt_logprobs_from_response([7, 8, 9], {"prompt_logprobs": [None, {"8": {"logprob": -1.5}}, {"4": {}}]})
    with pytest.raises(RemoteEngineError, match="3-token"):
        prompt_logprobs_from_response([7, 8, 9], {"prompt_logprobs": None})


def test_kv_tokens_from_the_metrics_line():
    from runtime.backends.remote_engine import kv_tokens_from_metrics

    line = ('vllm:cache_config_info{block_size="128",cache_dtype="auto",kv_cache_layout="None",'
            'kv_cache_dtype_skip_layers="[a, b]",kv_cache_size_tokens="33550",num_gpu_blocks="327"} 1.0')
    assert kv_tokens_from_metrics("# HELP x\n" + line) == 327 * 128  # blocks x block size, as a local engine's
    only_tokens = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None",kv_cache_size_tokens="1600"} 1.0'
    assert kv_tokens_from_metrics(only_tokens) == 1600
    assert kv_tokens_from_metrics("vllm:num_requests_running 0") is None


def test_sampling_payload_matches_the_local_engines_settings():
    from runtime.backends.generation import SamplingParams
    from runtime.backends.remote_engine import sampling_payload

    p = sampling_payload(SamplingParams(12, 0.7, 0.9), eos_token_id=2, seed=5)
    assert (p["max_tokens"], p["temperature"], p["top_p"], p["seed"], p["logprobs"], p["stop_token_ids"]) == (
        12, 0.7, 0.9, 5, 0, [2])
    greedy = sampling_payload(SamplingParams(12, 0.0), eos_token_id=2, seed=5)
    assert greedy["temperature"] == 0.0 and "seed" not in greedy


def test_engine_host_command_and_its_refusals():
    from runtime.backends.remote_engine import engine_host_command

    cmd = engine_host_command("py", "/m", port=8200, max_model_len=1025, kv_cache_gb=0.5)
    for flag in ("--enable-scale-out", "--worker-extension-cls", "--no-enable-chunked-prefill"):
        assert flag in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(2**29)
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    gpu = engine_host_command("py", "/m", cpu=False, tensor_parallel_size=4)
    assert gpu[gpu.index("--tensor-parallel-size") + 1] == "4" and "--kv-cache-memory-bytes" not in gpu
    with pytest.raises(ValueError, match="CPU build"):
        engine_host_command("py", "/m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="port"):
        engine_host_command("py", "/m", port=70000)


def _cfg(*sets, backend: str = "vllm"):
    from flows.config import build_config

    return build_config("babyai", "smoke", [f"rollout.backend={backend}", *sets])


def test_engine_urls_config_checks():
    from core.config import ConfigError

    cfg = _cfg("rollout.engines=2", 'rollout.engine_urls=["http://gpu-b:8100"]')
    assert cfg.rollout.engine_urls == ["http://gpu-b:8100"]
    cases = [
        (['rollout.engine_urls=["http://gpu-b:8100"]'], "rollout.engines=2"),  # engines counts it: 1 is too few
        (["rollout.engines=2", 'rollout.engine_urls=["gpu-b:8100"]'], "http://HOST:PORT"),
        (["rollout.engines=3", 'rollout.engine_urls=["http://b:1","http://b:1/"]'], "twice"),
        (["rollout.engines=2", 'rollout.engine_urls=["http://b:1"]', "rollout.engine_sync=broadcast"], "folder"),
        (["rollout.engines=2", 'rollout.engine_urls=["http://b:1"]', 'rollout.engine_hosts=["b"]'], "one way"),
        (["rollout.engine_sync_dir=/shared"], "engine_sync=folder"),
        (["rollout.engine_sync=folder", "rollout.engine_sync_dir=s3://b/p"], "engine_urls"),
    ]
    for sets, msg in cases:
        with pytest.raises((ConfigError, ValueError), match=msg):
            _cfg(*sets)
    with pytest.raises((ConfigError, ValueError), match="backend=vllm"):
        _cfg("rollout.engines=2", 'rollout.engine_urls=["http://b:1"]', backend="transformers")


class _FakeLLM:
    def __init__(self, log):
        self.log = log

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        self.log.append((method, args))
        return [None]

    def reset_prefix_cache(self):
        return None


class _FakeEngine:
    """Stands in for a local engine or an engine host in the set's hand-over logic (no vLLM, no HTTP): it records
    what it was asked to load and what each load's folder held at that moment."""

    eos_token_id, max_model_len, dtype, start_time_s, asleep = 2, 100, "bfloat16", 0.0, False

    def __init__(self, remote):
        self.remote, self.rpc, self.loaded, self.probes = remote, [], [], []
        self._llm = _FakeLLM(self.rpc)

    def healthy(self):
        return True

    def load_weights(self, path):
        p = Path(str(path))
        self.loaded.append((str(path), sorted(x.name for x in p.iterdir()) if p.is_dir() else None))

    def check_reads(self, probe, sync_dir):
        self.probes.append((probe, sync_dir, Path(probe).exists() if not probe.startswith("s3://") else None))

    def _wake_for_load(self):
        return None

    def wake(self, tags=None):
        return None


class _FakeStore:
    def __init__(self):
        self.put_calls, self.deleted = [], []

    def put(self, folder, base_uri, name=None):
        uri = f"{base_uri}/{name or 'weights-1'}"
        self.put_calls.append((sorted(x.name for x in Path(folder).iterdir()), uri))
        return uri

    def delete(self, uri):
        self.deleted.append(uri)


def test_engine_set_hands_a_folder_to_remote_engines_through_the_shared_dir(tmp_path):
    """A folder outside the shared sync dir is copied into it for the remote engine (the local one loads it where it
    is), the copy removed after the load; the join's probe is a file written into the shared dir."""
    from runtime.backends.engine_set import EngineSet

    local, remote = _FakeEngine(False), _FakeEngine(True)
    shared = tmp_path / "shared"
    es = EngineSet([local, remote], [100, 100], "folder", sync_dir=shared)
    assert [m for m, _ in local.rpc] == ["set_weight_version"] and remote.rpc == []  # the remote waits for its join
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    (model / "config.json").write_text("{}")
    es.join_remote(model)
    probe, where, existed = remote.probes[0]
    assert Path(probe).parent.parent == shared and where == str(shared) and existed
    assert local.loaded == [] and len(remote.loaded) == 1
    path, names = remote.loaded[0]
    assert Path(path).parent == shared and names == ["config.json", "model.safetensors"]
    assert ("set_weight_version", (0,)) in remote.rpc
    assert list(shared.iterdir()) == [], "the probe and the copy are removed"
    es._load_dir([0, 1], model, 3)
    assert local.loaded[-1] == (str(model), ["config.json", "model.safetensors"])
    assert Path(remote.loaded[-1][0]).parent == shared and list(shared.iterdir()) == []


def test_engine_set_hands_a_folder_to_remote_engines_through_s3(tmp_path):
    """With an s3:// sync dir the folder is stored once (the store's put), the remote engine loads the URI, the
    stored folder is deleted after; the join's probe is stored and deleted too. No store: refused."""
    from runtime.backends.engine_set import EngineSet

    local, remote = _FakeEngine(False), _FakeEngine(True)
    with pytest.raises(ValueError, match="weight store"):
        EngineSet([local, remote], [100, 100], "memory", sync_dir="s3://b/p")
    store = _FakeStore()
    es = EngineSet([local, remote], [100, 100], "memory", sync_dir="s3://b/p", weight_store=store)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    es.join_remote(model)
    assert remote.probes[0][0].startswith("s3://b/p/probe-") and store.put_calls[0][0] == ["probe.txt"]
    assert remote.loaded == [("s3://b/p/weights-1", None)] and store.put_calls[1] == (["model.safetensors"],
                                                                                      "s3://b/p/weights-1")
    assert store.deleted == [store.put_calls[0][1], "s3://b/p/weights-1"]


def test_engine_urls_are_where_an_engine_runs_not_what_is_trained():
    from core.fingerprint import OPERATIONAL_KEYS

    assert {"rollout.engine_urls", "rollout.engine_sync_dir"} <= OPERATIONAL_KEYS


def test_dry_run_lays_out_joined_engines():
    from core.engines import LOCAL, EngineHost
    from flows.dryrun import dry_run

    cfg = _cfg("rollout.engines=3", 'rollout.engine_urls=["http://gpu-b:8100"]', "rollout.engine_sync_dir=/shared")
    plan = dry_run(cfg, local_host=EngineHost(LOCAL, 0, 4))
    line = next(x for x in plan.lines if x.startswith("rollout engines"))
    assert "2 on CPUs + 1 on other hosts" in line and "2: http://gpu-b:8100 (joined)" in line and "/shared" in line
    assert not [e for e in plan.errors if "engine" in e]


@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_engine_host_dry_run_prints_the_server_command(tmp_path):
    from tests.clirun import cli

    r = cli("engine-host", "--model", str(tmp_path), "--port", "8200", "--max-model-len", "1025", "--dry-run",
            cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vllm.entrypoints.openai.api_server" in r.stdout and "--port 8200" in r.stdout
    r = cli("engine-host", "--model", str(tmp_path), "--port", "0", "--dry-run", cwd=tmp_path)
    assert r.returncode != 0 and "TCP port" in r.stderr


# -- a real engine host on loopback (slow) -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def _s3(env):
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    """An S3 endpoint on loopback (moto's server) with one bucket, and the AWS settings both "hosts" use."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    none = str(tmp_path_factory.mktemp("aws") / "none")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret-value",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": none, "AWS_SHARED_CREDENTIALS_FILE": none}
    _s3(env).create_bucket(Bucket="sync")
    yield env
    server.stop()


@pytest.fixture(scope="module")
def host_and_local(toy_policy, s3_env):
    """``scalinginter engine-host`` on loopback (its own process group, the second core) and a local engine on the
    first core, as a run with ``rollout.engines=2`` and one ``rollout.engine_urls`` entry has them."""
    import httpx
    from transformers import AutoTokenizer

    from runtime.backends import vllm_backend as vb
    from runtime.console import restore_env

    if not vb.is_cpu_build():
        pytest.skip("the CPU build's loopback test")
    tok = AutoTokenizer.from_pretrained(toy_policy)
    port = _free_port()
    cores = len(os.sched_getaffinity(0))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **LONG_WAITS, **s3_env,
           "PYTHONPATH": str(ROOT)}
    log = open(Path(toy_policy).parent / "engine-host.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "engine-host", "--model", str(toy_policy), "--host",
                             "127.0.0.1", "--port", str(port), "--max-model-len", "513", "--kv-cache-gb", "0.02",
                             "--threads", "1", "--cores", str(1 % cores), "--dtype", _dtype()],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in LONG_WAITS}
    os.environ.update({k: saved[k] or v for k, v in LONG_WAITS.items()})
    local = None
    try:
        local = vb.VLLMBackend(str(toy_policy), tok.eos_token_id, dtype=_dtype(), max_model_len=513,
                               kv_cache_gb=0.02, in_process=False, threads=1, cpu_cores="0")
        t0 = time.time()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() - t0 > 1200:
                log.flush()
                pytest.fail("the engine host did not come up: " + Path(log.name).read_text()[-2000:])
            time.sleep(2)
        yield tok, local, url, proc
    finally:
        if local is not None:
            local.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        log.close()
        restore_env(saved)








def _joined(local, url, tok, toy_policy, sync_dir, **kw):
    """The set a run builds: the local engine, the remote one joined (the run's weights loaded into it)."""
    from runtime.backends.engine_set import EngineSet
    from runtime.backends.remote_engine import RemoteEngine

    from runtime.backends.engine_set import engine_kv_tokens

    remote = RemoteEngine(url, tok.eos_token_id, dtype=local.dtype)
    cap = engine_kv_tokens(local, _capacity(toy_policy, local))
    assert remote.kv_tokens == cap, "the same KV budget on both hosts: the same room"
    es = EngineSet([local, remote], [cap, remote.kv_tokens], sync_dir=sync_dir, **kw)
    es.join_remote(toy_policy)
    return es


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_episodes_split_across_a_local_and_a_remote_engine_and_greedy_equals_one_engine(host_and_local, toy_policy,
                                                                                        tmp_path):
    from runtime.backends.engine_set import EngineSet

    tok, local, url, _ = host_and_local
    cap = _capacity(toy_policy, local)
    ref, _ = _rollout(EngineSet([local], [cap]), tok, 8, async_episodes=False)
    two = _joined(local, url, tok, toy_policy, tmp_path)
    assert two.weight_versions() == [0, 0]
    got, _ = _rollout(two, tok, 8, async_episodes=False)
    turns = sum(t.turns for t in got)
    print(f"\nlock-step greedy, 8 episodes ({turns} turns): episodes per engine {two.first_turns}, turns per engine "
          f"{two.routed}")
    assert _tokens(got) == _tokens(ref), "a local and a remote engine must give the one-engine rollout"
    assert min(two.first_turns) >= 2 and sum(two.routed) == turns
    two_async = _joined(local, url, tok, toy_policy, tmp_path)
    got_async, st = _rollout(two_async, tok, 8, async_episodes=True)
    two_async._close_active()
    print(f"per-episode greedy: episodes per engine {two_async.first_turns}, turns {two_async.routed}")
    assert st.async_episodes and _tokens(got_async) == _tokens(ref)
    assert min(two_async.first_turns) >= 2 and sum(two_async.first_turns) == 8


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_after_a_sync_the_remote_engine_gives_the_learners_logprobs(host_and_local, toy_policy, tmp_path):
    import torch

    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.vllm_backend import export_fn, named_weights_fn

    tok, local, url, _ = host_and_local
    torch.manual_seed(0)
    learner = TorchLearner(str(toy_policy), LearnerConfig(lr=1e-2, kl_coef=0.0, micro_batch_size=4,
                                                          bf16_autocast=False, temperature=1.0))
    es = _joined(local, url, tok, toy_policy, tmp_path / "sync", named_weights=named_weights_fn(learner),
                 export_weights=export_fn(learner))
    trajs, _ = _rollout(es, tok, 8, async_episodes=True, temperature=1.0)
    seq = list(trajs[0].token_ids)
    before = [es.prompt_logprobs([seq], engine=i)[0] for i in (0, 1)]
    advs = [[(1.0 if i % 2 else -1.0) * m for m in t.loss_mask] for i, t in enumerate(trajs)]
    learner.update(trajs, advs, prepared=learner.prepare(trajs, old_for_reward=True))
    want = learner.sequence_logprobs([seq])[0]
    stale = max(abs(a - b) for a, b in zip(before[1][1:], want[1:]))
    es.sync_weights()  # the local engine through shared memory, the remote one from a folder in the sync dir
    assert es.weight_versions() == [1, 1]
    assert not list((tmp_path / "sync").iterdir()), "the sync folder is removed once the engines loaded it"
    after = [es.prompt_logprobs([seq], engine=i)[0] for i in (0, 1)]
    d = [[abs(a - b) for a, b in zip(after[i][1:], want[1:])] for i in (0, 1)]
    between = max(abs(a - b) for a, b in zip(after[0][1:], after[1][1:]))
    print(f"\n{len(seq)} tokens, {_dtype()} engines: learner vs local max {max(d[0]):.2e} mean "
          f"{sum(d[0]) / len(d[0]):.2e}, remote max {max(d[1]):.2e} mean {sum(d[1]) / len(d[1]):.2e}; local vs remote "
          f"max {between:.2e}; remote before the sync {stale:.2e}")
    assert between < 1e-4, "the same weights must score the same tokens the same on both hosts"
    bf16 = _dtype() == "bfloat16"
    for di in d:
        assert max(di) < (0.25 if bf16 else 1e-3) and sum(di) / len(di) < (0.05 if bf16 else 1e-4)
    assert stale > 3 * max(sum(di) / len(di) for di in d), "the update must move the log-probs more than rounding"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_weights_reach_the_remote_engine_through_s3(host_and_local, toy_policy, s3_env, monkeypatch):
    """``rollout.engine_sync_dir=s3://...``: hosts without a shared mount. The learner's folder is stored under the
    URI (manifest last), the host's worker downloads it, checks every file's sha256 and reloads; the stored folder is
    deleted after the load."""
    import torch

    from runtime.backends.learner import LearnerConfig, TorchLearner
    from runtime.backends.vllm_backend import export_fn
    from storage.engine_weights import StoreHandover

    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    tok, local, url, _ = host_and_local
    torch.manual_seed(1)
    learner = TorchLearner(str(toy_policy), LearnerConfig(lr=1e-2, kl_coef=0.0, micro_batch_size=4,
                                                          bf16_autocast=False, temperature=1.0))
    es = _joined(local, url, tok, toy_policy, "s3://sync/run-a", export_weights=export_fn(learner),
                 weight_store=StoreHandover())
    trajs, _ = _rollout(es, tok, 4, async_episodes=False, temperature=1.0)
    seq = list(trajs[0].token_ids)
    advs = [[(1.0 if i % 2 else -1.0) * m for m in t.loss_mask] for i, t in enumerate(trajs)]
    learner.update(trajs, advs, prepared=learner.prepare(trajs, old_for_reward=True))
    want = learner.sequence_logprobs([seq])[0]
    t0 = time.time()
    es.sync_weights()  # both from the exported folder: the local engine from disk, the host through S3
    secs = time.time() - t0
    assert es.weight_versions() == [1, 1]
    after = [es.prompt_logprobs([seq], engine=i)[0] for i in (0, 1)]
    between = max(abs(a - b) for a, b in zip(after[0][1:], after[1][1:]))
    d = [abs(a - b) for a, b in zip(after[1][1:], want[1:])]
    print(f"\nsync through S3 in {secs:.1f} s: local vs remote max {between:.2e}, learner vs remote max {max(d):.2e} "
          f"mean {sum(d) / len(d):.2e}")
    assert between < 1e-4
    assert max(d) < (0.25 if _dtype() == "bfloat16" else 1e-3)
    s3 = _s3(s3_env)
    assert s3.list_objects_v2(Bucket="sync", Prefix="run-a/").get("KeyCount", 0) == 0, "stored weights deleted"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_a_sync_folder_the_host_cannot_read_is_refused(host_and_local, toy_policy, tmp_path):
    from runtime.backends.remote_engine import RemoteEngine, RemoteEngineError

    tok, local, url, _ = host_and_local
    remote = RemoteEngine(url, tok.eos_token_id)
    # on loopback the host reads every folder: it is asked about a probe that is not there, as a host without the
    # mount would be, and its worker's real answer decides
    with pytest.raises(RemoteEngineError, match="engine_sync_dir"):
        remote.check_reads(str(tmp_path / "not-mounted-there" / "probe.txt"), str(tmp_path / "not-mounted-there"))
    with pytest.raises(RemoteEngineError, match="AWS settings"):
        remote.check_reads("s3://sync/no-such-probe", "s3://sync")
    remote.check_reads(str(toy_policy / "config.json"), str(toy_policy))  # one it does see
    remote.close()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_toy_run_with_a_joined_engine_host(host_and_local, toy_policy, tmp_path, s3_env):
    """``scalinginter run toy --set rollout.engines=2 --set rollout.engine_urls=[the host]`` with the weights handed
    over through S3 (``rollout.engine_sync_dir=s3://...``): the toy preset's three steps end to end, one engine
    started by the run and the engine host joined, each update's weights reaching the host through the bucket."""
    from tests.toypolicy import toy_run_cmd

    _, _, url, _ = host_and_local
    cmd = toy_run_cmd(tmp_path, toy_policy, "joined", ["rollout.backend=vllm", "rollout.engines=2",
                                                        f'rollout.engine_urls=["{url}"]',
                                                        "rollout.engine_sync_dir=s3://sync/toy-run",
                                                        "rollout.samples_per_task=4"])
    t0 = time.time()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **LONG_WAITS, **s3_env,
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    print(f"\ntoy run, one local engine + the engine host, weights through S3: {time.time() - t0:.0f} s")
    assert p.returncode == 0, out[-4000:]
    assert "vLLM: 2 rollout engines (cores " in out and url in out
    rows = [json.loads(x) for x in (tmp_path / "joined" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 3 and all("train/weight_sync_s" in r for r in rows)
    s3 = _s3(s3_env)
    assert s3.list_objects_v2(Bucket="sync", Prefix="toy-run/").get("KeyCount", 0) == 0, "stored weights deleted"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_killing_the_engine_host_mid_rollout_loses_no_episode(host_and_local, toy_policy, tmp_path):
    """Runs last in this module: it kills the engine host (the fixture's teardown finds it gone)."""
    from envs.sessions import LocalEpisode
    from envs.toy import ToyEnv

    tok, local, url, proc = host_and_local
    es = _joined(local, url, tok, toy_policy, tmp_path)
    killed = []

    class KillAtFirstStep(LocalEpisode):  # the first env step while the remote engine has turns in flight kills it
        async def step(self, reply_text):
            if not killed and es.live[1] > 0:
                killed.append(proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)
            return await super().step(reply_text)

    trajs, st = _rollout(es, tok, 16, async_episodes=True, temperature=1.0, turn_limit=3,
                         make=lambda i: KillAtFirstStep(ToyEnv()), max_new_tokens=24)
    print(f"\nkilled the engine host (process group {killed[0]}) at the first env step: {es.resubmitted} turns in "
          f"flight there went to the local engine; requests per engine {es.routed}")
    assert killed and es.alive == [True, False]
    assert len(trajs) == 16 and all(t.finish_reason not in ("env_error", None) for t in trajs)
    assert st.retried_episodes == 0
    assert es.resubmitted >= 1, "the remote engine had turns in flight when it died"
