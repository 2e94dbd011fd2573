"""Where the real tokenizers come from: the one place that knows the checkout's layout.

Nothing can be downloaded on development or CI machines, so the Qwen3 and Llama-3.2
tokenizers (and chat templates) are kept in a folder beside the checkout,
`../shared/tokenizers/{qwen3,llama3.2}`. `$MOLT_PROXY_TOKENIZERS` names another folder of
the same shape; `build_tiny_model(tokenizer_dir=...)` (or `python -m devtools
build-tiny-model --tokenizer-dir`) names one tokenizer directly. The runtime package never
looks here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Arch = Literal["qwen3", "llama"]

ENV = "MOLT_PROXY_TOKENIZERS"
CHECKOUT_DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
"""`../shared/tokenizers` beside this checkout: where the project's machines keep them."""
_FOLDERS: dict[Arch, str] = {"qwen3": "qwen3", "llama": "llama3.2"}


def tokenizers_root() -> Path:
    """`$MOLT_PROXY_TOKENIZERS` if set, else the checkout default."""
    return Path(os.environ.get(ENV) or CHECKOUT_DEFAULT)


def tokenizer_source(arch: Arch, root: str | Path | None = None) -> Path | None:
    """The real tokenizer folder for `arch` under `root` (default `tokenizers_root()`), or
    None where it is absent."""
    folder = Path(root or tokenizers_root()) / _FOLDERS[arch]
    return folder if (folder / "tokenizer.json").exists() else None
