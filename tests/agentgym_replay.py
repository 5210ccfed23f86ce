"""Replay servers for the AgentGym adapter's tests, built from recordings of the real AgentGym env servers.

``tests/data/agentgym/`` holds a copy of ``../shared/agentgym-transcripts/``: ``babyai.jsonl`` (every HTTP
exchange of a session with the unmodified ``agentenv-babyai`` server on loopback) and ``README.md`` (the shapes
and rules of both the BabyAI and the TextCraft server). The apps below answer:

* a request that was recorded (same path, same ``data_idx`` / action) with the recorded body, byte for byte;
* anything else by the rules the README documents, in the recorded shapes:

  BabyAI: ``GET /`` the recorded greeting; ``/create`` (no body) ``{"id"}``; ``/reset`` needs ``id``
  (``env_idx`` alone: 422) and builds level ``data_idx % 40 + 1`` with seed ``data_idx // 40``;
  ``/step`` answers ``{"observation", "reward", "score", "done"}`` where ``reward`` is the *current* value
  (kept by an unrecognised action, 0 after a move that wins nothing, the win's worth after a win) and
  ``score`` the running sum of those values; ``done`` is un-set when a win is worth <= 0.5. An action must be
  one of the observation's "Available actions" exactly (case-sensitive, no full stop), else "The action is not
  recognized". Errors are HTTP 200 ``{"error"}``: "The id N is not valid.", "The task with environment N has
  finished.", ``{"error": "<id>"}`` for a step before reset, "Seed must be greater or equal to zero, ...".

  TextCraft: ``/create`` needs a JSON body (none: 422) and answers ``{"id", "observation", "done", "reward"}``
  with a task loaded; ``/reset`` picks goal ``data_idx % len(goal_names)`` (544); ``/step`` ``{"observation", "reward",
  "done"}``, reward 1 on crafting the goal; ``GET /observation`` a bare string; ``/close`` a bare bool.

What a win is worth is test data (``wins``): the recording has no win. ``transcript_app`` replays a whole
transcript in order (``babyai_farming.jsonl``: a synthetic one in the recorded format, see its ``.md``).
TextCraft's goal names are ``envs.agentgym.textcraft_goals()`` (a server reading its recipe files in sorted order)
unless a test passes its own ``goal_names`` (a server whose file system lists them in another order, or one with
other goals). Every app keeps what it was sent in
``app.state`` (``steps``: (id, action) pairs, ``resets``: (id, data_idx) pairs, ``goals``), so a test can check
what reached the server.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

DATA = Path(__file__).resolve().parent / "data" / "agentgym"
NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."
BABYAI_LEVELS = 40


def load_exchanges(name: str = "babyai.jsonl") -> list[dict[str, Any]]:
    """The recorded exchanges: method, path, request (parsed), status, response (parsed)."""
    out = []
    for line in (DATA / name).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            d["req"] = json.loads(d["req"]) if d.get("req") else None
            d["resp"] = json.loads(d["resp"])
            out.append(d)
    return out


def available_actions(observation: str) -> list[str]:
    """The list after 'Available actions: ' in a BabyAI observation (a JSON list in the recordings)."""
    marker = "Available actions: "
    at = observation.rfind(marker)
    return json.loads(observation[at + len(marker):]) if at >= 0 else []


async def _json(request: Request) -> Any:
    raw = await request.body()
    return json.loads(raw) if raw else None


def _missing(field: str) -> JSONResponse:  # FastAPI's validation reply, as the real servers give it
    return JSONResponse({"detail": [{"type": "missing", "loc": ["body", field], "msg": "Field required"}]}, 422)


async def _body(request: Request, *fields: str) -> tuple[dict, JSONResponse | None]:
    """The request's JSON body and the reply for its first missing field (None when all are there)."""
    b = await _json(request) or {}
    return b, next((_missing(f) for f in fields if f not in b), None)


