"""The oracle policy for the embedded default set (pure): it follows a question's ``plan`` — search the
entity by name, read the fact out of the returned passages, search the next entity, answer.

It never sees the gold answers: every value it answers with is read from the ``<information>`` block the
env returned. High accuracy therefore shows that the corpus, the retriever and the scorer agree.

Stateless: the next reply is a function of the latest observation and the env's ``info`` (the ``plan``,
the number of searches made so far and the last query), so it works in-process and over HTTP alike.
"""

from __future__ import annotations

import re
from typing import Any, Optional

# words added to a name so that a search finds the passage holding the relation, not just the entity
KEYWORDS = {
    "capital": "capital",
    "currency": "currency",
    "language": "official language",
    "demonym": "people called",
    "calling_code": "international calling code",
    "neighbour": "neighbouring countries",
    "region": "region",
    "country_by_capital": "capital",
    "country_by_tld": "internet country code top-level domain",
    "country_by_division": "administrative division",
}
_END = r"\.?(?=\s+The\s|\s*$)"  # a fact sentence ends before the next 'The ...' sentence or the passage end
# relation -> regex with groups (subject, value) over one passage's text
_SUBJECT_RE = {
    "capital": r"The capital of (.+?) is (.+?)" + _END,
    "currency": r"The currenc(?:y|ies) of (.+?) (?:is|are) (.+?)" + _END,
    "language": r"The official languages? of (.+?) (?:is|are) (.+?)" + _END,
    "demonym": r"The people of (.+?) are called (.+?)" + _END,
    "calling_code": r"The international calling code of (.+?) is (.+?)" + _END,
    "neighbour": r"The neighbouring countr(?:y|ies) of (.+?) (?:is|are) (.+?)" + _END,
    "region": r"The region of (.+?) is (.+?)" + _END,
}
# relation -> regex template (argument inserted) with one group, the subject (a country)
_ARG_RE = {
    "country_by_capital": r"The capital of (.+?) is {arg}" + _END,
    "country_by_tld": r"The internet country code top-level domain of (.+?) is {arg}" + _END,
    "country_by_division": r"The administrative division {arg} is a first-level division of the country (.+?)" + _END,
}
_DOC = re.compile(r"^Doc \d+\(Title: (.*?)\) (.*)$")


def parse_information(observation: str) -> list[tuple[str, str]]:
    """(title, text) of each passage in an ``<information>`` block, in rank order."""
    m = re.search(r"<information>(.*?)</information>", observation, re.DOTALL)
    if not m:
        return []
    docs = []
    for line in m.group(1).strip().splitlines():
        d = _DOC.match(line.strip())
        if d:
            docs.append((d.group(1), d.group(2)))
    return docs


def query_for(step: dict[str, Any], prev: Optional[str]) -> str:
    entity = step.get("arg") or step.get("subject") or prev
    if not entity:
        raise ValueError(f"plan step {step} has no entity and there is no previous value")
    return f"{entity} {KEYWORDS[step['relation']]}"


def extract(step: dict[str, Any], docs: list[tuple[str, str]], last_query: str) -> Optional[str]:
    """The value of ``step``'s relation in the first passage that states it about the searched entity."""
    rel = step["relation"]
    if rel in _ARG_RE:
        pat = re.compile(_ARG_RE[rel].format(arg=re.escape(step["arg"])))
        for _, text in docs:
            m = pat.search(text)
            if m:
                return m.group(1).strip()
        return None
    pat = re.compile(_SUBJECT_RE[rel])
    q = last_query.lower()
    for _, text in docs:
        for m in pat.finditer(text):
            subject, value = m.group(1).strip(), m.group(2).strip()
            if subject.lower() in q:
                return value.split(", ")[0].strip()  # lists: the first item
    return None


def oracle_reply(observation: str, info: dict[str, Any]) -> Optional[str]:
    """The oracle's next reply, or None when the task has no plan or the passages do not give the fact."""
    plan = info.get("plan")
    if not plan:
        return None
    k = int(info.get("n_searches", 0))
    if k == 0:
        return f"<search>{query_for(plan[0], None)}</search>"
    if k > len(plan):
        return None
    value = extract(plan[k - 1], parse_information(observation), str(info.get("last_query") or ""))
    if value is None:
        return None
    if k == len(plan):
        return f"<answer>{value}</answer>"
    return f"<think>Found {value}.</think><search>{query_for(plan[k], value)}</search>"
