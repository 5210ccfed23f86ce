"""The generated parts of the documentation site, and the MkDocs hook that adds them (``mkdocs.yml``: ``hooks``).

* ``reference/config.md``: every setting of ``core.config.RunConfig`` (dotted key, type, default, description),
  read from the pydantic model itself, so the page cannot drift from the config.
* ``reference/cli.md``: every ``scalinginter`` command with its arguments and options, read from the Typer app
  in ``flows/cli.py``.
* the files under ``bench/results/`` (all but Markdown) as site files at ``bench/results/...``, so that a results
  page links to and shows the file itself and a strict build fails when a cited file is missing.

Run it alone to print a page: ``python docs/gen_reference.py config`` (or ``cli``).
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# --- the config reference --------------------------------------------------------------------------------------
class Setting(NamedTuple):
    section: str  # the top-level key (env, rollout, ...), or "" for top-level settings
    key: str  # the dotted key that --set takes (list items: "curriculum.phases[].turn_limit")
    type: str
    default: str
    description: str


def _type_name(t: Any) -> str:
    """A readable annotation: ``int | None``, ``"auto" | "docker"``, ``list[str]``."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def _bounds(field: Any) -> str:
    """The numeric bounds pydantic enforces (ge=1 -> ">= 1")."""
    out = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sym} {v}")
    return ", ".join(out)


