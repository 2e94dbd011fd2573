"""`molt-proxy rollout`: its flags, and the call to `rollout.runner.run_rollout`.

The flags are declared here, beside the runner, and `molt_proxy/cli.py` only mounts them: the
runner is imported when the command runs, so `molt-proxy --help` stays quick.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from molt_proxy.auth import ADMIN_KEY_ENV
from molt_proxy.config import Settings, default
from rollout.progress import DEFAULT_SUCCESS_THRESHOLD


def add_arguments(parser: argparse.ArgumentParser) -> None:
    url = f"http://{default(Settings, 'host')}:{default(Settings, 'port')}"
    parser.add_argument(
        "--proxy-url", default=url, metavar="URL", help=f"the proxy's root URL (default: {url})"
    )
    parser.add_argument("--tasks", type=Path, required=True, metavar="PATH", help="the task set (JSONL)")
    parser.add_argument(
        "--harness",
        required=True,
        metavar="NAME",
        help="an adapter of rollout/harnesses (e.g. claude-code, codex), or a Python agent:"
        " module:function or path/to/file.py:function, called as fn(attempt) -> answer",
    )
    parser.add_argument(
        "--harness-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra flag for the harness's CLI, repeatable (write one that starts with '-' as"
        " --harness-arg=--flag)",
    )
    parser.add_argument(
        "--sandbox",
        metavar="NAME",
        help="run each attempt isolated: bwrap, docker, podman (docker:IMAGE, podman:IMAGE) or auto;"
        " the workspace mounted, no network but the proxy (docs/rollout.md)",
    )
    parser.add_argument("--attempts", type=int, default=1, metavar="K", help="attempts per task, one group")
    parser.add_argument("--concurrency", type=int, default=1, metavar="C", help="attempts at once")
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="seconds per attempt's harness (and check)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="PATH",
        help="the results JSONL; a rerun with the same file resumes (beside it: PATH.started)",
    )
    parser.add_argument(
        "--eval", action="store_true", help="evaluation episodes: groups eval/<task id>, never trained on"
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"the proxy's admin key, or an agent key (default: ${ADMIN_KEY_ENV})",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="keep each attempt's workspace and HOME under DIR (default: a temporary folder, each"
        " attempt's removed once checked)",
    )
    parser.add_argument(
        "--success-threshold",
        type=float,
        default=DEFAULT_SUCCESS_THRESHOLD,
        metavar="R",
        help="an attempt succeeded when its reward is at least R (default: 1.0)",
    )


def run(args: argparse.Namespace) -> int:
    from rollout.harnesses import HarnessError, harness
    from rollout.progress import summary
    from rollout.results import ResultsFileError
    from rollout.runner import RolloutError, run_rollout
    from rollout.sandbox import SandboxUnavailable, sandbox
    from rollout.tasks import TaskFileError

    # One line per request to the proxy would bury the progress line; errors are still shown.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        results = run_rollout(
            args.proxy_url,
            args.tasks,
            harness(args.harness, args.harness_arg),
            args.out,
            attempts=args.attempts,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            eval=args.eval,
            admin_key=args.admin_key,
            sandbox=sandbox(args.sandbox) if args.sandbox else None,
            workdir=args.workdir,
            success_threshold=args.success_threshold,
        )
    except (TaskFileError, HarnessError, ResultsFileError, RolloutError, SandboxUnavailable) as exc:
        print(f"molt-proxy rollout: error: {exc}", file=sys.stderr)
        return 2
    print(summary(results, args.success_threshold))
    return 0
