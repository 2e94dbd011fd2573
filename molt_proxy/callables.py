"""A function named on a command line: `package.module:function` or `path/to/file.py:function`.

The trainer's plug-ins (`trainer/plugins.py`), the rollout runner's Python agents and Python
checks (`rollout/`) are all named this way; this module only finds the function. It imports
nothing heavy, so a runner or a small agent process loads it without torch.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any


class CallableError(ValueError):
    """A name that does not lead to a function: its module or file cannot be loaded, or it has
    no function of that name."""


def absolute(spec: str, base: Path | None = None) -> str:
    """`file.py:function` with the file made absolute against `base` (default: the working
    directory now); any other name as it is."""
    path, _, name = spec.rpartition(":")
    if path.endswith(".py"):
        file = Path(path).expanduser()
        return f"{((base or Path.cwd()) / file).resolve()}:{name}"
    return spec


def load(spec: str) -> Callable[..., Any]:
    """The function `spec` names (`module:function` or `file.py:function`)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise CallableError(f"{spec!r} is not module:function or path/to/file.py:function")
    try:
        module = load_file(path) if path.endswith(".py") else importlib.import_module(path)
    except Exception as exc:  # ImportError, a missing file, or what the module raised
        raise CallableError(f"cannot load {path}: {exc}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise CallableError(f"{path} has no function {name!r}")
    return fn


@cache
def load_file(path: str) -> ModuleType:
    """A Python file, as a module of its own under a name made from its absolute path (so two
    files called `algo.py` do not meet), loaded once per process."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise OSError(f"no such file: {file}")
    name = f"molt_plugin_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
