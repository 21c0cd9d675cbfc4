"""`kvmesh trace`: a request's waterfall, the phase percentile table, the slowest requests,
read from the trace-collector's kvmesh.v1.Traces API."""

from __future__ import annotations

import argparse
import html
import os

import grpc

from kvmesh import run_file
from kvmesh.client import key_metadata
from shared import grpc_errors
from shared.pb.kvmesh.v1 import traces_pb2, traces_pb2_grpc

DEFAULT_COLLECTOR = "127.0.0.1:4317"
BAR_WIDTH = 48
SVG_ROW = 22
SVG_LABEL = 260
SVG_BARS = 640
SERVICE_COLOURS = {
    "gateway": "#4e79a7",
    "tokenizer": "#59a14f",
    "scheduler": "#f28e2b",
    "engine-worker": "#e15759",
}


def add_trace_parser(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser(
        "trace", help="where a request spent its time, or phase percentiles (trace-collector)"
    )
    trace.add_argument("request", nargs="?", help="request id (or trace id) to draw")
    trace.add_argument(
        "--collector",
        default=os.environ.get("KVMESH_COLLECTOR"),
        help="trace-collector HOST:PORT (default: the one `kvmesh up` started, else "
        f"{DEFAULT_COLLECTOR})",
    )
    trace.add_argument("--summary", action="store_true", help="p50/p95/p99 per phase")
    trace.add_argument("--slowest", type=int, metavar="N", help="the N slowest requests")
    trace.add_argument("--phase", default="e2e", help="order --slowest by this phase")
    trace.add_argument("--window", type=float, default=0, help="seconds back; 0: all held")
    trace.add_argument("--model", default="", help="only this model")
    trace.add_argument("--svg", metavar="PATH", help="also draw the waterfall as an SVG file")


def run_trace(args: argparse.Namespace) -> int:
    args.collector = args.collector or run_file.address_of("collector", DEFAULT_COLLECTOR)
    with grpc.insecure_channel(args.collector) as channel:
        stub = traces_pb2_grpc.TracesStub(channel)
        try:
            if args.summary:
                stats = stub.GetPhaseStats(
                    traces_pb2.PhaseStatsRequest(window_s=args.window, model=args.model),
                    metadata=key_metadata(),
                )
                print(format_summary(stats))
                return 0
            if args.slowest:
                slowest = stub.ListSlowest(
                    traces_pb2.SlowestRequest(
                        window_s=args.window, model=args.model, limit=args.slowest, phase=args.phase
                    ),
                    metadata=key_metadata(),
                )
                print(format_slowest(slowest))
                return 0
            if not args.request:
                raise SystemExit("kvmesh trace: give a request id, --summary or --slowest N")
            trace = _get_trace(stub, args.request)
        except grpc.RpcError as error:
            raise grpc_errors.from_call_to(error, "trace-collector", args.collector) from None
    print(format_waterfall(trace))
    if args.svg:
        with open(args.svg, "w", encoding="utf-8") as out:
            out.write(waterfall_svg(trace))
        print(f"wrote {args.svg}")
    return 0


def _get_trace(stub: traces_pb2_grpc.TracesStub, key: str) -> traces_pb2.Trace:
    looks_like_trace_id = len(key) == 32 and all(c in "0123456789abcdef" for c in key)
    request = (
        traces_pb2.GetTraceRequest(trace_id=key)
        if looks_like_trace_id
        else traces_pb2.GetTraceRequest(request_id=key)
    )
    return stub.GetTrace(request, metadata=key_metadata())


def _depths(trace: traces_pb2.Trace) -> dict[str, int]:
    parents = {span.span_id: span.parent_span_id for span in trace.spans}
    depths: dict[str, int] = {}
    for span in trace.spans:
        depth, parent = 0, parents.get(span.span_id, "")
        while parent in parents and depth < 32:
            depth, parent = depth + 1, parents[parent]
        depths[span.span_id] = depth
    return depths


def format_waterfall(trace: traces_pb2.Trace) -> str:
    if not trace.spans:
        return f"trace {trace.trace_id}: no spans"
    start = min(span.start_unix_ns for span in trace.spans)
    end = max(span.end_unix_ns for span in trace.spans)
    total = max(end - start, 1)
    depths = _depths(trace)
    lines = [f"request {trace.request_id}  trace {trace.trace_id}  {total / 1e6:.1f} ms"]
    for span in trace.spans:
        left = round((span.start_unix_ns - start) / total * BAR_WIDTH)
        width = max(1, round((span.end_unix_ns - span.start_unix_ns) / total * BAR_WIDTH))
        bar = " " * left + "█" * min(width, BAR_WIDTH - left)
        label = "  " * depths[span.span_id] + span.name
        duration = (span.end_unix_ns - span.start_unix_ns) / 1e6
        lines.append(
            f"{label:<26.26} {span.service:<13.13} |{bar:<{BAR_WIDTH}}| {duration:9.2f} ms"
            + ("  ERROR" if span.error else "")
        )
    timing = trace.timing
    if timing.request_id:
        lines.append(
            f"ttft {timing.ttft_ms:.1f} ms · tpot {timing.tpot_ms:.1f} ms · queue "
            f"{timing.queue_ms:.1f} ms · prefill {timing.prefill_ms:.1f} ms · decode "
            f"{timing.decode_ms:.1f} ms · {timing.output_tokens} tokens · {timing.outcome} "
            f"({timing.finish_reason})"
        )
    return "\n".join(lines)


def format_summary(stats: traces_pb2.PhaseStats) -> str:
    header = f"{'phase':<10}{'n':>7}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}  (ms)"
    lines = [f"{stats.requests} requests ({stats.rejected} refused, not counted)", header]
    for phase in stats.phases:
        lines.append(
            f"{phase.phase:<10}{phase.count:>7}{phase.p50_ms:>10.1f}{phase.p95_ms:>10.1f}"
            f"{phase.p99_ms:>10.1f}{phase.max_ms:>10.1f}"
        )
    return "\n".join(lines)


def format_slowest(slowest: traces_pb2.SlowestResponse) -> str:
    lines = [f"{'request':<24}{'e2e':>9}{'ttft':>9}{'queue':>9}{'prefill':>9}{'decode':>9}  tokens"]
    for t in slowest.requests:
        lines.append(
            f"{t.request_id:<24.24}{t.e2e_ms:>9.1f}{t.ttft_ms:>9.1f}{t.queue_ms:>9.1f}"
            f"{t.prefill_ms:>9.1f}{t.decode_ms:>9.1f}  {t.output_tokens}"
        )
    return "\n".join(lines)


def waterfall_svg(trace: traces_pb2.Trace) -> str:
    """The waterfall as a standalone SVG: one row per span, coloured by service."""
    start = min(span.start_unix_ns for span in trace.spans)
    total = max(max(span.end_unix_ns for span in trace.spans) - start, 1)
    depths = _depths(trace)
    height = SVG_ROW * (len(trace.spans) + 2)
    width = SVG_LABEL + SVG_BARS + 90
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="12">',
        f'<text x="4" y="15">{html.escape(f"request {trace.request_id}")} '
        f"({total / 1e6:.1f} ms)</text>",
    ]
    for row, span in enumerate(trace.spans, start=1):
        y = row * SVG_ROW + 4
        x = SVG_LABEL + (span.start_unix_ns - start) / total * SVG_BARS
        bar = max(1.0, (span.end_unix_ns - span.start_unix_ns) / total * SVG_BARS)
        colour = SERVICE_COLOURS.get(span.service, "#999999")
        label = html.escape(" " * 2 * depths[span.span_id] + span.name)
        duration = (span.end_unix_ns - span.start_unix_ns) / 1e6
        parts += [
            f'<text x="4" y="{y + 13}" xml:space="preserve">{label}</text>',
            f'<rect x="{x:.1f}" y="{y}" width="{bar:.1f}" height="16" fill="{colour}">'
            f"<title>{html.escape(span.service)}: {duration:.2f} ms</title></rect>",
            f'<text x="{SVG_LABEL + SVG_BARS + 6}" y="{y + 13}">{duration:.1f} ms</text>',
        ]
    parts.append("</svg>")
    return "\n".join(parts)
