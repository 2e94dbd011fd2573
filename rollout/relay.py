"""A byte relay that carries the proxy's one port into a sandbox with no network of its own.

A sandbox in a network namespace of its own (bwrap's `--unshare-net`, a container's
`--network none`) has only its own loopback: the proxy's `127.0.0.1:PORT` is not there, and
nothing else is either. Two relays bridge that one port through a unix socket in a directory
mounted on both sides, so the harness's configured URL works unchanged inside:

    outside:  --listen unix:DIR/proxy.sock   --connect tcp:127.0.0.1:PORT   -- bwrap … (or docker run …)
    inside:   --listen tcp:127.0.0.1:PORT    --connect unix:DIR/proxy.sock  -- the harness's command

Each relay listens first, then runs the command after `--` with its own stdin, stdout and
stderr, and exits with the command's exit code (128 + N for a signal N; 127 for a command not
found, as a shell). `--hold-stdin` gives the
command a pipe that stays open while the relay lives and `--lifeline` ends the relay (and its
command) when its stdin closes: together they end a container whose `docker run` client was
killed (a timeout kills the client, not the container).

Only the standard library: the sandbox runs this file by its path with the runner's Python,
where the package itself may not be importable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

CHUNK = 1 << 16


def _address(text: str) -> tuple[str, str, int]:
    """`tcp:HOST:PORT` → ("tcp", HOST, PORT); `unix:PATH` → ("unix", PATH, 0)."""
    kind, _, rest = text.partition(":")
    if kind == "unix" and rest:
        return kind, rest, 0
    host, _, port = rest.rpartition(":")
    if kind == "tcp" and host and port.isdigit():
        return kind, host.strip("[]"), int(port)
    raise argparse.ArgumentTypeError(f"{text!r}: expected tcp:HOST:PORT or unix:PATH")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of file, then pass the half-close on (HTTP clients may shut down their
    sending side and still wait for the answer)."""
    with contextlib.suppress(OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _open(address: tuple[str, str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    kind, where, port = address
    if kind == "unix":
        return await asyncio.open_unix_connection(where)
    return await asyncio.open_connection(where, port)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _handler(connect: tuple[str, str, int]) -> Handler:
    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer = await _open(connect)
        except OSError:
            client_writer.close()  # the client sees its connection closed, as a proxy that is down
            return
        try:
            await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))
        except asyncio.CancelledError:
            # The relay is exiting with this connection still open (a client's keep-alive).
            # Ending here, not cancelled: Python 3.11's stream server logs a cancelled handler
            # as an "Exception in callback" on stderr, which a harness's stderr would then hold.
            pass
        writer.close()
        client_writer.close()

    return relay


async def _serve(listen: tuple[str, str, int], connect: tuple[str, str, int]) -> asyncio.Server:
    kind, where, port = listen
    if kind == "unix":
        return await asyncio.start_unix_server(_handler(connect), where)
    return await asyncio.start_server(_handler(connect), where, port)


async def _stdin_closed() -> None:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(CHUNK):
        pass


async def relay(
    listen: tuple[str, str, int],
    connect: tuple[str, str, int],
    command: list[str],
    *,
    hold_stdin: bool = False,
    lifeline: bool = False,
) -> int:
    """Listen, run `command`, relay until it exits; its exit code (128 + N for signal N)."""
    server = await _serve(listen, connect)
    try:
        stdin = subprocess.PIPE if hold_stdin else subprocess.DEVNULL if lifeline else None
        try:
            process = await asyncio.create_subprocess_exec(*command, stdin=stdin)
        except OSError as exc:  # as a shell says it, with its exit codes
            print(f"relay: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
            return 127 if isinstance(exc, FileNotFoundError) else 126
        exited = asyncio.ensure_future(process.wait())
        if lifeline:
            closed = asyncio.ensure_future(_stdin_closed())
            await asyncio.wait([exited, closed], return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                process.kill()
            closed.cancel()
        code = await exited
        return 128 - code if code < 0 else code
    finally:
        server.close()
        if listen[0] == "unix":
            Path(listen[1]).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if "--" not in arguments:
        raise SystemExit("relay: the command to run goes after `--`")
    split = arguments.index("--")
    parser = argparse.ArgumentParser(prog="relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="tcp:HOST:PORT or unix:PATH")
    parser.add_argument("--connect", type=_address, required=True, help="tcp:HOST:PORT or unix:PATH")
    parser.add_argument("--hold-stdin", action="store_true", help="give the command a pipe held open")
    parser.add_argument("--lifeline", action="store_true", help="end when this relay's stdin closes")
    options = parser.parse_args(arguments[:split])
    command = arguments[split + 1 :]
    if not command:
        raise SystemExit("relay: no command after `--`")
    flags = {"hold_stdin": options.hold_stdin, "lifeline": options.lifeline}
    return asyncio.run(relay(options.listen, options.connect, command, **flags))


if __name__ == "__main__":
    sys.exit(main())
