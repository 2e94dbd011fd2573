"""The trainer's side of a live vLLM, one server for the whole file: a weight refresh under load
(16 agents keep running while vLLM gets new weights 3 times), a bad weights folder refused before
vLLM is touched, a trainer following two proxies, killed mid-run, that resumes without
training twice or skipping, a trainer stopped and restarted with another algorithm (the
example plug-ins) under running agents, and two LoRA trainers' proxies sharing the server
(multi-LoRA)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from molt_proxy.config import Settings
from tests.helpers import reply_as_message, trajectories
from tests.inprocess import mock_vllm, qwen3_tokenizer_dir, serve_app
from trainer import checkpoint, loop
from trainer.config import TrainerConfig
from trainer.lora import LoraPolicy
from trainer.metrics import read
from trainer.policy import token_logprobs

ROOT = Path(__file__).resolve().parents[2]


def perturbed_weights(base, out, version: int):
    """A new policy: the base weights plus seeded noise (as a trainer step would change them)."""
    shutil.copytree(base, out)
    state = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(version)
    for name, tensor in state.items():
        state[name] = tensor + 0.5 * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def greedy_ids(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_refresh_under_load_is_invisible_to_agents_and_versions_are_exact(
    digits_model, digits_vllm, start_proxy, tmp_path
):
    proxy = start_proxy(digits_model, digits_vllm)
    # The shared server may hold another test's weights: start from the base as version 0.
    reset = httpx.post(
        f"{proxy.url}/v1/admin/weights", json={"path": str(digits_model), "version": 0}, timeout=120
    )
    assert reset.status_code == 200, reset.text
    stop = threading.Event()
    errors: list[str] = []
    turns: list[tuple[float, float, str]] = []  # (sent, answered, completion id)
    lock = threading.Lock()

    def agent(index: int) -> None:
        episode = 0
        while not stop.is_set():
            session = f"agent{index}-{episode}"
            client = OpenAI(base_url=proxy.base_url(session), api_key="x", max_retries=0)
            history = [{"role": "user", "content": f"Hello {index}."}]
            try:
                for turn in range(3):
                    sent = time.monotonic()
                    reply = client.chat.completions.create(
                        model="m", messages=history, max_tokens=24, temperature=1.0
                    )
                    with lock:
                        turns.append((sent, time.monotonic(), reply.id))
                    history += [
                        reply_as_message(reply.choices[0].message),
                        {"role": "user", "content": f"more {turn}"},
                    ]
                httpx.post(
                    f"{proxy.url}/v1/rewards", json={"session_id": session, "reward": 1.0}
                ).raise_for_status()
            except Exception as exc:
                errors.append(repr(exc))
            episode += 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    refreshes: list[tuple[float, float]] = []  # (started, finished) per version 1..3
    for version in (1, 2, 3):
        time.sleep(2.0)
        weights = perturbed_weights(digits_model, tmp_path / f"v{version}", version)
        started = time.monotonic()
        response = httpx.post(
            f"{proxy.url}/v1/admin/weights", json={"path": str(weights), "version": version}, timeout=120
        )
        assert response.status_code == 200, response.text
        refreshes.append((started, time.monotonic()))
    time.sleep(2.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []

    records = httpx.get(f"{proxy.url}/v1/trajectories", params={"limit": 10_000}).json()["data"]
    by_completion = {}
    for record in records:
        sampled = [v for v, m in zip(record["weight_versions"], record["loss_mask"], strict=True) if m]
        assert sampled == sorted(sampled), "versions within a trajectory never go back"
        for turn in record["turns"]:
            by_completion[turn["completion_id"]] = record["weight_versions"][
                turn["completion_start"] : turn["completion_end"]
            ]
    assert {v for versions in by_completion.values() for v in versions} == {0, 1, 2, 3}
    for sent, answered, completion_id in turns:
        versions = by_completion.get(completion_id)
        if versions is None:  # a turn of an episode still open when the agents stopped
            continue
        # A turn sent after refresh k finished never sees an older version; a turn answered
        # before refresh k started never sees version k.
        floor = sum(1 for _, finished in refreshes if finished < sent)
        ceiling = sum(1 for started, _ in refreshes if started < answered)
        assert floor <= min(versions) and max(versions) <= ceiling, (versions, floor, ceiling)

    # After the last refresh, vLLM's greedy output is the new weights' greedy output.
    client = OpenAI(base_url=proxy.base_url("greedy"), api_key="x")
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Write a number."}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    httpx.post(f"{proxy.url}/v1/rewards", json={"session_id": "greedy", "reward": 0}).raise_for_status()
    [record] = [
        r
        for r in httpx.get(f"{proxy.url}/v1/trajectories", params={"limit": 10_000}).json()["data"]
        if r["session_id"] == "greedy"
    ]
    turn = record["turns"][0]
    prompt, sampled = (
        record["token_ids"][: turn["completion_start"]],
        record["token_ids"][turn["completion_start"] : turn["completion_end"]],
    )
    assert reply.usage.completion_tokens == len(sampled) == 12
    assert set(record["weight_versions"][turn["completion_start"] :]) == {3}
    assert sampled == greedy_ids(tmp_path / "v3", prompt, 12)
    assert sampled != greedy_ids(digits_model, prompt, 12), "the refresh must change the policy"


def test_refresh_refuses_a_bad_weights_folder_before_touching_vllm(digits_model, tmp_path):
    # The refusal is the proxy's own, so the stand-in vLLM serves here, and its log of calls
    # shows that nothing reached it.
    model = qwen3_tokenizer_dir()
    with mock_vllm(model) as upstream:
        settings = Settings(model=str(model), upstreams=[upstream], db_path=tmp_path / "p.db")
        with serve_app(settings) as proxy:
            (tmp_path / "empty").mkdir()
            for body, param in (
                ({"path": "relative/dir", "version": 1}, "path"),
                ({"path": str(tmp_path / "empty"), "version": 1}, "path"),
                ({"path": str(digits_model), "version": -1}, "version"),
                ({"version": 1}, "path"),
            ):
                response = httpx.post(f"{proxy}/v1/admin/weights", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == param
            assert httpx.get(f"{upstream}/_calls").json() == []
            # The replica still serves.
            client = OpenAI(base_url=f"{proxy}/s/alive/v1", api_key="x")
            assert client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            ).id


def _agents(proxy_urls: list[str], stop_file: Path) -> subprocess.Popen:
    """Episodes in groups of 4, each rewarded by the share of digits (a separate process);
    episodes take turns over the proxies, so each group has sessions on every one."""
    code = f"""