def babyai_app(wins: dict[tuple[int, str], float] | None = None) -> FastAPI:
    """The BabyAI server as recorded. ``wins[(data_idx, action)]`` is what that action's win is worth."""
    ex = load_exchanges()
    hello = next(e["resp"] for e in ex if e["path"] == "/")
    recorded_resets = {e["req"]["data_idx"]: e["resp"] for e in ex if e["path"] == "/reset"}
    reset_of_id = {e["req"]["id"]: e["req"]["data_idx"] for e in ex if e["path"] == "/reset"}
    recorded_steps = {(reset_of_id[e["req"]["id"]], e["req"]["action"]): e["resp"] for e in ex if e["path"] == "/step"}
    first_id = min(e["resp"]["id"] for e in ex if e["path"] == "/create")
    wins = dict(wins or {})

    app = FastAPI()
    app.state.steps, app.state.resets, app.state.closed = [], [], []
    envs: dict[int, dict[str, Any]] = {}
    app.state.envs = envs
    app.state.next_id = first_id

    def check(i: Any, reset: bool = False) -> dict[str, Any] | None:
        if i not in envs or envs[i]["deleted"]:
            return {"error": f"The id {i} is not valid."}
        if not reset and envs[i]["done"]:
            return {"error": f"The task with environment {i} has finished."}
        return None

    @app.get("/")
    def root():
        return hello

    @app.post("/create")
    def create():
        i = app.state.next_id
        app.state.next_id += 1
        envs[i] = {"deleted": False, "done": False, "data_idx": None, "score": 0, "reward": 0, "observation": ""}
        return {"id": i}

    @app.post("/reset")
    async def reset(request: Request):
        b, err = await _body(request, "id", "data_idx")
        if err is not None:
            return err
        i, k = b["id"], b["data_idx"]
        app.state.resets.append((i, k))
        if (err := check(i, reset=True)) is not None:
            return err
        if k // BABYAI_LEVELS < 0:
            return {"error": f"Seed must be greater or equal to zero, actual value: {k // BABYAI_LEVELS}"}
        if k in recorded_resets:
            payload = dict(recorded_resets[k])
        else:  # not recorded: the recorded shape, naming the level and seed the server builds for k
            obs = (f"Your goal: the goal of level {k % BABYAI_LEVELS + 1} with seed {k // BABYAI_LEVELS}\n"
                   "You cannot see any objects within sight.The room has walls around you. You are not carrying "
                   'anything.\nAvailable actions: ["turn left", "turn right", "move forward", "check available '
                   'actions"]')
            payload = {"observation": obs, "reward": 0, "score": 0, "deleted": False, "done": False}
        envs[i].update(data_idx=k, done=False, score=0, reward=0, observation=payload["observation"])
        return payload

    @app.post("/step")
    async def step(request: Request):
        b, err = await _body(request, "id", "action")
        if err is not None:
            return err
        i, action = b["id"], b["action"]
        app.state.steps.append((i, action))
        if (err := check(i)) is not None:
            return err
        e = envs[i]
        if e["data_idx"] is None:
            return {"error": str(i)}
        rec = recorded_steps.get((e["data_idx"], action))
        if rec is not None:
            e.update(reward=rec["reward"], score=rec["score"], done=rec["done"], observation=rec["observation"])
            return rec
        actions = available_actions(e["observation"])
        listing = "\nAvailable actions: " + json.dumps(actions)
        if action.strip() not in actions:
            text = NOT_RECOGNIZED  # the current value stays what it was
        elif (e["data_idx"], action.strip()) in wins:
            e["reward"] = wins[(e["data_idx"], action.strip())]
            text = "You did it.\n The task is completed."  # appended before a late win's done is cleared
        else:
            e["reward"] = 0
            text = f"You {action.strip()}."
        e["score"] = e["score"] + e["reward"]
        e["done"] = e["reward"] > 0.5  # a late win worth <= 0.5 does not end the episode
        e["observation"] = text + listing
        return {"observation": e["observation"], "reward": e["reward"], "score": e["score"], "done": e["done"]}

    @app.get("/observation")
    def observation(id: int):  # noqa: A002
        if (err := check(id, reset=True)) is not None:
            return err
        return {"observation": envs[id]["observation"]}

    @app.post("/close")
    async def close(request: Request):
        b, err = await _body(request, "id")
        if err is not None:
            return err
        app.state.closed.append(b["id"])
        if b["id"] not in envs or envs[b["id"]]["deleted"]:
            return False
        envs[b["id"]]["deleted"] = True
        return True

    return app


def transcript_app(name: str = "babyai_farming.jsonl") -> FastAPI:
    """Replays a transcript in order: each request must be the next recorded one (method, path and JSON body,
    compared parsed) and gets its recorded reply byte for byte; anything else answers 409 naming the difference.
    ``app.state.served`` counts the exchanges served."""
    from fastapi.responses import Response

    ex = load_exchanges(name)
    app = FastAPI()
    app.state.served = 0

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def replay(path: str, request: Request):
        i = app.state.served
        req = await _json(request)
        if i >= len(ex):
            return JSONResponse({"detail": f"transcript over, got {request.method} /{path} {req}"}, 409)
        e = ex[i]
        if (request.method, "/" + path, req) != (e["method"], e["path"], e["req"] if e["method"] == "POST" else None):
            return JSONResponse({"detail": f"exchange {i}: expected {e['method']} {e['path']} {e['req']}, got "
                                           f"{request.method} /{path} {req}"}, 409)
        app.state.served += 1
        raw = (DATA / name).read_text().splitlines()[i]
        return Response(json.loads(raw)["resp"], status_code=e["status"], media_type="application/json")

    return app


