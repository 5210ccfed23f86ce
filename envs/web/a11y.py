"""Accessibility-tree observation of a page, with element ids the actions refer to.

``SNAPSHOT_JS`` runs in the page: it walks the DOM, computes a role and an accessible name per element
(explicit ``role``/``aria-*`` first, then the HTML element's implicit role and its label / alt / text),
skips hidden elements, flattens role-less wrappers (div, span, ...) and gives every element it reports a
stable numeric id stored in ``data-si-id`` (kept across steps on the same document, so an id the agent
saw stays valid). It returns flat nodes ``{d, id, role, name, props, top, bottom}``.

``format_tree`` (pure) turns the nodes into the text the agent reads (WebArena style)::

    [3] link 'Cart (0)'
    [7] searchbox 'Search products'
      StaticText 'Price: $12.50'

showing the part of the page from the current scroll position on, cut to ``max_chars`` with a note on what
is above/below (``scroll [down]`` moves the window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ID_ATTR = "data-si-id"

SNAPSHOT_JS = r"""
(rootSelector) => {
  const root = rootSelector ? document.querySelector(rootSelector) : document.body;
  if (!root) return {nodes: [], scrollY: window.scrollY, innerHeight: window.innerHeight, title: document.title};
  if (typeof window.__siNext !== 'number') window.__siNext = 1;
  const SKIP = new Set(['SCRIPT','STYLE','NOSCRIPT','TEMPLATE','HEAD','META','LINK','BR','HR']);
  const FROM_CONTENT = new Set(['link','button','heading','option','tab','menuitem','radio','checkbox','switch',
                                'treeitem','columnheader','rowheader']);
  const clean = (s) => (s || '').replace(/\s+/g, ' ').trim();
  const cut = (s, n) => s.length > n ? s.slice(0, n - 3) + '...' : s;
  function implicitRole(el) {
    const t = el.tagName;
    const type = (el.getAttribute('type') || 'text').toLowerCase();
    switch (t) {
      case 'A': return el.hasAttribute('href') ? 'link' : null;
      case 'BUTTON': return 'button';
      case 'SUMMARY': return 'button';
      case 'INPUT':
        if (type === 'hidden') return 'hidden';
        if (['button','submit','reset','image'].includes(type)) return 'button';
        if (type === 'checkbox') return 'checkbox';
        if (type === 'radio') return 'radio';
        if (type === 'range') return 'slider';
        if (type === 'number') return 'spinbutton';
        if (type === 'search') return 'searchbox';
        return 'textbox';
      case 'TEXTAREA': return 'textbox';
      case 'SELECT': return (el.multiple || el.size > 1) ? 'listbox' : 'combobox';
      case 'OPTION': return 'option';
      case 'H1': case 'H2': case 'H3': case 'H4': case 'H5': case 'H6': return 'heading';
      case 'IMG': return el.getAttribute('alt') === '' ? null : 'img';
      case 'TH': return 'columnheader';
      case 'DIALOG': return 'dialog';
      case 'CANVAS': case 'SVG': case 'svg': return 'img';
    }
    if (el.isContentEditable && !(el.parentElement && el.parentElement.isContentEditable)) return 'textbox';
    return null;
  }
  function labelOf(el) {
    if (el.getAttribute('aria-label')) return clean(el.getAttribute('aria-label'));
    const lb = el.getAttribute('aria-labelledby');
    if (lb) {
      const t = lb.split(/\s+/).map(id => document.getElementById(id)).filter(x => x).map(x => x.innerText || x.textContent).join(' ');
      if (clean(t)) return clean(t);
    }
    if (el.labels && el.labels.length) {
      const t = Array.from(el.labels).map(l => l.innerText || l.textContent).join(' ');
      if (clean(t)) return clean(t);
    }
    return '';
  }
  function nameOf(el, role) {
    let n = labelOf(el);
    if (n) return n;
    const t = el.tagName;
    if (t === 'IMG') return clean(el.getAttribute('alt') || el.getAttribute('title'));
    if (t === 'INPUT' && ['button','submit','reset'].includes((el.type || '').toLowerCase()))
      return clean(el.value || (el.type === 'submit' ? 'Submit' : ''));
    if (t === 'INPUT' || t === 'TEXTAREA' || t === 'SELECT')
      return clean(el.getAttribute('placeholder') || el.getAttribute('title') || el.getAttribute('name') || '');
    if (FROM_CONTENT.has(role) || role === 'textbox') return clean(el.innerText || el.textContent);
    return clean(el.getAttribute('title') || '');
  }
  function visible(el, style) {
    if (style.display === 'none' || style.visibility === 'hidden' || style.visibility === 'collapse') return false;
    if (el.hidden || el.getAttribute('aria-hidden') === 'true') return false;
    return true;
  }
  const nodes = [];
  const sy = window.scrollY;
  const active = document.activeElement;
  function rectOf(el) { const r = el.getBoundingClientRect(); return [r.top + sy, r.bottom + sy, r.width, r.height]; }
  function idOf(el) {
    if (!el.hasAttribute('data-si-id')) el.setAttribute('data-si-id', String(window.__siNext++));
    return parseInt(el.getAttribute('data-si-id'));
  }
  function walk(node, depth) {
    for (const ch of node.childNodes) {
      if (ch.nodeType === 3) {
        const t = clean(ch.textContent);
        const holder = ch.parentElement;
        if (t && holder && !(holder.tagName === 'LABEL' && holder.control)) {
          const r = rectOf(holder);
          nodes.push({d: depth, id: idOf(holder), role: 'StaticText', name: cut(t, 160), props: {}, top: r[0], bottom: r[1]});
        }
        continue;
      }
      if (ch.nodeType !== 1 || SKIP.has(ch.tagName)) continue;
      const el = ch;
      const style = window.getComputedStyle(el);
      if (!visible(el, style)) continue;
      let role = el.getAttribute('role') || implicitRole(el);
      if (role === 'hidden') continue;
      if (role === null || role === 'generic' || role === 'presentation' || role === 'none') {
        if (el.tagName === 'INPUT') continue;
        walk(el, depth);
        continue;
      }
      const rect = rectOf(el);
      if (rect[2] === 0 && rect[3] === 0 && el.children.length === 0 && el.tagName !== 'OPTION') continue;
      const id = idOf(el);
      let name = cut(nameOf(el, role), 100);
      const props = {};
      if (el === active && el !== document.body) props.focused = true;
      if (el.disabled) props.disabled = true;
      if (role === 'checkbox' || role === 'radio' || role === 'switch') props.checked = !!el.checked || el.getAttribute('aria-checked') === 'true';
      if (role === 'option') { if (el.selected || el.getAttribute('aria-selected') === 'true') props.selected = true; }
      if (el.getAttribute('aria-expanded')) props.expanded = el.getAttribute('aria-expanded') === 'true';
      if (role === 'textbox' || role === 'searchbox' || role === 'spinbutton' || role === 'slider') {
        const v = el.isContentEditable ? clean(el.innerText) : clean(el.value);
        if (v) props.value = cut(v, 100);
        if (el.isContentEditable && name === v) name = '';
      }
      if (role === 'combobox' && el.tagName === 'SELECT' && el.selectedIndex >= 0) props.value = clean(el.options[el.selectedIndex].text);
      nodes.push({d: depth, id: id, role: role, name: name, props: props, top: rect[0], bottom: rect[1]});
      if (role === 'combobox' && el.tagName === 'SELECT') {
        for (const o of el.options) {
          const r = rectOf(el);
          const op = {d: depth + 1, id: idOf(o), role: 'option', name: cut(clean(o.text), 100), props: {}, top: r[0], bottom: r[1]};
          if (o.selected) op.props.selected = true;
          nodes.push(op);
        }
        continue;
      }
      // name taken from the content: do not repeat the text, but keep interactive children
      if (FROM_CONTENT.has(role) && name) {
        for (const x of el.querySelectorAll('a[href],button,input,select,textarea,[role=button],[role=link],[role=checkbox]'))
          walk({childNodes: [x]}, depth + 1);
        continue;
      }
      walk(el, depth + 1);
    }
  }
  walk(root, 0);
  return {nodes: nodes, scrollY: sy, innerHeight: window.innerHeight, title: document.title};
}
"""


@dataclass
class Snapshot:
    nodes: list[dict[str, Any]]
    scroll_y: float = 0.0
    inner_height: float = 720.0
    title: str = ""

    @classmethod
    def from_js(cls, d: dict[str, Any]) -> "Snapshot":
        return cls(list(d.get("nodes") or []), float(d.get("scrollY") or 0), float(d.get("innerHeight") or 720),
                   str(d.get("title") or ""))

    def ids(self) -> set[int]:
        return {n["id"] for n in self.nodes if n.get("id") is not None}


def _q(s: str) -> str:
    return "'" + s.replace("\n", " ") + "'"


def format_node(n: dict[str, Any], indent: str = " ") -> str:
    pad = indent * int(n.get("d", 0))
    if n.get("id") is None:
        return f"{pad}{n.get('role', 'StaticText')} {_q(str(n.get('name', '')))}"
    parts = [f"{pad}[{n['id']}] {n.get('role', '')}"]
    if n.get("name"):
        parts.append(_q(str(n["name"])))
    for k, v in (n.get("props") or {}).items():
        if isinstance(v, bool):
            parts.append(f"{k}: {str(v).lower()}" if k in ("checked", "expanded") else (k if v else f"not {k}"))
        else:
            parts.append(f"{k}: {_q(str(v))}")
    return " ".join(parts)


def format_tree(snap: Snapshot, max_chars: int = 2400, indent: str = " ") -> str:
    """The visible part of the tree (from the scroll position down), cut at ``max_chars`` characters."""
    nodes = snap.nodes
    if not nodes:
        return "(the page is empty)"
    start = 0
    if snap.scroll_y > 1:
        limit = snap.scroll_y + 1
        while start < len(nodes) and float(nodes[start].get("bottom", 0)) <= limit:
            start += 1
        start = min(start, len(nodes) - 1)
    out: list[str] = []
    used = 0
    if start:
        out.append(f"({start} lines above; scroll [up] to see them)")
    end = start
    for n in nodes[start:]:
        line = format_node(n, indent)
        if used + len(line) + 1 > max_chars and end > start:
            break
        if len(line) > max_chars:
            line = line[: max_chars - 3] + "..."
        out.append(line)
        used += len(line) + 1
        end += 1
    rest = len(nodes) - end
    if rest > 0:
        out.append(f"({rest} more lines below; scroll [down] to see them)")
    return "\n".join(out)
