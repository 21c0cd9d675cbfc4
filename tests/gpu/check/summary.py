"""One page from a GPU check's output folder: the machine, each part's outcome, the GPU suite's
counts and failures, the mesh's streamed answer, the decode graphs, the benchmark tables, and
the host's step work and the mesh against the engine when those parts ran.

    python -m tests.gpu.check.summary OUT_DIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def parts(out: Path) -> list[str]:
    lines = ["| part | exit | seconds |", "|---|---|---|"]
    for line in _read(out / "results.txt").splitlines():
        name, rc, seconds = line.split()
        lines.append(f"| {name} | {rc.removeprefix('rc=')} | {seconds.removeprefix('seconds=')} |")
    return lines


def suite(out: Path) -> list[str]:
    report = out / "suite.xml"
    if not report.exists():
        return ["GPU suite: not run (no suite.xml)"]
    root = ElementTree.parse(report).getroot()
    cases = root.iter("testcase")
    failed = [
        f"- {case.get('classname')}::{case.get('name')}: "
        + (problem.get("message") or "")[:300].replace("\n", " ")
        for case in cases
        for problem in (case.find("failure"), case.find("error"))
        if problem is not None
    ]
    totals = root.find("testsuite") if root.tag == "testsuites" else root
    counts = {k: totals.get(k, "0") for k in ("tests", "failures", "errors", "skipped", "time")}
    head = (
        f"GPU suite (graphs on): {counts['tests']} tests, {counts['failures']} failed, "
        f"{counts['errors']} errors, {counts['skipped']} skipped in {counts['time']} s"
    )
    return [head, *failed]


def mesh(out: Path) -> list[str]:
    text = _read(out / "mesh.log").strip().splitlines()
    manifest = _read(out / "manifest.log")
    try:
        graphs = json.dumps(json.loads(manifest[manifest.index("{") :]).get("cuda_graphs"))
    except ValueError:  # no JSON object in it: the load failed (see manifest.log)
        graphs = "not read"
    return [
        "Mesh (`kvmesh up --backend cupy`, graphs on), last lines:",
        "```",
        *text[-8:],
        "```",
        f"Decode graphs (manifest, bf16): {graphs}",
    ]


# What the issue asks of kvmesh against llama.cpp F16, per shape and batch size.
TARGETS = {"default": {1: 1.3, 32: 1.5, 128: 1.5}, "llama3-8b": {1: 1.0, 32: 1.3, 128: 1.3}}


def _cell(name: str, value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if name.endswith("_ms") else f"{value:.0f}"


def bench_table(path: Path) -> list[str]:
    figures = json.loads(path.read_text())
    shape = figures.get("shape", "default")
    rows = figures["rows"]
    names = [name for name in rows[0] if name != "batch"]
    lines = [
        f"bench-gpu, {shape} shapes: {figures['device']}, {figures['dtype']}, "
        f"{figures['prompt_len']}-token prompts, {figures['output_len']} decoded; decode tok/s, "
        "the cupy backend's GPU and host ms per step, and its ratio to llama.cpp F16 (target)",
        "| batch | " + " | ".join(names) + " | cupy / F16 (target) |",
        "|---" * (len(names) + 2) + "|",
    ]
    for row in rows:
        cells = [_cell(name, row[name]) for name in names]
        peer, target = row.get("llama_cpp_F16"), TARGETS.get(shape, {}).get(row["batch"])
        ratio = f"{row['kvmesh_cupy'] / peer:.2f}x" if peer else "-"
        lines.append(
            f"| {row['batch']} | " + " | ".join(cells) + f" | {ratio} ({target or '-'}x) |"
        )
    return lines


def bench(out: Path) -> list[str]:
    paths = sorted(out.glob("bench-gpu*.json"))
    if not paths:
        return ["bench-gpu: no figures (see bench.log, bench8b.log)"]
    return [line for path in paths for line in [*bench_table(path), ""]]


def _tail(title: str, path: Path, lines: int) -> list[str]:
    if not path.exists():
        return []
    return [f"{title}:", "```", *_read(path).splitlines()[-lines:], "```", ""]


def render(out: Path) -> str:
    page = [
        "# GPU check",
        "",
        "Machine: " + " / ".join(_read(out / "gpu.txt").split("\n")).strip(" /"),
        "",
        *parts(out),
        "",
        *suite(out),
        "",
        *mesh(out),
        "",
        *bench(out),
        "",
        "bench-kernels:",
        "```",
        *_read(out / "kernels.log").splitlines()[-40:],
        "```",
        "",
        *_tail("bench-host (µs a step, model taken out)", out / "host.log", 17),
        *_tail(
            "bench-mesh on cupy, 4 gateways (target: mesh >= 0.9x in-process)",
            out / "meshbench.log",
            8,
        ),
        *_tail(
            "bench-mesh-ceiling on the sim backend, 4 gateways (target: ITL p99 <= 2x the step)",
            out / "meshceiling.log",
            2,
        ),
    ]
    return "\n".join(page)


def main() -> None:
    print(render(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
