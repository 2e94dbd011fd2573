"""The trainer's plug points: what an algorithm is, and how a name on the command line becomes one.

An algorithm is plain Python on the typed contract (`molt_proxy.types.Trajectory`), four
callables, each named by a flag as a built-in name, `package.module:function`, or
`path/to/file.py:function`:

    --advantage NAME       fn(group: list[Trajectory]) -> list[float] | list[list[float]]
                           one advantage per trajectory of the group, or per turn of each
    --loss NAME            fn(inputs: LossInputs) -> tuple[Tensor, dict[str, float]]
                           the micro-batch's loss and its metrics (`trainer/loss.py`)
    --group-filter NAME    fn(group: list[Trajectory]) -> bool: whether a step takes the group
    --reward-shaping NAME  fn(trajectory: Trajectory) -> float | list[float]: the reward (or
                           per-turn rewards) the advantage sees instead of the posted one

The built-ins (`trainer/algorithms.py`) are registered with `register` and resolved like any
other. Resolution checks the signature (one argument), so a wrong name or signature stops the
run before its first step; `call` runs a plug-in and turns its exception into a `PluginError`
that names the plug-in, the step and the group: a plug-in that fails stops the run, never
skips a group silently. A file is loaded from its absolute path (the config makes a relative
one absolute where the command was typed), so it works from any working directory, and each
process (a Ray actor, a data-parallel worker) resolves the same name to the same function:
names, not functions, travel in the config and the checkpoint pins none.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from molt_proxy.callables import CallableError, load

Kind = Literal["advantage", "loss", "group_filter", "reward_shaping"]
_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {
    "advantage": {},
    "loss": {},
    "group_filter": {},
    "reward_shaping": {},
}
_TAKES = {
    "advantage": "group: list[Trajectory]",
    "loss": "inputs: LossInputs",
    "group_filter": "group: list[Trajectory]",
    "reward_shaping": "trajectory: Trajectory",
}


class PluginError(ValueError):
    """A plug-in that cannot be found, takes the wrong arguments, returns the wrong thing, or
    raised: the message names the flag, the plug-in and, once running, the step and group."""


@dataclass(frozen=True, slots=True)
class Plugin:
    kind: Kind
    spec: str
    """As given: a built-in name, `module:function` or `file.py:function`."""
    fn: Callable[..., Any]

    def __str__(self) -> str:
        return f"--{self.kind.replace('_', '-')} {self.spec}"


def register(kind: Kind, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `fn` is the built-in `name` of plug point `kind`."""

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY[kind][name] = fn
        return fn

    return add


def builtins(kind: Kind) -> list[str]:
    import trainer.algorithms  # noqa: F401  (registers the built-ins)

    return sorted(_REGISTRY[kind])


@cache
def resolve(kind: Kind, spec: str) -> Plugin:
    """The plug-in `spec` names, its signature checked: it must accept one argument. Cached:
    the loss is resolved per micro-batch."""
    flag = f"--{kind.replace('_', '-')} {spec}"
    names = builtins(kind)
    path, _, name = spec.rpartition(":")
    if not path:
        if spec not in names:
            raise PluginError(
                f"{flag}: no built-in of that name (built-ins: {', '.join(names)}); "
                "give module:function or path/to/file.py:function for your own"
            )
        fn = _REGISTRY[kind][spec]
    else:
        try:
            fn = load(spec)
        except CallableError as exc:
            raise PluginError(f"{flag}: {exc}") from exc
    try:
        inspect.signature(fn).bind(None)
    except TypeError as exc:
        raise PluginError(
            f"{flag}: {name or spec}{inspect.signature(fn)} must take one argument ({_TAKES[kind]}): {exc}"
        ) from exc
    return Plugin(kind, spec, fn)


def call(plugin: Plugin, argument: Any, where: str) -> Any:
    """`plugin.fn(argument)`; an exception stops the run as a `PluginError` naming the
    plug-in and `where` (the step and the group, or the micro-batch)."""
    try:
        return plugin.fn(argument)
    except Exception as exc:
        raise PluginError(f"{plugin} raised at {where}: {exc!r}") from exc
