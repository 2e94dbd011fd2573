"""Two FSDP2 ranks over gloo (Ray actors on a local Ray) train exactly like one `Policy`.

AdamW's first step is nearly invariant to the scale of the gradient, so equal weights alone
would not catch gradients averaged over the ranks instead of summed; the grad norm does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from devtools import build_tiny_model
from tests.trainer.builders import trajectory
from tests.trainer.test_policy import CURRENT, LOSS, SHAPES, trajectories
from trainer.batch import collate
from trainer.policy import Policy
from trainer.prefix import pack
from trainer.workers import DataParallelPolicy, TrainWorker

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", teach=False)


@pytest.fixture(scope="module")
def workers(model_dir: Path) -> Iterator[DataParallelPolicy]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    policy = DataParallelPolicy(2, model_dir, lr=1e-4)
    yield policy
    policy.close()
    ray.shutdown()


def assert_close_per_tensor(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float = 1e-5
) -> None:
    """Each tensor within `tolerance` of the expected one, relative in norm. Not element by element:
    Adam's first step is lr * g / (|g| + eps) per element, so where a gradient nearly cancels
    to |g| ~ eps, a last-bit difference in g (summed in another order across ranks) moves that
    element's update by a visible fraction of lr (measured: 1.6e-6 of lr = 1e-4 on 3 of 20M)."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        error = float((got[name] - tensor).norm() / tensor.norm().clamp(min=1e-12))
        assert error <= tolerance, (name, error)


def gradients(workers: DataParallelPolicy) -> dict[str, torch.Tensor]:
    """The reduced (and clipped) gradient of the last step, gathered whole from the ranks."""

    def gather(worker: TrainWorker) -> dict[str, torch.Tensor]:  # collective: runs on every rank
        return {name: p.grad.full_tensor() for name, p in worker.policy.model.named_parameters()}

    return ray.get([w.__ray_call__.remote(gather) for w in workers.workers])[0]


def test_workers_really_are_fsdp2_ranks_over_gloo(workers: DataParallelPolicy) -> None:
    def describe(worker: TrainWorker) -> tuple[str, bool, bool]:  # runs inside each actor
        model = worker.policy.model
        return dist.get_backend(), isinstance(model, FSDPModule), isinstance(model.lm_head.weight, DTensor)

    described = ray.get([w.__ray_call__.remote(describe) for w in workers.workers])
    assert described == [("gloo", True, True)] * 2


