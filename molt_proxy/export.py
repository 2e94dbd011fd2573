"""Exports of finalized trajectories, in the schema the trainer reads (docs/using-it.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from molt_proxy.store import read_trajectories

Format = Literal["jsonl", "parquet"]


def export(db_path: str | Path, out: str | Path, fmt: Format) -> int:
    """Write every finalized trajectory of the store to `out`; returns how many."""
    rows = read_trajectories(db_path)
    if fmt == "jsonl":
        with open(out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        # `info` is free-form: stored as a JSON string so the column has one type.
        table = pa.Table.from_pylist([{**row, "info": json.dumps(row["info"])} for row in rows])
        pq.write_table(table, out)
    return len(rows)


def load(path: str | Path) -> list[dict[str, Any]]:
    """Read an export back into trajectory dicts (either format)."""
    path = Path(path)
    if path.suffix == ".parquet":
        return [{**row, "info": json.loads(row["info"])} for row in pq.read_table(path).to_pylist()]
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
