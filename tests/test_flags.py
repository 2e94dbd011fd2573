"""The flag generator (`molt_proxy/flags.py`) on a dataclass with every shape of field a settings
class has: each field one flag, its help the docstring and default, its values read back into
the dataclass exactly, and bad values refused with argparse's message or the parser's own."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from molt_proxy.flags import NO_FLAG, add_flags, flag, from_flags


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


def parse_pair(text: str) -> dict[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not value.isdigit():
        raise ValueError(f"{text!r} is not NAME=DIGITS")
    return {name: int(value)}


@dataclass(frozen=True)
class Inner:
    """Knobs of the inner part."""

    depth: int = 3
    """How deep."""


@dataclass(frozen=True)
class Example:
    name: str
    """The name; no default, so the flag is required."""
    given: str = field(default="from the command", metadata=NO_FLAG)
    """Set by the command, never a flag."""
    wait_s: float = 1.5
    """Seconds to wait."""
    mode: Literal["a", "b"] = "a"
    """A or b."""
    color: Color = Color.RED
    """A colour."""
    loud: bool = False
    """Shout."""
    words: list[str] = field(default_factory=list)
    """Words after one flag."""
    maybe: list[str] = field(default_factory=lambda: ["hi there"], metadata=flag("--maybe-word", nargs="*"))
    """Words, or none at all."""
    urls: list[str] = field(default_factory=list, metadata=flag("--url", repeat=True, metavar="URL"))
    """One URL a flag."""
    span: tuple[float, float] = field(default=(0.0, 1.0), metadata=flag(metavar=("LOW", "HIGH")))
    """Two numbers."""
    names: tuple[str, ...] = ("p", "q")
    """Some names."""
    limit: int | None = 4
    """A limit, 100% enforced."""
    cap: float | None = None
    """A cap, if any."""
    path: Path = Path("out")
    """Where to write."""
    pair: dict[str, int] = field(default_factory=dict, metadata=flag(parse=parse_pair, metavar="K=V"))
    """A pair."""
    inner: Inner = field(default_factory=Inner)
    """The inner part."""


@dataclass(frozen=True)
class Undocumented:
    size: int = 1


def command() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example")
    add_flags(parser, Example)
    return parser


def test_every_field_but_the_commands_own_is_one_flag_named_after_it():
    options = [o for a in command()._actions for o in a.option_strings if o not in ("-h", "--help")]
    assert options == [
        *("--name", "--wait", "--mode", "--color", "--loud", "--words", "--maybe-word", "--url"),
        *("--span", "--names", "--limit", "--cap", "--path", "--pair", "--depth"),
    ]


def test_the_defaults_are_the_fields_own():
    assert from_flags(Example, command().parse_args(["--name", "n"])) == Example(name="n")


def test_every_value_reaches_its_field_in_the_fields_type():
    args = command().parse_args(
        [
            *("--name", "n", "--wait", "2", "--mode", "b", "--color", "blue", "--loud"),
            *("--words", "x", "y", "--maybe-word", "--url", "u1", "--url", "u2", "--span", "-1", "1e3"),
            *("--names", "r", "--limit", "none", "--cap", "0.5", "--path", "p/q", "--pair", "k=7"),
            *("--depth", "9"),
        ]
    )
    assert from_flags(Example, args, given="by the test") == Example(
        name="n",
        given="by the test",
        wait_s=2.0,
        mode="b",
        color=Color.BLUE,
        loud=True,
        words=["x", "y"],
        maybe=[],
        urls=["u1", "u2"],
        span=(-1.0, 1000.0),
        names=("r",),
        limit=None,
        cap=0.5,
        path=Path("p/q"),
        pair={"k": 7},
        inner=Inner(depth=9),
    )
    assert type(from_flags(Example, args).color) is Color
    assert from_flags(Example, command().parse_args(["--name", "n", "--limit", "2"])).limit == 2


def test_a_given_value_wins_over_the_flag():
    args = command().parse_args(["--name", "from the flag"])
    assert from_flags(Example, args, name="given").name == "given"


def test_a_field_whose_flag_the_command_line_lacks_keeps_its_default():
    parser = argparse.ArgumentParser()
    add_flags(parser, Example, but=("wait_s", "limit"))
    args = parser.parse_args(["--name", "n"])
    assert not hasattr(args, "wait") and not hasattr(args, "limit")
    assert from_flags(Example, args) == Example(name="n")


def test_the_help_is_the_docstring_and_the_default_as_typed():
    helps = {a.option_strings[0]: a.help for a in command()._actions}
    assert helps["--name"] == "The name; no default, so the flag is required."
    assert helps["--wait"] == "Seconds to wait. (default: 1.5)"
    assert helps["--color"] == "A colour. (default: red)"
    assert helps["--loud"] == "Shout."
    assert helps["--words"] == "Words after one flag."
    assert helps["--maybe-word"] == "Words, or none at all. (default: 'hi there')"
    assert helps["--span"] == "Two numbers. (default: 0.0 1.0)"
    assert helps["--limit"] == "A limit, 100%% enforced. (default: 4)"  # argparse reads % as a format
    assert helps["--cap"] == "A cap, if any."
    assert helps["--path"] == "Where to write. (default: out)"


def test_the_help_renders_with_the_nested_class_as_a_group():
    parser = argparse.ArgumentParser(prog="example")
    add_flags(parser, Example, group="example")
    shown = parser.format_help()
    assert "example:\n  --name NAME" in shown
    assert "example inner:\n  Knobs of the inner part.\n\n  --depth DEPTH " in shown
    assert "How deep. (default: 3)" in shown
    assert "A limit, 100% enforced. (default: 4)" in shown
    assert "--span LOW HIGH" in shown and "--url URL" in shown and "--pair K=V" in shown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: --name"),
        (["--mode", "c"], "argument --mode: invalid choice: 'c' (choose from 'a', 'b')"),
        (["--color", "green"], "argument --color: invalid choice: 'green' (choose from 'red', 'blue')"),
        (["--limit", "lots"], "argument --limit: invalid int value: 'lots'"),
        (["--cap", "none"], "argument --cap: invalid float value: 'none'"),
        (["--span", "1"], "argument --span: expected 2 arguments"),
        (["--pair", "k=v"], "argument --pair: 'k=v' is not NAME=DIGITS"),
    ],
)
def test_a_bad_value_is_refused_with_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit):
        command().parse_args(["--name", "n", *argv] if argv else argv)
    assert capsys.readouterr().err.splitlines()[-1] == f"example: error: {message}"


def test_a_field_without_a_docstring_has_no_help_and_is_refused():
    with pytest.raises(TypeError, match=r"Undocumented.size has no docstring: it is the help of --size"):
        add_flags(argparse.ArgumentParser(), Undocumented)
