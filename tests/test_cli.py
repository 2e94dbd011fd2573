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
