"""Step-level credit in the spirit of GiGPO (Feng et al. 2025, "Group-in-Group Policy
Optimization"): turns that start from the same state share a baseline.

Within a group of attempts at one task, a turn's state is what the agent was shown just
before it (the tokens its request appended: the task for a first turn, a tool result or
user message later). Each turn k of session i gets

    A_ik = (R_i - mean_j R_j)  +  (G_ik - mean of G over the group's turns from the same state)

an episode-level advantage (R: the session's reward) plus a step-level one, with G_ik the
discounted return from turn k on (per-turn rewards, R on the last turn, GAMMA). Both are
mean-centred only (GiGPO's F_norm = 1). A state seen once gives a step-level term of 0.

    python -m trainer ... --advantage examples/algorithms/gigpo.py:gigpo
"""

from __future__ import annotations

from molt_proxy.types import Trajectory

GAMMA = 0.95


def gigpo(group: list[Trajectory]) -> list[list[float]]:
    states: dict[str, list[tuple[int, ...]]] = {}  # per session, its turns' states in order
    rewards: dict[str, list[float]] = {}
    finals: dict[str, float] = {}
    for t in group:  # a session's segments come together and in order
        for turn in t.turns:
            states.setdefault(t.session_id, []).append(
                tuple(t.token_ids[turn.prompt_start : turn.completion_start])
            )
            rewards.setdefault(t.session_id, []).append(turn.reward or 0.0)
        finals[t.session_id] = t.reward
    returns: dict[str, list[float]] = {}
    for session, steps in rewards.items():
        future, out = 0.0, []
        for k in reversed(range(len(steps))):
            future = steps[k] + (finals[session] if k == len(steps) - 1 else 0.0) + GAMMA * future
            out.append(future)
        returns[session] = out[::-1]
    by_state: dict[tuple[int, ...], list[float]] = {}
    for session in states:
        for state, g in zip(states[session], returns[session], strict=True):
            by_state.setdefault(state, []).append(g)
    episode_mean = sum(finals.values()) / len(finals)
    advantages = {
        session: [
            finals[session] - episode_mean + g - sum(by_state[state]) / len(by_state[state])
            for state, g in zip(states[session], returns[session], strict=True)
        ]
        for session in states
    }
    out, taken = [], dict.fromkeys(states, 0)
    for t in group:
        start = taken[t.session_id]
        out.append(advantages[t.session_id][start : start + len(t.turns)])
        taken[t.session_id] = start + len(t.turns)
    return out
