"""Redaction of secrets in URIs before they are logged or saved (pure: strings and JSON-like data in and out).

A ``tracking.uri`` or ``env.url`` may carry credentials: ``scheme://user:password@host`` or a bare token as the
user part (``https://TOKEN@host``), or a secret in the query (``?password=...``, ``?token=...``). ``redact_uri``
replaces the password (or a bare token) with ``***`` and keeps everything else, so the logged value still says
where the run went; ``redact`` does this to every string inside a config dump.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# scheme://userinfo@ — userinfo stops at the first '/', '?', '#' or whitespace; its last '@' ends it
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#\s@]*(?:@[^/?#\s@]*)*)@")
# query / fragment parameters whose value is a secret
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&;#](?:[\w.\-]*(?:password|passwd|pwd|secret|token|api[_\-]?key|access[_\-]?key|signature|"
    r"credential|auth)[\w.\-]*)=)(?P<value>[^&;#\s]*)", re.IGNORECASE)


def _mask_userinfo(m: re.Match) -> str:
    info = m.group("userinfo")
    if ":" in info:
        user = info.split(":", 1)[0]
        return f"{m.group('scheme')}{user}:{MASK}@"
    return f"{m.group('scheme')}{MASK}@"  # a bare user part is as likely a token as a name


def redact_uri(text: str) -> str:
    """``text`` with the credentials of every URI in it replaced by ``***`` (unchanged if it has none)."""
    if "://" not in text and "=" not in text:
        return text
    out = _USERINFO.sub(_mask_userinfo, text)
    return _SECRET_PARAM.sub(lambda m: m.group("key") + (MASK if m.group("value") else ""), out)


def redact(obj: Any) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, strings, scalars) with every string passed through ``redact_uri``."""
    if isinstance(obj, str):
        return redact_uri(obj)
    if isinstance(obj, dict):
        return {k: redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    return obj


# --- environments of child processes ----------------------------------------------------------------------
# variables a spawned env server never needs: cloud / tracking / orchestration credentials (S3 block secrets are
# exported to this process's environment) and anything named like a secret
_DROP_PREFIXES = ("AWS_", "MLFLOW_TRACKING_", "PREFECT_API_", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_")
_DROP_MARKERS = ("SECRET", "PASSWORD", "PASSWD", "TOKEN", "API_KEY", "APIKEY", "ACCESS_KEY", "CREDENTIAL",
                 "PRIVATE_KEY", "SESSION_KEY")
# secrets an env server does use: its own access token, the deep-search judge's key
ENV_SERVER_SECRETS = ("SCALINGINTER_ENV_TOKEN", "SI_JUDGE_API_KEY")


def is_credential_var(name: str) -> bool:
    """True for an environment variable name that holds (or may hold) a credential."""
    up = name.upper()
    return up.startswith(_DROP_PREFIXES) or any(m in up for m in _DROP_MARKERS)


def child_environ(environ: dict[str, str], keep: tuple[str, ...] = ENV_SERVER_SECRETS) -> dict[str, str]:
    """A copy of ``environ`` without credential variables (``is_credential_var``) except those in ``keep``, and
    without any value that carries a URI password (``redact_uri`` would change it)."""
    return {k: v for k, v in environ.items()
            if k in keep or (not is_credential_var(k) and redact_uri(v) == v)}
