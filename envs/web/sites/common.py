"""HTML helpers shared by the local sites (plain server-rendered HTML, no JavaScript)."""

from __future__ import annotations

from html import escape


def e(x: object) -> str:
    return escape(str(x), quote=True)


def page(title: str, nav: str, body: str) -> str:
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{e(title)}</title>"
        "<style>body{font-family:sans-serif;margin:12px;max-width:900px} nav a{margin-right:10px}"
        " li{margin:3px 0} td,th{padding:2px 8px;text-align:left}</style></head><body>"
        f"<nav>{nav}</nav><main>{body}</main></body></html>"
    )


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"
