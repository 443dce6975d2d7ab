"""The `meshserve` command."""

from __future__ import annotations

import argparse
import logging
import sys

from meshserve.shared.models_repo import DEFAULT_MODEL


def _models(args) -> int:
    from meshserve.shared import models_repo

    if args.action == "pull":
        print(models_repo.pull(args.name))
    else:
        for name in models_repo.KNOWN_MODELS:
            path = models_repo.cached_path(name)
            print(f"{name}\t{path if path else '(not pulled)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshserve", description="An LLM inference mesh over NATS.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("batch", help="run an OpenAI Batch JSONL file through the in-process engine")
    b.add_argument("-i", "--input", required=True, help="input JSONL ('-' for stdin)")
    b.add_argument("-o", "--output", required=True, help="output JSONL ('-' for stdout)")
    b.add_argument("--model", default=DEFAULT_MODEL, help="model name, HF directory or .gguf file")
    b.add_argument("--served-model-name", default=None, help="name in the responses (default: --model)")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.set_defaults(func=lambda a: __import__("meshserve.services.batch", fromlist=["main"]).main(a))

    m = sub.add_parser("models", help="the local model repository")
    m.add_argument("action", choices=["pull", "list"])
    m.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    m.set_defaults(func=_models)

    bench = sub.add_parser("bench-engine", help="the engine benchmark: meshserve vs Transformers, side by side")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: __import__("meshserve.services.bench.engine_bench",
                                                 fromlist=["main"]).main(a.rest))
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
