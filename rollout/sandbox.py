"""Where an attempt's harness runs: directly in its workspace (the default), or isolated
(`--sandbox`): the workspace mounted, the rest of the file system read-only, and no network but
the proxy.

A `Sandbox` rewrites a `CommandHarness`'s command line and environment; the harness and the
runner know nothing else about it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rollout.harness import Attempt


class Sandbox(Protocol):
    name: str

    def wrap(
        self, command: list[str], env: dict[str, str], attempt: Attempt
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that run `command` inside the sandbox."""
        ...
