"""`molt-proxy`: arguments → settings → run. Every flag is a settings field (`flags.py`);
those that mean what `vllm serve`'s mean keep its names."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from molt_proxy import logs
from molt_proxy.config import Settings
from molt_proxy.flags import add_flags, default, flag, from_flags
from rollout.command import RolloutOptions
from trainer.config import TrainerConfig


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What `serve` does besides proxying: the vLLM it launches, its log, where the keys come
    from, and the trainer beside it."""

    max_model_len: int | None = None
    """Passed to the vLLM that `serve` launches, as `vllm serve --max-model-len`."""
    vllm_port: int | None = None
    """Port of the (first) vLLM that `serve` launches; further replicas take the next ones.
    Default: free ports."""
    vllm_args: list[str] = field(
        default_factory=list, metadata=flag("--vllm-arg", repeat=True, metavar="ARG")
    )
    """An extra argument for the vLLM that `serve` launches; repeat the flag for several."""
    admin_key_file: Path | None = field(default=None, metadata=flag(metavar="PATH"))
    """A file holding the admin key."""
    agent_keys_file: Path | None = field(default=None, metadata=flag(metavar="PATH"))
    """A file of agent keys, one a line."""
    log_format: logs.Format = "text"
    """text, or one JSON object a line; either way one line per request (session, segment, turn,
    tokens, latency, replica, status), never message content or keys."""
    train: bool = False
    """Also run the trainer (a Ray actor) on this machine, with the trainer flags below."""


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """uvicorn re-raises the SIGTERM it shut down on; with the default handler that would kill
    the process before `serve` stops the vLLM servers it launched, orphaning them."""
    raise SystemExit(128 + signum)


def settings_from_args(args: argparse.Namespace, admin_key: str | None, agent_keys: list[str]) -> Settings:
    """`serve`'s flags as settings; the keys come resolved (flags, files, environment)."""
    return from_flags(Settings, args, admin_key=admin_key, agent_keys=agent_keys, lora_name=lora_name(args))


def lora_name(args: argparse.Namespace) -> str | None:
    """`--lora-name`; `serve --train --lora-rank` without one serves its adapter as "lora"."""
    if args.lora_name is None and args.train and args.lora_rank is not None:
        return "lora"
    if args.train and args.lora_name is not None and args.lora_rank is None:
        raise SystemExit("--train with --lora-name needs --lora-rank: the trainer must push adapters")
    return args.lora_name


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Ctrl-C (SIGINT) stops `serve` and what it launched even where it was started with SIGINT
    # ignored, as a non-interactive shell starts a background job: a parent stopping it with
    # SIGINT (examples/learn_line_count.py) otherwise waited a minute, then killed it, and its
    # vLLM lived on (seen in a CI run, where that orphan's 2.7 GB ran the machine out of memory).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    options = from_flags(ServeOptions, args)
    logs.configure(options.log_format)

    from molt_proxy.app import create_app
    from molt_proxy.auth import load_keys
    from molt_proxy.launcher import Supervisor, VLLMServer

    admin_key, agent_keys = load_keys(
        args.admin_key, options.admin_key_file, args.agent_key, options.agent_keys_file, os.environ
    )
    args.admin_key = admin_key  # `--train`'s trainer reads it from `args`
    # Settings first: a bad flag (or plug-in) fails now, not after minutes of starting vLLM.
    settings = settings_from_args(args, admin_key, agent_keys)
    trainer_config = _trainer_config(args, settings) if options.train else None
    servers: list[VLLMServer] = []
    ray_replicas: list = []  # `ray_replicas.RayReplica`s, imported with Ray only when asked for
    try:
        if not settings.upstreams and settings.ray_address:
            ray_replicas = _start_ray_replicas(settings, options, _vllm_args(args, options, settings))
            settings.upstreams = [replica.base_url for replica in ray_replicas]
        elif not settings.upstreams:
            servers = _start_local_replicas(settings, options, _vllm_args(args, options, settings))
            settings.upstreams = [server.url for server in servers]
        # The app's health watcher relaunches a launched server that dies or hangs.
        supervisors = {s.url: Supervisor(s, max_restarts=settings.max_restarts) for s in servers}
        supervisors |= {replica.base_url: replica for replica in ray_replicas}
        app = create_app(settings, supervisors, ray_replicas)
        gc.freeze()  # what is loaded by now lives on: full collections skip it (bench proxy)
        if trainer_config is None:
            uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", log_config=None)
            return 0
        _serve_and_train(app, settings, trainer_config)
    finally:
        for server in servers:
            server.stop()
        for replica in ray_replicas:
            replica.stop()
    return 0


