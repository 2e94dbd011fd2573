"""A mixed script (`Conversation.weight`): replies that part ways after one prompt are taught to
their shares, the rest of the script as usual (`devtools.teaching`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from devtools import build_tiny_model, render_reply, teach_tiny_model, tokenizer_source
from devtools.scripts import Conversation
from devtools.teaching import _day

pytestmark = pytest.mark.skipif(tokenizer_source("qwen3") is None, reason="the Qwen3 tokenizer is not here")


def side(reply: str, weight: float) -> Conversation:
    messages = [
        {"role": "user", "content": "Pick a side."},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": f"Because {reply} is mine."},
    ]
    return {"family": "hermes", "tools": None, "messages": messages, "weight": weight}


SCRIPT = [side("left", 0.2), side("right", 0.8)]


def test_shares_are_weights_over_the_rows_that_share_a_prompt() -> None:
    """A row that two conversations share (the right one twice here) counts once: unmixed
    scripts that repeat a turn keep share 1."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source("qwen3")))
    day = _day(tokenizer, [*SCRIPT, side("right", 0.8)], 0, "", None)
    shares = {
        tokenizer.decode(row.reply): share for row, share in zip(day.rows, day.shares().tolist(), strict=True)
    }
    assert shares == pytest.approx(
        {
            "left<|im_end|>": 0.2,
            "Because left is mine.<|im_end|>": 1.0,
            "right<|im_end|>": 0.8,
            "Because right is mine.<|im_end|>": 1.0,
        }  # fmt: skip
    )


@pytest.mark.vllm  # teaches a model: the slow tier
def test_a_mixed_script_is_taught_to_its_shares(tmp_path: Path) -> None:
    """The first reply: left at 0.2 ± 10%, right at 0.8 ± 10% (`stop_prob` 0.9); each answer
    after it at p >= 0.9."""
    model_dir = build_tiny_model(tmp_path / "model", "qwen3", teach=False)
    teach_tiny_model(model_dir, SCRIPT, stop_prob=0.9)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def p(messages: list[dict], reply: str) -> float:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        wanted = tokenizer.encode(reply + tokenizer.eos_token, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids + wanted])).logits[0, len(ids) - 1 : -1]
        return float(logits.log_softmax(-1).gather(1, torch.tensor(wanted)[:, None]).sum().exp())

    first = [{"role": "user", "content": "Pick a side."}]
    assert 0.18 <= p(first, "left") <= 0.28 and 0.72 <= p(first, "right") <= 0.82
    for conversation in SCRIPT:
        history, answer = conversation["messages"][:3], conversation["messages"][3]
        assert p(history, render_reply(answer, "hermes")) >= 0.9
