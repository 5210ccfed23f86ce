"""Trajectory viewer (`scalinginter view`).

- core.trajview: hand-computed cases (turn segments, finish labels, filters, paging, phase ranges, the chart).
- The pages over rollout files written by the real writer (and one in the old, pre-viewer layout), in process.
- Done-when: a tiny run trained here, the viewer served by the CLI, Debian's Chromium clicking run -> step ->
  episode; the turns shown equal the stored trajectory; the token view; a screenshot; 404 pages.
  (SCALINGINTER_VIEWER_SCREENSHOT=path also writes the screenshot there: docs/viewer-episode.png is made so.)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core import trajview as V
from core.metrics import DIAGNOSTICS
from core.trajectory import Trajectory
from tests.clirun import cli as _cli

CHROMIUM = "/usr/bin/chromium"


# --- core.trajview -----------------------------------------------------------------------------------------
def test_finish_labels():
    assert V.finish_label("success") == "terminated" and V.finish_label("failure") == "terminated"
    assert V.finish_label("turn_limit") == "turn limit" and V.finish_label("token_budget") == "token budget"
    assert V.finish_label("env_error") == "masked" and V.finish_label("failure", masked=True) == "masked"
    assert V.finish_label("failure", env_truncated=True) == "env limit"
    assert V.finish_label("") == "-" and V.finish_label(None) == "-"


def test_token_segments_prompt_actions_env():
    #        prompt  a0   env  a1
    mask = [0, 0, 0, 1, 1, 0, 0, 1]
    assert V.policy_runs(mask) == [(3, 5), (7, 8)]
    segs = V.token_segments(mask, [4, 7])
    assert [(s.kind, s.turn, s.start, s.end) for s in segs] == [
        ("prompt", 0, 0, 3), ("action", 0, 3, 5), ("env", 0, 5, 7), ("action", 1, 7, 8)]
    # two action turns with no env tokens between them are told apart by action_ends only
    segs = V.token_segments([0, 1, 1, 1, 1], [2, 4])
    assert [(s.kind, s.start, s.end) for s in segs] == [("prompt", 0, 1), ("action", 1, 3), ("action", 3, 5)]
    assert [(s.kind, s.start, s.end) for s in V.token_segments([0, 1, 1, 1, 1])] == [("prompt", 0, 1), ("action", 1, 5)]
    assert V.token_segments([]) == []


def test_action_span_and_conversation():
    reply = "Go to the ball. Action: Go To Red Ball 1"
    assert V.action_span(reply, "go to red ball 1") == (24, 40)
    assert V.action_span("go left, go left", "go left") == (9, 16)  # the last occurrence
    assert V.action_span("hello", "pick up") is None and V.action_span("x", None) is None
    turns = V.conversation("start", ["r1", "r2"], ["o1"], [0.0, 1.0], ["a1", None], [False, True])
    assert [(t.index, t.seen, t.reply, t.action, t.invalid, t.reward, t.observation_after) for t in turns] == [
        (1, "start", "r1", "a1", False, 0.0, "o1"), (2, "o1", "r2", None, True, 1.0, None)]
    old = V.conversation(None, None, None, [0.5], turns=1)  # an old file: rewards only
    assert len(old) == 1 and old[0].reply is None and old[0].reward == 0.5


def test_select_and_page():
    rows = [{"index": 0, "task_id": 7, "reward": 1.0, "success": True, "finish": "terminated", "category": "A"},
            {"index": 1, "task_id": 7, "reward": 0.0, "success": False, "finish": "turn limit", "category": "B"},
            {"index": 2, "task_id": 8, "reward": 0.0, "success": False, "finish": "masked", "category": None},
            {"index": 3, "task_id": 8, "reward": 0.5, "success": False, "finish": "terminated", "category": "A"}]
    ix = lambda rs: [r["index"] for r in rs]  # noqa: E731
    assert ix(V.select_episodes(rows, failed=True)) == [1, 3]  # masked episodes are not failures
    assert ix(V.select_episodes(rows, truncated=True)) == [1]
    assert ix(V.select_episodes(rows, task=8)) == [2, 3]
    assert ix(V.select_episodes(rows, category="A", sort="reward")) == [3, 0]
    assert ix(V.select_episodes(rows, sort="reward", desc=True)) == [0, 3, 2, 1]  # ties keep index order, reversed
    assert ix(V.select_episodes(rows, sort="category")) == [0, 3, 1, 2]  # missing values last
    with pytest.raises(ValueError, match="unknown sort key"):
        V.select_episodes(rows, sort="nope")
    assert V.page_of(1000, 1, 50) == (0, 50, 20)
    assert V.page_of(1000, 20, 50) == (950, 1000, 20)
    assert V.page_of(1000, 99, 50) == (950, 1000, 20)  # clamped
    assert V.page_of(0, 1, 50) == (0, 0, 1)


def test_phase_ranges_and_chart():
    metrics = [{"global_step": 1, "phase": 1, "turn_limit": 2.0}, {"global_step": 2, "phase": 1, "turn_limit": 2.0},
               {"global_step": 3, "phase": 2, "turn_limit": 4.0}, {"global_step": 3, "phase": 2, "turn_limit": 4.0}]
    assert V.phase_ranges(metrics) == [V.PhaseRange(1, 1, 2, 2), V.PhaseRange(2, 3, 3, 4)]
    assert V.planned_phase_ranges([(2, 2), (4, 3)]) == [V.PhaseRange(1, 1, 2, 2), V.PhaseRange(2, 3, 5, 4)]
    svg = V.svg_chart("success", [(1, 0.0), (3, 1.0)], V.phase_ranges(metrics), width=244, height=148,
                      y_range=(0, 1))
    # plot area: x from 44 to 234 (w 190) over steps 1..3; y from 22 to 122 (h 100) over 0..1
    assert '<circle cx="44.0" cy="122.0"' in svg and '<circle cx="234.0" cy="22.0"' in svg
    assert 'x1="186.5" x2="186.5"' in svg  # the phase-2 boundary half a step before step 3
    assert "phase 2: \u22644 turns" in svg and "phase 1: \u22642 turns" in svg
    assert V.advantage_color(0.5, 1.0) == "rgba(22,163,74,0.50)"
    assert V.advantage_color(-3, 1.0) == "rgba(220,38,38,1.00)"
    assert V.advantage_color(None, 1.0) == "transparent" and V.advantage_color(0.0, 1.0) == "transparent"
    assert V.viewer_url("my run/1") == "http://127.0.0.1:8765/runs/my%20run%2F1"


def test_phase_artifact_links_the_viewer():
    from tasks.artifacts import phase_markdown

    md = phase_markdown("run-a", 1, 2, 4, 3, 3, 3, {"success_rate": 0.5}, "/ckpt", "abc")
    assert "http://127.0.0.1:8765/runs/run-a" in md


# --- pages over written files ---------------------------------------------------------------------------------
def _traj(task: int, k: int, turns: int, success: bool, category: str | None = "GoToObj") -> Trajectory:
    t = Trajectory(task_id=task, group_id=task)
    t.start([1, 2, 3])
    replies, obs = [], []
    for j in range(turns):
        t.add_action([10 + j, 11 + j], [-0.5, -0.25])
        replies.append(f"<think> & {k}.{j}\n</think> Action: go to red ball {j}")
        obs.append(f"obs {k}.{j} <b>")
        t.set_turn_reward(1.0 if success and j == turns - 1 else 0.0)
        if j < turns - 1:
            t.add_env([5, 6])
    t.finish("success" if success else "turn_limit", success)
    t.first_observation, t.replies, t.observations = f"\nfirst {k}", replies, obs
    t.actions = [f"go to red ball {j}" for j in range(turns)]
    t.invalid_actions, t.turn_limit = [j == 0 and not success for j in range(turns)], turns
    if category:
        t.category = category
    return t


@pytest.fixture()
def runs(tmp_path):
    from tasks.steps import write_rollout_parquet

    run = tmp_path / "r1"
    trajs = [_traj(100 + i // 2, i, 1 + i % 3, i % 4 == 0, None if i == 1 else "GoToObj") for i in range(120)]
    adv = [[0.5 * m for m in t.loss_mask] for t in trajs]  # what the update used, per token
    write_rollout_parquet(trajs[:60], run / "rollouts" / "step-000001.parquet", 1, 0, advantages=adv[:60])
    write_rollout_parquet(trajs[60:], run / "rollouts" / "step-000003.parquet", 2, 2, advantages=adv[60:])
    (run / "config.json").write_text(json.dumps({"env": {"name": "babyai"}, "model": {"path": "/nonexistent/model"},
                                                 "algo": {"estimator": "grpo"}, "output_dir": str(tmp_path),
                                                 "curriculum": {"phases": [{"turn_limit": 2, "steps": 2},
                                                                           {"turn_limit": 3, "steps": 1}]}}))
    with open(run / "metrics.jsonl", "w") as fh:
        for s, ph, tl in ((1, 1, 2), (2, 1, 2), (3, 2, 3)):
            fh.write(json.dumps({"global_step": s, "phase": ph, "turn_limit": float(tl), "episodes": 60.0,
                                 "success_rate": 0.25, "mean_reward": 0.25, "mean_turns": 2.0,
                                 "train/entropy": 1.5 - 0.1 * s, "diag/invalid_action_rate": 0.1 * s}) + "\n")
    # an older run: the rollout layout before the viewer's columns
    old = tmp_path / "old"
    (old / "rollouts").mkdir(parents=True)
    pq.write_table(pa.table({"task_id": [5, 6], "group_id": [0, 1], "turns": [1, 1], "token_ids": [[1, 2, 3], [1, 4]],
                             "loss_mask": [[0, 1, 1], [0, 1]], "logprobs": [[0.0, -1.0, -1.0], [0.0, -2.0]],
                             "turn_rewards": [[1.0], [0.0]], "finish_reason": ["success", "failure"],
                             "success": [True, False], "masked": [False, False], "phase": [1, 1], "step": [0, 0]}),
                   old / "rollouts" / "step-000001.parquet")
    return tmp_path, trajs


@pytest.fixture()
def client(runs):
    from fastapi.testclient import TestClient

    from flows.viewer.app import create_app

    return TestClient(create_app(runs[0], tracking_uri=None), raise_server_exceptions=False)


def test_pages_show_runs_steps_and_paging(client):
    r = client.get("/")
    assert r.status_code == 200 and 'href="/runs/r1"' in r.text and 'href="/runs/old"' in r.text
    assert "grpo" in r.text and "2 → 3 turns" in r.text
    r = client.get("/runs/r1")
    assert r.status_code == 200 and r.text.count("<svg") == 5 and "phase 2: \u22643 turns" in r.text
    assert "Stability diagnostics" in r.text and "policy entropy" in r.text and "invalid actions" in r.text
    assert 'href="/runs/r1/steps/1"' in r.text and "no rollout file" in r.text  # step 2 has metrics only
    r = client.get("/runs/r1/steps/1")
    assert r.status_code == 200 and "page 1 of 2" in r.text and r.text.count('class="episode-link"') == 50
    r = client.get("/runs/r1/steps/1?page=2")
    assert r.text.count('class="episode-link"') == 10 and 'data-index="59"' in r.text
    r = client.get("/runs/r1/steps/1?failed=1&sort=reward&desc=1")
    shown = [int(x.split('"')[0]) for x in r.text.split('data-index="')[1:]]
    assert shown and all(not (i % 4 == 0) for i in shown)  # episodes 0, 4, 8, ... succeeded
    r = client.get("/runs/r1/steps/1?truncated=1&task=100")
    assert [int(x.split('"')[0]) for x in r.text.split('data-index="')[1:]] == [1]  # task 100: 0 succeeded


def test_episode_page_is_the_stored_trajectory(client, runs):
    _, trajs = runs
    r = client.get("/runs/r1/steps/3/episodes/5")  # step 3 holds trajs[60:]
    t = trajs[65]
    assert r.status_code == 200
    from html import escape

    for j, reply in enumerate(t.replies):
        act = t.actions[j]
        i = reply.rfind(act)
        assert escape(reply[:i]) + f'<mark class="action">{escape(act)}</mark>' in r.text
        assert f'data-reward="{t.turn_rewards[j]!r}"' in r.text
    assert escape(t.observations[0]) in r.text and "category</dt><dd>GoToObj" in r.text
    assert 'class="badge invalid"' in r.text  # turn 1 of a failed episode is flagged in this data
    r = client.get("/runs/r1/steps/1/episodes/1")
    assert "category</dt><dd>-" in r.text  # no category: '-'
    # token view without a loadable tokenizer: ids, mask and advantage colours still shown
    r = client.get("/runs/r1/steps/3/episodes/5/tokens")
    assert r.status_code == 200 and "could not be loaded" in r.text
    assert r.text.count('class="tok pol"') == sum(t.loss_mask) and r.text.count('class="tok ') == len(t.token_ids)
    assert "rgba(22,163,74,1.00)" in r.text
    r = client.get("/runs/r1/tasks/100")
    assert r.status_code == 200 and r.text.count('class="col"') == 1  # task 100 ran in phase 1 only
    r = client.get("/runs/r1/tasks/130")  # trajs[60:] start at task 130: phase 2
    assert r.status_code == 200 and "phase 2 · step 3" in r.text


def test_old_rollout_files_still_open(client):
    r = client.get("/runs/old/steps/1")
    assert r.status_code == 200 and r.text.count('class="episode-link"') == 2
    r = client.get("/runs/old/steps/1/episodes/0")
    assert r.status_code == 200 and "predates the viewer" in r.text and 'data-reward="1.0"' in r.text
    r = client.get("/runs/old/steps/1/episodes/0/tokens")
    assert r.status_code == 200 and "stores no advantages" in r.text and r.text.count('class="tok pol"') == 2


def test_not_found_pages_say_what_exists(client, runs):
    r = client.get("/runs/nope")
    assert r.status_code == 404 and "No run named" in r.text and 'href="/runs/r1"' in r.text
    r = client.get("/runs/r1/steps/9")
    assert r.status_code == 404 and "has no step 9" in r.text and 'href="/runs/r1/steps/3"' in r.text
    r = client.get("/runs/r1/steps/2")  # logged in metrics.jsonl, no rollout file
    assert r.status_code == 404 and "the rollout file is missing" in r.text and "step-000002.parquet" in r.text
    r = client.get("/runs/r1/steps/1/episodes/60")
    assert r.status_code == 404 and "episodes 0 to 59" in r.text
    r = client.get("/runs/r1/steps/x")
    assert r.status_code == 404 and "integers" in r.text
    assert client.get("/nowhere").status_code == 404
    (runs[0] / "r1" / "rollouts" / "step-000003.parquet").write_bytes(b"not parquet")
    r = client.get("/runs/r1/steps/3")
    assert r.status_code == 500 and "could not be read" in r.text and "Traceback" not in r.text


def test_eval_pages(client, runs):
    from core.evalreport import Outcome, build_document, model_report

    tmp, _ = runs
    ids = [1_000_000, 1_000_001]
    outs = [Outcome(t, b, k, (t + k) % 2 == 0, 1.0 if (t + k) % 2 == 0 else 0.0, 2, "GoToObj",
                    required_turns=1 if t == ids[0] else 5)
            for b in (2, 4) for t in ids for k in range(2)]
    meta = {"header": "babyai test split", "env": "babyai", "split": "test", "task_ids": ids, "n_tasks": 2,
            "temperature": 1.0, "greedy": False, "max_new_tokens": 8, "token_budget": 256, "backend": "x",
            "env_options": {}, "env_options_source": "defaults"}
    doc = build_document(meta, {"model": ("ckpt", model_report(outs, ids, [2, 4], 2, 0.95, 0))}, 2, [2, 4], 0.95, 0)
    (tmp / "evals").mkdir()
    (tmp / "evals" / "sweep.json").write_text(json.dumps(doc))
    (tmp / "r1" / "eval_after.json").write_text(json.dumps({"success_rate": 0.5, "mean_reward": 0.5,
                                                             "mean_turns": 1.5, "episodes": 2}))
    r = client.get("/evals")
    assert r.status_code == 200 and 'href="/evals/sweep"' in r.text and 'href="/evals/r1.eval_after"' in r.text
    r = client.get("/evals/sweep")
    assert r.status_code == 200 and "Avg@2" in r.text and "per task at turn budget 4" in r.text
    assert "4 · needs 1 turn<" in r.text and "4 · needs 4-6 turns<" in r.text  # the required-turns buckets
    assert "✓ ✗" in r.text or "✗ ✓" in r.text
    assert "0.500" in client.get("/runs/r1").text  # held-out after, linked to its eval page
    r = client.get("/evals/none")
    assert r.status_code == 404 and 'href="/evals/sweep"' in r.text


# --- done when: a trained run in a real browser -----------------------------------------------------------------
RUN = "e2e"  # the session's tiny run (conftest.py: tiny_babyai_run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trained(tiny_babyai_run, tmp_path_factory):
    """A copy (without checkpoints) of the session's tiny run (conftest.py, run name ``e2e``): this module deletes a
    rollout file of it at the end."""
    src, log = tiny_babyai_run
    out = tmp_path_factory.mktemp("viewer-run")
    shutil.copytree(src / RUN, out / RUN)
    yield out, log


@pytest.fixture(scope="module")
def viewer(trained, tmp_path_factory):
    out, _ = trained
    port = _free_port()
    log = tmp_path_factory.mktemp("viewer-log") / "view.log"
    proc = _cli("view", "--runs-dir", str(out), "--port", str(port), cwd=out, popen=True, log=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(base + "/static/viewer.css", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the viewer did not start: {log.read_text()[-2000:]}")
        time.sleep(0.3)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def test_summary_and_artifact_print_the_viewer_url(trained):
    _, log = trained
    assert V.viewer_url(RUN) in log


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (infra/install.sh)")
def test_browser_run_step_episode_tokens(trained, viewer, tmp_path):
    from playwright.sync_api import sync_playwright

    out, _ = trained
    stored = pq.read_table(out / RUN / "rollouts" / "step-000002.parquet").to_pylist()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(120_000)
            page.goto(viewer + "/")
            page.click(f"a.run-link:text-is('{RUN}')")
            page.wait_for_url(f"**/runs/{RUN}")
            # train success, reward, turns; then the stability diagnostics: policy entropy and the 6 of
            # core.metrics.DIAGNOSTICS (the run's metrics.jsonl has them all)
            assert page.locator("svg.chart").count() == 3 + 1 + len(DIAGNOSTICS)
            assert page.locator("h2", has_text="Stability diagnostics").count() == 1
            page.click(f"a.step-link[href='/runs/{RUN}/steps/2']")
            page.wait_for_url(f"**/runs/{RUN}/steps/2")
            assert page.locator("a.episode-link").count() == len(stored)
            # the episode with the most turns (phase 2 allows 2)
            i = max(range(len(stored)), key=lambda k: (stored[k]["turns"], -k))
            page.click(f"tr[data-index='{i}'] a.episode-link")
            page.wait_for_url(f"**/runs/{RUN}/steps/2/episodes/{i}")
            ep = stored[i]
            turns = page.locator(".turn[data-turn]")
            assert turns.count() == ep["turns"] == len(ep["replies"]) >= 1
            for k in range(ep["turns"]):
                t = turns.nth(k)
                assert t.locator("pre.reply").text_content() == ep["replies"][k]
                seen = ep["first_observation"] if k == 0 else ep["observations"][k - 1]
                assert t.locator("pre.observation").text_content() == seen
                assert float(t.locator(".reward").get_attribute("data-reward")) == ep["turn_rewards"][k]
                if ep["invalid_actions"][k]:
                    assert t.locator(".badge.invalid").count() == 1
                elif ep["actions"][k] and ep["actions"][k].lower() in ep["replies"][k].lower():
                    assert t.locator("mark.action").text_content().lower() == ep["actions"][k].lower()
            page.click("#token-toggle")  # the first token view imports transformers: slow on a busy machine
            page.wait_for_selector("#tokens .token-view, #tokens .warn", timeout=600_000)
            assert page.locator("#tokens .tok").count() == len(ep["token_ids"])
            assert page.locator("#tokens .tok.pol").count() == sum(ep["loss_mask"])
            assert "could not be loaded" not in page.locator("#tokens").text_content()  # decoded, not raw ids
            shot = tmp_path / "viewer-episode.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("SCALINGINTER_VIEWER_SCREENSHOT"):
                shutil.copy(shot, os.environ["SCALINGINTER_VIEWER_SCREENSHOT"])
            page.click("#token-toggle")
            assert page.locator("#tokens").is_hidden()

            resp = page.goto(viewer + "/runs/no-such-run")
            assert resp.status == 404 and "No run named 'no-such-run'" in page.content()
            assert page.locator(f"a[href='/runs/{RUN}']").count() == 1
            (out / RUN / "rollouts" / "step-000001.parquet").unlink()  # the last check of this module
            resp = page.goto(viewer + f"/runs/{RUN}/steps/1")
            assert resp.status == 404 and "the rollout file is missing" in page.content()
            assert "Traceback" not in page.content()
        finally:
            browser.close()
