"""Command lines made from settings dataclasses: each field one flag, its docstring the help.

`serve`, `python -m trainer` and `molt-proxy rollout` declare no flag by hand. `add_flags`
reads a dataclass's fields (name, type, default) and the docstring written under each, and
`from_flags` builds the dataclass back from the parsed command line; so a setting is written
once, beside the check that guards it, and its flag, default and help cannot drift apart.

A field's flag is its name with `-` for `_` and the unit suffix `_s` (seconds) dropped:
`session_ttl_s` is `--session-ttl`. Its type decides the rest: a `Literal` or an enum gives
choices, a `bool` a switch, a list or `tuple[str, ...]` several values after one flag,
`tuple[float, float]` exactly two, `X | None` with another default also takes `none`, and a
field that is itself a settings dataclass (`TrainerConfig.loss`) a group of its own. Where a
flag differs from that (a name `vllm serve` spells otherwise, a flag given once per value, a
parser of its own) the field says so: `field(metadata=flag(...))`. A field the command sets
itself has `metadata=NO_FLAG`.

Imports nothing of the package: a command line builds without loading what it runs.
"""

from __future__ import annotations

import argparse
import ast
import enum
import inspect
import shlex
import types
from collections.abc import Callable, Collection
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_KEY = "molt_proxy.flags"


@dataclass(frozen=True, slots=True)
class Flag:
    """How a field's flag differs from the one its name and type imply."""

    name: str | None = None
    """The flag as typed (`--upstream` for `upstreams`); None: made from the field's name."""
    metavar: str | tuple[str, ...] | None = None
    """What `--help` shows for the value (`URL`); None: argparse's choice."""
    parse: Callable[[str], Any] | None = None
    """Reads one value from its text; the message of the `ValueError` it raises is the error
    shown. None: the field's type."""
    repeat: bool = False
    """A list given as the flag once per value (`--upstream A --upstream B`), rather than as the
    values after one flag."""
    nargs: str | None = None
    """`*` where the flag given with no value means something (`--side-request`: no rules);
    None: one value, or `+` for a list."""


def flag(
    name: str | None = None,
    *,
    metavar: str | tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
    nargs: str | None = None,
) -> dict[str, Flag]:
    """A field's metadata that shapes its flag (`Flag` says how)."""
    return {_KEY: Flag(name, metavar, parse, repeat, nargs)}


NO_FLAG: dict[str, None] = {_KEY: None}
"""The metadata of a field that the command sets itself; its docstring says from what."""


def add_flags(
    parser: argparse.ArgumentParser, cls: type, *, group: str | None = None, but: Collection[str] = ()
) -> None:
    """A flag for each field of the dataclass `cls`, except `but` (fields whose flag another
    class on this command line declares: both read the same value). With `group`, they are
    listed under that title, described by the class's docstring; a nested settings class's
    flags follow under `group` and the field's name."""
    target = parser.add_argument_group(group, _class_docstring(cls)) if group else parser
    hints = _hints(cls)
    helps = docstrings(cls)
    for f in fields(cls):
        spec = f.metadata.get(_KEY, Flag())
        if spec is None or f.name in but:
            continue
        if is_dataclass(hints[f.name]):
            add_flags(parser, hints[f.name], group=f"{group} {f.name}" if group else f.name)
            continue
        if f.name not in helps:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring: it is the help of {flag_name(f)}")
        target.add_argument(flag_name(f), **_options(f, hints[f.name], spec, helps[f.name]))


