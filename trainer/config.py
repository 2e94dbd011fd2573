"""The trainer's settings: every default and cross-field check in one place, and the source of
the trainer's flags (`molt_proxy/flags.py`: each field's flag, and its docstring the help).
Imports no torch, so the command line (`molt-proxy serve --help`) builds in milliseconds."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from molt_proxy.callables import absolute
from molt_proxy.flags import NO_FLAG, flag, from_flags
from trainer.advantage import Estimator

Transport = Literal["files", "nccl", "ipc"]
"""How a refresh reaches vLLM (`trainer/transfer.py`)."""

IsMode = Literal["truncate", "mask"]
Level = Literal["token", "sequence"]
KlEstimator = Literal["k1", "k2", "k3"]
KlIn = Literal["loss", "reward"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
ConstrainedTurns = Literal["train", "skip"]
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a decoder layer (attention and MLP), as QLoRA found best."""


@dataclass(frozen=True, slots=True)
class LossConfig:
    """The policy loss's knobs; `trainer/loss.py` has the formula they enter."""

    clip_low: float = 0.2
    """Where A < 0, r is clipped below 1 - clip_low (0.2 as in PPO, Schulman et al. 2017)."""
    clip_high: float = 0.28
    """Where A > 0, r is clipped above 1 + clip_high. Above clip_low ("clip-higher", DAPO):
    unlikely tokens with a positive advantage may gain more, which slows entropy collapse."""
    is_mode: IsMode = "truncate"
    """truncate: w = min(ratio, is_high) (TIS, Yao et al. 2025); every token trains, the
    variance is bounded, at a small bias. mask: w = ratio inside [is_low, is_high], else 0;
    tokens the trainer and the sampler disagree about are dropped instead of trusted a bit."""
    is_level: Level = "token"
    """token: a ratio per token. sequence: the geometric mean of the token ratios over the
    sequence's kept tokens, shared by all of them; a sequence is judged (and masked) whole.
    The geometric mean sits much closer to 1, so the sequence level wants tighter bounds."""
    is_low: float = 0.5
    """Lower bound of `mask`; `truncate` ignores it."""
    is_high: float = 2.0
    """Cap of `truncate` and upper bound of `mask` (C = 2 as in TIS)."""
    max_staleness: int | None = 4
    """Sampled tokens more than this many weight versions older than the trainer's are
    withheld and counted; None (`none`) trains on any age. 4 is a cautious start: AReaL (whose eta
    this is) trains well a few versions behind once decoupled PPO corrects for it."""

    ratio_level: Level = "token"
    """The PPO ratio pi/pi_old and its clip. token: per token (PPO). sequence: GSPO (Zheng et
    al. 2025), s_i = exp(mean over the sequence's kept tokens of log(pi/pi_old)), clipped once
    per sequence and shared by its tokens; its gradient is the mean of the tokens'. GSPO's
    objective is this with `--loss-agg seq-mean-token-mean` and far tighter clips (3e-4, 4e-4
    in the paper), since a geometric mean stays close to 1."""
    entropy_coef: float = 0.0
    """An entropy bonus: this times the policy's entropy at each kept token is subtracted
    from the loss. 0 (the default; DAPO and Dr.GRPO use none): the entropy is only logged.
    Above 0 a step whose advantages are all 0 still runs, for this term (`loop.py`)."""
    kl_coef: float = 0.0
    """beta of a KL penalty towards a frozen reference policy, the initial weights. 0 (the
    default, as in DAPO and Dr.GRPO, which found it only slows learning): no reference model
    is loaded at all. Above 0 the trainer holds a second copy of the model and runs one more
    forward per micro-batch (bench/RESULTS.md, block 4). Above 0 with `kl_in` loss, a step
    whose advantages are all 0 still runs, for this term (`loop.py`)."""
    kl_estimator: KlEstimator = "k3"
    """Per sampled token, with x = log ref - log pi: k1 = -x (unbiased, can be negative), k2 =
    x^2 / 2, k3 = e^x - 1 - x (unbiased for KL(pi || ref), never negative, low variance:
    GRPO's); Schulman, "Approximating KL divergence" (2020)."""
    kl_in: KlIn = "loss"
    """loss: beta * k_t is added to every kept token's term, with its gradient (GRPO). reward:
    beta times the sum of k_t over a trajectory's sampled tokens (pi there: the sampler's mu)
    is subtracted from its reward before the advantages (PPO-RLHF); per turn with
    `--turn-discount`."""
    loss_agg: LossAgg = "token-mean"
    """How token terms add up to the loss (`trainer/loss.py` has the normalisations):
    token-mean weighs every token alike (DAPO); seq-mean-token-sum divides by a constant, the
    sequence count (Dr.GRPO, no length bias); seq-mean-token-mean weighs every sequence alike."""
    loss: str = "ppo"
    """The per-token policy loss, a plug-in (`trainer/plugins.py`) given a `loss.LossInputs`:
    ppo (the built-in clipped surrogate of `trainer/loss.py`, with the knobs above),
    `module:function` or `path/to/file.py:function`. A name, not a function: each process
    (data-parallel workers too) resolves it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", absolute(self.loss))
        hints = get_type_hints(LossConfig)
        for f in fields(self):
            choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else ()
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        for name in ("clip_high", "entropy_coef", "kl_coef"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.is_low <= 1.0 <= self.is_high:
            raise ValueError(
                f"need 0 <= is_low <= 1 <= is_high, got is_low={self.is_low}, is_high={self.is_high}"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")


@dataclass(slots=True)
class TrainerConfig:
    """The trainer: what it learns from, how it turns groups of episodes into steps, and how
    its weights reach vLLM."""

    proxy_url: str = field(metadata=NO_FLAG)
    """The molt-proxy to learn from (its trajectory stream) and to refresh (its admin route):
    `serve --train`'s own, or the first `--proxy-url` of `python -m trainer`."""
    model: str
    """Initial weights (a Hugging Face folder): the same model vLLM started with."""
    out_dir: Path = field(default=Path("runs/train"), metadata=flag("--train-out", metavar="DIR"))
    """Checkpoints, weights pushed to vLLM, metrics.jsonl and reward_curve.png."""
    admin_key: str | None = None
    """The proxies' admin key, for their trajectory stream and their refresh route; None: they
    are open."""
    more_proxy_urls: list[str] = field(
        default_factory=list, metadata=flag("--proxy-url", repeat=True, metavar="URL")
    )
    """A (further) molt-proxy to learn from and refresh alike; repeat the flag for several: N
    proxies behind a session-affine balancer, one cursor each in the checkpoint. Keep their
    order across restarts; add new ones at the end."""
    tensorboard: Path | None = field(default=None, metadata=flag(metavar="DIR"))
    """Also write every metrics.jsonl field as TensorBoard scalars into this folder (None: don't)."""
    group_size: int = 8
    """Episodes per group (sessions sharing a `group_id`); the group baseline compares them."""
    group_timeout_s: float = 60.0
    """A group waits at most this many seconds for stragglers, then trains with what it has."""
    groups_per_step: int = 4
    """Groups each step trains on."""
    max_steps: int = 100
    """Steps to run, taken or skipped (a step that would change nothing still consumes its
    groups), so a run whose task is solved still ends."""
    estimator: Estimator = Estimator.GRPO
    """The built-in advantage estimator (`trainer/advantage.py`): grpo, dr_grpo (no division by
    the std), rloo (leave-one-out baseline), reinforce (none), reinforce_baseline (a running
    mean)."""
    lr: float = 1e-5
    """AdamW's learning rate."""
    train_only: tuple[str, ...] = field(default=(), metadata=flag(metavar="NAME"))
    """Train only the parameters whose names start with one of these (as `model.named_parameters()`
    names them, e.g. `lm_head` or `model.layers.1.`); the rest stay frozen. Empty (the default):
    every parameter. A few parameters take a far higher `lr` than the whole model does without
    losing what it knew (`examples/learn_line_count.py` trains the LM head alone at 1e-2); vLLM
    still gets the whole model at each refresh."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm before each optimizer step."""
    micro_batch_size: int = 16
    """Rows per micro-batch (on average: micro-batches are balanced by tokens); memory, not math."""
    ppo_epochs: int = 1
    """Passes over a step's data, each one optimizer step per mini-batch, against the same
    pi_old (computed once, before the first). 1 (the default): one update, the PPO ratio is 1
    and the clip idle; 2 or more make the clip act (PPO, Schulman et al. 2017, used 3-10)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the step's rows are split into this many mini-batches."""
    turn_discount: float | None = None
    """Per-turn credit: each turn's advantage from its discounted reward-to-go over the
    per-turn rewards (`Turn.reward`) and the final reward, compared per turn position within
    the group (`trainer/advantage.py`). None (the default): one advantage per episode, from
    its final reward, on every sampled token."""
    drop_flat_groups: bool = False
    """DAPO's dynamic sampling: a group whose episodes all had the same outcome (reward, and
    per-turn rewards with `turn_discount`) gives a group-relative estimator advantage 0
    everywhere; drop it before the step (counted: `dropped_flat_groups`) and wait for groups
    with something to learn, so every step has `groups_per_step` informative groups. The
    built-in group filter `drop_flat` (`trainer/algorithms.py`)."""
    advantage: str | None = field(default=None, metadata=flag(metavar="NAME"))
    """An advantage plug-in (`trainer/plugins.py`): `module:function` or `file.py:function`,
    fn(group) -> one advantage per trajectory, or per turn of each. None: the built-in that
    `estimator` names (per turn with `turn_discount`); a built-in's name sets `estimator`."""
    group_filter: str | None = field(default=None, metadata=flag(metavar="NAME"))
    """A group-filter plug-in, fn(group) -> bool: whether a step takes a ready group (those
    it refuses are consumed and counted, `dropped_filtered_groups`). `drop_flat` is
    `drop_flat_groups`."""
    reward_shaping: str | None = field(default=None, metadata=flag(metavar="NAME"))
    """A reward-shaping plug-in, fn(trajectory) -> a reward, or one per turn: what the
    advantage sees instead of the posted reward (which stays in the record and `reward_mean`)."""
    trajectories: Path | None = field(default=None, metadata=flag(metavar="FILE"))
    """Train offline from this `molt-proxy export` (JSONL or Parquet) instead of a proxy's
    stream: the same steps, no proxy, no vLLM, no refresh (`trainer/source.py`), deterministic
    under `--seed`."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss's knobs, a flag each."""
    refresh_every: int = 1
    """Push new weights to vLLM after every this many steps."""
    num_workers: int = 1
    """>1: data-parallel FSDP2 workers as Ray actors."""
    lora_rank: int | None = field(default=None, metadata=flag(metavar="R"))
    """Train a LoRA adapter of this rank instead of the full weights (`trainer/lora.py`), and
    push adapters (megabytes): the proxies must serve one (`--lora-name`). None: full weights."""
    lora_alpha: float = 16.0
    """The adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: tuple[str, ...] = field(default=LORA_TARGETS, metadata=flag(metavar="NAME"))
    """The linear layers (by their own name, as PEFT's `target_modules`) that get an adapter."""
    ray_address: str | None = None
    """A Ray cluster to join (its address, or `auto`) instead of starting one in this process."""
    weight_transfer: Transport = "files"
    """How a refresh reaches vLLM (`trainer/transfer.py`): files (safetensors the proxy has vLLM
    reload), or nccl / ipc (vLLM's weight-transfer engine, GPU to GPU; the folder is still
    written, for replicas that come back). nccl / ipc fall back to files without CUDA."""
    seed: int = 0
    """Seeds the trainer's randomness: with it, offline training (`--trajectories`) does the same
    steps every run."""
    train_greedy: bool = False
    """Train on greedy (temperature 0) tokens, at their T = 1 logprob. Off by default: an
    argmax is not a sample of the policy, so they are left out and counted (`greedy_tokens`)."""
    constrained_turns: ConstrainedTurns = "skip"
    """The sampled tokens of constrained turns (`Turn.constrained`: tool_choice required or
    named, JSON response_format, structured outputs). vLLM drew them from the grammar-masked
    distribution renormalised over the allowed tokens, and records that distribution's
    logprob (measured: bench/RESULTS.md), which the trainer cannot recompute: it has no
    grammar. skip (the default) leaves them out of the loss and counts them
    (`constrained_tokens`); train trains them like any token, against the unmasked pi, so a
    forced token's importance weight pi/mu is the mass the grammar allowed (at most 1)."""

    @property
    def proxy_urls(self) -> list[str]:
        """The proxies followed and refreshed; none offline (`trajectories`)."""
        return [] if self.trajectories is not None else [self.proxy_url, *self.more_proxy_urls]

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.tensorboard = None if self.tensorboard is None else Path(self.tensorboard)
        self.trajectories = None if self.trajectories is None else Path(self.trajectories).resolve()
        self._plug_ins()
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
        for name in ("lr", "max_grad_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.turn_discount is not None and not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in [0, 1], got {self.turn_discount}")
        if self.drop_flat_groups and self.estimator in (Estimator.REINFORCE, Estimator.REINFORCE_BASELINE):
            raise ValueError(
                f"drop_flat_groups needs a group-relative estimator: {self.estimator} learns from any group"
            )
        self._check_lora()
        if self.train_only and self.num_workers > 1:
            raise ValueError("train_only needs num_workers 1: FSDP shards every parameter alike")
        if self.trajectories is not None and self.more_proxy_urls:
            raise ValueError("trajectories (offline) follows no proxy: drop --proxy-url")
        if self.loss.kl_coef > 0 and self.num_workers > 1:
            raise ValueError("kl_coef > 0 needs num_workers 1: the reference model is not sharded yet")
        if self.constrained_turns not in ("train", "skip"):
            raise ValueError(f"constrained_turns must be 'train' or 'skip', got {self.constrained_turns!r}")

    def _plug_ins(self) -> None:
        """A built-in's name is that built-in's own setting (`--advantage rloo` is `--estimator
        rloo`, `--group-filter drop_flat` is `--drop-flat-groups`), so the checks and the
        state they keep (REINFORCE's running baseline) stay one; a file path is made absolute
        where the command was given."""
        if self.advantage in {e.value for e in Estimator}:
            self.estimator, self.advantage = Estimator(self.advantage), None
        if self.group_filter == "drop_flat":
            self.drop_flat_groups, self.group_filter = True, None
        self.estimator = Estimator(self.estimator)
        for name in ("advantage", "group_filter", "reward_shaping"):
            if getattr(self, name) is not None:
                setattr(self, name, absolute(getattr(self, name)))
        if self.advantage is not None and self.turn_discount is not None:
            raise ValueError(
                f"turn_discount is the built-in estimators' per-turn credit; {self.advantage} "
                "returns per-turn advantages itself, as it chooses"
            )

    def _check_lora(self) -> None:
        if self.lora_rank is None:
            return
        if self.lora_rank < 1 or self.lora_alpha <= 0 or not self.lora_target_modules:
            raise ValueError(
                f"LoRA needs a rank >= 1, alpha > 0 and target modules, got {self.lora_rank}, "
                f"{self.lora_alpha} and {list(self.lora_target_modules)}"
            )
        if self.num_workers > 1:
            raise ValueError("lora_rank needs num_workers 1: adapters are not sharded yet")
        if self.train_only:
            raise ValueError("train_only picks among the full weights; LoRA trains its adapter alone")


def config_from_args(args: argparse.Namespace, proxy_url: str, model: str) -> TrainerConfig:
    """The trainer's flags as settings, following `proxy_url` (`serve --train`: its own) first
    and the `--proxy-url`s after it."""
    return from_flags(TrainerConfig, args, proxy_url=proxy_url, model=model)
