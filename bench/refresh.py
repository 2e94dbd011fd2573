"""Benchmark 5: weight refresh under load: how long from the trainer's call until the replica
serves the new version, and what the agents see meanwhile.

A real vLLM (CPU) with the tiny model of examples/learn_digits.py, molt-proxy in front, and
agent threads running 3-turn sessions without pause. The trainer's side is what
`trainer/loop.py` does after a step: `POST /v1/admin/weights {"path", "version"}` with a folder
of new safetensors (here the base weights plus seeded noise, written before the clock starts).
The proxy pauses vLLM with `mode=keep`, reloads, relabels, resumes. The baseline is the same
refresh on the idle server, in the same run. "Serving" is read from the record, not assumed:
the first reply whose sampled tokens carry the new version.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from bench.common import OUT, Section, median, ms, percentile, proxy_server, table, tiny_model
from molt_proxy.launcher import VLLMServer


def perturbed_weights(base: Path, out: Path, version: int) -> Path:
    """A new policy: the base weights plus seeded noise, in a complete model folder."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out)
    state = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(version)
    for name, tensor in state.items():
        state[name] = tensor + 0.1 * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out.resolve()


class Agents:
    """`n` threads of 3-turn sessions until stopped; every turn and error is recorded."""

    def __init__(self, url: str, n: int):
        self.url, self.stop = url, threading.Event()
        self.turns: list[tuple[float, float, str]] = []  # (sent, answered, completion id)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def _loop(self, index: int) -> None:
        http = httpx.Client(timeout=300)
        episode = 0
        while not self.stop.is_set():
            session = f"agent{index}-{episode}"
            history = [{"role": "user", "content": f"Write a number, agent {index}."}]
            try:
                for _ in range(3):
                    sent = time.monotonic()
                    reply = http.post(
                        f"{self.url}/s/{session}/v1/chat/completions",
                        json={"model": "m", "messages": history, "max_tokens": 8, "temperature": 1.0},
                    )
                    reply.raise_for_status()
                    body = reply.json()
                    self.turns.append((sent, time.monotonic(), body["id"]))
                    history += [
                        {"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
                        {"role": "user", "content": "more"},
                    ]
                http.post(
                    f"{self.url}/v1/rewards", json={"session_id": session, "reward": 1.0}
                ).raise_for_status()
            except Exception as exc:  # agent-visible: counted
                self.errors.append(repr(exc)[:200])
            episode += 1

    def __enter__(self) -> Agents:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)


def refresh(url: str, folder: Path, version: int) -> tuple[float, float]:
    started = time.monotonic()
    response = httpx.post(
        f"{url}/v1/admin/weights", json={"path": str(folder), "version": version}, timeout=600
    )
    response.raise_for_status()
    return started, time.monotonic()


def versions_by_completion(url: str) -> dict[str, set[int]]:
    records = httpx.get(f"{url}/v1/trajectories", params={"limit": 10_000}, timeout=60).json()["data"]
    out = {}
    for record in records:
        for turn in record["turns"]:
            out[turn["completion_id"]] = set(
                record["weight_versions"][turn["completion_start"] : turn["completion_end"]]
            )
    return out


def run(quick: bool = False) -> Section:
    count, n_agents, gap_s = (2, 8, 2.0) if quick else (4, 8, 3.0)
    section = Section(
        "refresh",
        "5. Weight refresh under load",
        "python -m bench refresh",
        "the same refresh (same folder size, same route) on the idle server, in the same run.",
    )
    model = tiny_model("digits")
    folders = [
        perturbed_weights(model, OUT / "refresh-weights" / f"v{v}", v) for v in range(1, 2 * count + 1)
    ]
    for path in OUT.glob("refresh-bench.db*"):
        path.unlink()
    with VLLMServer(str(model), max_model_len=256, log_path=OUT / "logs" / "vllm-refresh-bench.log") as vllm:
        proxy = proxy_server("molt-proxy-refresh", model, vllm.url, OUT / "refresh-bench.db")
        with proxy:
            idle = [refresh(proxy.url, folders[v - 1], v) for v in range(1, count + 1)]
            loaded: list[tuple[float, float]] = []
            with Agents(proxy.url, n_agents) as agents:
                time.sleep(gap_s)
                for v in range(count + 1, 2 * count + 1):
                    loaded.append(refresh(proxy.url, folders[v - 1], v))
                    time.sleep(gap_s)
            versions = versions_by_completion(proxy.url)
    shutil.rmtree(OUT / "refresh-weights", ignore_errors=True)
    serving = []
    for k, (started, _) in enumerate(loaded):
        version = count + 1 + k
        answered = [a for _, a, cid in agents.turns if version in versions.get(cid, set())]
        if answered:
            serving.append(min(answered) - started)
    overlapping = [a - s for s, a, _ in agents.turns if any(s < end and a > start for start, end in loaded)]
    outside = [a - s for s, a, _ in agents.turns if not any(s < end and a > start for start, end in loaded)]
    section.body.append(
        f"{count} refreshes on the idle server, then {count} while {n_agents} agent threads run 3-turn "
        f"sessions (8 tokens per turn, temperature 1) through molt-proxy, one every {gap_s:.0f} s; "
        "tiny Qwen3-architecture model with the byte-level BPE of examples/learn_digits.py "
        f"({sum(p.stat().st_size for p in model.glob('*.safetensors')) / 1e6:.1f} MB of safetensors), "
        "vLLM on CPU. Medians."
    )
    section.body.append(
        table(
            ["", "idle (baseline)", "under load"],
            [
                [
                    "POST /v1/admin/weights, call → answer, ms",
                    ms(median([e - s for s, e in idle])),
                    ms(median([e - s for s, e in loaded])),
                ],
                ["call → first reply sampled by the new version, ms", "–", ms(median(serving))],
                ["refreshes whose new version was observed", "–", f"{len(serving)} / {len(loaded)}"],
            ],
        )
    )
    section.body.append(
        table(
            ["agent turns", "count", "p50 ms", "max ms"],
            [
                [
                    "overlapping a refresh",
                    len(overlapping),
                    ms(median(overlapping)),
                    ms(max(overlapping, default=float("nan"))),
                ],
                ["not overlapping one", len(outside), ms(median(outside)), ms(percentile(outside, 100))],
            ],
        )
    )
    section.body.append(
        f"Agent-visible errors during the loaded phase: **{len(agents.errors)}**"
        + (f" (first: `{agents.errors[0]}`)." if agents.errors else ".")
    )
    return section
