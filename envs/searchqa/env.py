"""Deep search (retrieval QA) as a ScalingInter text environment.

The agent answers a question by searching a local corpus: ``<search>query</search>`` returns the top-k
passages as ``<information>Doc 1(Title: t) text ... Doc k(Title: t) text</information>``;
``<answer>text</answer>`` ends the episode. Reasoning inside ``<think>...</think>`` is ignored.

**One final answer**: the first answer ends the episode; reward = exact match after the standard answer
normalisation against any gold answer (1.0 or 0.0), ``info["f1"]`` reports token F1. Training and
evaluation use the same rule (the AgentGym version let the agent answer again after "wrong").

Data: by default the embedded country-facts set (``envs.searchqa.build_default``, built into the cache on
first use); or your own files: ``corpus`` (wiki-18 style JSONL), ``train_questions`` / ``test_questions``
(FlashRAG / Search-R1 JSONL or Parquet; a comma-separated list mixes datasets). Task index -> question:
test ``TEST_OFFSET + i`` is test question ``i`` (``i >= num_tasks("test")`` is a ValueError); train
indices wrap around the train questions (``data_idx % num_tasks("train")``), so any ``env.task_pool`` works.

The corpus store, the questions and the retriever are loaded once per process and shared by every env
instance (the env server creates one instance per episode slot); searches from concurrent steps are
batched (``BatchingRetriever``). Options: ``retriever`` ('bm25' | 'dense'), ``topk``, ``max_passage_chars``,
``batch_wait_ms``, ``max_batch``, ``cache_dir``, ``progress``, plus the retriever's own options (bm25: ``k1``,
``b``, ``stemmer``, ``threads``; dense: ``encoder``, ``index_type`` ('flat' | 'ivf'), ``nlist``, ``nprobe``,
``pooling``, ``query_prefix``, ``passage_prefix``, ``device``, ``batch_size``, ``fp16``, ``index_path``,
``faiss_gpu``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from envs.base import TEST_OFFSET, StepResult, split_of
from envs.searchqa.data import DocStore, Passage, Question, as_paths, cache_root, load_questions
from envs.searchqa.parse import parse_reply
from envs.searchqa.retriever import BatchingRetriever, make_retriever
from envs.searchqa.scoring import exact_match, f1_score

INSTRUCTION = (
    "Answer the question. To look something up, write <search>your query</search>; the best passages come "
    "back inside <information>...</information>. You may search several times. When you know the answer, "
    "write <answer>short answer</answer> (a name or a few words). Your first answer is final. "
    "You may think inside <think>...</think> first. One action per reply: a search or an answer."
)


@dataclass
class Resources:
    store: DocStore
    questions: dict[str, list[Question]]
    retriever: BatchingRetriever


_RESOURCES: dict[str, Resources] = {}
_RES_LOCK = threading.Lock()


def shared_resources(corpus: Optional[str], train_questions: Any, test_questions: Any, retriever_options: dict,
                     cache_dir: Optional[str], max_batch: int, batch_wait_ms: float) -> Resources:
    """Load (once per process) the corpus store, the question sets and the retriever."""
    if corpus is None:
        from envs.searchqa.build_default import ensure_default

        d = ensure_default()
        corpus = str(d / "corpus.jsonl")
        train_questions = str(d / "train.jsonl") if train_questions is None else train_questions
        test_questions = str(d / "test.jsonl") if test_questions is None else test_questions
    key = json.dumps([str(Path(corpus).resolve()), [str(p.resolve()) for p in as_paths(train_questions)],
                      [str(p.resolve()) for p in as_paths(test_questions)], retriever_options, cache_dir,
                      max_batch, batch_wait_ms], sort_keys=True, default=str)
    with _RES_LOCK:
        if key not in _RESOURCES:
            root = Path(cache_dir) if cache_dir else cache_root()
            store = DocStore(corpus, cache_dir=root / "searchqa" / "docstore")
            questions = {"train": load_questions(train_questions), "test": load_questions(test_questions)}
            opts = dict(retriever_options)
            opts["cache_dir"] = root / "searchqa" / "index"
            inner = make_retriever(store, opts)
            _RESOURCES[key] = Resources(store, questions, BatchingRetriever(inner, max_batch=max_batch,
                                                                             wait_ms=batch_wait_ms))
        return _RESOURCES[key]


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text[:n].rsplit(" ", 1)[0]
    return cut + " ..."


def render_information(passages: list[Passage], max_chars: int) -> str:
    if not passages:
        return "<information>No passage matches this query; try other words.</information>"
    docs = "\n".join(f"Doc {i}(Title: {p.title}) {_clip(p.text, max_chars)}" for i, p in enumerate(passages, 1))
    return f"<information>{docs}</information>"


class SearchQAEnv:
    name = "searchqa"

    def __init__(self, corpus: Optional[str] = None, train_questions: Any = None, test_questions: Any = None,
                 retriever: str = "bm25", topk: int = 3, max_passage_chars: int = 800, max_query_chars: int = 300,
                 batch_wait_ms: float = 2.0, max_batch: int = 64, cache_dir: Optional[str] = None,
                 progress: bool = True, **retriever_options: Any):
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if max_passage_chars < 20 or max_query_chars < 1:
            raise ValueError("max_passage_chars must be >= 20 and max_query_chars >= 1")
        self.topk, self.max_passage_chars, self.max_query_chars = int(topk), int(max_passage_chars), int(max_query_chars)
        opts = {"retriever": retriever, "progress": bool(progress), **retriever_options}
        self._res = shared_resources(corpus, train_questions, test_questions, opts, cache_dir,
                                     int(max_batch), float(batch_wait_ms))
        self._q: Optional[Question] = None
        self._data_idx: Optional[int] = None
        self._done = True
        self._n_searches = 0
        self._last_query = ""
        self._obs = ""

    # --- TextEnv ---------------------------------------------------------------------------------------
    def instruction(self) -> str:
        return INSTRUCTION

    def num_tasks(self, split: str) -> int:
        if split not in self._res.questions:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return len(self._res.questions[split])

    def question(self, data_idx: int) -> Question:
        split = split_of(data_idx)
        qs = self._res.questions[split]
        if not qs:
            raise ValueError(f"no {split} questions configured (pass {split}_questions=PATH)")
        if split == "train":
            return qs[data_idx % len(qs)]
        i = data_idx - TEST_OFFSET
        if i >= len(qs):
            raise ValueError(f"data_idx {data_idx} out of range: the test split has {len(qs)} questions "
                             f"(valid: [{TEST_OFFSET}, {TEST_OFFSET + len(qs)}))")
        return qs[i]

    def reset(self, data_idx: int) -> tuple[str, dict[str, Any]]:
        data_idx = int(data_idx)
        q = self.question(data_idx)
        self._q, self._data_idx = q, data_idx
        self._done, self._n_searches, self._last_query = False, 0, ""
        self._obs = f"Question: {q.question}"
        return self._obs, self._info(False, data_idx=data_idx, split=split_of(data_idx), question_id=q.id,
                                     question=q.question, type=q.metadata.get("type"),
                                     category=hop_category(q.metadata))

    def step(self, action: str) -> StepResult:
        if self._q is None:
            raise RuntimeError("searchqa env: step() before reset()")
        if self._done:
            raise RuntimeError("searchqa env: step() after the episode ended; call reset()")
        parsed = parse_reply(action)
        if not parsed.ok:
            self._obs = f"Invalid reply: {parsed.error}"
            return StepResult(self._obs, 0.0, False, False, self._info(False, invalid_action=True, error=parsed.error))
        act = parsed.action
        if act.kind == "search":
            query = act.text[: self.max_query_chars]
            hits, batch = self._res.retriever.search_counted(query, self.topk)
            passages = [self._res.store.get(h.row) for h in hits]
            self._n_searches += 1
            self._last_query = query
            self._obs = render_information(passages, self.max_passage_chars)
            return StepResult(self._obs, 0.0, False, False,
                              self._info(False, action="search", query=query, retrieved=[p.id for p in passages],
                                         search_batch=batch))
        # the one final answer
        golds = list(self._q.golden_answers)
        em, f1 = exact_match(act.text, golds), f1_score(act.text, golds)
        self._done = True
        verdict = "correct" if em else "not correct"
        self._obs = f"Your final answer '{act.text}' is {verdict}. The episode is over."
        return StepResult(self._obs, em, True, False,
                          self._info(em == 1.0, action="answer", answer=act.text, em=em, f1=f1, golden_answers=golds))

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self._q, self._done = None, True

    # --- helpers ---------------------------------------------------------------------------------------
    def _info(self, success: bool, **extra: Any) -> dict[str, Any]:
        info: dict[str, Any] = {"success": bool(success), "n_searches": self._n_searches,
                                "last_query": self._last_query}
        plan = self._q.metadata.get("plan") if self._q is not None else None
        if plan:
            info["plan"] = plan
        info.update(extra)
        # for the eval/train metrics: F1 of the final answer (0 until one is given) and searches made
        info["episode_metrics"] = {"f1": float(extra.get("f1", 0.0)), "searches": float(self._n_searches)}
        return info


def hop_category(metadata: dict[str, Any]) -> str:
    """A question's category for per-category eval scores: its hop count (``metadata["hops"]``, or the length of
    its oracle ``plan``), else its ``type``, else "-"."""
    hops = metadata.get("hops")
    if hops is None and isinstance(metadata.get("plan"), list):
        hops = len(metadata["plan"])
    if hops is not None:
        try:
            return f"{int(hops)}-hop"
        except (TypeError, ValueError):
            pass
    return str(metadata.get("type") or "-")
