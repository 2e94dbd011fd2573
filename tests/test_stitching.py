"""Stitching on the real Qwen3 tokenizer and template: continue a chain, open one, never double-append."""

from __future__ import annotations

import pytest

from devtools import tokenizer_source
from molt_proxy.stitching import commit_turn, plan_prompt
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, Segment


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    source = tokenizer_source("qwen3")
    if source is None:
        pytest.skip("the real Qwen3 tokenizer is not in ../shared/tokenizers")
    return Tokenizer.load(str(source))


def sample(tokenizer: Tokenizer, text: str) -> Generation:
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    return Generation(ids, [-0.5] * len(ids), [3] * len(ids), "stop")


def turn(tokenizer, segment, messages, reply_text, tools=None):
    plan = plan_prompt([] if segment is None else [segment], tokenizer.render(messages, tools, {}), tokenizer)
    target = (
        segment
        if plan.continues and segment is not None
        else Segment(index=0 if segment is None else segment.index + 1)
    )
    commit_turn(target, plan, sample(tokenizer, reply_text), f"c{len(target.turns)}", tokenizer)
    return plan, target


def test_continuation_with_two_tool_results_appends_only_the_suffix(tokenizer):
    def call(call_id: str, city: str) -> dict:
        arguments = f'{{"city": "{city}"}}'
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }

    messages = [{"role": "user", "content": "Weather in Paris and London?"}]
    reply = "\n".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
        for city in ("Paris", "London")
    )
    _, segment = turn(tokenizer, None, messages, reply)
    before = list(segment.token_ids)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call("a", "Paris"), call("b", "London")]},
        {"role": "tool", "tool_call_id": "a", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "Rainy"},
    ]
    plan, same = turn(tokenizer, segment, messages, "Sunny and rainy.")
    assert plan.continues and same is segment
    assert list(plan.ids[: len(before)]) == before
    suffix = tokenizer.hf.decode(plan.new_ids)
    assert suffix.startswith("\n<|im_start|>user\n<tool_response>\nSunny") and "Rainy" in suffix
    first, second = segment.turns
    assert segment.loss_mask == (
        [0] * first.completion_start
        + [1] * (first.completion_end - first.completion_start)
        + [0] * len(plan.new_ids)
        + [1] * (second.completion_end - second.completion_start)
    )
    assert second.prompt_start == first.completion_end == len(before)
    assert tokenizer.ids_bytes(segment.token_ids) == segment.text


def test_rewritten_history_starts_a_new_segment_from_the_full_render(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    _, segment = turn(tokenizer, None, messages, "<think>\nGreeting.\n</think>\n\nHello!")
    messages += [
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greeting."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.render(messages, None, {})
    plan = plan_prompt([segment], rendered, tokenizer)
    assert not plan.continues and plan.ids == plan.new_ids == tokenizer.encode(rendered)


def test_plan_without_commit_leaves_the_segment_unchanged(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    _, segment = turn(tokenizer, None, messages, "Hello!")
    snapshot = (list(segment.token_ids), list(segment.loss_mask), segment.text, len(segment.turns))
    messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    rendered = tokenizer.render(messages, None, {})
    first = plan_prompt([segment], rendered, tokenizer)  # generation failed: nothing committed
    assert (segment.token_ids.tolist(), segment.loss_mask, segment.text, len(segment.turns)) == snapshot
    retry = plan_prompt([segment], rendered, tokenizer)
    assert retry == first


def test_a_segment_cut_inside_a_character_does_not_continue(tokenizer):
    """By its sampled bytes alone; the reply's echo view continues it (tests/test_echo.py)."""

    def is_partial(token_id: int) -> bool:
        try:
            tokenizer.token_bytes(token_id).decode()
        except UnicodeDecodeError:
            return True
        return False

    partial = next(i for i in range(tokenizer.hf.vocab_size) if is_partial(i))  # a lone UTF-8 lead byte
    messages = [{"role": "user", "content": "Price?"}]
    plan = plan_prompt([], tokenizer.render(messages, None, {}), tokenizer)
    segment = Segment(index=0)
    commit_turn(segment, plan, Generation([partial], [-1.0], [0], "length"), "c0", tokenizer)
    messages += [{"role": "assistant", "content": "\ufffd"}, {"role": "user", "content": "ok"}]
    assert not plan_prompt([segment], tokenizer.render(messages, None, {}), tokenizer).continues


def test_a_render_continues_the_chain_it_extends_furthest(tokenizer):
    def render(messages: list[dict]) -> str:
        return tokenizer.render(messages, None, {})

    question = [{"role": "system", "content": "Lead."}, {"role": "user", "content": "Hi"}]
    _, first = turn(tokenizer, None, question, "Hello!")
    sub = [{"role": "system", "content": "Sub."}, question[1]]
    _, other = turn(tokenizer, first, sub, "Yes?")  # extends no chain: a new one, index 1
    history = [*question, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}]
    longer = Segment(index=2)  # `first` and one more turn: both chains are prefixes of the next render
    for messages, reply in ((question, "Hello!"), (history, "Sure.")):
        plan = plan_prompt([longer] if longer.turns else [], render(messages), tokenizer)
        commit_turn(longer, plan, sample(tokenizer, reply), f"c{len(longer.turns)}", tokenizer)
    chains = [first, other, longer]
    assert [c.index for c in chains] == [0, 1, 2] and longer.text.startswith(first.text)
    further = [*history, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Done"}]
    assert plan_prompt(chains, render(further), tokenizer).segment == 2
    elsewhere = [*history[:-1], {"role": "user", "content": "Less"}]
    assert plan_prompt(chains, render(elsewhere), tokenizer).segment == 0
    more_sub = [*sub, {"role": "assistant", "content": "Yes?"}, {"role": "user", "content": "Go"}]
    plan = plan_prompt(chains, render(more_sub), tokenizer)
    assert plan.segment == 1 and list(plan.ids) == other.token_ids.tolist() + plan.new_ids
    opened = plan_prompt(chains, render([{"role": "user", "content": "New"}]), tokenizer)
    assert (
        opened.segment is None
        and not opened.continues
        and opened.ids == tokenizer.encode(render([{"role": "user", "content": "New"}]))
    )
