"""Prebuild the deep-search data and index (so a server starts fast), then print where they are.

    python -m envs.searchqa [--option key=value ...]      # the same options as the env / `env serve`
"""

from __future__ import annotations

import argparse
import time

from envs.server import _parse_option


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.searchqa", description=__doc__.split("\n\n")[0])
    p.add_argument("--option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    from envs.searchqa.env import SearchQAEnv

    t0 = time.monotonic()
    env = SearchQAEnv(**dict(a.option))
    res = env._res
    print(f"corpus: {res.store.path} ({len(res.store)} passages)")
    print(f"questions: {env.num_tasks('train')} train, {env.num_tasks('test')} test")
    print(f"{res.retriever.kind} index: {res.retriever.inner.index_dir}")
    print(f"ready in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
