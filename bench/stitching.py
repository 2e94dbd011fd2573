"""Benchmark 2: the proxy's CPU per turn as a conversation grows: render, echo view, stitch.

One conversation grows to 200 turns (about 30k tokens) with the real Qwen3 and Llama-3.2
tokenizers and chat templates. Each turn the proxy renders the request (`Renders.render`:
a window over the previous turn's render where checked, `rendering.py`), renders the reply's
echo view (`echo.echo_view`, the same way), then *stitches*: `plan_prompt` compares the render
with the segment's bytes and tokenizes the new suffix, the generate request's body is encoded
with the prompt ids (`upstream.encoded`), `commit_turn` appends the ids.
Baselines in the same run: the whole-history renders the proxy did before (`Tokenizer.render`
of the request, and of the history with the reply for the echo view), the prompt ids built as
a Python list and encoded from it, as before, and for stitching, a proxy without a token
record that tokenizes the whole render again each turn.
Target: the per-turn total flat in the conversation's length (turn 200 within 2x of turn 10).
"""

from __future__ import annotations

import copy
import json
import time
from array import array
from collections.abc import Callable

import orjson

from bench.common import Section, median, ms, ratio, table
from devtools import tokenizer_source
from molt_proxy.echo import Rendered, echo_view
from molt_proxy.rendering import Renders
from molt_proxy.stitching import PromptPlan, commit_turn, plan_prompt
from molt_proxy.tokenizer import Tokenizer
from molt_proxy.types import Generation, ParsedReply, Segment
from molt_proxy.upstream import encoded, generate_body

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
SAMPLING = {"max_tokens": 512, "temperature": 1.0, "logprobs": 0}
"""What a turn samples with, sent beside the prompt ids."""


def one_conversation(tokenizer: Tokenizer, turns: int, samples: int) -> dict[int, dict[str, float]]:
    """Grow one conversation as the proxy renders and records it; at each checkpoint turn, time
    each step `samples` times, interleaved, on the same state (medians)."""
    closing = tokenizer.closing
    assert closing is not None
    end_id = tokenizer.hf.convert_tokens_to_ids(closing.end)
    renders = Renders(tokenizer)
    messages = [{"role": "system", "content": "You are a careful coding agent."}]
    segment: Segment | None = None
    out: dict[int, dict[str, float]] = {}
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": _USER.format(turn=turn)})
        before = copy.copy(renders)  # the cache as this turn finds it, to time the turn's render again
        before._entries = renders._entries.copy()
        request = json.loads(json.dumps(messages))  # parsed anew, as each request's are
        rendered = renders.render(request, None, {})
        reply = _REPLY.format(turn=turn)
        ids = tokenizer.encode(reply) + [end_id]  # what vLLM would have sampled
        generation = Generation(ids, [-0.1] * len(ids), [0] * len(ids), "stop")
        view = (Rendered(rendered, request, None, {}), ParsedReply(reply), tokenizer.ids_bytes(ids), True)
        if turn in CHECKPOINTS:
            out[turn] = _time_turn(tokenizer, before, view, segment, generation, samples)
        plan = plan_prompt([] if segment is None else [segment], rendered, tokenizer)
        target = segment if plan.continues and segment is not None else Segment(index=0)
        commit_turn(target, plan, generation, f"c{turn}", tokenizer, echo=echo_view(renders, *view))
        segment = target
        messages.append({"role": "assistant", "content": reply})
    return out


def _time_turn(
    tokenizer: Tokenizer,
    renders: Renders,
    view: tuple[Rendered, ParsedReply, bytes, bool],
    segment: Segment | None,
    generation: Generation,
    samples: int,
) -> dict[str, float]:
    """Each step of one turn, timed `samples` times on the same state, interleaved: the render
    and echo view whole (as before) and as the proxy does them now, the stitch, a re-tokenize.
    The renders are checked equal to the whole ones."""
    rendered, reply = view[0], view[1]
    history = [*rendered.messages, reply.as_message(), {"role": "user", "content": "next"}]
    timings: dict[str, list[float]] = {}
    for sample in range(samples):
        scratch = copy.copy(renders)  # a render fills the cache: time each on the turn's own
        scratch._entries = renders._entries.copy()
        t0 = time.perf_counter()
        whole = tokenizer.render(rendered.messages, None, {})
        t1 = time.perf_counter()
        tokenizer.render(history, None, {}, add_generation_prompt=False)
        t2 = time.perf_counter()
        text = scratch.render(rendered.messages, None, {})
        t3 = time.perf_counter()
        echo_view(scratch, Rendered(text, rendered.messages, None, {}), *view[1:])
        t4 = time.perf_counter()
        bodies: dict[str, bytes] = {}
        for key in ("stitch", "stitch before") if sample % 2 else ("stitch before", "stitch"):
            stitched = _copy(segment)  # commit_turn mutates: time each on a copy
            t5 = time.perf_counter()
            plan, bodies[key] = _stitch(stitched, text, tokenizer, generation, _SENDS[key])
            timings.setdefault(key, []).append(time.perf_counter() - t5)
        t7 = time.perf_counter()
        full = tokenizer.encode(text)
        t8 = time.perf_counter()
        if text != whole or full != list(plan.ids) or bodies["stitch"] != bodies["stitch before"]:
            raise RuntimeError("the render or the stitched ids differ from the whole render's")
        steps = {"render whole": t1 - t0, "echo whole": t2 - t1, "render": t3 - t2, "echo": t4 - t3}
        for key, seconds in (steps | {"retokenize": t8 - t7}).items():
            timings.setdefault(key, []).append(seconds)
    cell = {key: median(values) for key, values in timings.items()}
    return cell | {"tokens": len(plan.ids), "windowed": float(renders.windowed > 0)}