def _model_of(t: Any):
    """The pydantic model a field holds (itself, or the item type of a list), else None."""
    from pydantic import BaseModel

    if isinstance(t, type) and issubclass(t, BaseModel):
        return t, False
    if typing.get_origin(t) is list:
        (item,) = typing.get_args(t) or (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, True
    return None, False


def _default(field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        value = value.model_dump()
    elif isinstance(value, list):
        value = [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
    return json.dumps(value)


def settings(model: Any = None, prefix: str = "", section: str = "") -> Iterator[Setting]:
    """Every setting of ``model`` (default ``RunConfig``), depth first, in declaration order. A nested section
    (``rollout``, ``algo.critic``) yields its settings, not itself; a list of models (``curriculum.phases``) yields
    the list and then the fields of one item as ``key[].field``."""
    if model is None:
        from core.config import RunConfig

        model = RunConfig
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub, is_list = _model_of(field.annotation)
        if sub is not None and not is_list:
            yield from settings(sub, key + ".", section or name)
            continue
        kind = _type_name(field.annotation)
        bounds = _bounds(field)
        yield Setting(section, key, kind + (f" ({bounds})" if bounds else ""), _default(field),
                      " ".join((field.description or "").split()))
        if sub is not None:
            yield from settings(sub, key + "[].", section or name)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code in a table cell. A pipe inside a code span does not split the cell (Python-Markdown's tables),
    so only newlines go; a backtick inside takes a double-backtick span."""
    text = " ".join(text.split("\n"))
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def config_markdown() -> str:
    from core.config import RunConfig

    doc = (RunConfig.__dict__.get("__doc__") or "").strip()  # its own docstring, not BaseModel's
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by docs/gen_reference.py from core/config.py: edit the config, not this page -->",
        "",
        "Every setting of a run, generated from the typed config (`core.config.RunConfig`) when the site is "
        "built. A preset is a partial config; `--set key=value` overrides one setting (the value is parsed as "
        "JSON when it is JSON, so defaults are shown as JSON); `scalinginter run ENV --print-config` prints the "
        "resolved config of a run. Settings marked `None` by default are resolved at run time as their "
        "description says.",
        "",
    ]
    if doc:
        lines += [doc, ""]
    by_section: dict[str, list[Setting]] = {}
    for s in settings():
        by_section.setdefault(s.section, []).append(s)
    order = [k for k in by_section if k] + ([""] if "" in by_section else [])
    for sec in order:
        title = f"`{sec}`" if sec else "Top-level settings"
        desc = ""
        if sec:
            desc = " ".join((RunConfig.model_fields[sec].description or "").split())
        lines += [f"## {title}", ""]
        if desc:
            lines += [desc, ""]
        lines += ["| setting | type | default | description |", "|---|---|---|---|"]
        for s in by_section[sec]:
            lines.append(f"| {_code(s.key)} | {_code(s.type)} | {_code(s.default)} | {_cell(s.description) or '–'} |")
        lines.append("")
    return "\n".join(lines)


# --- the CLI reference -----------------------------------------------------------------------------------------
# Typer 0.29 builds its commands on a click of its own (typer._click), so these helpers duck-type: a group is a
# command with list_commands, an argument a parameter whose param_type_name is "argument".
def _context(cmd: Any, path: list[str], parent: Any = None) -> Any:
    import typer

    return typer.Context(cmd, info_name=" ".join(path), parent=parent)


def _commands(group: Any, path: list[str], parent: Any = None) -> Iterator[tuple[list[str], Any, Any]]:
    """(path, command, context) for every visible command under ``group``, groups before their members."""
    ctx = _context(group, path, parent)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or getattr(cmd, "hidden", False):
            continue
        yield path + [name], cmd, _context(cmd, path + [name], ctx)
        if hasattr(cmd, "list_commands"):
            yield from _commands(cmd, path + [name], ctx)


def _param_type(p: Any) -> str:
    if getattr(p, "is_flag", False):
        return "flag"
    annotation = getattr(getattr(p, "type_descriptor", None), "annotation", None)
    if annotation is not None:
        if getattr(p, "multiple", False) and typing.get_origin(annotation) is list:
            (annotation,) = typing.get_args(annotation)  # a repeatable option: the type of one value
        kind = _type_name(annotation)
    else:  # a plain click parameter
        kind = getattr(getattr(p, "type", None), "name", "text")
    return {"str": "text", "Path": "path"}.get(kind, kind)


def _param_default(p: Any) -> str:
    d = p.default
    if callable(d) or d is None or d == () or d == [] or getattr(p, "required", False):
        return "–"
    if getattr(p, "is_flag", False):
        if getattr(p, "secondary_opts", None):
            return _code(p.opts[0] if d else p.secondary_opts[0])
        return "on" if d else "off"
    return _code(str(d))


def cli_markdown() -> str:
    import typer

    from flows.cli import app

    root = typer.main.get_command(app)
    lines = [
        "# Command-line reference",
        "",
        "<!-- generated by docs/gen_reference.py from flows/cli.py: edit the CLI, not this page -->",
        "",
        "Every command of `scalinginter` (the console script of `flows.cli`), generated from the CLI itself when "
        "the site is built. `scalinginter COMMAND --help` prints the same. The benchmark scripts under `bench/` "
        "and `python -m runtime.backends.deepspeed_learner join` (several machines) have their own `--help`.",
        "",
        " ".join((root.help or "").split()),
        "",
    ]
    for path, cmd, ctx in _commands(root, ["scalinginter"]):
        lines += [f"## `{' '.join(path)}`", ""]
        text = " ".join((cmd.help or "").split())
        if text:
            lines += [text, ""]
        if hasattr(cmd, "list_commands"):
            subs = ", ".join(f"`{n}`" for n in cmd.list_commands(ctx))
            lines += [f"Subcommands: {subs}.", ""]
            continue
        usage = [re.sub(r"^\{(\w+)\}$", lambda m: m.group(1).upper(), u) for u in cmd.collect_usage_pieces(ctx)]
        lines += ["```text", " ".join(path + usage), "```", ""]
        params = [p for p in cmd.params if p.name != "help" and not getattr(p, "hidden", False)]
        if params:
            lines += ["| argument or option | type | default | description |", "|---|---|---|---|"]
            for p in params:
                if getattr(p, "param_type_name", "") == "argument":
                    name = p.name.upper()
                else:
                    name = ", ".join(list(p.opts) + [f"{o}" for o in getattr(p, "secondary_opts", [])])
                kind = _param_type(p)
                if getattr(p, "multiple", False):
                    kind += ", repeatable"
                if getattr(p, "required", False):
                    kind += ", required"
                desc = " ".join((getattr(p, "help", None) or "").split())
                lines.append(f"| {_code(name)} | {_cell(kind)} | {_param_default(p)} | {_cell(desc) or '–'} |")
            lines.append("")
    return "\n".join(lines)


# --- the MkDocs hook -------------------------------------------------------------------------------------------
GENERATED = {"reference/config.md": config_markdown, "reference/cli.md": cli_markdown}


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages and the result files (``bench/results/**``, Markdown left out: the site would
    render it as pages of its own) to the site."""
    from mkdocs.structure.files import File

    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    results = ROOT / "bench" / "results"
    for path in sorted(results.rglob("*")):
        if path.is_file() and path.suffix != ".md":
            uri = path.relative_to(ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "config"
    print({"config": config_markdown, "cli": cli_markdown}[which]())