def from_flags(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The dataclass `cls` from a parsed command line: each field from its flag, or from
    `given` (what the command decides; it wins over a flag). A field whose flag this command
    line does not have keeps its default."""
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in given or f.metadata.get(_KEY, Flag()) is None:
            continue
        if is_dataclass(hints[f.name]):
            values[f.name] = from_flags(hints[f.name], args)
        elif hasattr(args, _dest(flag_name(f))):
            values[f.name] = _value(getattr(args, _dest(flag_name(f))), hints[f.name])
    return cls(**values, **given)


def flag_name(f: Field) -> str:
    """`--name` of field `f`: its metadata's, else its name with `-` for `_`, `_s` dropped."""
    spec = f.metadata.get(_KEY)
    if spec is not None and spec.name is not None:
        return spec.name
    return "--" + f.name.removesuffix("_s").replace("_", "-")


def _dest(name: str) -> str:
    """The attribute the parsed command line keeps flag `name` under, as argparse names it."""
    return name.lstrip("-").replace("-", "_")


def default(cls: type[DataclassInstance], name: str) -> Any:
    """The default of field `name` of dataclass `cls`; MISSING where it has none."""
    return _default(cls.__dataclass_fields__[name])


def docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring, the string literal right under it, on one line. Python keeps
    none of them at run time, so they are read from the class's source."""
    body = _class_node(cls).body
    found = {}
    for statement, after in zip(body, body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[statement.target.id] = " ".join(after.value.value.split())
    return found


def _class_docstring(cls: type) -> str | None:
    """The docstring written on `cls`, on one line; None where it has none (`__doc__` then
    holds the signature that `dataclass` makes up)."""
    text = ast.get_docstring(_class_node(cls))
    return None if text is None else " ".join(text.split())


@cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields' types, their annotations evaluated (once: that is most of a parser's cost)."""
    return get_type_hints(cls)


def _class_node(cls: type) -> ast.ClassDef:
    return _classes(inspect.getfile(cls))[cls.__qualname__]


@cache
def _classes(path: str) -> dict[str, ast.ClassDef]:
    """The classes of a module's source by name: one parse per module, whose few classes are
    each read at most twice (their fields' docstrings, their own)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


# The argparse options of one field ---------------------------------------------------------


def _options(f: Field, kind: Any, spec: Flag, doc: str) -> dict[str, Any]:
    value = _default(f)
    options: dict[str, Any] = {"required": True} if value is MISSING else {"default": value}
    shown = "" if value is MISSING else _shown(value)
    options["help"] = (doc + (f" (default: {shown})" if shown else "")).replace(
        "%", "%%"
    )  # argparse formats it
    if spec.metavar is not None:
        options["metavar"] = spec.metavar
    kind, optional = _without_none(kind)
    if kind is bool:
        if value is not False:
            raise TypeError(f"{f.name}: a switch that is on by default has no flag that turns it off")
        return options | {"action": "store_true"}
    item = kind
    if get_origin(kind) in (list, tuple):
        item, *rest = get_args(kind)
        if spec.repeat:
            options["action"] = "append"
        else:
            fixed = get_origin(kind) is tuple and rest != [Ellipsis]
            options["nargs"] = len(rest) + 1 if fixed else spec.nargs or "+"
    if get_origin(item) is Literal:
        options["choices"] = get_args(item)
        item = type(options["choices"][0])
    elif isinstance(item, type) and issubclass(item, enum.Enum):
        options["choices"] = [member.value for member in item]
        item = type(options["choices"][0])
    options["type"] = _reader(spec.parse or item, none=optional and value is not None)
    return options


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _without_none(kind: Any) -> tuple[Any, bool]:
    """`X` of `X | None`, and whether None was allowed."""
    if get_origin(kind) in (Union, types.UnionType) and type(None) in get_args(kind):
        [inner] = [arg for arg in get_args(kind) if arg is not type(None)]
        return inner, True
    return kind, False


def _reader(parse: Callable[[str], Any], *, none: bool) -> Callable[[str], Any]:
    """`parse`, where a type keeps argparse's own message (`invalid int value: 'x'`) and a
    parser of the field's own shows what its `ValueError` says; with `none`, `none` is None."""
    if isinstance(parse, type) and not none:
        return parse

    def read(text: str) -> Any:
        if none and text.lower() == "none":
            return None
        try:
            return parse(text)
        except ValueError as exc:
            if isinstance(parse, type):
                raise
            raise argparse.ArgumentTypeError(str(exc)) from None

    read.__name__ = getattr(parse, "__name__", "value")
    return read


def _shown(value: Any) -> str:
    """The default in `--help`, as it would be typed; empty where there is none to show."""
    if value is None or value is False or (isinstance(value, list | tuple | dict) and not value):
        return ""
    if isinstance(value, list | tuple):
        return shlex.join(str(item) for item in value)
    return str(value.value if isinstance(value, enum.Enum) else value)


def _value(parsed: Any, kind: Any) -> Any:
    """The field's value from what argparse parsed: a tuple from its list, an enum member."""
    kind, _ = _without_none(kind)
    if parsed is None:
        return None
    if get_origin(kind) is tuple:
        return tuple(parsed)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(parsed)
    return parsed
