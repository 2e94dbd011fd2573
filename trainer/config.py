"""The trainer's settings: every default and cross-field check in one place. Imports no
torch, so the command line (`molt-proxy serve --help`) builds in milliseconds."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from molt_proxy.callables import absolute
from molt_proxy.config import default
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
    withheld and counted; None trains on any age. 4 is a cautious start: AReaL (whose eta
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
    proxy_url: str
    """The molt-proxy to learn from (its trajectory stream) and to refresh (its admin route)."""
    model: str
    """Initial weights (a Hugging Face folder): the same model vLLM started with."""
    out_dir: Path
    """Checkpoints, weights pushed to vLLM, metrics.jsonl and reward_curve.png."""
    admin_key: str | None = None
    more_proxy_urls: list[str] = field(default_factory=list)
    """Further proxies to learn from and refresh alike (`--proxy-url`, repeatable): N proxies
    behind a session-affine balancer, one cursor each in the checkpoint. Keep their order
    across restarts; add new ones at the end."""
    tensorboard: Path | None = None
    """Also write every metrics.jsonl field as TensorBoard scalars into this folder (None: don't)."""
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
    advantage: str | None = None
    """An advantage plug-in (`trainer/plugins.py`): `module:function` or `file.py:function`,
    fn(group) -> one advantage per trajectory, or per turn of each. None: the built-in that
    `estimator` names (per turn with `turn_discount`); a built-in's name sets `estimator`."""
    group_filter: str | None = None
    """A group-filter plug-in, fn(group) -> bool: whether a step takes a ready group (those
    it refuses are consumed and counted, `dropped_filtered_groups`). `drop_flat` is
    `drop_flat_groups`."""
    reward_shaping: str | None = None
    """A reward-shaping plug-in, fn(trajectory) -> a reward, or one per turn: what the
    advantage sees instead of the posted reward (which stays in the record and `reward_mean`)."""
    trajectories: Path | None = None
    """Train offline from this `molt-proxy export` (JSONL or Parquet) instead of a proxy's
    stream: the same steps, no proxy, no vLLM, no refresh (`trainer/source.py`)."""
    loss: LossConfig = field(default_factory=LossConfig)
    refresh_every: int = 1
    """Push new weights to vLLM after every this many steps."""
    num_workers: int = 1
    """>1: data-parallel FSDP2 workers as Ray actors."""
    lora_rank: int | None = None
    """Train a LoRA adapter of this rank instead of the full weights (`trainer/lora.py`), and
    push adapters (megabytes): the proxies must serve one (`--lora-name`). None: full weights."""
    lora_alpha: float = 16.0
    """The adapter's update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    """The linear layers (by their own name, as PEFT's `target_modules`) that get an adapter."""
    ray_address: str | None = None
    weight_transfer: Transport = "files"
    """How a refresh reaches vLLM (`trainer/transfer.py`): files (safetensors the proxy has vLLM
    reload), or nccl / ipc (vLLM's weight-transfer engine, GPU to GPU; the folder is still
    written, for replicas that come back). nccl / ipc fall back to files without CUDA."""
    seed: int = 0
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
        if self.lr <= 0:
            raise ValueError("lr must be positive")
        if self.turn_discount is not None and not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in [0, 1], got {self.turn_discount}")
        if self.drop_flat_groups and self.estimator in (Estimator.REINFORCE, Estimator.REINFORCE_BASELINE):
            raise ValueError(
                f"drop_flat_groups needs a group-relative estimator: {self.estimator} learns from any group"
            )
        self._check_lora()
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The trainer's flags; each default is the field's own, above or on `LossConfig`."""
    train = partial(default, TrainerConfig)
    group = parser.add_argument_group("trainer")
    group.add_argument(
        "--train-out", default="runs/train", help="checkpoints, weights, metrics, reward curve"
    )
    group.add_argument(
        "--tensorboard",
        type=Path,
        default=train("tensorboard"),
        metavar="DIR",
        help="also write every metrics.jsonl field as TensorBoard scalars into DIR",
    )
    group.add_argument(
        "--proxy-url",
        action="append",
        metavar="URL",
        help="a (further) molt-proxy to learn from and refresh; repeatable, keep the order across restarts",
    )
    group.add_argument("--group-size", type=int, default=train("group_size"))
    group.add_argument("--group-timeout", type=float, default=train("group_timeout_s"))
    group.add_argument("--groups-per-step", type=int, default=train("groups_per_step"))
    group.add_argument("--max-steps", type=int, default=train("max_steps"))
    group.add_argument("--estimator", choices=[e.value for e in Estimator], default=train("estimator").value)
    plug_in = "a built-in name, module:function or path/to/file.py:function (trainer/plugins.py)"
    group.add_argument(
        "--advantage",
        metavar="NAME",
        help=f"fn(group: list[Trajectory]) -> one advantage per trajectory or per turn; {plug_in}; "
        "default: --estimator's",
    )
    group.add_argument(
        "--group-filter",
        metavar="NAME",
        help=f"fn(group: list[Trajectory]) -> bool: which ready groups a step takes; {plug_in}",
    )
    group.add_argument(
        "--reward-shaping",
        metavar="NAME",
        help=f"fn(trajectory: Trajectory) -> float | list[float]: the reward (or per-turn rewards) "
        f"the advantage sees instead of the posted one; {plug_in}",
    )
    group.add_argument("--lr", type=float, default=train("lr"))
    group.add_argument("--micro-batch-size", type=int, default=train("micro_batch_size"))
    group.add_argument(
        "--ppo-epochs",
        type=int,
        default=train("ppo_epochs"),
        help="passes over each step's data (clip acts at >1)",
    )
    group.add_argument(
        "--mini-batches", type=int, default=train("mini_batches"), help="optimizer steps per epoch"
    )
    group.add_argument(
        "--turn-discount",
        type=float,
        default=train("turn_discount"),
        help="per-turn credit: each turn's advantage from its discounted reward-to-go over per-turn "
        "rewards and the final reward, per turn position in the group; default: one per episode",
    )
    group.add_argument(
        "--drop-flat-groups",
        action="store_true",
        help="DAPO dynamic sampling: drop groups whose episodes all had the same outcome (advantage 0) "
        "before the step, counted; a step waits for groups_per_step informative groups",
    )
    group.add_argument("--refresh-every", type=int, default=train("refresh_every"))
    group.add_argument(
        "--num-workers", type=int, default=train("num_workers"), help=">1: FSDP2 data-parallel workers"
    )
    group.add_argument(
        "--ray-address",
        help="join an existing Ray cluster instead of starting one (serve without --upstream also"
        " runs its vLLM replicas there, in Ray actors)",
    )
    group.add_argument(
        "--lora-rank",
        type=int,
        default=train("lora_rank"),
        metavar="R",
        help="train a LoRA adapter of rank R instead of the full weights; a refresh moves the adapter",
    )
    group.add_argument("--lora-alpha", type=float, default=train("lora_alpha"), help="scale: alpha / rank")
    group.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=list(train("lora_target_modules")),
        metavar="NAME",
        help="linear layers (by name) that get an adapter (default: %(default)s)",
    )
    group.add_argument(
        "--weight-transfer",
        choices=get_args(Transport),
        default=train("weight_transfer"),
        help="how a refresh reaches vLLM: files, or GPU to GPU with vLLM's weight-transfer engine:"
        " nccl (trainer and replicas on distinct GPUs) or ipc (one GPU shared with vLLM); needs"
        " CUDA in the trainer, else files",
    )
    group.add_argument("--seed", type=int, default=train("seed"))
    group.add_argument(
        "--train-greedy",
        action="store_true",
        help="train on greedy (temperature 0) tokens too, at their T=1 logprob; default: left out, counted",
    )
    group.add_argument(
        "--constrained-turns",
        choices=["train", "skip"],
        default=train("constrained_turns"),
        help="the sampled tokens of constrained turns (tool_choice required/named, JSON response_format): "
        "vLLM records their grammar-masked, renormalised logprob, which the trainer cannot recompute; "
        "skip leaves them out of the loss (counted: constrained_tokens), train trains them against the "
        "unmasked policy (default: %(default)s)",
    )
    _add_loss_arguments(parser.add_argument_group("trainer loss (trainer/loss.py)"))


_LOSS_HELP = {
    "clip_low": "PPO clip 1 - clip_low where A < 0: how far one update may lower a token",
    "clip_high": "PPO clip 1 + clip_high where A > 0; above clip_low (clip-higher, DAPO): slows "
    "entropy collapse",
    "is_mode": "train/rollout weight pi_old/mu: truncate caps it at is_high (TIS), mask zeroes it outside "
    "[is_low, is_high]",
    "is_level": "that weight per token, or one geometric mean per sequence (judged whole)",
    "is_low": "lower bound of --is-mode mask",
    "is_high": "cap of truncate, upper bound of mask",
    "ratio_level": "PPO ratio and clip per token, or per sequence (GSPO: geometric mean of the token ratios)",
    "entropy_coef": "entropy bonus per kept token (the entropy is logged whatever this is)",
    "kl_coef": "beta of a KL penalty towards the initial weights; 0: no reference model loaded",
    "kl_estimator": "per-token KL estimate: k1 (log ratio), k2 (half its square), k3 (low variance, >= 0)",
    "kl_in": "the penalty in each token's loss term (GRPO), or subtracted from the reward (PPO-RLHF)",
    "loss_agg": "token terms to loss: per token (DAPO), per sequence summed (Dr.GRPO, no length bias), "
    "or per sequence averaged (GRPO)",
    "loss": "the per-token policy loss: ppo (built-in), module:function or path/to/file.py:function, "
    "given a trainer.loss.LossInputs",
    "max_staleness": "tokens more than this many weight versions old are withheld and counted; none: any age",
}
"""One line of why per `LossConfig` field; the flag, type, choices and default come from the field."""


def _add_loss_arguments(group: argparse._ArgumentGroup) -> None:
    """A flag per `LossConfig` field (`clip_low` -> `--clip-low`), its default the field's own."""
    hints = get_type_hints(LossConfig)
    for f in fields(LossConfig):
        kind = hints[f.name]
        options: dict = {"default": f.default, "help": f"{_LOSS_HELP[f.name]} (default: %(default)s)"}
        if get_origin(kind) is Literal:
            options["choices"] = get_args(kind)
        elif kind == int | None:
            options["type"] = _int_or_none
        else:
            options["type"] = kind
        group.add_argument("--" + f.name.replace("_", "-"), **options)


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def config_from_args(args: argparse.Namespace, proxy_url: str, model: str) -> TrainerConfig:
    """`proxy_url`: the first proxy to follow (`serve --train`: its own); `--proxy-url`s after it."""
    return TrainerConfig(
        proxy_url=proxy_url,
        more_proxy_urls=list(args.proxy_url or []),
        model=model,
        out_dir=Path(args.train_out),
        admin_key=getattr(args, "admin_key", None),
        tensorboard=args.tensorboard,
        group_size=args.group_size,
        group_timeout_s=args.group_timeout,
        groups_per_step=args.groups_per_step,
        max_steps=args.max_steps,
        estimator=Estimator(args.estimator),
        turn_discount=args.turn_discount,
        drop_flat_groups=args.drop_flat_groups,
        advantage=args.advantage,
        group_filter=args.group_filter,
        reward_shaping=args.reward_shaping,
        trajectories=getattr(args, "trajectories", None),
        lr=args.lr,
        micro_batch_size=args.micro_batch_size,
        ppo_epochs=args.ppo_epochs,
        mini_batches=args.mini_batches,
        refresh_every=args.refresh_every,
        loss=LossConfig(**{f.name: getattr(args, f.name) for f in fields(LossConfig)}),
        num_workers=args.num_workers,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_target_modules=tuple(args.lora_target_modules),
        ray_address=args.ray_address,
        weight_transfer=args.weight_transfer,
        seed=args.seed,
        train_greedy=args.train_greedy,
        constrained_turns=args.constrained_turns,
    )
