"""What the adapters of npm CLIs (Claude Code, Codex) share: where the pinned CLI is, and
which transcript file a run left.

`scripts/setup.sh` installs each CLI, pinned, under the checkout's `.tools/` (never globally):
an adapter runs that one unless told otherwise, or else the one on `PATH`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / ".tools" / "node_modules" / ".bin"
"""Where `scripts/setup.sh` installs the CLIs (`npm install --prefix .tools`)."""


def find_cli(name: str, cli: str | Path | None) -> Path:
    """The CLI to run: `cli` if given (a path, or a name on `PATH`), else the pinned one under
    `.tools/`, else `name` on `PATH`. Checked now, so a rollout stops before its first attempt
    rather than failing every one."""
    if cli is None:
        pinned = TOOLS / name
        found = str(pinned) if pinned.exists() else shutil.which(name)
        if found is None:
            raise FileNotFoundError(
                f"{name}: not under {TOOLS} nor on PATH (bash scripts/setup.sh installs it)"
            )
        return Path(found)
    found = shutil.which(str(cli))
    if found is None:
        raise FileNotFoundError(f"{name}: {cli} is not an executable file")
    return Path(found).absolute()  # the command runs in the workspace


def newest(folder: Path, pattern: str) -> str | None:
    """The newest file under `folder` matching `pattern` (a glob, `**` allowed), if any."""
    found = [path for path in folder.glob(pattern) if path.is_file()] if folder.is_dir() else []
    return str(max(found, key=os.path.getmtime)) if found else None