def textcraft_goal(k: int, goal_names: list[str] | tuple[str, ...] | None = None) -> str:
    """The name of goal ``k % len(goal_names)`` (default: the goal list the adapter expects)."""
    from envs.agentgym import textcraft_goals

    names = goal_names if goal_names is not None else textcraft_goals()
    return names[k % len(names)]


def textcraft_app(goal_names: list[str] | tuple[str, ...] | None = None) -> FastAPI:
    """TextCraft's shapes: goal ``data_idx % len(goal_names)`` (default: the 544 goals the adapter expects, in its
    order); "get 1 sunflower" then "craft 1 <goal> using 1 sunflower"."""
    from envs.agentgym import textcraft_goals

    names = list(goal_names if goal_names is not None else textcraft_goals())
    app = FastAPI()
    app.state.names = names  # a test may change the list while the server runs (a server restarted in another order)
    app.state.steps, app.state.resets, app.state.goals, app.state.closed = [], [], [], []
    envs: dict[int, dict[str, Any]] = {}
    app.state.next_id = 0

    def load(e: dict[str, Any], k: int) -> str:
        names = app.state.names
        g = k % len(names)
        app.state.goals.append(g)
        e.update(goal=names[g], inventory=set(), done=False)
        e["observation"] = (f"Crafting commands:\ncraft 1 {names[g]} using 1 sunflower\n\n"
                            f"Goal: craft {names[g]}.")
        return e["observation"]

    def check(i: Any) -> dict[str, Any] | None:
        if i not in envs or envs[i]["deleted"]:
            return {"error": f"The id {i} is not valid."}
        return None

    @app.get("/")
    def root():
        return "This is environment TextCraft."

    @app.post("/create")
    async def create(request: Request):
        if await _json(request) is None:
            return _missing("body")
        i = app.state.next_id
        app.state.next_id += 1
        envs[i] = {"deleted": False}
        obs = load(envs[i], i)  # the server loads task ``id`` at create
        return {"id": i, "observation": obs, "done": False, "reward": 0}

    @app.post("/reset")
    async def reset(request: Request):
        b, err = await _body(request, "id", "data_idx")
        if err is not None:
            return err
        app.state.resets.append((b["id"], b["data_idx"]))
        if (err := check(b["id"])) is not None:
            return err
        return {"id": b["id"], "observation": load(envs[b["id"]], b["data_idx"]), "done": False, "reward": 0}

    @app.post("/step")
    async def step(request: Request):
        b, err = await _body(request, "id", "action")
        if err is not None:
            return err
        app.state.steps.append((b["id"], b["action"]))
        if (err := check(b["id"])) is not None:
            return err
        e, a = envs[b["id"]], b["action"]
        reward, done = 0, False
        if a == "inventory":
            text = f"Inventory: {', '.join(sorted(e['inventory'])) or 'nothing'}"
        elif a.startswith("get 1 "):
            item = a[len("get 1 "):]
            if item == "sunflower":
                e["inventory"].add(item)
                text = "Got 1 sunflower"
            else:
                text = f"Could not find {item.rstrip('.')}."
        elif a == f"craft 1 {e['goal']} using 1 sunflower" and "sunflower" in e["inventory"]:
            text, reward, done = f"Crafted 1 minecraft:{e['goal']}", 1, True
        else:
            text = f"Could not execute {a}"
        e["observation"], e["done"] = text, done
        return {"observation": text, "reward": reward, "done": done}

    @app.get("/observation")
    def observation(id: int):  # noqa: A002
        if (err := check(id)) is not None:
            return err
        return envs[id]["observation"]

    @app.post("/close")
    async def close(request: Request):
        b = await _json(request) or {}
        app.state.closed.append(b.get("id"))
        if b.get("id") not in envs or envs[b["id"]]["deleted"]:
            return False
        envs[b["id"]]["deleted"] = True
        return True

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(app):
    """``app`` served on a loopback port by uvicorn in a thread of this process, for what needs a real URL (the
    rollout's clients, the CLI in a subprocess); yields the base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(400):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