def _stitch(
    segment: Segment | None,
    text: str,
    tokenizer: Tokenizer,
    generation: Generation,
    send: Callable[[Segment | None, PromptPlan], bytes],
) -> tuple[PromptPlan, bytes]:
    """One turn's stitch: plan the prompt, write the generate request's body (`send`), commit."""
    plan = plan_prompt([] if segment is None else [segment], text, tokenizer)
    body = send(segment, plan)
    commit_turn(segment if plan.continues and segment else Segment(0), plan, generation, "c", tokenizer)
    return plan, body


def _send(segment: Segment | None, plan: PromptPlan) -> bytes:
    """The body as the proxy writes it now: a continued chain's ids packed (`upstream.encoded`)."""
    return encoded(generate_body(plan.ids, SAMPLING, stream=False, return_prompt_ids=False))


def _send_as_list(segment: Segment | None, plan: PromptPlan) -> bytes:
    """The body as the proxy wrote it before: the prompt built as a Python list and encoded
    from it (the plan has packed the ids already, a copy of about 10 µs at 30k tokens)."""
    ids = segment.token_ids.tolist() + plan.new_ids if plan.continues and segment else plan.ids
    return orjson.dumps(generate_body(ids, SAMPLING, stream=False, return_prompt_ids=False))


_SENDS = {"stitch": _send, "stitch before": _send_as_list}
"""The stitch now and as before, timed in turns (the first of a sample runs on colder caches)."""


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
    cells = {t: {k: median([r[t][k] for r in runs]) for k in runs[0][t]} for t in CHECKPOINTS if t <= turns}
    base = cells[10]
    for turn, cell in cells.items():
        before = cell["render whole"] + cell["echo whole"] + cell["stitch before"]
        after = cell["render"] + cell["echo"] + cell["stitch"]
        rows.append(
            [
                turn,
                f"{cell['tokens']:,.0f}",
                f"{ms(cell['stitch before'])} → {ms(cell['stitch'])}",
                ms(cell["retokenize"]),
                f"{ms(cell['render whole'])} → {ms(cell['render'])}",
                f"{ms(cell['echo whole'])} → {ms(cell['echo'])}",
                f"{ms(before)} → {ms(after)}",
                f"{ratio(before, base['render whole'] + base['echo whole'] + base['stitch before'])} → "
                f"{ratio(after, base['render'] + base['echo'] + base['stitch'])}",
            ]
        )
    return rows


def run(quick: bool = False) -> Section:
    repeats, turns, samples = (1, 100, 3) if quick else (3, 200, 7)
    section = Section(
        "stitching",
        "2. Proxy CPU per turn as the conversation grows: render, echo view, stitch",
        "python -m bench stitching",
        "the whole-history renders the proxy did before this change (`Tokenizer.render` of the "
        "request and of the history with the reply, for the echo view), timed on the same turn "
        "in the same run; the stitch with the prompt ids built as a Python list and encoded from "
        "it, as before, timed beside it; for stitching, tokenizing the whole render again each turn.",
    )
    header = [
        "turn",
        "prompt tokens",
        "stitch ms, list → packed",
        "re-tokenize ms",
        "render ms, whole → now",
        "echo view ms, whole → now",
        "per-turn total ms, whole → now",
        "total / turn 10, whole → now",
    ]
    for arch, name in (("qwen3", "Qwen3"), ("llama", "Llama-3.2")):
        tokenizer = Tokenizer.load(str(tokenizer_source(arch)))
        runs = [one_conversation(tokenizer, turns, samples) for _ in range(repeats)]
        rows = _rows(runs, turns)
        section.body.append(f"**{name} template** (~{rows[-1][1]} tokens at turn {rows[-1][0]})")
        section.body.append(table(header, rows))
    section.body.append(
        f"One conversation grown turn by turn ({repeats} times per template); at each listed turn "
        f"every step is timed {samples} times on the same state, interleaved (median of medians); "
        "each turn adds a user message (a tool report) and a reply; each request's messages are "
        "parsed anew from JSON, as a request's are. *now* is the proxy's path: "
        "`Renders.render` (a window over the previous turn's render, checked, `rendering.py`; "
        "below 16 messages left out the whole history is rendered; a window reuses the "
        "previous one's render while its context spans at most 10 messages, about 4 turns "
        "here, then anchors anew with one more small render, so a turn's render is one or two "
        "small renders) and `echo_view` through `Renders.after` (one small render); *whole* "
        "renders the whole history, as before. *stitch* = `plan_prompt` "
        "(byte-prefix check, tokenize the new suffix) + the generate request's body with the "
        "prompt ids (`upstream.encoded`) + `commit_turn` (append to the packed record); *list* "
        "is the same stitch with the prompt ids built as a Python list and encoded from it, as "
        "before, *packed* the segment's int32 array and the new ids, encoded from a NumPy view. "
        "Per-turn total = render + echo view + stitch (*whole*: with the stitch as before); the "
        "turn's SQLite write holds only its new ids (benchmark 3). Every timed render is checked "
        "equal to the whole render, the stitched ids to a fresh tokenization, and the two bodies "
        "byte for byte. The machine is shared (6 people measuring at once): read "
        "the ratios, not the absolute times."
    )
    return section
