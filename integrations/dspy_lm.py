"""DSPy on molt-proxy: a `dspy.LM` bound to one session.

DSPy sends each step of a program (each `ReAct` iteration, the final extraction) as a fresh
system and user prompt with the trajectory written into text, so no request extends another:
without a session name each call would be a session of its own. Bound to the session's URL,
every call of a program run lands in one session, one chain (segment) per call. DSPy caches
replies by default (in memory and on disk); a cached reply never reaches the proxy and a rerun
episode would replay the last one, so the cache is off.
"""

from __future__ import annotations

from typing import Any

import dspy

from integrations.session import MoltSession


def lm(session: MoltSession, model: str = "default", **kwargs: Any) -> dspy.LM:
    """`dspy.LM("openai/<model>", api_base=..., api_key=..., cache=False)` for `session`;
    `kwargs` (temperature, max_tokens, seed, ...) pass through. `model` is only a label."""
    return dspy.LM(
        f"openai/{model}", api_base=session.base_url, api_key=session.api_key, cache=False, **kwargs
    )