def _start_local_replicas(settings: Settings, options: ServeOptions, extra: list[str]) -> list:
    """`settings.replicas` vLLM servers as child processes, booted at the same time."""
    from molt_proxy.launcher import VLLMServer

    servers = []
    for index in range(settings.replicas):
        suffix = ".vllm.log" if settings.replicas == 1 else f".vllm{index}.log"
        log = settings.db_path.with_suffix(suffix)
        logging.info("starting vLLM for %s (log: %s)", settings.model, log)
        port = options.vllm_port + index if options.vllm_port else None
        server = VLLMServer(
            settings.model, port=port, max_model_len=options.max_model_len, extra_args=extra, log_path=log
        )
        servers.append(server.spawn())
    try:
        for server in servers:
            server.wait()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _start_ray_replicas(settings: Settings, options: ServeOptions, extra: list[str]) -> list:
    """`settings.replicas` vLLM servers in Ray actors on the cluster at `--ray-address`."""
    from molt_proxy.ray_replicas import start_replicas

    assert settings.ray_address is not None
    logging.info("starting %d vLLM replicas on Ray at %s", settings.replicas, settings.ray_address)
    return start_replicas(
        settings.ray_address,
        settings.replicas,
        settings.replica_resources,
        model=settings.model,
        max_model_len=options.max_model_len,
        extra_args=extra,
        max_restarts=settings.max_restarts,
        timeout_s=settings.upstream_timeout_s,
    )


def _trainer_config(args: argparse.Namespace, settings: Settings) -> TrainerConfig:
    """`serve --train`'s trainer settings, its plug-ins resolved: a wrong name or signature
    stops `serve` before it starts vLLM, as it stops `python -m trainer` (trainer/plugins.py)."""
    from trainer.config import config_from_args
    from trainer.loop import resolve_plugins
    from trainer.plugins import PluginError

    try:
        config = config_from_args(args, f"http://{settings.host}:{settings.port}", settings.model)
        resolve_plugins(config)
    except (ValueError, PluginError) as exc:
        raise SystemExit(f"molt-proxy serve --train: {exc}") from None
    return config


def _serve_and_train(app, settings: Settings, config: TrainerConfig) -> None:
    """The proxy in a background thread, the trainer (a Ray actor) driven from this one."""
    import threading
    import time

    import uvicorn

    from trainer.run import train

    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", log_config=None)
    )
    thread = threading.Thread(target=server.run, name="molt-proxy", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the proxy failed to start")
        time.sleep(0.1)
    try:
        train(config)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _export(args: argparse.Namespace) -> int:
    from molt_proxy.export import export

    count = export(args.db, args.out, args.format)
    print(f"wrote {count} trajectories to {args.out}")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    from rollout.command import run

    return run(args)


def _vllm_args(args: argparse.Namespace, options: ServeOptions, settings: Settings) -> list[str]:
    """`launched_vllm_args` and the trainer's `--weight-transfer` backend (`trainer/transfer.py`);
    with `ipc`, vLLM may unpickle CUDA IPC handles sent over HTTP (a launched vLLM inherits this)."""
    extra = launched_vllm_args(
        options.vllm_args, settings.reasoning_parser, settings.lora_name, args.lora_rank
    )
    if args.weight_transfer == "files":
        return extra
    if args.weight_transfer == "ipc":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return [*extra, "--weight-transfer-config", json.dumps({"backend": args.weight_transfer})]


def launched_vllm_args(
    extra: list[str], reasoning_parser: str | None, lora_name: str | None = None, lora_rank: int | None = None
) -> list[str]:
    """`--vllm-arg`s, and the proxy's `--reasoning-parser` for the vLLM it launches: with it,
    vLLM applies a structured-outputs grammar only once the model's reasoning has ended, as
    its chat route does; without it the grammar starts at the first token, and a thinking
    model's constrained reply is read as reasoning. With `--lora-name`, LoRA on
    (`lora.vllm_args`), before the `--vllm-arg`s so that those win."""
    from molt_proxy.lora import vllm_args

    args = [*(vllm_args(lora_rank) if lora_name else []), *extra]
    if reasoning_parser is None or any(arg.startswith("--reasoning-parser") for arg in extra):
        return args
    return [*args, "--reasoning-parser", reasoning_parser]


def parser() -> argparse.ArgumentParser:
    """The whole command line, made from the settings classes (`flags.py`). `serve`'s trainer
    flags come from `trainer.config`, which imports no torch: help is quick, and the trainer
    itself is imported only for `--train`."""
    root = argparse.ArgumentParser(prog="molt-proxy", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy (and vLLM, unless --upstream is given)")
    add_flags(serve, Settings)
    add_flags(serve, ServeOptions)
    # The trainer follows this proxy, with its model, admin key and Ray cluster: those flags are
    # the proxy's own. Offline training (`--trajectories`) is `python -m trainer`'s.
    add_flags(
        serve, TrainerConfig, group="trainer", but=("model", "admin_key", "ray_address", "trajectories")
    )
    serve.set_defaults(run=_serve)

    exp = commands.add_parser("export", help="write finalized trajectories to JSONL or Parquet")
    exp.add_argument("--db", default=default(Settings, "db_path"))
    exp.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    exp.add_argument("--out", required=True)
    exp.set_defaults(run=_export)

    rollout = commands.add_parser(
        "rollout", help="run a task set through a harness, attempts per task as groups (docs/rollout.md)"
    )
    add_flags(rollout, RolloutOptions)
    rollout.set_defaults(run=_rollout)
    return root


def main(argv: list[str] | None = None) -> int:
    logs.configure("text")
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
