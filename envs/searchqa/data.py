"""Corpus and question files in the formats of the original deep-search setup.

Corpus (wiki-18 / FlashRAG style): JSONL, one passage per line, ``{"id": ..., "contents": "\\"Title\\"\\ntext"}``
(``{"id", "title", "text"}`` is accepted too). Row ``i`` of the corpus is passage ``i`` of every index built
over it (a prebuilt FAISS index must use the same order, as the Search-R1 ``e5_Flat.index`` does).
``DocStore`` keeps only the byte offsets of the lines in memory and reads passages with ``os.pread``, so a
21 M-passage corpus costs ~170 MB of RAM, and reads are thread-safe.

Questions (FlashRAG / Search-R1 style): JSONL or Parquet rows with ``question`` and ``golden_answers`` (a
list or a string); ``answers`` / ``answer`` / ``reward_model.ground_truth.target`` are accepted as fallbacks,
``id`` and ``metadata`` are kept when present.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from envs.cache import cache_root  # noqa: F401  (re-exported: retriever, env, build_default use it)


@dataclass(frozen=True)
class Passage:
    row: int  # line number in the corpus (the index position)
    id: str
    title: str
    text: str


def split_contents(contents: str) -> tuple[str, str]:
    """'"Title"\\ntext' -> ('Title', 'text'); without a newline the title is empty."""
    head, sep, rest = str(contents).partition("\n")
    if not sep:
        return "", head.strip()
    return head.strip().strip('"').strip(), rest.strip()


def passage_from_record(row: int, rec: dict[str, Any]) -> Passage:
    if "contents" in rec:
        title, text = split_contents(rec["contents"])
    elif "text" in rec:
        title, text = str(rec.get("title") or "").strip(), str(rec["text"]).strip()
    else:
        raise ValueError(f"corpus line {row + 1}: expected a 'contents' (or 'text') field, got keys {sorted(rec)}")
    return Passage(row, str(rec.get("id", row)), title, text)


def index_text(p: Passage) -> str:
    """What the indexes see: title and text (the title matters for entity queries)."""
    return f"{p.title}\n{p.text}" if p.title else p.text


def file_fingerprint(path: str | os.PathLike) -> str:
    """Cheap content fingerprint: size + SHA-256 of the first and last MiB (no mtime, so copies match)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]


def line_offsets(path: str | os.PathLike, chunk: int = 1 << 24) -> np.ndarray:
    """Byte offsets of the non-empty lines of a file, plus the file size at the end (len = lines + 1)."""
    starts: list[np.ndarray] = []
    pos = 0
    prev_newline = True
    with open(path, "rb") as f:
        while True:
            buf = f.read(chunk)
            if not buf:
                break
            arr = np.frombuffer(buf, dtype=np.uint8)
            nl = np.flatnonzero(arr == 10)
            cand = np.concatenate([[0] if prev_newline else [], nl + 1]).astype(np.int64)
            cand = cand[cand < len(arr)]
            cand = cand[(arr[cand] != 10) & (arr[cand] != 13)]  # skip blank lines
            starts.append(cand + pos)
            prev_newline = buf[-1] == 10
            pos += len(buf)
    offs = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    return np.concatenate([offs, [pos]]).astype(np.int64)


class DocStore:
    """Random access to the passages of a JSONL corpus by row."""

    def __init__(self, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus file {str(self.path)!r} does not exist")
        self.fingerprint = file_fingerprint(self.path)
        cache = Path(cache_dir) if cache_dir else cache_root() / "searchqa" / "docstore"
        cached = cache / f"{self.path.stem}-{self.fingerprint}.offsets.npy"
        if cached.exists():
            offs = np.load(cached)
        else:
            offs = line_offsets(self.path)
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, offs)
            os.replace(tmp, cached)
        self._offsets = offs
        self._fd = os.open(self.path, os.O_RDONLY)
        if len(self) == 0:
            raise ValueError(f"corpus file {str(self.path)!r} has no passages")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def raw(self, row: int) -> bytes:
        if not 0 <= row < len(self):
            raise IndexError(f"passage row {row} out of range [0, {len(self)})")
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        return os.pread(self._fd, end - start, start)

    def get(self, row: int) -> Passage:
        line = self.raw(row).decode("utf-8").strip()
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}: line {row + 1} is not valid JSON: {e}") from None
        return passage_from_record(row, rec)

    def __iter__(self) -> Iterator[Passage]:
        """All passages in order (streamed, for index building)."""
        with open(self.path, "rb") as f:
            row = 0
            for line in f:
                if line in (b"\n", b"\r\n"):
                    continue
                yield passage_from_record(row, json.loads(line))
                row += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


# --- questions -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    id: str
    question: str
    golden_answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


def _answers_of(rec: dict[str, Any]) -> list[str]:
    for key in ("golden_answers", "answers", "answer"):
        if rec.get(key) is not None:
            val = rec[key]
            break
    else:
        val = (((rec.get("reward_model") or {}).get("ground_truth") or {}) or {})
        val = val.get("target") if isinstance(val, dict) else None
    if val is None:
        return []
    if isinstance(val, str):
        return [val]
    if hasattr(val, "tolist"):
        val = val.tolist()
    return [str(v) for v in val if str(v).strip()]


def question_from_record(i: int, rec: dict[str, Any], source: str) -> Question:
    q = rec.get("question")
    if not isinstance(q, str) or not q.strip():
        raise ValueError(f"{source}: row {i + 1} has no 'question' text (keys: {sorted(rec)})")
    answers = _answers_of(rec)
    if not answers:
        raise ValueError(f"{source}: row {i + 1} has no gold answers ('golden_answers' list or string)")
    meta = rec.get("metadata") or {}
    if not isinstance(meta, dict):
        meta = {"metadata": meta}
    return Question(str(rec.get("id", f"{Path(source).stem}-{i}")), q.strip(), tuple(answers), meta)


def _records(path: Path) -> Iterable[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {n} is not valid JSON: {e}") from None


def as_paths(spec: str | os.PathLike | Iterable[str | os.PathLike] | None) -> list[Path]:
    """A path, a comma-separated string of paths, or a list of paths."""
    if spec is None or spec == "":
        return []
    if isinstance(spec, (str, os.PathLike)):
        return [Path(p.strip()) for p in str(spec).split(",") if p.strip()]
    return [Path(p) for p in spec]


def load_questions(spec: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Question]:
    """Questions from one or more JSONL / Parquet files, in file order."""
    out: list[Question] = []
    for path in as_paths(spec):
        if not path.is_file():
            raise FileNotFoundError(f"question file {str(path)!r} does not exist")
        if path.suffix not in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"question file {str(path)!r}: expected .jsonl or .parquet")
        for i, rec in enumerate(_records(path)):
            out.append(question_from_record(i, rec, str(path)))
    return out
