"""Build the embedded default search-QA set offline from data a package carries (``countryinfo`` for country
facts, ``pycountry`` for language and currency names). Small and synthetic in style, real in content: for
development and CI, not a benchmark.

Corpus (wiki-18 format, one JSON line per passage, ``{"id", "contents": "\\"Title\\"\\ntext"}``):

* per country, up to three passages titled with its name: an overview (region, subregion, capital,
  population, area, demonym), society (official languages, currencies, calling code, internet domain) and
  geography (land neighbours, first-level administrative divisions, split into chunks when long);
* per administrative division, a one-sentence passage naming its country (thousands of near-duplicate
  distractors, so that a search has to be specific).

Every fact sentence starts with "The " and ends with ".", which lets the oracle (``envs.searchqa.oracle``)
read facts back out of retrieved passages.

Questions (FlashRAG format: ``id``, ``question``, ``golden_answers``, ``metadata``): single-hop (capital,
country of a capital / internet domain / division, currency, official language, demonym, calling code,
neighbour, region) and two-hop bridge questions ("What currency is used in the country whose capital is
Canberra?"). ``metadata`` holds ``type``, ``hops`` and the oracle ``plan``. Split: about one country in five
(by a hash of its name) is held out; a question belongs to the split of the country it is about, so test
questions ask about countries no train question is about. Everything is sorted and seeded: two builds
give byte-identical files.

    python -m envs.searchqa.build_default --out DIR      # or let the env build it into the cache on first use
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from envs.searchqa.data import cache_root

BUILD_VERSION = 1
TEST_EVERY = 5  # one country in TEST_EVERY (by name hash) is held out
DIVISIONS_PER_CHUNK = 30
FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl", "meta.json")
_FUND_CURRENCIES = {"USN", "USS", "CHE", "CHW", "BOV", "CLF", "UYI", "MXV", "COU", "XDR", "XSU", "XUA"}


# --- facts ----------------------------------------------------------------------------------------------
def _h(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def _clean_name(name: str) -> str:
    return re.sub(r"\s*\([^)]*\)", "", name).strip()


def _list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def load_facts() -> list[dict[str, Any]]:
    """One dict per country with readable facts, sorted by name."""
    try:
        import pycountry
        from countryinfo import all_countries
    except ImportError as e:
        raise ImportError("building the default search-QA set needs the 'countryinfo' and 'pycountry' packages "
                          "(pip install -e '.[searchqa]')") from e
    raw = sorted((c.info() for c in all_countries()), key=lambda d: d["name"])
    code_to_name: dict[str, str] = {}
    for d in raw:
        for k in ("alpha2", "alpha3"):
            if (d.get("ISO") or {}).get(k):
                code_to_name[d["ISO"][k]] = d["name"]
    facts = []
    for d in raw:
        name = d["name"].strip()
        capital = next((c.strip() for c in _list(d.get("capital")) if isinstance(c, str) and c.strip()), None)
        langs = []
        for code in _list(d.get("languages")):
            lang = pycountry.languages.get(alpha_2=code) if len(code) == 2 else pycountry.languages.get(alpha_3=code)
            if lang is not None and _clean_name(lang.name) not in langs:
                langs.append(_clean_name(lang.name))
        currencies = []
        for code in _list(d.get("currencies")):
            cur = pycountry.currencies.get(alpha_3=code)
            if cur is not None and code not in _FUND_CURRENCIES and "(" not in cur.name:
                currencies.append((cur.name, code))
        tld = next((t for t in _list(d.get("tld")) if re.fullmatch(r"\.[a-z]{2}", t or "")), None)
        calling = [f"+{c}" for c in _list(d.get("callingCodes")) if str(c).isdigit()]
        demonyms = [x.strip() for x in str(d.get("demonym") or "").split(",") if x.strip()]
        borders = sorted({code_to_name[b] for b in _list(d.get("borders")) if b in code_to_name} - {name})
        divisions = sorted({p.strip() for p in _list(d.get("provinces")) if isinstance(p, str) and p.strip()}
                           - {name})
        alt = [a for a in _list(d.get("altSpellings")) if isinstance(a, str) and len(a) > 3 and not a.isupper()]
        facts.append({
            "name": name, "aliases": [name] + [a for a in alt if a != name], "capital": capital,
            "region": (d.get("region") or "").strip() or None, "subregion": (d.get("subregion") or "").strip() or None,
            "population": d.get("population") if isinstance(d.get("population"), int) else None,
            "area": d.get("area") if isinstance(d.get("area"), (int, float)) else None,
            "demonyms": demonyms, "languages": langs, "currencies": currencies, "calling": calling, "tld": tld,
            "borders": borders, "divisions": divisions,
        })
    return facts


# --- passages ---------------------------------------------------------------------------------------------
def _s(text: str) -> str:
    """A sentence: no double period when the value already ends with one ('Washington D.C.')."""
    return text if text.endswith(".") else text + "."


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:g}"


def render_country(f: dict[str, Any]) -> list[str]:
    """The passages (texts) of one country, each a run of 'The ... .' sentences."""
    s = f["name"]
    overview = []
    if f["region"]:
        overview.append(_s(f"The region of {s} is {f['region']}"))
    if f["subregion"]:
        overview.append(_s(f"The subregion of {s} is {f['subregion']}"))
    if f["capital"]:
        overview.append(_s(f"The capital of {s} is {f['capital']}"))
    if f["population"]:
        overview.append(_s(f"The population of {s} is {_num(f['population'])}"))
    if f["area"]:
        overview.append(_s(f"The area of {s} is {_num(f['area'])} square kilometres"))
    if f["demonyms"]:
        overview.append(_s(f"The people of {s} are called {', '.join(f['demonyms'])}"))
    society = []
    if f["languages"]:
        many = len(f["languages"]) > 1
        society.append(_s(f"The official language{'s' if many else ''} of {s} {'are' if many else 'is'} "
                          + ", ".join(f["languages"])))
    if f["currencies"]:
        many = len(f["currencies"]) > 1
        society.append(_s(f"The {'currencies' if many else 'currency'} of {s} {'are' if many else 'is'} "
                          + ", ".join(n for n, _ in f["currencies"])))
    if f["calling"]:
        society.append(_s(f"The international calling code of {s} is {', '.join(f['calling'])}"))
    if f["tld"]:
        society.append(_s(f"The internet country code top-level domain of {s} is {f['tld']}"))
    geo = []
    if f["borders"]:
        many = len(f["borders"]) > 1
        geo.append(_s(f"The neighbouring countr{'ies' if many else 'y'} of {s} {'are' if many else 'is'} "
                      + ", ".join(f["borders"])))
    elif f["region"]:
        geo.append(_s(f"The country {s} has no land borders"))
    passages = [" ".join(p) for p in (overview, society) if p]
    divs = f["divisions"]
    chunks = [divs[i : i + DIVISIONS_PER_CHUNK] for i in range(0, len(divs), DIVISIONS_PER_CHUNK)]
    for i, chunk in enumerate(chunks or [[]]):
        text = list(geo) if i == 0 else []
        if chunk:
            text.append(_s(f"The first-level administrative divisions of {s} include {', '.join(chunk)}"))
        if text:
            passages.append(" ".join(text))
    return passages


def render_division(division: str, country: str) -> str:
    return _s(f"The administrative division {division} is a first-level division of the country {country}")


# --- questions ----------------------------------------------------------------------------------------------
def _step(relation: str, subject: str | None = None, arg: str | None = None) -> dict[str, Any]:
    return {"relation": relation, "subject": subject, "arg": arg}


TEMPLATES: dict[str, tuple[str, ...]] = {
    "capital": ("What is the capital of {S}?", "Which city is the capital of {S}?"),
    "country_by_capital": ("{C} is the capital of which country?", "Which country has {C} as its capital?"),
    "currency": ("What currency is used in {S}?", "What is the currency of {S}?"),
    "language": ("What is an official language of {S}?", "Name an official language of {S}."),
    "demonym": ("What are people from {S} called?", "What is the demonym of {S}?"),
    "calling_code": ("What is the international calling code of {S}?", "What is the telephone country code of {S}?"),
    "country_by_tld": ("Which country uses the internet domain {T}?", "The top-level domain {T} belongs to which country?"),
    "country_by_division": ("{P} is an administrative division of which country?",
                            "In which country is the administrative division {P}?"),
    "neighbour": ("Name a country that shares a land border with {S}.", "Which country is a neighbour of {S}?"),
    "region": ("In which world region is {S}?",),
    "currency_of_capital_country": ("What currency is used in the country whose capital is {C}?",),
    "language_of_capital_country": ("What is an official language of the country whose capital is {C}?",),
    "demonym_of_capital_country": ("What are the people of the country whose capital is {C} called?",),
    "capital_of_division_country": ("What is the capital of the country that contains the administrative division {P}?",),
    "currency_of_division_country": ("What currency is used in the country that contains the administrative division {P}?",),
    "calling_code_of_tld_country": ("What is the calling code of the country whose internet domain is {T}?",),
    "capital_of_neighbour": ("What is the capital of a country that borders {S}?",),
}


def make_questions(facts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {f["name"]: f for f in facts}
    capital_count = Counter(f["capital"] for f in facts if f["capital"])
    tld_count = Counter(f["tld"] for f in facts if f["tld"])
    div_count = Counter(d for f in facts for d in f["divisions"])
    names = set(by_name)
    out: list[dict[str, Any]] = []

    def add(kind: str, about: str, answers: list[str], plan: list[dict[str, Any]], **slots: str) -> None:
        answers = list(dict.fromkeys(a for a in answers if a))
        if not answers:
            return
        rng = random.Random(f"searchqa-{BUILD_VERSION}-{kind}-{about}-{sorted(slots.items())}")
        text = rng.choice(TEMPLATES[kind]).format(**slots)
        out.append({"question": text, "golden_answers": answers, "about": about,
                    "metadata": {"type": kind, "hops": len(plan), "plan": plan}})

    def currency_answers(f):
        return [n for n, _ in f["currencies"]] + [c for _, c in f["currencies"]]

    for f in facts:
        s = f["name"]
        cap_ok = f["capital"] and capital_count[f["capital"]] == 1 and f["capital"] not in names
        tld_ok = f["tld"] and tld_count[f["tld"]] == 1
        if f["capital"]:
            add("capital", s, [f["capital"]], [_step("capital", subject=s)], S=s)
        if cap_ok:
            add("country_by_capital", s, f["aliases"], [_step("country_by_capital", arg=f["capital"])], C=f["capital"])
        add("currency", s, currency_answers(f), [_step("currency", subject=s)], S=s)
        add("language", s, f["languages"], [_step("language", subject=s)], S=s)
        add("demonym", s, f["demonyms"], [_step("demonym", subject=s)], S=s)
        add("calling_code", s, f["calling"], [_step("calling_code", subject=s)], S=s)
        if tld_ok:
            add("country_by_tld", s, f["aliases"], [_step("country_by_tld", arg=f["tld"])], T=f["tld"])
        add("neighbour", s, f["borders"], [_step("neighbour", subject=s)], S=s)
        if f["region"]:
            add("region", s, [f["region"]], [_step("region", subject=s)], S=s)
        if cap_ok:
            first = _step("country_by_capital", arg=f["capital"])
            add("currency_of_capital_country", s, currency_answers(f), [first, _step("currency")], C=f["capital"])
            add("language_of_capital_country", s, f["languages"], [first, _step("language")], C=f["capital"])
            add("demonym_of_capital_country", s, f["demonyms"], [first, _step("demonym")], C=f["capital"])
        if tld_ok:
            add("calling_code_of_tld_country", s, f["calling"],
                [_step("country_by_tld", arg=f["tld"]), _step("calling_code")], T=f["tld"])
        divs = [d for d in f["divisions"] if div_count[d] == 1 and d not in names and d != f["capital"]]
        if divs:
            rng = random.Random(f"searchqa-{BUILD_VERSION}-divisions-{s}")
            picks = rng.sample(divs, min(3, len(divs)))
            add("country_by_division", s, f["aliases"], [_step("country_by_division", arg=picks[0])], P=picks[0])
            if f["capital"]:
                p = picks[1 % len(picks)]
                add("capital_of_division_country", s, [f["capital"]],
                    [_step("country_by_division", arg=p), _step("capital")], P=p)
            p = picks[2 % len(picks)]
            add("currency_of_division_country", s, currency_answers(f),
                [_step("country_by_division", arg=p), _step("currency")], P=p)
        capitals = [by_name[b]["capital"] for b in f["borders"] if by_name[b]["capital"]]
        if len(capitals) == len(f["borders"]):  # the oracle follows the first neighbour listed
            add("capital_of_neighbour", s, capitals, [_step("neighbour", subject=s), _step("capital")], S=s)
    return out


def is_test_country(name: str) -> bool:
    return _h(f"searchqa-split-{name}") % TEST_EVERY == 0


# --- build ------------------------------------------------------------------------------------------------
def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def build(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Write corpus.jsonl, train.jsonl, test.jsonl and meta.json into ``out_dir`` (atomically). Returns meta."""
    out = Path(out_dir)
    facts = load_facts()
    corpus: list[dict[str, Any]] = []
    for f in facts:
        for text in render_country(f):
            corpus.append({"id": str(len(corpus)), "contents": f'"{f["name"]}"\n{text}'})
    for f in facts:
        for d in f["divisions"]:
            corpus.append({"id": str(len(corpus)), "contents": f'"{d}"\n{render_division(d, f["name"])}'})
    questions = make_questions(facts)
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for q in questions:
        splits["test" if is_test_country(q.pop("about")) else "train"].append(q)
    for name, rows in splits.items():
        random.Random(f"searchqa-{BUILD_VERSION}-order-{name}").shuffle(rows)
        for i, q in enumerate(rows):
            rows[i] = {"id": f"{name}-{i:05d}", **q}
    meta = {
        "build_version": BUILD_VERSION,
        "sources": {"countryinfo": _version("countryinfo"), "pycountry": _version("pycountry")},
        "passages": len(corpus), "countries": len(facts),
        "train": len(splits["train"]), "test": len(splits["test"]),
        "types": dict(sorted(Counter(q["metadata"]["type"] for q in questions).items())),
        "multi_hop": {s: sum(q["metadata"]["hops"] > 1 for q in rows) for s, rows in splits.items()},
    }
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _write_jsonl(tmp / "corpus.jsonl", corpus)
    _write_jsonl(tmp / "train.jsonl", splits["train"])
    _write_jsonl(tmp / "test.jsonl", splits["test"])
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return meta


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "?"


def default_dir() -> Path:
    """Where the default set lives: the cache, keyed by the build version and the source package versions."""
    return cache_root() / "searchqa" / (
        f"default-v{BUILD_VERSION}-countryinfo{_version('countryinfo')}-pycountry{_version('pycountry')}")


def ensure_default() -> Path:
    """Build the default set into the cache unless it is there; returns its directory."""
    from envs.searchqa.retriever import _build_lock

    d = default_dir()
    if all((d / n).exists() for n in FILES):
        return d
    with _build_lock(d.with_suffix(".lock")):
        if not all((d / n).exists() for n in FILES):
            build(d)
    return d


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.searchqa.build_default", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default: the cache folder the env uses)")
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else default_dir()
    meta = build(out)
    print(json.dumps(meta, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
