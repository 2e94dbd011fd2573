"""The plug points: names resolve to built-ins, modules or files from any working directory;
a wrong name, signature or result stops the run before its first step, naming the plug-in,
the step and the group; the three example algorithms give their hand-computed numbers; and
a run from an export is the same run twice under one seed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from molt_proxy.types import SessionStatus, Trajectory
from tests.trainer.builders import episodes, trajectory, turns
from trainer import checkpoint, credit, plugins, run
from trainer.buffer import Group
from trainer.config import LossConfig, TrainerConfig
from trainer.loop import Trainer
from trainer.loss import policy_loss
from trainer.metrics import read
from trainer.policy import loss_plugin

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ROOT / "examples" / "algorithms"


def write_jsonl(path: Path, records: list[Trajectory]) -> Path:
    """An export as `molt-proxy export` writes it: one trajectory's JSON per line."""
    path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in records))
    return path


def offline(model: Path, out: Path, data: Path, **fields) -> TrainerConfig:
    return TrainerConfig(
        proxy_url="", model=str(model), out_dir=out, trajectories=data, group_size=2, groups_per_step=1,
        lr=1e-3, **fields,
    )  # fmt: skip


# 1. Names ---------------------------------------------------------------------------------------


def test_every_builtin_is_registered_and_a_builtin_name_is_its_own_setting() -> None:
    assert plugins.builtins("advantage") == [
        "dr_grpo", "grpo", "reinforce", "reinforce_baseline", "rloo", "turn_credit"
    ]  # fmt: skip
    assert plugins.builtins("loss") == ["ppo"] and plugins.builtins("group_filter") == ["drop_flat"]
    config = TrainerConfig(proxy_url="u", model="m", out_dir="o", advantage="rloo", group_filter="drop_flat")
    assert (config.estimator, config.advantage, config.drop_flat_groups, config.group_filter) == (
        "rloo",
        None,
        True,
        None,
    )


def test_a_file_plugin_resolves_from_its_absolute_path_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "algo.py").write_text("def half(group):\n    return [0.5] * len(group)\n")
    monkeypatch.chdir(tmp_path / "mine")
    config = TrainerConfig(proxy_url="u", model="m", out_dir="o", advantage="algo.py:half")
    assert config.advantage == f"{tmp_path / 'mine' / 'algo.py'}:half"
    monkeypatch.chdir(ROOT)
    group = episodes(1, "g", (1.0, 0.0), version=0)
    assert plugins.resolve("advantage", config.advantage).fn(group) == [0.5, 0.5]
    assert plugins.resolve("loss", "trainer.loss:clipped_surrogate").spec == "trainer.loss:clipped_surrogate"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--advantage", "gae"], "--advantage gae: no built-in of that name (built-ins: dr_grpo, grpo,"),
        (["--loss", "no.such.module:f"], "--loss no.such.module:f: cannot load no.such.module"),
        (["--group-filter", "{algos}/cispo.py:nothing"], "cispo.py has no function 'nothing'"),
        (["--reward-shaping", "{tmp}/two.py:shape"], "shape(trajectory, scale) must take one argument"),
        (["--advantage", "{tmp}/absent.py:f"], "cannot load"),
    ],
)
def test_a_wrong_name_or_signature_stops_the_command_before_anything_starts(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "two.py").write_text("def shape(trajectory, scale):\n    return 0.0\n")
    flags = [f.format(algos=ALGORITHMS, tmp=tmp_path) for f in flags]
    with pytest.raises(SystemExit) as exit:
        run.main(["--model", "m", "--trajectories", "t.jsonl", "--train-out", str(tmp_path), *flags])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def _run_offline(digits_model: Path, tmp_path: Path, code: str, **fields) -> str:
    (tmp_path / "bad.py").write_text(code)
    data = write_jsonl(tmp_path / "t.jsonl", episodes(1, "g7", (1.0, 0.0), version=0))
    trainer = Trainer(offline(digits_model, tmp_path / "out", data, max_steps=1, **fields))
    with pytest.raises(plugins.PluginError) as error:
        trainer.run()
    assert checkpoint.load(tmp_path / "out" / "checkpoint") is None, "no step was taken"
    return str(error.value)


def test_a_plugin_returning_the_wrong_number_of_advantages_stops_the_first_step(
    digits_model: Path, tmp_path: Path
) -> None:
    message = _run_offline(
        digits_model, tmp_path, "def one(group):\n    return [1.0]\n", advantage=f"{tmp_path}/bad.py:one"
    )
    assert message == (
        f"--advantage {tmp_path}/bad.py:one returned 1 advantages for the 2 trajectories of step 1, "
        "group g7: one per trajectory, or one list per trajectory with one per turn"
    )


