"""Deep search (envs/searchqa): scoring, parsing, data formats, the default set, BM25 and the env in-process."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("bm25s")
pytest.importorskip("countryinfo")

from envs.base import TEST_OFFSET, make_env, task_index  # noqa: E402
from envs.searchqa import build_default  # noqa: E402
from envs.searchqa.data import DocStore, line_offsets, load_questions, split_contents  # noqa: E402
from envs.searchqa.oracle import extract, parse_information, query_for  # noqa: E402
from envs.searchqa.parse import parse_reply  # noqa: E402
from envs.searchqa.retriever import BatchingRetriever, BM25Retriever, Hit  # noqa: E402
from envs.searchqa.scoring import exact_match, f1_score, normalize_answer  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache (default set + indexes) for this module."""
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("sqcache")
    mp.setenv("SCALINGINTER_CACHE", str(d))
    yield d
    mp.undo()


# --- scoring (hand-computed) ---------------------------------------------------------------------------------
def test_normalisation_em_f1():
    assert normalize_answer("The  Australian-Dollar.") == "australiandollar"
    assert normalize_answer("  An apple, THE pie!") == "apple pie"
    assert normalize_answer("Washington D.C.") == "washington dc"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert exact_match("the Euro", ["euro", "EUR"]) == 1.0
    assert exact_match("Euro zone", ["euro"]) == 0.0
    assert exact_match("+61", "61") == 1.0
    # pred "new south wales" vs gold "wales": common 1, P = 1/3, R = 1, F1 = 0.5
    assert f1_score("New South Wales", ["Wales"]) == pytest.approx(0.5)
    # best over golds: "canberra city" vs "canberra" -> P=1/2, R=1 -> 2/3; vs "sydney" -> 0
    assert f1_score("Canberra city", ["Sydney", "Canberra"]) == pytest.approx(2 / 3)
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing
    assert f1_score("paris", ["the"]) == 0.0
    with pytest.raises(ValueError):
        exact_match("x", [])


# --- parsing (hand-written replies) -----------------------------------------------------------------------------
@pytest.mark.parametrize("reply,kind,text", [
    ("<search>capital of France</search>", "search", "capital of France"),
    ("<think>I need the capital.</think>\n<search> capital\n of   France </search>", "search", "capital of France"),
    ("<THINK>hm <answer>Lyon</answer></THINK> <Answer>Paris</Answer>", "answer", "Paris"),
    ("<answer>Paris</answer> so <answer> paris </answer>".replace(" paris ", "Paris"), "answer", "Paris"),
    ("Let me see. <search>Canberra capital</search> done", "search", "Canberra capital"),
])
def test_parse_ok(reply, kind, text):
    r = parse_reply(reply)
    assert r.ok and r.action.kind == kind and r.action.text == text, r


@pytest.mark.parametrize("reply,needle", [
    ("", "empty"),
    ("I think it is Paris.", "No action found"),
    ("<think><search>x</search></think>", "No action found"),
    ("<search>capital of France", "not closed"),
    ("<answer></answer>", "empty"),
    ("<search>a</search><answer>b</answer>", "a search and an answer"),
    ("<search>a</search><search>b</search>", "2 different searches"),
    ("<answer>Paris</answer><answer>Lyon</answer>", "2 different answers"),
    ("Action: search capital", "No action found"),
])
def test_parse_errors(reply, needle):
    r = parse_reply(reply)
    assert not r.ok and needle in r.error and "<search>" in r.error, r


