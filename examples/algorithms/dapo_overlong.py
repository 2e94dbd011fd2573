"""DAPO's overlong reward shaping (Yu et al. 2025, "DAPO", section 3.4): a soft penalty for
replies that run into the length limit, instead of punishing a truncated reply as a wrong one.
With |y| the trajectory's sampled tokens, L_max the limit and L_cache the soft zone before it:

    R_length = 0                               |y| <= L_max - L_cache
             = (L_max - L_cache - |y|) / L_cache  L_max - L_cache < |y| <= L_max
             = -1                              |y| > L_max

and the advantage sees reward + R_length; the posted reward stays in the record.

    python -m trainer ... --reward-shaping examples/algorithms/dapo_overlong.py:overlong
"""

from __future__ import annotations

from collections.abc import Callable

from molt_proxy.types import Trajectory


def overlong_penalty(max_length: int, cache: int) -> Callable[[Trajectory], float]:
    """The shaping for a limit of `max_length` sampled tokens with a soft zone of `cache`."""

    def shaped(trajectory: Trajectory) -> float:
        length = sum(trajectory.loss_mask)
        if length <= max_length - cache:
            return trajectory.reward
        if length <= max_length:
            return trajectory.reward + (max_length - cache - length) / cache
        return trajectory.reward - 1.0

    return shaped


overlong = overlong_penalty(max_length=20480, cache=4096)
"""DAPO's own numbers: 16,384 tokens free, penalised up to 20,480."""
digits = overlong_penalty(max_length=8, cache=4)
"""For `examples/learn_digits.py`'s 8-token replies: free up to 4 tokens."""
