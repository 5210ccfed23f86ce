"""Answer scoring for retrieval QA (pure): the standard normalisation, exact match and token F1.

Normalisation (the SQuAD / NQ / HotpotQA convention used by FlashRAG and Search-R1): lower case, drop ASCII
punctuation, drop the articles "a", "an", "the", collapse whitespace. Exact match is 1.0 when the normalised
prediction equals any normalised gold answer; F1 is the best token-overlap F1 over the gold answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """'The  Australian-Dollar.' -> 'australiandollar'; 'an Apple, the pie' -> 'apple pie'."""
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(gold_answers: str | Iterable[str]) -> list[str]:
    golds = [gold_answers] if isinstance(gold_answers, str) else list(gold_answers)
    if not golds:
        raise ValueError("no gold answers to score against")
    return [str(g) for g in golds]


def exact_match(prediction: str, gold_answers: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(gold_answers)))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold_answers: str | Iterable[str]) -> float:
    """Best token-level F1 (over normalised tokens) between the prediction and any gold answer."""
    pred = normalize_answer(prediction).split()
    return max(_f1(pred, normalize_answer(g).split()) for g in _golds(gold_answers))