# --- data formats ----------------------------------------------------------------------------------------------
def test_corpus_and_question_formats(tmp_path):
    assert split_contents('"Canberra"\nCanberra is the capital.') == ("Canberra", "Canberra is the capital.")
    assert split_contents("no title here") == ("", "no title here")
    lines = [{"id": "a", "contents": '"T1"\nfirst text'}, {"id": "b", "title": "T2", "text": "second"},
             {"id": "c", "contents": '"Tü"\nthird ünïcode'}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines[:2]) + "\n\n"
                      + json.dumps(lines[2], ensure_ascii=False))  # a blank line, no trailing newline
    assert len(line_offsets(corpus)) == 4
    store = DocStore(corpus, cache_dir=tmp_path / "ds")
    assert len(store) == 3
    assert [(p.id, p.title, p.text) for p in store] == [("a", "T1", "first text"), ("b", "T2", "second"),
                                                          ("c", "Tü", "third ünïcode")]
    assert store.get(2).title == "Tü" and store.get(0).row == 0
    with pytest.raises(IndexError):
        store.get(3)
    assert DocStore(corpus, cache_dir=tmp_path / "ds").get(1).text == "second"  # cached offsets

    qj = tmp_path / "q.jsonl"
    qj.write_text(json.dumps({"id": "q1", "question": "Who?", "golden_answers": ["A", "B"]}) + "\n"
                  + json.dumps({"question": "Where?", "answer": "C"}) + "\n"
                  + json.dumps({"id": "r", "question": "Why?", "reward_model": {"ground_truth": {"target": ["E", "F"]}}})
                  + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    qp = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": "p1", "question": "When?", "golden_answers": ["D"]},
        {"id": "p2", "question": "How?", "golden_answers": ["G"]},
    ]), qp)
    qs = load_questions(f"{qj},{qp}")
    assert [(q.id, q.question, q.golden_answers) for q in qs] == [
        ("q1", "Who?", ("A", "B")), ("q-1", "Where?", ("C",)), ("r", "Why?", ("E", "F")), ("p1", "When?", ("D",)),
        ("p2", "How?", ("G",))]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no answers"}) + "\n")
    with pytest.raises(ValueError, match="no gold answers"):
        load_questions(bad)
    with pytest.raises(FileNotFoundError):
        load_questions(tmp_path / "missing.jsonl")


# --- the default set -------------------------------------------------------------------------------------------
def test_default_set_is_deterministic_and_split(tmp_path):
    m1 = build_default.build(tmp_path / "a")
    build_default.build(tmp_path / "b")
    for name in build_default.FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert m1["passages"] > 3000 and m1["train"] > 2000 and m1["test"] > 400
    assert m1["multi_hop"]["test"] > 100 and m1["multi_hop"]["train"] > 500
    train = load_questions(tmp_path / "a" / "train.jsonl")
    test = load_questions(tmp_path / "a" / "test.jsonl")
    assert not {q.question for q in train} & {q.question for q in test}
    q = next(q for q in test + train if q.metadata["type"] == "currency_of_capital_country"
             and "Canberra" in q.question)
    assert q.question == "What currency is used in the country whose capital is Canberra?"
    assert "Australian Dollar" in q.golden_answers and q.metadata["hops"] == 2
    corpus = [json.loads(x) for x in (tmp_path / "a" / "corpus.jsonl").read_text().splitlines()]
    assert all(set(c) == {"id", "contents"} and c["contents"].startswith('"') for c in corpus)
    assert any("The capital of Australia is Canberra." in c["contents"] for c in corpus)


# --- oracle reading ----------------------------------------------------------------------------------------
def test_oracle_extraction_by_hand():
    obs = ("<information>Doc 1(Title: Queensland) The administrative division Queensland is a first-level "
           "division of the country Australia.\nDoc 2(Title: United States) The capital of United States is "
           "Washington D.C. The population of United States is 319,259,000.\nDoc 3(Title: Holy See (Vatican)) "
           "The neighbouring countries of France are Andorra, Belgium.</information>")
    docs = parse_information(obs)
    assert [t for t, _ in docs] == ["Queensland", "United States", "Holy See (Vatican)"]
    assert extract({"relation": "country_by_division", "arg": "Queensland"}, docs, "") == "Australia"
    assert extract({"relation": "capital"}, docs, "United States capital") == "Washington D.C"
    assert extract({"relation": "capital"}, docs, "Canada capital") is None  # not about the searched entity
    assert extract({"relation": "neighbour"}, docs, "France neighbouring countries") == "Andorra"
    assert query_for({"relation": "currency", "subject": None, "arg": None}, "Australia") == "Australia currency"
    assert parse_information("Question: what?") == []


# --- BM25 and batching -----------------------------------------------------------------------------------------
def test_bm25_finds_the_entity(cache):
    d = build_default.ensure_default()
    store = DocStore(d / "corpus.jsonl")
    r = BM25Retriever(store, cache_dir=cache / "idx", progress=False)
    assert r.built
    hits = r.search_batch(["capital of Australia", "currencies of Japan", "zzzz qqqq"], k=3)
    assert store.get(hits[0][0].row).title == "Australia"
    assert "Yen" in store.get(hits[1][0].row).text  # stemming: currencies ~ currency
    assert hits[2] == []  # nothing matches -> no passages, not random ones
    again = BM25Retriever(store, cache_dir=cache / "idx", progress=False)
    assert not again.built and again.search_batch(["capital of Australia"], 3) == hits[:1]


class _Slow:
    kind = "slow"

    def __init__(self):
        self.calls = []

    def search_batch(self, queries, k):
        self.calls.append(list(queries))
        time.sleep(0.05)
        if "boom" in queries:
            raise RuntimeError("index on fire")
        return [[Hit(len(q), 1.0)] * k for q in queries]


