"""molt-proxy: an OpenAI-compatible proxy that records token-exact trajectories for RL."""

from molt_proxy.types import Generation, Segment, SessionStatus, Trajectory, Turn

__all__ = ["Generation", "Segment", "SessionStatus", "Trajectory", "Turn"]
