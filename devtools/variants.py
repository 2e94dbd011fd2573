"""Stand-ins for the text that differs between two runs of a CLI's episode — the folder it runs
in, the date, the ids its tools print — for teaching to show in its place (`Conversation.vary`),
one of each per teaching day, so the tiny model learns to look past them.

How many matters more than which. Taught twelve of each, the model wrote Gemini CLI's first
reply wrong (greedy) after 15 of 20 folders it had not seen; taught four chunk ids, Codex's
answer after 9 of 20 others. Taught `COUNT`: after 1 of 60 such folders (none of 100 named as
the tests' are) and none of 20 chunk ids. So each is drawn `COUNT` times from a seeded
generator (the same on every build), in the shapes real runs give them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import date, timedelta
from typing import TypeVar

T = TypeVar("T")

COUNT = 36
"""Values of each run-dependent text: teaching's days are as many (`devtools.teaching`)."""

_WORDS = "cli writes the file runs hi rollout attempt episode codex gemini claude example task".split()
_USERS = ["root", "runner", "ci", "dev", "alice"]


HELD_OUT = 1_000
"""Added to a seed with `drawn(held_out=True)`: another generator, values teaching never showed."""


def drawn(seed: int, draw: Callable[[random.Random], T], held_out: bool = False) -> list[T]:
    """`COUNT` values of `draw`, from a generator seeded with `seed`; `held_out`: with `seed +
    HELD_OUT`, for checking that the taught model looks past values it never saw
    (`tests/test_tinymodel.py`)."""
    rng = random.Random(seed + HELD_OUT if held_out else seed)
    return [draw(rng) for _ in range(COUNT)]


def _name(rng: random.Random, size: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(size))


def folder(rng: random.Random) -> str:
    """A temporary folder as pytest (alone or in an xdist worker), `tempfile` or a rollout makes one."""
    user, test = rng.choice(_USERS), "test_" + "_".join(rng.sample(_WORDS, rng.randint(2, 5)))
    shapes = [
        f"/tmp/pytest-of-{user}/pytest-{rng.randint(0, 400)}/popen-gw{rng.randint(0, 3)}/{test[:30]}0",
        f"/tmp/pytest-of-{user}/pytest-{rng.randint(0, 400)}/{test[:30]}{rng.randint(0, 2)}",
        f"/tmp/tmp{_name(rng, 8)}",
        f"/tmp/molt-{rng.choice(_WORDS)}-{_name(rng, 8)}",
        f"/tmp/molt-rollout-{_name(rng, 5)}/attempts/{rng.choice(_WORDS)}-{rng.randint(0, 9)}",
        f"/home/{user}/work/{_name(rng, 6)}",
    ]
    return rng.choice(shapes)


def pid(rng: random.Random) -> int:
    """A process (group) id as Linux hands them out, 2 to 4,194,304, as many of them with one
    digit as with seven: a machine up for minutes has short ones, a busy one long. Gemini CLI's
    answer went wrong greedily after 19 of 40 such ids when taught ids drawn uniformly (nearly
    all of seven digits): the id in a test is short on a fresh machine."""
    digits = rng.randint(1, 7)
    return rng.randint(max(2, 10 ** (digits - 1)), min(4_194_304, 10**digits - 1))


def day(rng: random.Random) -> date:
    """A date from 2024 to 2028."""
    return date(2024, 1, 1) + timedelta(days=rng.randint(0, 5 * 365))
