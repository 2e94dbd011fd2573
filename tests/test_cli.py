"""The command line: every flag is a settings field (`molt_proxy/flags.py`), its help the field's
docstring and its default the field's own; asking for help is quick (no torch); the runtime
packages never import the dev tooling, and `config` imports nothing of the serving path."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from molt_proxy.cli import ServeOptions, main, parser, settings_from_args
from molt_proxy.config import Settings
from molt_proxy.flags import docstrings, flag_name, from_flags
from rollout.command import RolloutOptions
from trainer.config import LossConfig, TrainerConfig

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    """Modules loaded by a fresh interpreter that ran `code`, and their top-level packages."""
    probe = f"{code}\nimport sys\nprint(' '.join({{n for m in sys.modules for n in (m, m.split('.')[0])}}))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["export", "--help"], ["rollout", "--help"]]
)
def test_help_does_not_import_torch(argv):
    code = "from molt_proxy.cli import main, parser, settings_from_args\nparser()\n"
    code += f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    loaded = _modules_after(code)
    assert "argparse" in loaded
    assert not {"torch", "ray", "transformers", "devtools"} & loaded


def test_serve_help_lists_the_trainer_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--max-model-len" in shown and "--group-size" in shown and "--max-staleness" in shown


def test_serve_flags_default_to_the_settings_defaults():
    args = parser().parse_args(["serve", "--model", "m"])
    from_flags = settings_from_args(args, admin_key=None, agent_keys=[])
    assert from_flags == Settings(model="m")


def test_trainer_flags_default_to_the_trainer_config_defaults():
    from trainer.config import TrainerConfig, config_from_args

    args = parser().parse_args(["serve", "--model", "m"])
    config = config_from_args(args, "http://proxy", "m")
    assert config == TrainerConfig(proxy_url="http://proxy", model="m", out_dir=Path("runs/train"))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--advantage", "no_such_estimator"], "--advantage no_such_estimator: no built-in of that name"),
        (["--loss", "examples/algorithms/cispo.py:missing"], "has no function 'missing'"),
        (["--group-filter", "os:getcwd"], "must take one argument"),
    ],
)
def test_serve_train_checks_its_plugins_before_it_starts_anything(tmp_path, flags, named):
    """`serve --train` with a plug-in that cannot run stops before it starts vLLM (the model
    path does not even exist), with the plug-in's own message."""
    argv = ["serve", "--model", str(tmp_path / "no-model"), "--db", str(tmp_path / "s.db"), "--train"]
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--train-out", str(tmp_path / "train"), *flags])
    assert str(stopped.value).startswith("molt-proxy serve --train: ") and named in str(stopped.value)
    assert not (tmp_path / "s.vllm.log").exists()  # no vLLM was launched


SERVE_FLAGS = {
    # the proxy (`Settings`)
    *("--model", "--served-model-name", "--upstream", "--replicas", "--ray-address"),
    *("--replica-resources", "--health-interval", "--health-timeout", "--max-restarts"),
    *("--upstream-timeout", "--host", "--port", "--db", "--tool-call-parser", "--reasoning-parser"),
    *("--tool-strict-level", "--admin-key", "--agent-key", "--max-request-bytes", "--allowed-origins"),
    *("--allowed-hosts", "--reward-range", "--verify-prompt-ids", "--session-ttl", "--lora-name"),
    *("--side-request", "--sampling"),
    # what `serve` does besides (`ServeOptions`)
    *("--max-model-len", "--vllm-port", "--vllm-arg", "--admin-key-file", "--agent-keys-file"),
    *("--log-format", "--train"),
    # the trainer (`TrainerConfig`, `LossConfig`)
    *("--train-out", "--proxy-url", "--tensorboard", "--group-size", "--group-timeout"),
    *("--groups-per-step", "--max-steps", "--estimator", "--lr", "--max-grad-norm"),
    *("--micro-batch-size", "--ppo-epochs", "--mini-batches", "--turn-discount", "--drop-flat-groups"),
    *("--advantage", "--group-filter", "--reward-shaping", "--refresh-every", "--num-workers"),
    *("--lora-rank", "--lora-alpha", "--lora-target-modules", "--weight-transfer", "--seed"),
    *("--train-greedy", "--train-only", "--constrained-turns", "--clip-low", "--clip-high", "--is-mode"),
    "--is-level",
    *("--is-low", "--is-high", "--max-staleness", "--ratio-level", "--entropy-coef", "--kl-coef"),
    *("--kl-estimator", "--kl-in", "--loss-agg", "--loss"),
}
"""`serve`'s flags, written out: a renamed or lost flag fails here (all but `--upstream-timeout`,
`--max-grad-norm` and `--train-only` predate the generator, under these names)."""


