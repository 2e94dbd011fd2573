"""One vLLM server inside a Ray actor, on whatever node Ray placed it (`serve --ray-address`).

The actor is the node-local keeper of its server; Ray is the one that restarts it:

- It launches vLLM (`launcher.VLLMServer`) listening on its node's IP, and says where it is
  (`where`: URL, Ray node id, and its own pid, which tells one incarnation from the next).
- A watchdog thread ends the actor (`os._exit`) when its vLLM exits, or stops answering
  `/health` after it has answered; Ray then restarts the actor (at most `max_restarts` times)
  and the new incarnation boots a new vLLM. The proxy notices the new incarnation and gives
  it the current weights before any traffic (`ray_replicas.RayReplica`).
- A vLLM never outlives its actor: it is SIGKILLed when the actor's process dies
  (`ServerProcess.die_with_parent`), and a new incarnation kills whatever is left of the
  previous one's process group (a GPU engine process would hold the GPU's memory).
- `stage` writes weights shipped through Ray's object store into a folder on this node, so
  vLLM can `reload_weights` from it with no filesystem shared with the trainer.

Imported on the replica's node by Ray; imports nothing of Ray at module level (the proxy
imports Ray only with `--ray-address`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

from molt_proxy.launcher import VLLMServer

WATCH_INTERVAL_S = 5.0
FAILED_PROBES = 3
"""Consecutive failed `/health` probes (after a first success) that end the actor."""


class VLLMActor:
    """Wrapped with `ray.remote` by `ray_replicas.start_replicas`. Its folder on the node (its
    vLLM's log and process group, its staged weights) is named by its Ray actor id, which
    every incarnation shares and no other actor has."""

    def __init__(self, model: str, max_model_len: int | None, extra_args: list[str]):
        import ray

        actor_id = ray.get_runtime_context().get_actor_id()
        self.folder = Path(tempfile.gettempdir()) / "molt-proxy-ray" / actor_id
        self.folder.mkdir(parents=True, exist_ok=True)
        _kill_group_in(self.folder / "vllm.pgid")
        # Ray sets OMP_NUM_THREADS to the actor's CPUs (1 for none); vLLM sets its own threads.
        os.environ.pop("OMP_NUM_THREADS", None)
        self.server = VLLMServer(
            model,
            host=ray.util.get_node_ip_address(),
            max_model_len=max_model_len,
            extra_args=extra_args,
            log_path=self.folder / "vllm.log",
        )
        self.server.die_with_parent = True
        self.server.spawn()
        assert self.server.process is not None
        (self.folder / "vllm.pgid").write_text(str(self.server.process.pid))
        self.server.wait()
        self._where = {
            "url": self.server.url,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="vLLM watchdog", daemon=True).start()

    def where(self) -> dict[str, Any]:
        return self._where

    def stage(self, version: int, names: list[str], *blobs: bytes) -> str:
        """Write a weights folder's files (`names`, their bytes as Ray resolved them) on this
        node; returns its path. Written aside and renamed, so vLLM never reads half a folder;
        earlier staged versions are removed (vLLM holds loaded weights in memory)."""
        folder = self.folder / f"weights-v{version}"
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, blob in zip(names, blobs, strict=True):
            (tmp / Path(name).name).write_bytes(blob)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        for old in self.folder.glob("weights-v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        return str(folder)

    def stop(self) -> None:
        """Stop vLLM for good (the proxy is shutting down) and remove the staged weights;
        the actor is killed next. The log stays."""
        self._stopping.set()
        self.server.stop()
        for staged in self.folder.glob("*weights-v*"):
            shutil.rmtree(staged, ignore_errors=True)

    def _watch(self) -> None:
        answered, failed = False, 0
        while not self._stopping.wait(WATCH_INTERVAL_S):
            if self.server.returncode is not None:
                why = f"vLLM exited with code {self.server.returncode}"
            else:
                try:
                    ok = httpx.get(f"{self.server.url}/health", timeout=10).status_code == 200
                except httpx.HTTPError:
                    ok = False
                answered, failed = answered or ok, 0 if ok else failed + 1
                if not answered or failed < FAILED_PROBES:
                    continue
                why = f"vLLM did not answer /health {failed} times"
            if self._stopping.is_set():
                return
            print(f"molt-proxy replica at {self.server.url}: {why}; ending the actor for Ray to restart")
            self.server.kill()
            os._exit(1)


def _kill_group_in(pgid_file: Path) -> None:
    """SIGKILL the process group a previous incarnation's vLLM led, if any is left."""
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        os.killpg(int(pgid_file.read_text()), signal.SIGKILL)
