"""Retrievers over a ``DocStore``: BM25 (``bm25s``, the default) and dense (an e5-style encoder through
transformers + a FAISS flat or IVF index), plus ``BatchingRetriever``, which gathers the searches that env
steps issue concurrently (the env server runs steps in worker threads) into one ``search_batch`` call.

Indexes are built once, with a progress bar, and cached under ``<cache>/searchqa/index/<kind>-<key>``
where ``<key>`` hashes the corpus fingerprint and every parameter that changes the index. Builds hold a file
lock, so several server processes starting at once build an index once.

    store = DocStore("wiki-18.jsonl")
    r = make_retriever(store, {"retriever": "bm25"})
    r.search_batch(["capital of australia"], k=3)   # -> [[Hit(row, score), ...]]
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import numpy as np

from envs.searchqa.data import DocStore, cache_root, index_text

log = logging.getLogger("envs.searchqa")


@dataclass(frozen=True)
class Hit:
    row: int  # passage row in the DocStore
    score: float


class Retriever(Protocol):
    kind: str

    def search_batch(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Top-k hits per query, best first (possibly fewer than k when nothing matches)."""
        ...


def _progress(iterable: Iterable, total: int | None, desc: str, enabled: bool = True):
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="doc", disable=not enabled, file=sys.stderr,
                mininterval=1.0)


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _index_dir(cache_dir: str | os.PathLike | None, kind: str, key: str) -> Path:
    root = Path(cache_dir) if cache_dir else cache_root() / "searchqa" / "index"
    return root / f"{kind}-{key}"


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished build into place atomically."""
    (tmp / "COMPLETE").write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


# --- BM25 ------------------------------------------------------------------------------------------------
class BM25Retriever:
    """Okapi BM25 (``bm25s``, Lucene variant) over title + text; English stop words and Snowball stemming."""

    kind = "bm25"

    def __init__(self, store: DocStore, *, k1: float = 0.9, b: float = 0.4, stemmer: str | None = "english",
                 cache_dir: str | os.PathLike | None = None, progress: bool = True, threads: int = 0):
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.store = store
        self.threads = int(threads)
        stem = None
        if stemmer:
            try:
                import Stemmer  # PyStemmer
            except ImportError as e:
                raise ImportError("BM25 stemming needs PyStemmer (pip install PyStemmer), or set stemmer=null") from e
            stem = Stemmer.Stemmer(stemmer).stemWord
        self.tokenizer = Tokenizer(stopwords="en", stemmer=stem)
        key = _key("bm25", store.fingerprint, len(store), k1, b, stemmer, bm25s.__version__)
        self.index_dir = _index_dir(cache_dir, "bm25", key)
        t0 = time.monotonic()
        with _build_lock(self.index_dir.with_suffix(".lock")):
            if not (self.index_dir / "COMPLETE").exists():
                self._build(bm25s, k1, b, progress)
                self.built = True
            else:
                self.built = False
        self.model = bm25s.BM25.load(str(self.index_dir), load_vocab=True)
        self.tokenizer.load_vocab(str(self.index_dir))
        self.tokenizer.load_stopwords(str(self.index_dir))
        self.load_s = time.monotonic() - t0

    def _build(self, bm25s, k1: float, b: float, progress: bool) -> None:
        log.info("building the BM25 index of %s (%d passages) in %s", self.store.path, len(self.store), self.index_dir)
        tmp = self.index_dir.with_name(self.index_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        texts = (index_text(p) for p in _progress(self.store, len(self.store), "BM25 index", progress))
        ids = list(self.tokenizer.streaming_tokenize(texts, update_vocab=True))
        model = bm25s.BM25(k1=k1, b=b, method="lucene")
        model.index((ids, self.tokenizer.get_vocab_dict()), show_progress=progress)
        model.save(str(tmp), show_progress=False)
        self.tokenizer.save_vocab(str(tmp))
        self.tokenizer.save_stopwords(str(tmp))
        _publish(tmp, self.index_dir)

    def search_batch(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        k = min(k, len(self.store))
        ids = list(self.tokenizer.streaming_tokenize(queries, update_vocab="never"))
        docs, scores = self.model.retrieve(ids, k=k, show_progress=False, n_threads=self.threads)
        return [[Hit(int(d), float(s)) for d, s in zip(drow, srow) if s > 0] for drow, srow in zip(docs, scores)]


# --- dense ----------------------------------------------------------------------------------------------
class Encoder:
    """A sentence encoder through transformers: mean pooling (e5, MiniLM) or CLS, L2-normalised."""

    def __init__(self, name_or_path: str, *, pooling: str = "mean", max_length: int = 256, device: str = "cpu",
                 batch_size: int = 64, fp16: bool = False):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(name_or_path)
        self.model = AutoModel.from_pretrained(name_or_path).to(device).eval()
        if fp16:
            self.model = self.model.half()
        self.pooling, self.max_length, self.device, self.batch_size = pooling, int(max_length), device, int(batch_size)
        self.dim = int(self.model.config.hidden_size)

    def encode(self, texts: list[str]) -> np.ndarray:
        torch = self.torch
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tok(texts[i : i + self.batch_size], padding=True, truncation=True,
                               max_length=self.max_length, return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state
                if self.pooling == "cls":
                    emb = hidden[:, 0]
                else:
                    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                emb = torch.nn.functional.normalize(emb.float(), dim=-1)
                out.append(emb.cpu().numpy())
        return np.concatenate(out, axis=0).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)


class DenseRetriever:
    """Inner-product search over normalised embeddings with FAISS (``IndexFlatIP`` or ``IndexIVFFlat``).

    ``index_path`` loads a prebuilt FAISS index (row i = corpus line i, e.g. Search-R1's ``e5_Flat.index``)
    instead of encoding the corpus. ``faiss_gpu`` moves the index to all visible GPUs (needs faiss-gpu).
    """

    kind = "dense"

    def __init__(self, store: DocStore, *, encoder: str = "intfloat/e5-base-v2", index_type: str = "flat",
                 nlist: int | None = None, nprobe: int = 16, pooling: str = "mean", max_length: int = 256,
                 query_prefix: str = "query: ", passage_prefix: str = "passage: ", device: str = "cpu",
                 batch_size: int = 64, fp16: bool = False, index_path: str | None = None, faiss_gpu: bool = False,
                 cache_dir: str | os.PathLike | None = None, progress: bool = True):
        import faiss

        if index_type not in ("flat", "ivf"):
            raise ValueError(f"index_type must be 'flat' or 'ivf', got {index_type!r}")
        self.store = store
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.encoder = Encoder(encoder, pooling=pooling, max_length=max_length, device=device,
                               batch_size=batch_size, fp16=fp16)
        t0 = time.monotonic()
        self.built = False
        if index_path:
            self.index_dir = Path(index_path)
            index = faiss.read_index(str(index_path))
        else:
            enc_id = str(Path(encoder).resolve()) if Path(encoder).exists() else encoder
            key = _key("dense", store.fingerprint, len(store), enc_id, index_type, nlist, pooling, max_length,
                       passage_prefix)
            self.index_dir = _index_dir(cache_dir, f"dense-{index_type}", key)
            with _build_lock(self.index_dir.with_suffix(".lock")):
                if not (self.index_dir / "COMPLETE").exists():
                    self._build(faiss, index_type, nlist, batch_size, progress)
                    self.built = True
            index = faiss.read_index(str(self.index_dir / "index.faiss"))
        if index.ntotal != len(store):
            raise ValueError(f"the FAISS index has {index.ntotal} vectors but the corpus has {len(store)} passages; "
                             "build it over this corpus (row i = line i)")
        if index.d != self.encoder.dim:
            raise ValueError(f"the FAISS index has dimension {index.d}, the encoder {self.encoder.dim}")
        if hasattr(index, "nprobe"):
            index.nprobe = int(nprobe)
        if faiss_gpu:
            if not hasattr(faiss, "index_cpu_to_all_gpus"):
                raise ImportError("faiss_gpu=true needs the faiss-gpu build")
            index = faiss.index_cpu_to_all_gpus(index)
        self.index = index
        self.load_s = time.monotonic() - t0

    def _build(self, faiss, index_type: str, nlist: int | None, batch_size: int, progress: bool) -> None:
        n = len(self.store)
        log.info("encoding %d passages for the dense index in %s", n, self.index_dir)
        tmp = self.index_dir.with_name(self.index_dir.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        emb = np.lib.format.open_memmap(tmp / "emb.npy", mode="w+", dtype=np.float32, shape=(n, self.encoder.dim))
        chunk: list[str] = []
        pos = 0
        for p in _progress(self.store, n, "dense index", progress):
            chunk.append(self.passage_prefix + index_text(p))
            if len(chunk) == batch_size * 8:
                emb[pos : pos + len(chunk)] = self.encoder.encode(chunk)
                pos += len(chunk)
                chunk = []
        if chunk:
            emb[pos : pos + len(chunk)] = self.encoder.encode(chunk)
        emb.flush()
        d = self.encoder.dim
        if index_type == "flat":
            index = faiss.IndexFlatIP(d)
        else:
            nl = int(nlist or max(1, min(int(4 * np.sqrt(n)), n // 39 or 1)))
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nl, faiss.METRIC_INNER_PRODUCT)
            rng = np.random.default_rng(0)
            sample = np.sort(rng.choice(n, size=min(n, max(nl * 64, 10_000)), replace=False))
            index.train(np.ascontiguousarray(emb[sample]))
        for i in range(0, n, 100_000):
            index.add(np.ascontiguousarray(emb[i : i + 100_000]))
        faiss.write_index(index, str(tmp / "index.faiss"))
        del emb
        (tmp / "emb.npy").unlink()
        _publish(tmp, self.index_dir)

    def search_batch(self, queries: list[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        q = self.encoder.encode([self.query_prefix + x for x in queries])
        scores, rows = self.index.search(q, min(k, len(self.store)))
        return [[Hit(int(r), float(s)) for r, s in zip(rrow, srow) if r >= 0] for rrow, srow in zip(rows, scores)]


# --- batching ---------------------------------------------------------------------------------------------
class BatchingRetriever:
    """Thread-safe front of a retriever: concurrent ``search`` calls are served by one ``search_batch``.

    A single worker thread takes the first waiting query, then collects more for up to ``wait_ms`` (or until
    ``max_batch``), runs them as one batch and hands each caller its result. Under load, queries that arrive
    while a batch runs form the next batch, so an idle server adds at most ``wait_ms`` of latency.
    """

    def __init__(self, inner: Retriever, *, max_batch: int = 64, wait_ms: float = 2.0):
        if max_batch < 1 or wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and wait_ms >= 0")
        self.inner, self.kind = inner, inner.kind
        self.max_batch, self.wait_s = int(max_batch), float(wait_ms) / 1000.0
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = self.queries = self.largest_batch = 0

    def search_batch(self, queries: list[str], k: int) -> list[list[Hit]]:
        futs = [self._submit(q, k) for q in queries]
        return [f.result() for f in futs]

    def search(self, query: str, k: int) -> list[Hit]:
        return self._submit(query, k).result()

    def search_counted(self, query: str, k: int) -> tuple[list[Hit], int]:
        """Like ``search``, plus the size of the batch the query was served in."""
        fut = self._submit(query, k)
        hits = fut.result()
        return hits, fut.batch_size  # type: ignore[attr-defined]

    def _submit(self, query: str, k: int) -> Future:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="searchqa-retriever", daemon=True)
                    self._thread.start()
        fut: Future = Future()
        self._q.put((query, int(k), fut))
        return fut

    def _loop(self) -> None:
        while True:
            batch = [self._q.get()]
            deadline = time.monotonic() + self.wait_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    batch.append(self._q.get(timeout=left) if left > 0 else self._q.get_nowait())
                except queue.Empty:
                    break
            self._run(batch)

    def _run(self, batch: list[tuple[str, int, Future]]) -> None:
        self.batches += 1
        self.queries += len(batch)
        self.largest_batch = max(self.largest_batch, len(batch))
        by_k: dict[int, list[tuple[str, Future]]] = {}
        for query, k, fut in batch:
            by_k.setdefault(k, []).append((query, fut))
        for k, items in by_k.items():
            try:
                results = self.inner.search_batch([q for q, _ in items], k)
            except BaseException as exc:  # noqa: BLE001  (hand the error to every caller)
                for _, fut in items:
                    fut.set_exception(exc)
                continue
            for (_, fut), res in zip(items, results):
                fut.batch_size = len(items)  # type: ignore[attr-defined]
                fut.set_result(res)

    def stats(self) -> dict[str, float]:
        return {"batches": self.batches, "queries": self.queries, "largest_batch": self.largest_batch,
                "mean_batch": self.queries / self.batches if self.batches else 0.0}


def make_retriever(store: DocStore, options: dict[str, Any]) -> Retriever:
    """Build the retriever named by ``options["retriever"]`` ('bm25' or 'dense') with its options."""
    opts = dict(options)
    kind = opts.pop("retriever", "bm25")
    if kind == "bm25":
        allowed = {"k1", "b", "stemmer", "cache_dir", "progress", "threads"}
        cls = BM25Retriever
    elif kind == "dense":
        allowed = {"encoder", "index_type", "nlist", "nprobe", "pooling", "max_length", "query_prefix",
                   "passage_prefix", "device", "batch_size", "fp16", "index_path", "faiss_gpu", "cache_dir", "progress"}
        cls = DenseRetriever
    else:
        raise ValueError(f"retriever must be 'bm25' or 'dense', got {kind!r}")
    unknown = set(opts) - allowed
    if unknown:
        raise ValueError(f"unknown {kind} retriever option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return cls(store, **opts)
