"""How `serve` writes its log (`--log-format text|json`): every line logged in the `serve`
process, the proxy's and uvicorn's, through one handler on stderr. JSON puts one object a line,
with the fields a line carries (`extra={"fields": {...}}`, as the request lines of
`telemetry.py` do) at its top level, for log collectors that index them. Nothing here adds
content: what a line says is up to whoever logs it, and no line of the proxy holds a message's
content or a key. Text lines escape control characters (`TextFormatter`): a client's newline
never starts a forged line; JSON escapes them anyway.

Not the trainer's: under `serve --train` it is a Ray actor in a process of its own, which this
does not configure; Ray forwards what that process prints, prefixed `(Trainer pid=N)`, and those
lines are not in this format (not JSON). Its per-step progress lines are printed as plain text
(`trainer/run.py`); its metrics, machine-readable, are in `metrics.jsonl`."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Literal

Format = Literal["text", "json"]
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}
"""C0 and C1 control characters and Unicode's line and paragraph separators, as escapes."""


def escape_controls(text: str) -> str:
    """`text` on one line: every control character written as its escape (`\\x0a`)."""
    return text.translate(_CONTROL)


class TextFormatter(logging.Formatter):
    """`TEXT`, one record a line: a value a client chose (a request path, a session id) cannot
    start a line of its own and pass for another record, nor carry terminal escapes. The
    traceback of an exception, written by the proxy, keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return escape_controls(super().formatMessage(record))


def configure(log_format: Format) -> None:
    """Route every log record at INFO and above through one stderr handler in `log_format`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