def test_a_plugin_that_raises_stops_the_run_naming_itself_the_step_and_the_group(
    digits_model: Path, tmp_path: Path
) -> None:
    code = "def picky(group):\n    raise KeyError('difficulty')\n"
    message = _run_offline(digits_model, tmp_path, code, group_filter=f"{tmp_path}/bad.py:picky")
    assert (
        message
        == f"--group-filter {tmp_path}/bad.py:picky raised at step 1, group g7: KeyError('difficulty')"
    )


def test_a_loss_that_returns_anything_but_a_scalar_and_its_metrics_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sums.py").write_text("def total(inputs):\n    return inputs.logprobs.sum()\n")
    loss_fn = loss_plugin(f"{tmp_path}/sums.py:total", "step 3, micro-batch 0")
    mask = torch.tensor([[0, 1]])
    with pytest.raises(plugins.PluginError) as error:
        policy_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1),
            mask,
            mask - 1,
            0,
            LossConfig(),
            loss_fn=loss_fn,
        )
    assert str(error.value) == (
        f"--loss {tmp_path}/sums.py:total must return (a scalar tensor, a dict of metrics) "
        "at step 3, micro-batch 0"
    )


# 2. The example algorithms, by hand --------------------------------------------------------------


def test_cispo_weighs_every_tokens_gradient_by_its_clipped_importance_weight() -> None:
    """Ratios pi/mu of 2 and 0.5 clip to 1.28 and 0.8 (clip_high 0.28, clip_low 0.2); the
    loss is -(1.28 log 0.5 + 0.8 log 0.25) / 2 tokens, its gradient -w A / 2 on every token,
    the clipped one too (PPO's clip would have zeroed it)."""
    cispo = plugins.resolve("loss", f"{ALGORITHMS}/cispo.py:cispo").fn
    logprobs = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[0.0, math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1]])
    loss, metrics = policy_loss(
        logprobs, rollout, torch.tensor([1.0], dtype=torch.float64), mask, torch.where(mask.bool(), 0, -1), 0,
        LossConfig(), loss_fn=cispo,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-(1.28 * math.log(0.5) + 0.8 * math.log(0.25)) / 2, rel=1e-12)
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.64, -0.4], rel=1e-12)
    assert metrics["cispo_clip_frac"] == 1.0 and metrics["kept_tokens"] == 2.0


def test_gigpo_turns_from_the_same_state_share_a_baseline() -> None:
    """Sessions a (reward 1), b, c (0) of two turns; c's second turn starts from another
    state. Returns (gamma 0.95): a [0.95, 1], b and c [0, 0]. Episode terms R - 1/3; step
    terms G minus the mean over the state: first turns (0.95 + 0 + 0) / 3, a's and b's second
    turns (1 + 0) / 2, c's alone."""
    gigpo = plugins.resolve("advantage", f"{ALGORITHMS}/gigpo.py:gigpo").fn
    a, b, c = (
        turns(i + 1, name, [None, None], final)
        for i, (name, final) in enumerate((("a", 1.0), ("b", 0.0), ("c", 0.0)))
    )
    c.token_ids[3] = 99  # the prompt token of c's second turn
    values = gigpo([a, b, c])
    third = 1 / 3
    assert values == [
        pytest.approx([2 * third + 0.95 - 0.95 * third, 2 * third + 0.5], abs=1e-15),
        pytest.approx([-third - 0.95 * third, -third - 0.5], abs=1e-15),
        pytest.approx([-third - 0.95 * third, -third], abs=1e-15),
    ]
    # Through the trainer: each turn's value on its two sampled tokens.
    plugin = plugins.resolve("advantage", f"{ALGORITHMS}/gigpo.py:gigpo")
    tensor = credit.advantage_tensor(credit.advantages(plugin, [[a, b, c]]), [a, b, c], 6)
    assert tensor[2].tolist() == pytest.approx([0, -0.65, -0.65, 0, -third, -third], abs=1e-6)


