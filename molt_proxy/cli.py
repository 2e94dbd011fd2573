"""`molt-proxy`: arguments → settings → run. Flags mirror `vllm serve` where they mean the same."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molt_proxy import logs
from molt_proxy.config import Settings, default
from rollout.command import add_arguments as add_rollout_arguments
from trainer.config import TrainerConfig
from trainer.config import add_arguments as add_trainer_arguments


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """uvicorn re-raises the SIGTERM it shut down on; with the default handler that would kill
    the process before `serve` stops the vLLM servers it launched, orphaning them."""
    raise SystemExit(128 + signum)


def settings_from_args(args: argparse.Namespace, admin_key: str | None, agent_keys: list[str]) -> Settings:
    """`serve`'s flags as settings; the keys come resolved (flags, files, environment)."""
    return Settings(
        model=args.model,
        served_model_name=list(args.served_model_name),
        upstreams=list(args.upstream or []),
        replicas=args.replicas,
        ray_address=args.ray_address,
        replica_resources=args.replica_resources,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        max_restarts=args.max_restarts,
        host=args.host,
        port=args.port,
        db_path=Path(args.db),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        tool_strict_level=args.tool_strict_level,
        admin_key=admin_key,
        agent_keys=agent_keys,
        max_request_bytes=args.max_request_bytes,
        verify_prompt_ids=args.verify_prompt_ids,
        session_ttl_s=args.session_ttl,
        sampling=args.sampling,
        side_requests=list(args.side_request),
        lora_name=lora_name(args),
        allowed_origins=list(args.allowed_origins),
        allowed_hosts=list(args.allowed_hosts),
        reward_range=tuple(args.reward_range),
    )


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
    logs.configure(args.log_format)

    from molt_proxy.app import create_app
    from molt_proxy.auth import load_keys
    from molt_proxy.launcher import Supervisor, VLLMServer

    admin_key, agent_keys = load_keys(
        args.admin_key, args.admin_key_file, args.agent_key or [], args.agent_keys_file, os.environ
    )
    args.admin_key = admin_key  # `--train`'s trainer reads it from `args`
    # Settings first: a bad flag (or plug-in) fails now, not after minutes of starting vLLM.
    settings = settings_from_args(args, admin_key, agent_keys)
    trainer_config = _trainer_config(args) if args.train else None
    servers: list[VLLMServer] = []
    ray_replicas: list = []  # `ray_replicas.RayReplica`s, imported with Ray only when asked for
    try:
        if not settings.upstreams and settings.ray_address:
            ray_replicas = _start_ray_replicas(args, settings)
            settings.upstreams = [replica.base_url for replica in ray_replicas]
        elif not settings.upstreams:
            servers = _start_local_replicas(args, settings)
            settings.upstreams = [server.url for server in servers]
        # The app's health watcher relaunches a launched server that dies or hangs.
        supervisors = {s.url: Supervisor(s, max_restarts=settings.max_restarts) for s in servers}
        supervisors |= {replica.base_url: replica for replica in ray_replicas}
        app = create_app(settings, supervisors, ray_replicas)
        gc.freeze()  # what is loaded by now lives on: full collections skip it (bench proxy)
        if trainer_config is None:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning", log_config=None)
            return 0
        _serve_and_train(app, args, trainer_config)
    finally:
        for server in servers:
            server.stop()
        for replica in ray_replicas:
            replica.stop()
    return 0