def test_batching_retriever_gathers_concurrent_searches():
    inner = _Slow()
    br = BatchingRetriever(inner, max_batch=64, wait_ms=20)
    out: dict[int, object] = {}

    def one(i):
        out[i] = br.search_counted("q" * (i + 1), 2)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(out[i][0] == [Hit(i + 1, 1.0)] * 2 for i in range(24))  # each caller gets its own result
    assert sum(len(c) for c in inner.calls) == 24 and len(inner.calls) < 24 // 2
    assert br.stats()["largest_batch"] > 1
    with pytest.raises(RuntimeError, match="on fire"):
        br.search("boom", 1)
    assert br.search("ok", 1) == [Hit(2, 1.0)]  # the worker survives an error


# --- the env in-process -----------------------------------------------------------------------------------------
def test_env_episode_rules(cache):
    env = make_env("searchqa", progress=False)
    assert env.num_tasks("train") > 2000 and env.num_tasks("test") > 400
    with pytest.raises(ValueError):
        env.num_tasks("dev")
    obs, info = env.reset(TEST_OFFSET + 1)
    assert obs.startswith("Question: ") and info["split"] == "test" and info["success"] is False
    assert env.reset(TEST_OFFSET + 1)[0] == obs
    assert env.reset(task_index("train", env.num_tasks("train")))[0] == env.reset(0)[0]  # train wraps
    with pytest.raises(ValueError):
        env.reset(TEST_OFFSET + env.num_tasks("test"))

    q = env.question(TEST_OFFSET + 5)
    env.reset(TEST_OFFSET + 5)
    bad = env.step("I believe it is Paris.")
    assert not bad.done and bad.reward == 0 and bad.info["invalid_action"] and "<answer>" in bad.observation
    two = env.step("<search>x</search><answer>y</answer>")
    assert not two.done and two.info["invalid_action"] and two.info["n_searches"] == 0
    s = env.step(f"<think>search first</think><search>{q.question}</search>")
    assert not s.done and s.reward == 0 and s.info["n_searches"] == 1 and s.info["search_batch"] >= 1
    assert s.observation.startswith("<information>Doc 1(Title: ") and s.observation.count("Doc ") <= 3
    assert env.observation() == s.observation

    # a wrong answer scores 0 and ends the episode: no second chance
    wrong = env.step("<answer>Atlantis</answer>")
    assert wrong.done and wrong.terminated and wrong.reward == 0.0 and wrong.info["success"] is False
    assert wrong.info["em"] == 0.0 and wrong.info["golden_answers"] == list(q.golden_answers)
    with pytest.raises(RuntimeError):
        env.step(f"<answer>{q.golden_answers[0]}</answer>")

    env.reset(TEST_OFFSET + 5)
    right = env.step(f"<answer>  {q.golden_answers[0].upper()}. </answer>")  # normalised
    assert right.done and right.reward == 1.0 and right.info["success"] and right.info["f1"] == 1.0
    env.close()


def test_own_files_and_options(tmp_path, cache):
    corpus = tmp_path / "wiki.jsonl"
    docs = [("Paris", "Paris is the capital and largest city of France."),
            ("Berlin", "Berlin is the capital of Germany."),
            ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level.")]
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{x}'}) + "\n"
                              for i, (t, x) in enumerate(docs)))
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"question": "What is the capital of Germany?", "golden_answers": ["Berlin"]}) + "\n")
    env = make_env("searchqa", corpus=str(corpus), test_questions=str(test), topk=1, progress=False)
    assert env.num_tasks("test") == 1 and env.num_tasks("train") == 0
    with pytest.raises(ValueError, match="no train questions"):
        env.reset(0)
    env.reset(TEST_OFFSET)
    r = env.step("<search>highest mountain</search>")
    assert r.observation == ("<information>Doc 1(Title: Mount Everest) Mount Everest is Earth's highest mountain "
                             "above sea level.</information>")
    assert r.info["retrieved"] == ["2"] and "plan" not in r.info
    from envs.searchqa.contract import expert_action

    assert expert_action(r.observation, r.info) is None  # no plan: the oracle gives up
    with pytest.raises(ValueError, match="retriever must be"):
        make_env("searchqa", corpus=str(corpus), test_questions=str(test), retriever="splade")
    with pytest.raises(ValueError, match="unknown bm25 retriever option"):
        make_env("searchqa", corpus=str(corpus), test_questions=str(test), nprobe=3)
