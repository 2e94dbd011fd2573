"""The trainer's settings: every default and cross-field check in one place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from trainer.advantage import Estimator
from trainer.loss import LossConfig


@dataclass(slots=True)
class TrainerConfig:
    proxy_url: str
    """The molt-proxy to learn from (its trajectory stream) and to refresh (its admin route)."""
    model: str
    """Initial weights (a Hugging Face folder): the same model vLLM started with."""
    out_dir: Path
    """Checkpoints, weights pushed to vLLM, metrics.jsonl and reward_curve.png."""
    admin_key: str | None = None
    group_size: int = 8
    """Episodes per group (sessions sharing a `group_id`); the group baseline compares them."""
    group_timeout_s: float = 60.0
    """A group waits at most this long for stragglers, then trains with what it has."""
    groups_per_step: int = 4
    max_steps: int = 100
    """Steps to run, taken or skipped (a step that would change nothing still consumes its
    groups), so a run whose task is solved still ends."""
    estimator: Estimator = Estimator.GRPO
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    micro_batch_size: int = 16
    """Rows per micro-batch (on average: micro-batches are balanced by tokens); memory, not math."""
    ppo_epochs: int = 1
    """Passes over a step's data, each one optimizer step per mini-batch, against the same
    pi_old (computed once, before the first). 1 (the default): one update, the PPO ratio is 1
    and the clip idle; 2 or more make the clip act (PPO, Schulman et al. 2017, used 3-10)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the step's rows are split into this many mini-batches."""
    loss: LossConfig = field(default_factory=LossConfig)
    refresh_every: int = 1
    """Push new weights to vLLM after every this many steps."""
    num_workers: int = 1
    """>1: data-parallel FSDP2 workers as Ray actors."""
    ray_address: str | None = None
    seed: int = 0
    train_greedy: bool = False
    """Train on greedy (temperature 0) tokens, at their T = 1 logprob. Off by default: an
    argmax is not a sample of the policy, so they are left out and counted (`greedy_tokens`)."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.estimator = Estimator(self.estimator)
        for name in (
            "group_size",
            "groups_per_step",
            "max_steps",
            "micro_batch_size",
            "ppo_epochs",
            "mini_batches",
            "refresh_every",
            "num_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.lr <= 0:
            raise ValueError("lr must be positive")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("trainer")
    group.add_argument(
        "--train-out", default="runs/train", help="checkpoints, weights, metrics, reward curve"
    )
    group.add_argument("--group-size", type=int, default=8)
    group.add_argument("--group-timeout", type=float, default=60.0)
    group.add_argument("--groups-per-step", type=int, default=4)
    group.add_argument("--max-steps", type=int, default=100)
    group.add_argument("--estimator", choices=[e.value for e in Estimator], default="grpo")
    group.add_argument("--lr", type=float, default=1e-5)
    group.add_argument("--micro-batch-size", type=int, default=16)
    group.add_argument(
        "--ppo-epochs", type=int, default=1, help="passes over each step's data (clip acts at >1)"
    )
    group.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per epoch")
    group.add_argument("--refresh-every", type=int, default=1)
    group.add_argument("--max-staleness", type=int, default=4)
    group.add_argument("--is-mode", choices=["truncate", "mask"], default="truncate")
    group.add_argument("--is-level", choices=["token", "sequence"], default="token")
    group.add_argument("--num-workers", type=int, default=1, help=">1: FSDP2 data-parallel workers")
    group.add_argument("--ray-address", help="join an existing Ray cluster instead of starting one")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--train-greedy",
        action="store_true",
        help="train on greedy (temperature 0) tokens too, at their T=1 logprob; default: left out, counted",
    )


def config_from_args(args: argparse.Namespace, proxy_url: str, model: str) -> TrainerConfig:
    return TrainerConfig(
        proxy_url=proxy_url,
        model=model,
        out_dir=Path(args.train_out),
        admin_key=getattr(args, "admin_key", None),
        group_size=args.group_size,
        group_timeout_s=args.group_timeout,
        groups_per_step=args.groups_per_step,
        max_steps=args.max_steps,
        estimator=Estimator(args.estimator),
        lr=args.lr,
        micro_batch_size=args.micro_batch_size,
        ppo_epochs=args.ppo_epochs,
        mini_batches=args.mini_batches,
        refresh_every=args.refresh_every,
        loss=LossConfig(max_staleness=args.max_staleness, is_mode=args.is_mode, is_level=args.is_level),
        num_workers=args.num_workers,
        ray_address=args.ray_address,
        seed=args.seed,
        train_greedy=args.train_greedy,
    )