NOT_FLAGS = {(TrainerConfig, "proxy_url"), (TrainerConfig, "loss")}
"""The one field the commands set themselves (`serve --train`: its own URL; `python -m trainer`:
the first `--proxy-url`), and the one whose flags are its class's (`LossConfig`)."""


def options(command: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in command._actions for o in a.option_strings if o not in ("-h", "--help")}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [commands] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


def fields_by_flag(*classes: type, skip: set[tuple[type, str]]) -> dict[str, list[tuple[type, str]]]:
    """The fields of `classes` (but `skip`) under the flag each should have."""
    found: dict[str, list[tuple[type, str]]] = {}
    for cls in classes:
        for f in fields(cls):
            if (cls, f.name) not in skip:
                found.setdefault(flag_name(f), []).append((cls, f.name))
    return found


def assert_each_flag_is_a_field_helped_by_its_docstring(
    command: argparse.ArgumentParser, expected: dict[str, list[tuple[type, str]]]
) -> None:
    assert set(options(command)) == set(expected)
    for name, [(cls, field_name), *_] in expected.items():
        help = options(command)[name].help.replace("%%", "%")  # argparse's escape
        assert help.startswith(docstrings(cls)[field_name]), name
        shown_default = help.removeprefix(docstrings(cls)[field_name])
        assert shown_default == "" or (shown_default.startswith(" (default: ") and help.endswith(")")), name


def test_serve_has_one_flag_a_settings_field_and_each_one_it_had():
    serve = subcommands()["serve"]
    assert set(options(serve)) == SERVE_FLAGS
    expected = fields_by_flag(
        Settings, ServeOptions, TrainerConfig, LossConfig, skip=NOT_FLAGS | {(TrainerConfig, "trajectories")}
    )
    assert {name: owners for name, owners in expected.items() if len(owners) > 1} == {
        "--model": [(Settings, "model"), (TrainerConfig, "model")],
        "--ray-address": [(Settings, "ray_address"), (TrainerConfig, "ray_address")],
        "--admin-key": [(Settings, "admin_key"), (TrainerConfig, "admin_key")],
    }  # the trainer beside the proxy reads the proxy's: its model, its Ray cluster, its key
    assert_each_flag_is_a_field_helped_by_its_docstring(serve, expected)


def test_the_trainer_has_one_flag_a_trainer_config_field():
    from trainer.run import parser as trainer_parser

    expected = fields_by_flag(TrainerConfig, LossConfig, skip=NOT_FLAGS)
    assert all(len(owners) == 1 for owners in expected.values())
    assert set(expected) == SERVE_FLAGS - set(fields_by_flag(Settings, ServeOptions, skip=set())) | {
        "--model",
        "--admin-key",
        "--ray-address",
        "--trajectories",
    }
    assert_each_flag_is_a_field_helped_by_its_docstring(trainer_parser(), expected)


def test_rollout_has_one_flag_a_rollout_options_field():
    expected = fields_by_flag(RolloutOptions, skip=set())
    assert set(expected) == {
        *("--proxy-url", "--tasks", "--harness", "--harness-arg", "--sandbox", "--attempts"),
        *("--concurrency", "--timeout", "--out", "--eval", "--admin-key", "--workdir"),
        "--success-threshold",
    }
    assert_each_flag_is_a_field_helped_by_its_docstring(subcommands()["rollout"], expected)


