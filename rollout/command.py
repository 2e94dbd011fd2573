"""`molt-proxy rollout`: its flags, and the call to `rollout.runner.run_rollout`.

The flags are `RolloutOptions`' fields (`molt_proxy/flags.py`), declared here beside the runner;
`molt_proxy/cli.py` only mounts them. The runner is imported when the command runs, so
`molt-proxy --help` stays quick.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from molt_proxy.auth import ADMIN_KEY_ENV
from molt_proxy.config import Settings
from molt_proxy.flags import default, flag, from_flags
from rollout.progress import DEFAULT_SUCCESS_THRESHOLD


@dataclass(frozen=True, slots=True)
class RolloutOptions:
    """A rollout: which tasks, through which harness, how many attempts of each, and where the
    results go."""

    tasks: Path = field(metadata=flag(metavar="PATH"))
    """The task set (JSONL)."""
    harness: str = field(metadata=flag(metavar="NAME"))
    """An adapter of rollout/harnesses (e.g. claude-code, codex), or a Python agent:
    module:function or path/to/file.py:function, called as fn(attempt) -> answer."""
    out: Path = field(metadata=flag(metavar="PATH"))
    """The results JSONL; a rerun with the same file resumes (beside it: PATH.started)."""
    proxy_url: str = field(
        default=f"http://{default(Settings, 'host')}:{default(Settings, 'port')}",
        metadata=flag(metavar="URL"),
    )
    """The proxy's root URL."""
    harness_args: list[str] = field(
        default_factory=list, metadata=flag("--harness-arg", repeat=True, metavar="ARG")
    )
    """An extra flag for the harness's CLI; repeat the flag for several (write one that starts
    with '-' as --harness-arg=--flag)."""
    sandbox: str | None = field(default=None, metadata=flag(metavar="NAME"))
    """Run each attempt isolated: bwrap, docker, podman (docker:IMAGE, podman:IMAGE) or auto;
    the workspace mounted, no network but the proxy (docs/rollout.md)."""
    attempts: int = field(default=1, metadata=flag(metavar="K"))
    """Attempts per task, one group."""
    concurrency: int = field(default=1, metadata=flag(metavar="C"))
    """Attempts at once."""
    timeout_s: float = field(default=600.0, metadata=flag(metavar="S"))
    """Seconds per attempt's harness (and check)."""
    eval: bool = False
    """Evaluation episodes: groups eval/<task id>, never trained on."""
    admin_key: str | None = None
    """The proxy's admin key, or an agent key. Default: $MOLT_PROXY_ADMIN_KEY."""
    workdir: Path | None = field(default=None, metadata=flag(metavar="DIR"))
    """Keep each attempt's workspace and HOME under DIR. Default: a temporary folder, each
    attempt's removed once checked."""
    success_threshold: float = field(default=DEFAULT_SUCCESS_THRESHOLD, metadata=flag(metavar="R"))
    """An attempt succeeded when its reward is at least R."""


def run(args: argparse.Namespace) -> int:
    from rollout.harnesses import HarnessError, harness
    from rollout.progress import summary
    from rollout.results import ResultsFileError
    from rollout.runner import RolloutError, run_rollout
    from rollout.sandbox import SandboxUnavailable, sandbox
    from rollout.tasks import TaskFileError

    options = from_flags(RolloutOptions, args)
    admin_key = options.admin_key if options.admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
    # One line per request to the proxy would bury the progress line; errors are still shown.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        results = run_rollout(
            options.proxy_url,
            options.tasks,
            harness(options.harness, options.harness_args),
            options.out,
            attempts=options.attempts,
            concurrency=options.concurrency,
            timeout_s=options.timeout_s,
            eval=options.eval,
            admin_key=admin_key,
            sandbox=sandbox(options.sandbox) if options.sandbox else None,
            workdir=options.workdir,
            success_threshold=options.success_threshold,
        )
    except (TaskFileError, HarnessError, ResultsFileError, RolloutError, SandboxUnavailable) as exc:
        print(f"molt-proxy rollout: error: {exc}", file=sys.stderr)
        return 2
    print(summary(results, options.success_threshold))
    return 0
