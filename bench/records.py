"""Benchmark records: one JSON file per workload and session in bench/results/.

File names carry the UTC time, the workload and the checkpoint:
`2026-08-10-181500-decode-kipp-synthetic--qwen3-0.6b-shape.json`. A record holds the command that
made it, the protocol (warm-up, runs, interleaving order), the provenance block, and per arm its
status, every raw run, the summary and peak RSS. `validate` is the schema; the report reads only
records that pass it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = "kipp-bench/1"
RESULTS = Path(__file__).resolve().parent / "results"
TYPES = ("throughput", "ppl", "ceiling", "interop", "memory")
ARM_STATUSES = ("ok", "skipped", "unavailable", "refused", "failed")

_COMMON = {"schema": str, "type": str, "created": str, "command": str, "checkpoint": dict,
           "provenance": dict}
_BY_TYPE = {
    "throughput": {"workload": dict, "protocol": dict, "arms": list},
    "ppl": {"corpus": dict, "schemes": dict},
    "ceiling": {"ceiling": dict},
    "interop": {"schemes": dict},
    "memory": {"artifact": dict, "runs": list},
}
_ARM = {"arm": str, "engine": str, "scheme": str, "status": str, "spec": dict}
_ARM_OK = {"info": dict, "params": dict, "runs": list, "warmup_runs": list, "values": list,
           "summary": dict, "peak_rss_bytes": (int, type(None))}
_SUMMARY = ("n", "median", "mad", "min", "max")


def now() -> datetime:
    return datetime.now(timezone.utc)


def new(kind: str, command: str, checkpoint: dict, provenance: dict, **fields) -> dict:
    if kind not in TYPES:
        raise ValueError(f"unknown record type {kind!r}")
    return {"schema": SCHEMA, "type": kind, "created": now().isoformat(timespec="seconds"),
            "command": command, "checkpoint": checkpoint, "provenance": provenance, **fields}


def checkpoint_block(checkpoint_id: str) -> dict:
    from kipp.formats import registry

    entry = registry.get(checkpoint_id)
    return {"id": entry.id, "revision": entry.revision, "parameters": entry.parameter_count,
            "synthetic": entry.is_synthetic, "layers": entry.layers, "hidden": entry.hidden}


def _check_fields(obj: dict, fields: dict, where: str) -> list[str]:
    problems = []
    for key, kind in fields.items():
        if key not in obj:
            problems.append(f"{where}: missing {key!r}")
        elif not isinstance(obj[key], kind):
            problems.append(f"{where}: {key!r} is {type(obj[key]).__name__}")
    return problems


def validate(record: dict) -> list[str]:
    """Every way `record` departs from the schema (empty when it is valid)."""
    problems = _check_fields(record, _COMMON, "record")
    if record.get("schema") != SCHEMA:
        problems.append(f"record: schema {record.get('schema')!r} is not {SCHEMA!r}")
    kind = record.get("type")
    if kind not in TYPES:
        return problems + [f"record: unknown type {kind!r}"]
    problems += _check_fields(record, _BY_TYPE[kind], "record")
    if kind == "throughput" and isinstance(record.get("arms"), list):
        for arm in record["arms"]:
            problems += _validate_arm(arm)
    return problems


def _validate_arm(arm: dict) -> list[str]:
    where = f"arm {arm.get('arm')!r}"
    problems = _check_fields(arm, _ARM, where)
    status = arm.get("status")
    if status not in ARM_STATUSES:
        return problems + [f"{where}: status {status!r}"]
    if status != "ok":
        if not arm.get("reason"):
            problems.append(f"{where}: status {status} needs a reason")
        if arm.get("values"):
            problems.append(f"{where}: status {status} must carry no measurements")
        return problems
    problems += _check_fields(arm, _ARM_OK, where)
    if not problems:
        if len(arm["values"]) != len(arm["runs"]) or not arm["values"]:
            problems.append(f"{where}: values and runs disagree or are empty")
        missing = [k for k in _SUMMARY if k not in arm["summary"]]
        if missing:
            problems.append(f"{where}: summary lacks {missing}")
        elif arm["summary"]["n"] != len(arm["values"]):
            problems.append(f"{where}: summary n {arm['summary']['n']} != {len(arm['values'])}")
    return problems


def file_name(record: dict) -> str:
    stamp = datetime.fromisoformat(record["created"]).strftime("%Y-%m-%d-%H%M%S")
    tag = record["workload"]["name"] if record["type"] == "throughput" else record["type"]
    return f"{stamp}-{tag}-{record['checkpoint']['id'].replace('/', '--')}.json"


def write(record: dict, results: Path = RESULTS) -> Path:
    """Validate and write `record`; a record that fails the schema is never written."""
    problems = validate(record)
    if problems:
        raise ValueError("refusing to write an invalid record:\n  " + "\n  ".join(problems))
    results.mkdir(parents=True, exist_ok=True)
    path = results / file_name(record)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


def load_all(results: Path = RESULTS) -> list[tuple[Path, dict]]:
    """(path, record) for every valid record in `results`, oldest first."""
    found = []
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and not validate(record):
            found.append((path, record))
    return sorted(found, key=lambda item: item[1]["created"])


def latest(records: list[tuple[Path, dict]], kind: str, tag: str | None = None):
    """The newest (path, record) of a type (and workload name, for throughput)."""
    matching = [(p, r) for p, r in records if r["type"] == kind
                and (tag is None or r.get("workload", {}).get("name") == tag)]
    return matching[-1] if matching else None