def _start_local_replicas(args: argparse.Namespace, settings: Settings) -> list:
    """`settings.replicas` vLLM servers as child processes, booted at the same time."""
    from molt_proxy.launcher import VLLMServer

    servers = []
    for index in range(settings.replicas):
        log = Path(args.db).with_suffix(".vllm.log" if settings.replicas == 1 else f".vllm{index}.log")
        logging.info("starting vLLM for %s (log: %s)", args.model, log)
        port = args.vllm_port + index if args.vllm_port else None
        extra = _vllm_args(args, settings)
        server = VLLMServer(
            args.model, port=port, max_model_len=args.max_model_len, extra_args=extra, log_path=log
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


def _start_ray_replicas(args: argparse.Namespace, settings: Settings) -> list:
    """`settings.replicas` vLLM servers in Ray actors on the cluster at `--ray-address`."""
    from molt_proxy.ray_replicas import start_replicas

    assert settings.ray_address is not None
    logging.info("starting %d vLLM replicas on Ray at %s", settings.replicas, settings.ray_address)
    return start_replicas(
        settings.ray_address,
        settings.replicas,
        settings.replica_resources,
        model=args.model,
        max_model_len=args.max_model_len,
        extra_args=_vllm_args(args, settings),
        max_restarts=settings.max_restarts,
        timeout_s=settings.upstream_timeout_s,
    )


def _trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """`serve --train`'s trainer settings, its plug-ins resolved: a wrong name or signature
    stops `serve` before it starts vLLM, as it stops `python -m trainer` (trainer/plugins.py)."""
    from trainer.config import config_from_args
    from trainer.loop import resolve_plugins
    from trainer.plugins import PluginError

    try:
        config = config_from_args(args, f"http://{args.host}:{args.port}", args.model)
        resolve_plugins(config)
    except (ValueError, PluginError) as exc:
        raise SystemExit(f"molt-proxy serve --train: {exc}") from None
    return config


def _serve_and_train(app, args: argparse.Namespace, config: TrainerConfig) -> None:
    """The proxy in a background thread, the trainer (a Ray actor) driven from this one."""
    import threading
    import time

    import uvicorn

    from trainer.run import train

    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", log_config=None)
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


def _build_tiny_model(args: argparse.Namespace) -> int:
    from devtools import build_tiny_model  # dev tooling: installed beside, never imported by serving

    print(build_tiny_model(args.out, args.arch, tokenizer_dir=args.tokenizer_dir))
    return 0


def _parsed_by(module: str, function: str) -> Callable[[str], Any]:
    """An argparse `type` that parses with `module.function` (imported when used) and shows its
    `ValueError`'s message, as argparse does for an `ArgumentTypeError` only."""

    def parse(spec: str) -> Any:
        try:
            return getattr(importlib.import_module(module), function)(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = function
    return parse


def _vllm_args(args: argparse.Namespace, settings: Settings) -> list[str]:
    """`launched_vllm_args` and the trainer's `--weight-transfer` backend (`trainer/transfer.py`);
    with `ipc`, vLLM may unpickle CUDA IPC handles sent over HTTP (a launched vLLM inherits this)."""
    extra = launched_vllm_args(
        args.vllm_arg or [], settings.reasoning_parser, settings.lora_name, args.lora_rank
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
    """The whole command line. `serve`'s trainer flags come from `trainer.config`, which imports
    no torch: help is quick, and the trainer itself is imported only for `--train`."""
    root = argparse.ArgumentParser(prog="molt-proxy", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy (and vLLM, unless --upstream is given)")
    serve.add_argument(
        "--model", required=True, help="model path or id; its tokenizer and chat template are used"
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=default(Settings, "served_model_name"),
        metavar="NAME",
        help="the name(s) replies and /v1/models give the model, as in `vllm serve`; replies carry"
        " the first (default: the name vLLM serves it under; a vLLM launched here: --model)",
    )
    serve.add_argument(
        "--upstream",
        action="append",
        metavar="URL",
        help="a running vLLM server; repeat it for several replicas",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=default(Settings, "replicas"),
        metavar="K",
        help="without --upstream: launch K vLLM servers, each on its own port (with --ray-address:"
        " each in a Ray actor, placed by Ray)",
    )
    serve.add_argument(
        "--replica-resources",
        type=_parsed_by("molt_proxy.ray_replicas", "parse_resources"),
        default=default(Settings, "replica_resources"),
        metavar="JSON",
        help="with --ray-address: the Ray resources each vLLM replica's actor asks for, e.g."
        """ '{"GPU": 1}' or a custom resource that pins replicas to nodes (default: none)""",
    )
    serve.add_argument(
        "--health-interval",
        type=float,
        default=default(Settings, "health_interval_s"),
        metavar="S",
        help="seconds between replica health probes",
    )
    serve.add_argument(
        "--health-timeout",
        type=float,
        default=default(Settings, "health_timeout_s"),
        metavar="S",
        help="a replica whose /health does not answer within S seconds is taken out "
        "(one that serve launched is killed and relaunched)",
    )
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=default(Settings, "max_restarts"),
        metavar="N",
        help="relaunch a vLLM that serve launched at most N times in 10 minutes; then it stays down",
    )
    serve.add_argument("--host", default=default(Settings, "host"))
    serve.add_argument("--port", type=int, default=default(Settings, "port"))
    serve.add_argument("--db", default=default(Settings, "db_path"), help="SQLite store path")
    serve.add_argument("--tool-call-parser", help="vLLM tool parser name, as in `vllm serve`")
    serve.add_argument("--reasoning-parser", help="vLLM reasoning parser name, as in `vllm serve`")
    serve.add_argument(
        "--tool-strict-level",
        choices=("auto", "function", "parameter"),
        default=default(Settings, "tool_strict_level"),
        help="as in `vllm serve`: auto constrains forced calls and strict tools' arguments; "
        "function every request with tools to the call markup; parameter also every tool's "
        "arguments to its schema",
    )
    serve.add_argument("--max-model-len", type=int, help="passed to the vLLM it launches")
    serve.add_argument(
        "--vllm-port", type=int, help="port of the (first) vLLM it launches; replicas take the next ones"
    )
    serve.add_argument(
        "--vllm-arg", action="append", metavar="ARG", help="extra argument for the vLLM it launches"
    )
    serve.add_argument(
        "--admin-key",
        help="require keys on every route that writes or reads training data; this one may do"
        " everything (visible in `ps`: prefer --admin-key-file or $MOLT_PROXY_ADMIN_KEY)",
    )
    serve.add_argument("--admin-key-file", type=Path, metavar="PATH", help="a file holding the admin key")
    serve.add_argument(
        "--agent-key",
        action="append",
        metavar="KEY",
        help="a key that may create sessions and chat on and reward its own; repeatable"
        " (also $MOLT_PROXY_AGENT_KEYS, comma-separated)",
    )
    serve.add_argument("--agent-keys-file", type=Path, metavar="PATH", help="agent keys, one a line")
    serve.add_argument("--max-request-bytes", type=int, default=default(Settings, "max_request_bytes"))
    serve.add_argument(
        "--allowed-origins",
        nargs="*",
        default=default(Settings, "allowed_origins"),
        metavar="ORIGIN",
        help="web pages (e.g. https://notebook.example:8888) that may call the proxy from a browser;"
        " '*': any (default: the proxy's own and loopback origins only)",
    )
    serve.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=default(Settings, "allowed_hosts"),
        metavar="NAME",
        help="host names requests may address the proxy by, besides its bound address, IP addresses"
        " and localhost; '*': any (default: none; a proxy bound to a non-loopback --host checks Host"
        " only when this is given)",
    )
    serve.add_argument(
        "--reward-range",
        nargs=2,
        type=float,
        default=default(Settings, "reward_range"),
        metavar=("LOW", "HIGH"),
        help="rewards outside [LOW, HIGH] are refused with a 400 (default: -1e6 1e6)",
    )
    serve.add_argument(
        "--session-ttl",
        type=float,
        default=default(Settings, "session_ttl_s"),
        metavar="SECONDS",
        help="close a session with no turn for this long, unrewarded",
    )
    serve.add_argument(
        "--sampling",
        type=_parsed_by("molt_proxy.sampling", "parse_pins"),
        default=default(Settings, "sampling"),
        metavar="NAME=VALUE,...",
        help="pin sampling fields for every turn, whatever agents send (e.g. temperature=1,top_p=1): "
        "on-policy samples for training; each turn's record lists the fields pinned",
    )
    serve.add_argument(
        "--side-request",
        nargs="*",
        default=default(Settings, "side_requests"),
        metavar="REGEX",
        help="a request without tools whose system prompt matches one of these is a side request:"
        " served and recorded, kept out of the trainer's stream (default: Claude Code's and OpenCode's"
        " title requests; with no value: none)",
    )
    serve.add_argument(
        "--lora-name",
        default=default(Settings, "lora_name"),
        metavar="NAME",
        help="sample every turn from the trainer's newest LoRA adapter NAME, and take weight pushes as"
        " adapters (vLLM: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; a vLLM launched here gets"
        " them); several proxies with their own names may share one vLLM (default: with --train"
        " --lora-rank, 'lora'; else full weights)",
    )
    serve.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="text, or one JSON object a line; either way one line per request (session, segment,"
        " turn, tokens, latency, replica, status), never message content or keys",
    )
    serve.add_argument(
        "--verify-prompt-ids",
        action="store_true",
        help="have vLLM echo prompt ids and fail a turn on any difference",
    )
    serve.add_argument(
        "--train", action="store_true", help="also run the trainer (a Ray actor) on this machine"
    )
    add_trainer_arguments(serve)
    serve.set_defaults(run=_serve)

    exp = commands.add_parser("export", help="write finalized trajectories to JSONL or Parquet")
    exp.add_argument("--db", default=default(Settings, "db_path"))
    exp.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    exp.add_argument("--out", required=True)
    exp.set_defaults(run=_export)

    rollout = commands.add_parser(
        "rollout", help="run a task set through a harness, attempts per task as groups (docs/rollout.md)"
    )
    add_rollout_arguments(rollout)
    rollout.set_defaults(run=_rollout)

    tiny = commands.add_parser("build-tiny-model", help="build a tiny local model for demos and tests")
    tiny.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    tiny.add_argument("--out", required=True)
    tiny.add_argument(
        "--tokenizer-dir",
        type=Path,
        metavar="PATH",
        help="the real tokenizer to use (default: the arch's folder under $MOLT_PROXY_TOKENIZERS,"
        " else ../shared/tokenizers beside the checkout; none found: a small BPE trained here)",
    )
    tiny.set_defaults(run=_build_tiny_model)
    return root


def main(argv: list[str] | None = None) -> int:
    logs.configure("text")
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
