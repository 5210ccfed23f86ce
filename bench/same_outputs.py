"""Are two runs' recorded outputs the same? For a refactor that must not change behaviour: run the same
``scalinginter run`` (same config, seed and model) with the code before and after, then

    python bench/same_outputs.py OUT_BEFORE OUT_AFTER

compares every run under the two output dirs: metrics.jsonl (timing keys dropped), every Parquet file (episodes,
token ids, log-probs, advantages, texts; schema and values), the eval and summary JSONs (timings, run ids and paths
dropped), and the sha256 of every checkpoint's weights. Prints one line per file and exits 1 if any differs.
(What it proved for the rooms refactor: docs/concepts/architecture.md, "Typed trajectories".)"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

if len(sys.argv) != 3:
    sys.exit("usage: python bench/same_outputs.py OUT_BEFORE OUT_AFTER")
a, b = Path(sys.argv[1]), Path(sys.argv[2])
TIMING = ("time", "_s", "idle", "wall")  # substrings of the keys that measure time, not outcomes
NOT_COMPARED = ("mlflow_run_id", "mlflow_uri", "final_checkpoint", "run_name", "ref")  # ids and paths of the run


def clean(d):
    if isinstance(d, dict):
        return {k: clean(v) for k, v in d.items() if not any(t in k for t in TIMING) and k not in NOT_COMPARED}
    if isinstance(d, list):
        return [clean(x) for x in d]
    return d


bad = 0


def check(name, x, y):
    global bad
    ok = x == y
    bad += not ok
    print(("same " if ok else "DIFF ") + name)


def counterpart(path: Path) -> Path | None:
    """The same file under ``b``; None (counted as a difference) when it is missing there."""
    other = b / path.relative_to(a)
    if not other.exists():
        check(f"{path.relative_to(a)} (missing under {b})", 0, 1)
        return None
    return other


for ra in sorted(a.glob("*/metrics.jsonl")):
    if (rb := counterpart(ra)) is None:
        continue
    la = [clean(json.loads(l)) for l in ra.read_text().splitlines()]
    lb = [clean(json.loads(l)) for l in rb.read_text().splitlines()]
    check(str(ra.relative_to(a)) + f" ({len(la)} steps, {len(la[0]) if la else 0} keys)", la, lb)
for pf in sorted(a.rglob("*.parquet")):
    if (pb := counterpart(pf)) is None:
        continue
    ta, tb = pq.read_table(pf), pq.read_table(pb)
    check(str(pf.relative_to(a)) + f" ({ta.num_rows} episodes, {ta.num_columns} columns)",
          (ta.schema, ta.to_pylist()), (tb.schema, tb.to_pylist()))
for ja in sorted(a.glob("*/eval_*.json")) + sorted(a.glob("*/summary.json")):
    if (jb := counterpart(ja)) is None:
        continue
    check(str(ja.relative_to(a)), clean(json.loads(ja.read_text())), clean(json.loads(jb.read_text())))
for wa in sorted(a.rglob("model.safetensors")):
    if (wb := counterpart(wa)) is None:
        continue
    check(str(wa.relative_to(a)), *(hashlib.sha256(w.read_bytes()).hexdigest() for w in (wa, wb)))
print("ALL SAME" if not bad else f"{bad} DIFFERENT")
sys.exit(1 if bad else 0)
