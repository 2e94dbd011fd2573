"""Benchmark 2: the proxy's token bookkeeping per turn as a conversation grows.

One conversation with the real Qwen3 tokenizer and chat template grows to 200 turns (about
32k tokens). Each turn, molt-proxy renders the whole request (every OpenAI front-end must,
to apply the template) and then only *stitches*: `plan_prompt` compares the render with the
segment's bytes and tokenizes the new suffix, `commit_turn` appends the ids. The
baseline is what a proxy without a token record does: tokenize the whole render again each
turn. Target: stitching cost flat in the conversation's length, the baseline linear.
"""

from __future__ import annotations

import time
from array import array

from bench.common import Section, median, ms, ratio, table, tiny_model
from molt_proxy.stitching import commit_turn, plan_prompt
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, Segment

# ~160 tokens per turn (user + reply), so 200 turns reach ~32k tokens.
_USER = (
    "Turn {turn}. Here is the tool output you asked for: the build of module {turn} finished with "
    "three warnings about unused imports in files a.py, b.py and c.py; the test suite ran 412 tests "
    "in 38 seconds and all passed; coverage is 91 percent, up from 89, and the benchmark job took "
    "four minutes. The reviewer asked for a changelog entry. What should we do next? Keep it short."
)
_REPLY = (
    "Next, remove the unused imports in a.py, b.py and c.py, then rerun the linter. After that, "
    "tag the release for module {turn} and update the changelog with the test numbers."
)
CHECKPOINTS = (1, 10, 50, 100, 150, 200)


def one_conversation(tokenizer: Tokenizer, turns: int, samples: int) -> dict[int, dict[str, float]]:
    """Grow one conversation; at each checkpoint turn, time render, stitch and a full
    tokenize `samples` times each, interleaved, on the same state (medians)."""
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": "You are a careful coding agent."}]
    segment: Segment | None = None
    out: dict[int, dict[str, float]] = {}
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": _USER.format(turn=turn)})
        rendered = tokenizer.render(messages, None, {})
        reply = _REPLY.format(turn=turn)
        ids = tokenizer.encode(reply) + [im_end]  # what vLLM would have sampled
        generation = Generation(ids, [-0.1] * len(ids), [0] * len(ids), "stop")
        if turn in CHECKPOINTS:
            timings: dict[str, list[float]] = {"render": [], "stitch": [], "retokenize": []}
            for _ in range(samples):
                t0 = time.perf_counter()
                tokenizer.render(messages, None, {})
                t1 = time.perf_counter()
                scratch = _copy(segment)  # commit_turn mutates: time it on a copy
                t2 = time.perf_counter()
                plan = plan_prompt([] if scratch is None else [scratch], rendered, tokenizer)
                commit_turn(
                    scratch if plan.continues and scratch else Segment(0), plan, generation, "c", tokenizer
                )
                t3 = time.perf_counter()
                full = tokenizer.encode(rendered)
                t4 = time.perf_counter()
                timings["render"].append(t1 - t0)
                timings["stitch"].append(t3 - t2)
                timings["retokenize"].append(t4 - t3)
            if full != plan.ids:  # the record must be what a fresh tokenization gives here
                raise RuntimeError(f"turn {turn}: stitched ids differ from a fresh tokenization")
            out[turn] = {key: median(values) for key, values in timings.items()}
            out[turn] |= {"tokens": len(plan.ids), "continues": float(plan.continues)}
        plan = plan_prompt([] if segment is None else [segment], rendered, tokenizer)
        target = segment if plan.continues and segment is not None else Segment(index=0)
        commit_turn(target, plan, generation, f"c{turn}", tokenizer)
        segment = target
        messages.append({"role": "assistant", "content": reply})
    return out


def _copy(segment: Segment | None) -> Segment | None:
    if segment is None:
        return None
    return Segment(
        segment.index,
        array("i", segment.token_ids),
        array("d", segment.sampled_logprobs),
        list(segment.version_runs),
        list(segment.turns),
        segment.text,
    )


def _rows(runs: list[dict[int, dict[str, float]]], turns: int) -> list[list[object]]:
    rows: list[list[object]] = []
    for turn in [t for t in CHECKPOINTS if t <= turns]:
        cell = {key: median([r[turn][key] for r in runs]) for key in runs[0][turn]}
        rows.append(
            [
                turn,
                f"{cell['tokens']:,.0f}",
                "yes" if cell["continues"] else "no (first turn)",
                ms(cell["stitch"]),
                ms(cell["retokenize"]),
                ratio(cell["retokenize"], cell["stitch"]),
                ms(cell["render"]),
            ]
        )
    return rows


def run(quick: bool = False) -> Section:
    repeats, turns, samples = (1, 100, 3) if quick else (3, 200, 7)
    section = Section(
        "stitching",
        "2. Stitching cost per turn vs re-tokenizing the history",
        "python -m bench stitching",
        "tokenizing the whole rendered conversation again each turn (`Tokenizer.encode(render)`), "
        "timed on the same render at the same turn; both use the real Qwen3 tokenizer and template.",
    )
    tokenizer = Tokenizer.load(str(tiny_model("qwen3")))
    runs = [one_conversation(tokenizer, turns, samples) for _ in range(repeats)]
    header = [
        "turn",
        "prompt tokens",
        "continues segment",
        "stitch ms",
        "re-tokenize ms",
        "re-tokenize / stitch",
    ]
    rows = _rows(runs, turns)
    section.body.append(
        f"One conversation grown turn by turn ({repeats} times); at each listed turn, stitch, "
        f"re-tokenize and render are each timed {samples} times on the same state, interleaved "
        "(median of medians). Each turn adds a user message (a tool report) and a reply, "
        f"~{rows[-1][1]} tokens at turn {rows[-1][0]}. *stitch* = `plan_prompt` (byte-prefix check, tokenize "
        "the new suffix) + `commit_turn` (append ids, mask, logprobs, versions, bytes). At every "
        "checkpoint the stitched ids are checked equal to a fresh tokenization of the render. "
        "*render* is the chat template over the whole history, which every OpenAI front-end "
        "pays (vLLM too when it gets messages): shown for scale, it grows with the history."
    )
    section.body.append(table(header + ["render ms"], rows))
    first, last = rows[0], rows[-1]
    section.body.append(
        f"From turn {first[0]} to turn {last[0]} ({first[1]} → {last[1]} tokens) stitching went "
        f"{first[3]} → {last[3]} ms per turn; re-tokenizing went {first[4]} → {last[4]} ms."
    )
    return section
