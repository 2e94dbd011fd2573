"""The learn-digits task: prompts that ask for a number, rewarded by the share of digits.

Small enough for a tiny random model on 2 CPU cores to visibly learn (`examples/
learn_digits.py`); the trainer's end-to-end test rewards its agents the same way.
"""

from __future__ import annotations

PROMPTS = ["Write a number.", "Give me some digits.", "Count for me.", "What is your favourite number?"]


def digit_share(text: str) -> float:
    """The reward: which share of the reply's characters are digits (0 for an empty reply)."""
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
