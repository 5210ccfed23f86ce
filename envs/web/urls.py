"""URL normalisation for the web envs' allow checks (pure).

An allow check that compares prefixes of the raw text a model typed can be walked around: ``../`` segments (also
spelled ``%2e%2e``), backslashes (browsers read ``\\`` as ``/`` in http URLs), upper-case schemes and hosts,
default ports, extra slashes after the scheme, tabs and newlines (browsers drop them), ``user@`` prefixes that
move the real host. ``normalize_url`` resolves all of these the way a browser does and returns one canonical
http(s) URL, or None for anything it will not vouch for (other schemes, credentials, odd hosts or ports). The
caller checks *and navigates to* the canonical URL, so what was checked is what the browser loads.
"""

from __future__ import annotations

import re
from typing import Optional
from urllib.parse import urljoin

_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")
_DEFAULT_PORT = {"http": "80", "https": "443"}
# characters kept as they are in a path, query or fragment; everything else is percent-encoded (quotes,
# angle brackets, spaces, backticks, non-ASCII), so the canonical URL carries no markup
_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&()*+,;=:@/?")
_PCT = re.compile(r"%[0-9a-fA-F]{2}")


def _encode(text: str) -> str:
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "%" and _PCT.match(text, i):
            out.append(text[i : i + 3].upper())
            i += 3
            continue
        if c in _SAFE:
            out.append(c)
        else:
            out.extend(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
        i += 1
    return "".join(out)


def remove_dot_segments(path: str) -> str:
    """``/a/b/../c/./d`` -> ``/a/c/d`` (RFC 3986 5.2.4; ``%2e`` counts as ``.``, as browsers read it)."""
    segs = path.split("/")[1:]
    out: list[str] = []
    for i, seg in enumerate(segs):
        dots = seg.lower().replace("%2e", ".")
        last = i == len(segs) - 1
        if dots == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        elif dots == ".":
            if last:
                out.append("")
        else:
            out.append(seg)
    return "/" + "/".join(out)


def _authority(auth: str, scheme: str) -> Optional[str]:
    if "@" in auth or "%" in auth:  # credentials move the real host; encoded hosts are not worth the risk
        return None
    host, port = auth, ""
    if auth.startswith("["):
        end = auth.find("]")
        if end < 0:
            return None
        host, rest = auth[: end + 1].lower(), auth[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:]
        if not re.fullmatch(r"\[[0-9a-f:.]+\]", host):
            return None
    else:
        host, _, port = auth.partition(":")
        host = host.lower()
        if not _HOST.fullmatch(host):
            return None
    if port:
        if not port.isascii() or not port.isdigit() or int(port) > 65535:
            return None
        port = str(int(port))
        if port == _DEFAULT_PORT[scheme]:
            port = ""
    return host + (f":{port}" if port else "")


def normalize_url(url: str, base: Optional[str] = None) -> Optional[str]:
    """The canonical form of ``url`` (resolved against ``base`` when relative), or None when it is not an
    http(s) URL this module can vouch for. ``about:blank`` stays as it is."""
    u = re.sub(r"[\t\n\r]", "", str(url)).strip("\x00\x01\x02\x03\x04\x05\x06\x07\x08\x0b\x0c\x0e\x0f\x10\x11"
                                                "\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f ")
    if u.lower() == "about:blank":
        return "about:blank"
    m = _SCHEME.match(u)
    if m is None:  # relative: resolve against the page, with backslashes read as slashes like a browser does
        if base is None or normalize_url(base) in (None, "about:blank"):
            return None
        return normalize_url(urljoin(normalize_url(base), u.replace("\\", "/")))  # type: ignore[arg-type]
    scheme = m.group(1).lower()
    if scheme not in _DEFAULT_PORT:
        return None
    rest = u[m.end() :].replace("\\", "/")
    if not rest.startswith("/"):  # "http:host" (no slashes): browsers guess; we do not
        return None
    rest = rest.lstrip("/")
    cut = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0], default=len(rest))
    authority = _authority(rest[:cut], scheme)
    if not authority:
        return None
    tail = rest[cut:]
    tail, hash_, fragment = tail.partition("#")
    path, q, query = tail.partition("?")
    path = remove_dot_segments(path) if path.startswith("/") else "/"
    out = f"{scheme}://{authority}{_encode(path)}"
    if q:
        out += "?" + _encode(query)
    if hash_:
        out += "#" + _encode(fragment)
    return out


def within(url: str, base: str) -> bool:
    """``url`` (canonical) is ``base`` or below it: the same origin and a path under base's path."""
    b = base.rstrip("/")
    return url == b or url.startswith(b + "/") or url.startswith(b + "?") or url.startswith(b + "#")