import itertools, sys, httpx
from pathlib import Path
from openai import OpenAI
from devtools import digit_share
proxies = [httpx.Client(base_url=url, timeout=120) for url in {proxy_urls!r}]
for episode in itertools.count():
    if Path({str(stop_file)!r}).exists():
        break
    http = proxies[episode % len(proxies)]
    s = http.post("/v1/sessions", json={{"group_id": f"g{{episode // 4}}"}}).json()
    r = OpenAI(base_url=s["base_url"], api_key="x").chat.completions.create(
        model="m", messages=[{{"role": "user", "content": "Write a number."}}], max_tokens=8)
    reward = digit_share(r.choices[0].message.content or "")
    http.post("/v1/rewards", json={{"session_id": s["session_id"], "reward": reward}})
"""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)


def _trainer(
    proxy_urls: list[str], model: Path, out: Path, steps: int, log: Path, *flags: str, cwd: Path = ROOT
) -> subprocess.Popen:
    """A trainer in its own session (killed as a whole), started in `cwd` with `flags` added;
    its output goes to `log`, and with the fault handler on, SIGABRT makes it print where
    every thread is."""
    command = [
        sys.executable, "-m", "trainer", *(f for url in proxy_urls for f in ("--proxy-url", url)),
        "--model", str(model),
        "--train-out", str(out), "--max-steps", str(steps), "--group-size", "4", "--groups-per-step", "1",
        "--lr", "1e-3", *flags,
    ]  # fmt: skip
    with log.open("ab") as sink:
        return subprocess.Popen(
            command, cwd=cwd, start_new_session=True, stdout=sink, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": str(ROOT)},
        )  # fmt: skip


def _session_alive(sid: int) -> bool:
    """Whether any process of session `sid` (a killed trainer, its Ray head and workers) is left."""
    listed = subprocess.run(["ps", "-e", "-o", "sid=,stat="], capture_output=True, text=True).stdout
    return any(int(f[0]) == sid and not f[1].startswith("Z") for f in map(str.split, listed.splitlines()))


def _wait_or_dump(process: subprocess.Popen, log: Path, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Where every process is (CPU, kernel wait, allowed CPUs): a hang once showed a trainer
        # pinned to the CPU of a busy vLLM worker.
        processes = subprocess.run(
            "ps -e -o pid,sid,stat,psr,pcpu,wchan:24,args --sort=pid | cut -c1-160;"
            " grep -H Cpus_allowed_list /proc/[0-9]*/status",
            shell=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        process.send_signal(signal.SIGABRT)  # the fault handler prints every thread's stack
        process.wait(timeout=30)
        output = log.read_text(errors="replace")[-8000:]
        raise AssertionError(f"the trainer hung; its output:\n{output}\nprocesses:\n{processes}") from None


def _steps_done(folder: Path) -> int:
    loaded = checkpoint.load(folder)
    return 0 if loaded is None else loaded[0].step + sum(loaded[0].skipped_steps.values())


def test_trainer_following_two_proxies_killed_mid_run_resumes_without_training_twice_or_skipping(
    digits_model, digits_vllm, start_proxy, tmp_path
):
    """Two proxies (each its own SQLite store) in front of one vLLM; every group has sessions
    on both. Each proxy's seqs are its own: the trainer keeps a cursor per proxy."""
    proxies = [start_proxy(digits_model, digits_vllm), start_proxy(digits_model, digits_vllm)]
    urls = [proxy.url for proxy in proxies]
    stop_file = tmp_path / "stop"
    agents = _agents(urls, stop_file)
    out = tmp_path / "train"
    try:
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        first = _trainer(urls, digits_model, out, steps=6, log=first_log)
        deadline = time.monotonic() + 600
        # Steps taken or skipped (a skipped step, e.g. a group of equal rewards, writes no
        # metrics line but is checkpointed).
        while _steps_done(out / "checkpoint") < 2:
            assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-8000:]
            time.sleep(1.0)
        os.killpg(first.pid, signal.SIGKILL)  # mid-run: between or inside steps
        first.wait()
        # As after a crashed machine: nothing of the first run (Ray head, workers) is left.
        deadline = time.monotonic() + 60
        while _session_alive(first.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        second = _trainer(urls, digits_model, out, steps=6, log=second_log)
        try:
            assert _wait_or_dump(second, second_log, timeout_s=420) == 0, second_log.read_text()[-8000:]
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
    finally:
        stop_file.touch()
        agents.wait(timeout=120)
    state, _ = checkpoint.load(out / "checkpoint")
    assert state.step + sum(state.skipped_steps.values()) == 6  # taken or skipped
    trained = [trajectory_id for step in state.trained for trajectory_id in step]
    assert len(trained) == len(set(trained)), "a trajectory was trained on twice"
    taken = set(trained) | set(state.consumed) | {t.trajectory_id for t in state.pending}
    finalized = [
        {t["trajectory_id"] for t in trajectories(url) if t["seq"] <= cursor}
        for url, cursor in zip(urls, state.cursors, strict=True)
    ]
    assert not finalized[0] & finalized[1] and all(finalized), finalized
    assert taken == finalized[0] | finalized[1], (
        "every trajectory up to each cursor is trained on, let go or pending"
    )
    assert set(trained) & finalized[0] and set(trained) & finalized[1], (
        "both proxies' episodes are trained on"
    )
    # The restarted trainer pushed its resumed version back to vLLM before going on.
    assert httpx.get(f"{digits_vllm.url}/weight_info").json()["weight_version"] == str(state.version)


def test_a_trainer_restarted_with_another_algorithm_resumes_its_cursor_under_running_agents(
    digits_model, digits_vllm, start_proxy, tmp_path
):
    """The research loop, live: a trainer with the built-in algorithm is stopped after 2 steps
    while the proxy, vLLM and the agents keep running; the next one starts with the three
    example plug-ins (CISPO's loss, GiGPO's advantage, DAPO's overlong shaping), named by
    paths relative to another working directory, and goes on from the checkpoint: every
    trajectory up to its cursor is trained on once, let go or pending, none twice. Then the
    proxy's store, exported, trains offline with the same plug-ins."""
    proxy = start_proxy(digits_model, digits_vllm)
    stop_file = tmp_path / "stop"
    agents = _agents([proxy.url], stop_file)
    out = tmp_path / "train"
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    algorithms = Path(os.path.relpath(ROOT / "examples" / "algorithms", cwd))
    plug_ins = (
        "--loss", f"{algorithms}/cispo.py:cispo", "--advantage", f"{algorithms}/gigpo.py:gigpo",
        "--reward-shaping", f"{algorithms}/dapo_overlong.py:digits",
    )  # fmt: skip
    try:
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        first = _trainer([proxy.url], digits_model, out, 8, first_log)
        deadline = time.monotonic() + 600
        while _steps_done(out / "checkpoint") < 2:
            assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-8000:]
            time.sleep(1.0)
        os.killpg(first.pid, signal.SIGTERM)  # stopped, as a researcher stops it
        first.wait(timeout=120)
        deadline = time.monotonic() + 60  # its Ray actor too: it may be inside a step
        while _session_alive(first.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        done, first_records = _steps_done(out / "checkpoint"), len(read(out / "metrics.jsonl"))
        # 3 steps: a step on a group of equal rewards is skipped and writes no record
        second = _trainer([proxy.url], digits_model, out, done + 3, second_log, *plug_ins, cwd=cwd)
        try:
            assert _wait_or_dump(second, second_log, timeout_s=420) == 0, second_log.read_text()[-8000:]
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
    finally:
        stop_file.touch()
        agents.wait(timeout=120)
    state, _ = checkpoint.load(out / "checkpoint")
    assert state.step + sum(state.skipped_steps.values()) == done + 3
    trained = [trajectory_id for step in state.trained for trajectory_id in step]
    assert len(trained) == len(set(trained)), "a trajectory was trained on twice"
    taken = set(trained) | set(state.consumed) | {t.trajectory_id for t in state.pending}
    finalized = {t["trajectory_id"] for t in trajectories(proxy.url) if t["seq"] <= state.cursors[0]}
    assert taken == finalized, "every trajectory up to the cursor is trained on, let go or pending"
    records = read(out / "metrics.jsonl")
    assert records[first_records:], "the second trainer took a step"
    resumed = records[first_records:]
    assert all("cispo_clip_frac" in r and "shaped_reward_mean" in r for r in resumed), records
    assert not any("cispo_clip_frac" in r for r in records[:first_records]), "the first one ran PPO"

    export = tmp_path / "export.parquet"
    subprocess.run(
        [sys.executable, "-m", "molt_proxy", "export", "--db", str(proxy.db), "--format", "parquet",
         "--out", str(export)],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    offline = subprocess.run(
        [
            sys.executable, "-m", "trainer", "--model", str(digits_model), "--trajectories", str(export),
            "--train-out", str(tmp_path / "offline"), "--max-steps", "2", "--group-size", "4",
            "--groups-per-step", "1", *plug_ins,
        ],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert offline.returncode == 0, offline.stderr[-4000:]
    state, _ = checkpoint.load(tmp_path / "offline" / "checkpoint")
    assert state.step + sum(state.skipped_steps.values()) == 2 and state.cursors[0] > 0


def test_two_lora_trainers_share_one_vllm_each_sampling_its_own_adapter_at_exact_versions(
    digits_model, digits_vllm, start_proxy, tmp_path
):
    """Two proxies with their own `--lora-name` in front of one vLLM (multi-LoRA), each given
    adapters as its trainer writes them: every turn samples from its own proxy's newest
    adapter, its tokens carry that adapter's version, and its recorded logprobs are the
    trainer's under that adapter. A push keeps the adapter before it loaded and unloads older
    ones."""
    base = start_proxy(digits_model, digits_vllm)
    # The shared server may hold another test's weights: the adapters apply to the base.
    reset = httpx.post(
        f"{base.url}/v1/admin/weights", json={"path": str(digits_model), "version": 0}, timeout=120
    )
    assert reset.status_code == 200, reset.text
    proxies = {name: start_proxy(digits_model, digits_vllm, "--lora-name", name) for name in ("alice", "bob")}

    # Alice's trainer pushes through its own refresh (`Trainer._refresh`), bob's by hand.
    alice = loop.Trainer(
        TrainerConfig(
            proxy_url=proxies["alice"].url, model=str(digits_model), out_dir=tmp_path / "alice", lora_rank=4,
            lora_alpha=8.0,
        )
    )  # fmt: skip

    def push(name: str, version: int) -> LoraPolicy:
        policy = alice.policy if name == "alice" else LoraPolicy(digits_model, rank=4, alpha=8.0)
        generator = torch.Generator().manual_seed(10 * version + len(name))
        with torch.no_grad():
            for key, parameter in policy.adapter_parameters().items():
                if "lora_B" in key:  # as training moves B away from 0
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
        if name == "alice":
            alice.state.version = version
            alice._refresh()
            assert alice.replicas_behind == 0
            return policy
        folder = tmp_path / name / f"v{version}"
        policy.save_weights(folder)
        response = httpx.post(
            f"{proxies[name].url}/v1/admin/weights",
            json={"path": str(folder), "version": version},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        return policy

    def turn(name: str, session: str) -> tuple[list[int], list[float], list[int], torch.Tensor]:
        """A turn through `name`'s proxy: (all ids, sampled logprobs, sampled versions, mask)."""
        client = OpenAI(base_url=proxies[name].base_url(session), api_key="x", max_retries=0)
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Write a number."}],
            max_tokens=8,
            temperature=1.0,
        )
        httpx.post(f"{proxies[name].url}/v1/rewards", json={"session_id": session, "reward": 1.0})
        [record] = [r for r in trajectories(proxies[name].url) if r["session_id"] == session]
        mask = torch.tensor(record["loss_mask"], dtype=torch.bool)
        sampled = [v for v, m in zip(record["weight_versions"], record["loss_mask"], strict=True) if m]
        return record["token_ids"], torch.tensor(record["logprobs"])[mask].tolist(), sampled, mask

    def trainer_logprobs(policy: LoraPolicy, ids: list[int], mask: torch.Tensor) -> list[float]:
        full = torch.tensor([ids])
        with torch.no_grad():
            return token_logprobs(policy.model, full, torch.ones_like(full))[0][mask].tolist()

    policies = {"alice": push("alice", 1), "bob": push("bob", 1)}
    for name, other in (("alice", "bob"), ("bob", "alice")):
        ids, recorded, versions, mask = turn(name, f"{name}-1")
        assert versions == [1] * len(recorded) and recorded
        assert recorded == pytest.approx(trainer_logprobs(policies[name], ids, mask), abs=1e-4)
        theirs = trainer_logprobs(policies[other], ids, mask)
        assert max(abs(a - b) for a, b in zip(recorded, theirs, strict=True)) > 0.05, (
            "sampled by its own adapter"
        )

    push("alice", 2)
    policies["alice"] = push("alice", 3)
    # The trainer keeps the newest two adapters on disk (vLLM may reload an evicted one from there).
    assert sorted(p.name for p in (tmp_path / "alice" / "weights").iterdir()) == ["v2", "v3"]
    served = {m["id"] for m in httpx.get(f"{digits_vllm.url}/v1/models").json()["data"]}
    assert {"alice-v2", "alice-v3", "bob-v1"} <= served and "alice-v1" not in served
    ids, recorded, versions, mask = turn("alice", "alice-3")
    assert versions == [3] * len(recorded)
    assert recorded == pytest.approx(trainer_logprobs(policies["alice"], ids, mask), abs=1e-4)
    versions_by_proxy = {
        name: [r["weight_version"] for r in httpx.get(f"{proxy.url}/health").json()["replicas"]]
        for name, proxy in proxies.items()
    }
    assert versions_by_proxy == {"alice": [3], "bob": [1]}
