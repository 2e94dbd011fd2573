"""`python -m devtools build-tiny-model`: a tiny local model for demos and tests, built from the
command line. Development tooling has a command of its own: `molt-proxy` never imports it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from devtools.tinymodel import build_tiny_model
from devtools.tokenizers import Arch


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m devtools", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("build-tiny-model", help="build a tiny local model for demos and tests")
    tiny.add_argument("--arch", choices=get_args(Arch), default="qwen3")
    tiny.add_argument("--out", required=True, type=Path, metavar="DIR")
    tiny.add_argument(
        "--tokenizer-dir",
        type=Path,
        metavar="PATH",
        help="the real tokenizer to use (default: the arch's folder under $MOLT_PROXY_TOKENIZERS,"
        " else ../shared/tokenizers beside the checkout; none found: a small BPE trained here)",
    )
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(build_tiny_model(args.out, args.arch, tokenizer_dir=args.tokenizer_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
