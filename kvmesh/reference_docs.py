"""The reference pages' generated parts, read from the code so the docs cannot drift from it:
every `kvmesh` command, every service's flags, every error reason, every Prometheus metric.

`docs/hooks/reference.py` puts `section(NAME)` in place of `<!-- reference:NAME -->` when the
site builds; `python -m kvmesh.reference_docs NAME` prints one.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pathlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "tokenizer", "scheduler", "engine_worker", "trace_collector")
METRIC_TYPES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}


@contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help to the terminal's width: a fixed one makes the pages reproducible."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_blocks(name: str, parser: argparse.ArgumentParser, depth: int) -> Iterator[str]:
    from kvmesh.cli import DELEGATED

    with _columns(100):
        text = parser.format_help().rstrip()
    yield f"{'#' * depth} `{name}`\n\n```text\n{text}\n```\n"
    for sub_name, sub in subcommands(parser).items():
        if name == "kvmesh" and sub_name in DELEGATED:  # its flags are its module's own parser
            sub = importlib.import_module(DELEGATED[sub_name]).build_parser()
        yield from _help_blocks(f"{name} {sub_name}", sub, depth + 1)


def cli() -> str:
    from kvmesh.cli import build_parser

    return "\n".join(_help_blocks("kvmesh", build_parser(), 2))


def _flag_rows(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags or isinstance(action, argparse._HelpAction):
            continue
        env = "KVMESH_" + flags[0][2:].upper().replace("-", "_")
        default = "" if action.default in (None, False, "") else f"`{action.default}`"
        what = (action.help or "").replace("|", "\\|").replace("\n", " ")
        if action.choices:
            what = f"{what} (one of {', '.join(map(str, action.choices))})".lstrip()
        yield f"| `{flags[0]}` | `{env}` | {default} | {what} |"


def service_flags() -> str:
    parts = []
    for service in SERVICES:
        parser = importlib.import_module(f"services.{service}.__main__").build_parser()
        rows = "\n".join(_flag_rows(parser))
        parts.append(
            f"## {service.replace('_', '-')}\n\n`python -m services.{service}`\n\n"
            f"| flag | environment | default | what |\n| --- | --- | --- | --- |\n{rows}\n"
        )
    return "\n".join(parts)


def _reason_notes() -> dict[str, str]:
    """Each reason's comment in shared/errors.py: on its line, or on the lines above it."""
    notes: dict[str, str] = {}
    pending: list[str] = []
    for line in (ROOT / "shared" / "errors.py").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
        elif " = " in stripped and stripped.split(" = ")[0].isupper():
            name = stripped.split(" = ")[0]
            _, _, trailing = stripped.partition("  # ")
            notes[name] = " ".join([*pending, trailing]).strip()
            pending = []
        else:
            pending = []
    return notes


def errors() -> str:
    from services.gateway.openai_front.http_errors import HTTP_STATUS
    from shared.errors import Reason
    from shared.grpc_errors import STATUS_CODES

    notes = _reason_notes()
    rows = [
        f"| `{reason.value}` | `{STATUS_CODES[reason].name}` | {HTTP_STATUS.get(reason, 400)} "
        f"| {notes.get(reason.name, '')} |"
        for reason in Reason
    ]
    header = "| reason | gRPC status | HTTP status | what |\n| --- | --- | --- | --- |\n"
    return header + "\n".join(rows) + "\n"


def _metric_calls(path: pathlib.Path) -> Iterator[tuple[str, str, str, list[str]]]:
    """(name, type, help, labels) of each prometheus_client metric the module defines."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        kind = METRIC_TYPES.get(node.func.id)
        strings = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
        if kind is None or len(strings) < 2:
            continue
        labels: list[str] = []
        for value in [*node.args[2:3], *(k.value for k in node.keywords if k.arg == "labelnames")]:
            if isinstance(value, ast.List | ast.Tuple):
                labels = [str(e.value) for e in value.elts if isinstance(e, ast.Constant)]
        yield str(strings[0]), kind, str(strings[1]), labels


def _exposed(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def metrics() -> str:
    from services.scheduler.metrics import COUNTERS, GAUGES

    by_owner: dict[str, list[str]] = {}
    for path in sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "shared").rglob("*.py")]):
        parts = path.relative_to(ROOT).parts
        owner = parts[1].replace("_", "-") if parts[0] == "services" else "every service"
        for name, kind, help_text, labels in _metric_calls(path):
            label_text = ", ".join(f"`{label}`" for label in labels)
            row = f"| `{_exposed(name, kind)}` | {kind} | {label_text} | {help_text} |"
            by_owner.setdefault(owner, []).append(row)
    for table, kind in ((GAUGES, "gauge"), (COUNTERS, "counter")):
        for name, (help_text, _) in table.items():
            by_owner["scheduler"].append(f"| `{_exposed(name, kind)}` | {kind} | | {help_text} |")
    header = "| metric | type | labels | what |\n| --- | --- | --- | --- |\n"
    return "\n".join(
        f"## {owner}\n\n{header}" + "\n".join(sorted(rows)) + "\n"
        for owner, rows in sorted(by_owner.items(), key=lambda item: item[0] == "every service")
    )


SECTIONS: dict[str, Callable[[], str]] = {
    "cli": cli,
    "service-flags": service_flags,
    "errors": errors,
    "metrics": metrics,
}


def section(name: str) -> str:
    return SECTIONS[name]()


if __name__ == "__main__":
    print(section(sys.argv[1]))
