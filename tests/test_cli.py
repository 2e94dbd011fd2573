"""The command line: its defaults are the settings' own, and asking for help is quick (no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from molt_proxy.cli import main, parser, settings_from_args
from molt_proxy.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    """Top-level modules loaded by a fresh interpreter that ran `code`."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["export", "--help"], ["build-tiny-model", "--help"]]
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