def test_dapo_overlong_shaping_penalises_replies_in_the_soft_zone_and_beyond() -> None:
    """L_max 8, L_cache 4: 4 sampled tokens are free, 6 cost (4 - 6) / 4 = 0.5, 9 cost 1."""
    shaping = plugins.resolve("reward_shaping", f"{ALGORITHMS}/dapo_overlong.py:digits")
    short, soft, long = (
        trajectory(i, f"s{i}", "g", 1.0, token_ids=list(range(2 + n))) for i, n in ((1, 4), (2, 6), (3, 9))
    )
    assert [shaping.fn(t) for t in (short, soft, long)] == [1.0, 0.5, 0.0]
    assert plugins.resolve("reward_shaping", f"{ALGORITHMS}/dapo_overlong.py:overlong").fn(long) == 1.0
    # The advantage sees the shaped rewards; the records keep the posted ones. A session's
    # segments add their changes up: two soft segments of one session cost 0.5 each.
    two = [
        trajectory(4 + i, "two", "g", 1.0, segment=i, num_segments=2, token_ids=list(range(8)))
        for i in range(2)
    ]
    [shaped] = credit.shape([Group("g", [short, soft, *two])], shaping)
    assert [t.reward for t in shaped] == [1.0, 0.5, 0.0, 0.0]
    assert [t.reward for t in (short, soft, *two)] == [1.0] * 4


# 3. Offline ---------------------------------------------------------------------------------------


def test_an_offline_run_from_an_export_is_the_same_run_twice_under_one_seed(
    digits_model: Path, tmp_path: Path
) -> None:
    """Two runs of the same file: the same weights and the same numbers in every record but
    its timings. Unrewarded, side and evaluation episodes are skipped as the live loop skips
    them; a group left incomplete at the end of the file is released as a timed-out one
    would be (here one session alone: advantage 0, a skipped step)."""
    side = trajectory(6, "side", "h", None)
    side.status = SessionStatus.SIDE
    records = [
        *episodes(1, "g1", (1.0, 0.0), version=0),
        trajectory(3, "lost", "g2", None),
        *episodes(4, "eval/x", (1.0, 0.0), version=0),
        side,
        *episodes(7, "g3", (0.0, 0.5), version=0),
        trajectory(9, "alone", "g4", 1.0),
    ]
    data = write_jsonl(tmp_path / "t.jsonl", records)
    runs = []
    for name in ("a", "b"):
        config = offline(digits_model, tmp_path / name, data, max_steps=10, advantage="dr_grpo")
        assert Trainer(config).run() == {"step": 2, "version": 2, "cursors": [9]}
        state, policy = checkpoint.load(tmp_path / name / "checkpoint")
        runs.append((state, policy["model"], read(tmp_path / name / "metrics.jsonl")))
    (state, weights, metrics), (_, other_weights, other_metrics) = runs
    assert all(torch.equal(weights[k], other_weights[k]) for k in weights)
    timings = {"compute_s", "refresh_s", "step_s", "time", "tokens_per_s"}
    assert [{k: v for k, v in r.items() if k not in timings} for r in metrics] == [
        {k: v for k, v in r.items() if k not in timings} for r in other_metrics
    ]
    assert state.trained == [["g1-0:0", "g1-1:0"], ["g3-0:0", "g3-1:0"]]
    assert state.skipped_steps == {"zero_advantage": 1} and "alone:0" in state.consumed
    assert [r["refresh_s"] for r in metrics] == [0.0, 0.0]


def test_the_example_algorithms_run_offline_through_python_m_trainer_from_another_directory(
    digits_model: Path, tmp_path: Path
) -> None:
    """The three files as they are, named by paths relative to a working directory that is
    neither the repository nor the files' own: CISPO's loss, GiGPO's advantage and DAPO's
    shaping in one run of `python -m trainer --trajectories`."""
    write_jsonl(
        tmp_path / "t.jsonl",
        [*episodes(1, "g1", (1.0, 0.0), version=0), *episodes(3, "g2", (0.0, 1.0), version=0)],
    )
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    relative = os.path.relpath(ALGORITHMS, cwd)
    command = [
        sys.executable, "-m", "trainer", "--model", str(digits_model), "--trajectories", "../t.jsonl",
        "--train-out", "out", "--group-size", "2", "--groups-per-step", "1", "--max-steps", "2",
        "--loss", f"{relative}/cispo.py:cispo", "--advantage", f"{relative}/gigpo.py:gigpo",
        "--reward-shaping", f"{relative}/dapo_overlong.py:digits",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read(cwd / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # 2 sampled tokens each: no penalty; cispo's own metric landed in the record as it is
    assert all(r["shaped_reward_mean"] == r["reward_mean"] == 0.5 for r in records)
    assert all(0.0 <= r["cispo_clip_frac"] <= 1.0 for r in records)
