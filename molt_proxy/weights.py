"""Checks on a weights push (`POST /v1/admin/weights`) before any replica is touched.

A failed `reload_weights` leaves a vLLM engine dead on its next request (DESIGN §5), and a
refresh that fails half-way leaves replicas paused, reloaded or relabelled while the store
says otherwise. So everything that can be checked is checked first, here, and only then does
the proxy act: the folder (resolved, complete safetensors headers, a loadable config) and the
version (an int64 that never goes back).

This module reads files and compares numbers; it speaks to neither vLLM nor SQLite, and it
imports nothing heavy (no torch, no transformers: a safetensors header is 8 bytes of length
and a JSON object).
"""

from __future__ import annotations

import json
from pathlib import Path

from molt_proxy.errors import BadRequest

MAX_VERSION = 2**63 - 1
"""Versions are stored as SQLite INTEGERs (int64)."""
_MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on its JSON header."""


def check_weights_dir(path: str) -> str:
    """The folder `path` names, with symlinks resolved, if it holds a complete safetensors
    checkpoint; otherwise `BadRequest`. vLLM is given the resolved path, so the folder it
    loads is the one checked here, even if a link is repointed meanwhile."""
    if not Path(path).is_absolute():
        raise BadRequest("'path' must be absolute: vLLM resolves it in its own directory", param="path")
    try:
        folder = Path(path).resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, a symlink loop, unreadable
        why = getattr(exc, "strerror", None) or exc  # Python 3.11's symlink-loop RuntimeError has none
        raise BadRequest(f"{path} cannot be resolved: {why}", param="path") from None
    if not folder.is_dir():
        raise BadRequest(f"{path} is not a directory", param="path")
    _check_config(folder / "config.json")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise BadRequest(f"{path} has no *.safetensors weights", param="path")
    for shard in shards:
        _check_safetensors(shard)
    return str(folder)


def check_version(version: object, path: str, current: tuple[str, int] | None) -> int:
    """`version` if it may label weights at `path`, given the `current` (path, version) the
    store last saved (None: vLLM still serves its boot weights); otherwise `BadRequest`.

    The rule: a version is an int64 strictly above the current one, or *equal* to it for the
    same resolved folder. The equal case is the trainer re-pushing its current weights when it
    (re)starts (`trainer/loop.py` `_refresh`: vLLM may have restarted with its boot weights
    meanwhile); the same label on another folder would name two policies by one version, and a
    lower one would make the per-token versions go back in time.
    """
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise BadRequest(f"'version' must be an integer from 0 to {MAX_VERSION}", param="version")
    if current is None:
        return version
    current_path, current_version = current
    if version < current_version or (version == current_version and path != current_path):
        raise BadRequest(
            f"'version' {version} is not above the current version {current_version}"
            + (f" (loaded from {current_path})" if version == current_version else ""),
            param="version",
        )
    return version


def _check_config(path: Path) -> None:
    try:
        config = json.loads(path.read_bytes())
    except OSError as exc:
        raise BadRequest(f"{path} cannot be read: {exc.strerror or exc}", param="path") from None
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"{path} is not valid JSON", param="path") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise BadRequest(f"{path} is not a model config (no 'model_type')", param="path")


def _check_safetensors(path: Path) -> None:
    """The header parses and every tensor's bytes lie inside the file: a truncated copy (the
    trainer still writing, a full disk) is refused here instead of killing the engine."""
    try:
        with path.open("rb") as file:
            size = path.stat().st_size
            prefix = file.read(8)
            length = int.from_bytes(prefix, "little")
            if len(prefix) < 8 or length > min(_MAX_HEADER_BYTES, size - 8):
                raise BadRequest(f"{path} is not a safetensors file (no header)", param="path")
            header = json.loads(file.read(length))
    except OSError as exc:
        raise BadRequest(f"{path} cannot be read: {exc.strerror or exc}", param="path") from None
    except (ValueError, RecursionError):
        raise BadRequest(f"{path} has an unreadable safetensors header", param="path") from None
    if not isinstance(header, dict):
        raise BadRequest(f"{path} has an unreadable safetensors header", param="path")
    data_bytes = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise BadRequest(f"{path} is truncated or corrupt (tensor {name!r})", param="path")