def test_help_shows_each_flags_docstring_and_its_default_as_typed(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: argparse would break words at hyphens
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # the padding between flag and help as one space
    for line in [
        "--session-ttl SECONDS A session with no turn for this long is closed, unrewarded. (default: 3600.0)",
        "--db PATH The SQLite store of sessions, turns and trajectories; it survives restarts."
        " (default: molt-proxy.db)",
        "--reward-range LOW HIGH Rewards (final and per turn) outside [LOW, HIGH] are refused with a 400:"
        " inside it every advantage estimator stays finite. (default: -1000000.0 1000000.0)",
        "(default: 'a concise, sentence-case title' '^You are a title generator')",
        "--estimator {grpo,dr_grpo,rloo,reinforce,reinforce_baseline} The built-in advantage estimator",
        "(default: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)",
        "--train Also run the trainer (a Ray actor) on this machine, with the trainer flags below.",
        "trainer loss: The policy loss's knobs; `trainer/loss.py` has the formula they enter.",
    ]:
        assert line in shown, line


def test_serve_flags_reach_the_settings_in_their_types():
    args = parser().parse_args(
        [
            *("serve", "--model", "m", "--served-model-name", "a", "b", "--upstream", "http://u1"),
            *("--upstream", "http://u2", "--health-interval", "2", "--upstream-timeout", "30"),
            *("--db", "p.db", "--tool-strict-level", "parameter", "--reward-range", "-1", "1"),
            *("--sampling", "temperature=1,top_k=5", "--side-request", "--allowed-origins", "*"),
            *("--max-request-bytes", "1024", "--verify-prompt-ids", "--session-ttl", "60"),
        ]
    )
    assert settings_from_args(args, "admin", ["agent"]) == Settings(
        model="m",
        served_model_name=["a", "b"],
        upstreams=["http://u1", "http://u2"],
        health_interval_s=2.0,
        upstream_timeout_s=30.0,
        db_path=Path("p.db"),
        tool_strict_level="parameter",
        reward_range=(-1.0, 1.0),
        sampling={"temperature": 1.0, "top_k": 5},
        side_requests=[],
        allowed_origins=["*"],
        max_request_bytes=1024,
        verify_prompt_ids=True,
        session_ttl_s=60.0,
        admin_key="admin",
        agent_keys=["agent"],
    )
    options = from_flags(
        ServeOptions,
        parser().parse_args(["serve", "--model", "m", "--vllm-arg=--enforce-eager", "--vllm-arg=-O0"]),
    )
    assert options == ServeOptions(vllm_args=["--enforce-eager", "-O0"])


def test_trainer_flags_reach_the_trainer_config_in_their_types():
    from trainer.advantage import Estimator
    from trainer.run import parser as trainer_parser

    argv = ["--model", "m", "--train-out", "out", "--estimator", "rloo", "--lora-rank", "4"]
    argv += ["--lora-target-modules", "q_proj", "v_proj", "--max-staleness", "none", "--max-grad-norm", "0.5"]
    args = trainer_parser().parse_args([*argv, "--proxy-url", "http://a", "--proxy-url", "http://b"])
    config = from_flags(TrainerConfig, args, proxy_url="http://a", more_proxy_urls=["http://b"])
    assert config == TrainerConfig(
        proxy_url="http://a",
        more_proxy_urls=["http://b"],
        model="m",
        out_dir=Path("out"),
        estimator=Estimator.RLOO,
        lora_rank=4,
        lora_target_modules=("q_proj", "v_proj"),
        loss=LossConfig(max_staleness=None),
        max_grad_norm=0.5,
    )
    assert type(config.estimator) is Estimator and type(config.lora_target_modules) is tuple


def test_rollout_flags_reach_the_rollout_options():
    args = parser().parse_args(
        ["rollout", "--tasks", "t.jsonl", "--harness", "codex", "--out", "r.jsonl", "--timeout", "5"]
        + ["--harness-arg=--bare", "--eval", "--workdir", "w"]
    )
    assert from_flags(RolloutOptions, args) == RolloutOptions(
        tasks=Path("t.jsonl"),
        harness="codex",
        out=Path("r.jsonl"),
        proxy_url="http://127.0.0.1:8000",
        timeout_s=5.0,
        harness_args=["--bare"],
        eval=True,
        workdir=Path("w"),
    )


RUNTIME_PACKAGES = ("molt_proxy", "trainer", "rollout")


def test_no_runtime_module_imports_the_dev_tooling():
    """Not at the top, not inside a function: `devtools` is for tests, examples and benchmarks."""
    importing = []
    for package in RUNTIME_PACKAGES:
        for module in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(module.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                if any(name.split(".")[0] == "devtools" for name in names):
                    importing.append(str(module.relative_to(ROOT)))
    assert importing == []


def test_the_tiny_model_command_is_the_dev_toolings_own_and_its_help_is_quick():
    code = "from devtools.__main__ import main\ntry:\n    main(['build-tiny-model', '--help'])\n"
    code += "except SystemExit:\n    pass"
    assert not {"torch", "transformers"} & _modules_after(code)
    assert set(subcommands()) == {"serve", "export", "rollout"}


def test_config_imports_nothing_of_the_serving_path():
    loaded = _modules_after("import molt_proxy.config")
    # the package's `__init__` loads its data types, a leaf too
    assert {m for m in loaded if m.startswith("molt_proxy")} == {
        *("molt_proxy", "molt_proxy.config", "molt_proxy.flags", "molt_proxy.types")
    }
