"""bench/capture.py: how `python -m bench peers` judges a system's record against what vLLM saw
and sampled (the tap's calls). Pure; the peers themselves are never installed in CI."""

from __future__ import annotations

from bench.capture import Call, Trace, judge, per_call

FIRST = Call([1, 2, 3], [10, 11], [-0.5, -0.25])
SECOND = Call([1, 2, 3, 10, 11, 4], [12], [-1.0])


def segment(logprobs: list[float] | None = None, versions: list[object] | None = None) -> Trace:
    """One segment holding both calls: prompt, sampled, the next message, sampled."""
    ids = [1, 2, 3, 10, 11, 4, 12]
    sampled = [False, False, False, True, True, False, True]
    return Trace(ids, sampled, logprobs, versions)


def test_one_segment_with_both_calls_is_exact_with_its_logprobs_and_versions():
    trace = segment([0, 0, 0, -0.5, -0.25, 0, -1.0], [-1, -1, -1, 3, 3, -1, 3])
    verdict = judge([FIRST, SECOND], [trace])
    assert (verdict.ids_exact, verdict.traces, verdict.logprobs, verdict.versions) == (True, 1, "exact", True)
    assert verdict.chains == 1


def test_a_trace_per_call_is_exact_too_and_counted_as_two_traces():
    traces = [per_call(c.prompt_ids, c.sampled_ids, c.logprobs) for c in (FIRST, SECOND)]
    verdict = judge([FIRST, SECOND], traces)
    assert (verdict.ids_exact, verdict.traces, verdict.logprobs, verdict.versions) == (
        True,
        2,
        "exact",
        False,
    )


def test_retokenized_history_is_not_exact():
    """A record whose second prompt re-tokenized the first reply (11 became 13 14)."""
    retokenized = Call([1, 2, 3, 13, 14, 4], [12], [-1.0])
    traces = [
        per_call(FIRST.prompt_ids, FIRST.sampled_ids, None),
        per_call(retokenized.prompt_ids, [12], None),
    ]
    verdict = judge([FIRST, SECOND], traces)
    assert not verdict.ids_exact and verdict.why.startswith("call 2")
    assert judge([FIRST, retokenized], traces).chains == 2, "vLLM itself saw two sequences"
    assert verdict.logprobs == "absent"


def test_a_sampled_id_marked_as_prompt_or_an_extra_mark_is_not_exact():
    unmarked = Trace([1, 2, 3, 10, 11, 4, 12], [False, False, False, True, False, False, True])
    assert not judge([FIRST, SECOND], [unmarked]).ids_exact
    extra = Trace([1, 2, 3, 10, 11, 4, 12], [True, False, False, True, True, False, True])
    verdict = judge([FIRST, SECOND], [extra])
    assert not verdict.ids_exact and "marked sampled wrongly" in verdict.why


def test_logprobs_that_differ_from_vllms_are_reported_with_the_largest_gap():
    verdict = judge([FIRST, SECOND], [segment([0, 0, 0, -0.5, -0.3, 0, -1.0])])
    assert verdict.ids_exact and verdict.logprobs == "differ (max Δ 0.05)"


def test_no_calls_or_no_traces_is_not_exact():
    assert not judge([], []).ids_exact
    verdict = judge([FIRST], [])
    assert (verdict.ids_exact, verdict.traces, verdict.logprobs, verdict.versions) == (
        False,
        0,
        "absent",
        False,
    )


def test_the_tap_takes_out_of_the_reply_only_what_it_asked_vllm_for():
    from bench.tap import strip_chat

    def reply() -> dict:
        choice = {"index": 0, "token_ids": [10], "logprobs": {"content": [{"logprob": -0.5}]}}
        return {"prompt_token_ids": [1, 2], "choices": [choice]}

    assert strip_chat(reply(), ids=True, logprobs=True) == {"choices": [{"index": 0, "logprobs": None}]}
    assert strip_chat(reply(), ids=False, logprobs=False) == reply()