def test_two_fsdp_workers_make_the_update_of_one_policy(
    workers: DataParallelPolicy, model_dir: Path, tmp_path: Path
) -> None:
    single = Policy(model_dir, lr=1e-4)
    workers.load_state_dict(single.state_dict())  # the same start, whatever ran before
    records = trajectories(single.model)
    micro_batches = collate(records, [1.5, -0.5, 1.0, -2.0]).split(2)  # one row per rank each

    expected = single.ppo_step([micro_batches], CURRENT, LOSS)
    got = workers.ppo_step([micro_batches], CURRENT, LOSS)

    assert got["kept_tokens"] == expected["kept_tokens"] == sum(n - p for n, p in SHAPES[1:])
    assert got["stale_tokens"] == expected["stale_tokens"]
    for key in ("loss", "grad_norm", "is_ratio_mean", "is_ratio_max", "is_truncated_frac", "approx_kl"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert_close_per_tensor(gradients(workers), {n: p.grad for n, p in single.model.named_parameters()})
    state = workers.state_dict()["model"]
    assert_close_per_tensor(state, single.model.state_dict())

    workers.save_weights(tmp_path / "v1")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "v1"), dtype=torch.float32).state_dict()
    assert reloaded.keys() == state.keys()
    assert all(torch.equal(reloaded[name], tensor) for name, tensor in state.items())
    assert (tmp_path / "v1" / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()


def test_a_checkpoint_moves_from_one_policy_to_the_workers_mid_training(
    workers: DataParallelPolicy, model_dir: Path
) -> None:
    single = Policy(model_dir, lr=1e-4)
    single.train_step([collate(trajectories(single.model), [1.0, -1.0, 0.5, 2.0])], CURRENT, LOSS)
    workers.load_state_dict(single.state_dict())

    micro_batches = collate(trajectories(single.model, seed=1), [-1.0, 0.5, 1.0, -0.5]).split(2)
    expected = single.ppo_step([micro_batches], CURRENT + 1, LOSS)
    got = workers.ppo_step([micro_batches], CURRENT + 1, LOSS)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    state = workers.state_dict()
    assert_close_per_tensor(state["model"], single.model.state_dict())
    step = single.optimizer.state[single.model.lm_head.weight]["step"]
    assert state["optimizer"]["state"]["lm_head.weight"]["step"] == step == 2


def test_a_micro_batch_of_one_row_trains_on_two_workers_like_one_policy(
    workers: DataParallelPolicy, model_dir: Path
) -> None:
    """Fewer rows than ranks: the rank left without a row runs a masked token through the same
    collectives and adds a zero gradient (a timed-out group of one session makes this common)."""
    single = Policy(model_dir, lr=1e-4)
    workers.load_state_dict(single.state_dict())
    one_row = collate(trajectories(single.model)[1:2], [1.0])

    expected = single.ppo_step([[one_row]], CURRENT, LOSS)
    got = workers.ppo_step([[one_row]], CURRENT, LOSS)

    assert got["kept_tokens"] == expected["kept_tokens"] == SHAPES[1][0] - SHAPES[1][1]
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert_close_per_tensor(workers.state_dict()["model"], single.model.state_dict())


def test_ppo_epochs_and_mini_batches_on_the_workers_make_the_updates_of_one_policy(
    workers: DataParallelPolicy, model_dir: Path
) -> None:
    single = Policy(model_dir, lr=1e-2)  # large enough for the clip to act in the second epoch
    workers.load_state_dict(single.state_dict())
    workers_lr(workers, 1e-2)
    batch = collate(trajectories(single.model, noise=0.0), [0.0, 1.0, -1.0, 1.0])
    mini_batches = [part.split(1) for part in batch.split(2)]  # 2 mini-batches of 2 rows each

    expected = single.ppo_step(mini_batches, CURRENT, LOSS, epochs=2)
    got = workers.ppo_step(mini_batches, CURRENT, LOSS, epochs=2)

    assert got["optimizer_steps"] == expected["optimizer_steps"] == 4
    assert expected["clip_frac_low"] + expected["clip_frac_high"] > 0
    for key in ("loss", "grad_norm", "clip_frac_low", "clip_frac_high", "kept_tokens"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    state = workers.state_dict()
    # four Adam steps at lr 1e-2 carry those last-bit differences further than one at 1e-4
    assert_close_per_tensor(state["model"], single.model.state_dict(), tolerance=1e-4)
    assert state["optimizer"]["state"]["lm_head.weight"]["step"] == 4
    workers_lr(workers, 1e-4)


def test_attempts_sharing_a_prompt_train_packed_on_two_workers_like_padded_rows_on_one_policy(
    workers: DataParallelPolicy, model_dir: Path
) -> None:
    single = Policy(model_dir, lr=1e-4, shared_prefix=False)
    workers.load_state_dict(single.state_dict())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, (24,), generator=gen).tolist()
    records = [
        trajectory(
            i,
            f"s{i}",
            token_ids=prompt + torch.randint(1000, (n,), generator=gen).tolist(),
            prompt=24,
            version=CURRENT - 1,
        )
        for i, n in enumerate((3, 8, 5, 7))
    ]
    micro_batch = collate(records, [1.5, -0.5, 1.0, -2.0])
    # each rank gets two attempts, and runs their prompt once
    assert all(pack(part.input_ids, part.attention_mask) is not None for part in micro_batch.split(2))

    expected = single.ppo_step([[micro_batch]], CURRENT, LOSS)
    got = workers.ppo_step([[micro_batch]], CURRENT, LOSS)

    assert got["kept_tokens"] == expected["kept_tokens"] == 3 + 8 + 5 + 7
    for key in ("loss", "grad_norm", "is_ratio_mean", "approx_kl"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert_close_per_tensor(gradients(workers), {n: p.grad for n, p in single.model.named_parameters()})
    assert_close_per_tensor(workers.state_dict()["model"], single.model.state_dict())


def workers_lr(workers: DataParallelPolicy, lr: float) -> None:
    def set_lr(worker: TrainWorker) -> None:  # runs inside each actor
        for param_group in worker.policy.optimizer.param_groups:
            param_group["lr"] = lr

    ray.get([w.__ray_call__.remote(set_lr) for w in workers.workers])
