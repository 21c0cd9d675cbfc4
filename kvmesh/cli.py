"""`kvmesh` command line: generate in one process, or start and talk to the mesh."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from kvmesh import run_file
from kvmesh.convert import add_convert_parser, run_convert
from kvmesh.mesh_cli import add_up_parser, run_up
from kvmesh.models_cli import add_models_parser, run_models
from kvmesh.prepare_cli import add_prepare_parser, run_prepare
from kvmesh.remote_cli import add_remote_flags, run_chat, run_remote_generate
from kvmesh.trace_cli import add_trace_parser, run_trace
from services.engine_worker.config import ENGINE_SETTINGS, engine_config
from services.scheduler.config import BATCHING_SETTINGS, scheduler_config
from shared.config import EngineConfig
from shared.errors import KvmeshError
from shared.pb.kvmesh.v1 import common_pb2
from shared.runtime.settings import SettingsParser, add_settings, parse_args_or_exit
from shared.sampling import ResponseFormat, SamplingParams

# Commands run as another package's module, by name: `kvmesh` does not import the benchmarks.
DELEGATED = {"bench": "loadtest.bench_cli"}
BENCH_HELP = "send a workload to a server (kvmesh gRPC or any OpenAI HTTP API)"


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        logprobs=args.logprobs,
        response_format=_response_format(args),
    )


def _response_format(args: argparse.Namespace) -> ResponseFormat | None:
    """--json-schema / --json-object / --regex / --grammar; a schema or grammar may be given
    inline or as a file path."""
    if args.json_object:
        return ResponseFormat("json_object")
    for kind, value in (("json_schema", args.json_schema), ("regex", args.regex)):
        if value is not None:
            return ResponseFormat(kind, _inline_or_file(value) if kind != "regex" else value)
    if args.grammar is not None:
        return ResponseFormat("lark", _inline_or_file(args.grammar))
    return None


def _inline_or_file(value: str) -> str:
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            return handle.read()
    return value


def _add_response_format_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("response format (output constrained token by token)")
    exclusive = group.add_mutually_exclusive_group()
    exclusive.add_argument("--json-schema", help="a JSON schema, inline or a file path")
    exclusive.add_argument("--json-object", action="store_true", help="any JSON object")
    exclusive.add_argument("--regex", help="a regular expression the whole output matches")
    exclusive.add_argument("--grammar", help="a Lark grammar, inline or a file path")


# The in-process engine (`generate`, `manifest`) is a worker and its scheduler in one process.
IN_PROCESS_SETTINGS = (*ENGINE_SETTINGS, *BATCHING_SETTINGS)


def in_process_config(args: argparse.Namespace) -> EngineConfig:
    return engine_config(args, scheduler_config(args))


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(prog="kvmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser(
        "generate", help="generate from a prompt or a JSONL file of prompts"
    )
    generate.add_argument("prompt", nargs="?", help="a prompt to answer, streamed to the terminal")
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    generate.add_argument(
        "--prompts-file", help='JSONL: {"prompt"}, {"messages"} or {"token_ids"} per line'
    )
    generate.add_argument("--output", help="JSONL results in input order (default: stdout)")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--logprobs", type=int, help="return the top N logprobs per token")
    generate.add_argument("--ignore-eos", action="store_true")
    _add_response_format_flags(generate)
    add_settings(generate, IN_PROCESS_SETTINGS)
    add_remote_flags(generate)
    chat = commands.add_parser("chat", help="a conversation with a running mesh (--addr)")
    chat.add_argument(
        "--addr",
        help="gateway HOST:PORT (default: the mesh `kvmesh up` started, else 127.0.0.1:50051)",
    )
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--stop", action="append", default=[])
    chat.add_argument("--timeout", type=float)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--seed", type=int)
    add_up_parser(commands)
    manifest = commands.add_parser("manifest", help="load a model and print its manifest as JSON")
    add_settings(manifest, IN_PROCESS_SETTINGS)
    add_trace_parser(commands)
    # Listed for --help; main() hands `bench` to the load generator before parsing.
    commands.add_parser("bench", help=BENCH_HELP, add_help=False)
    add_convert_parser(commands)
    add_models_parser(commands)
    add_prepare_parser(commands)
    return parser


def _remote_sampling(args: argparse.Namespace) -> dict:
    """Flags as proto field values; None leaves the server default."""
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": getattr(args, "top_k", None),
        "min_p": getattr(args, "min_p", None),
        "repetition_penalty": getattr(args, "repetition_penalty", None),
        "seed": args.seed,
        "ignore_eos": getattr(args, "ignore_eos", None),
        "logprobs": getattr(args, "logprobs", None),
        "response_format": _response_format_pb(args),
    }


def _response_format_pb(args: argparse.Namespace) -> common_pb2.ResponseFormat | None:
    found = _response_format(args) if hasattr(args, "json_schema") else None
    return None if found is None else common_pb2.ResponseFormat(kind=found.kind, spec=found.spec)


def _run_generate(args: argparse.Namespace) -> int:
    from kvmesh.engine import Engine

    if bool(args.prompt) == bool(args.prompts_file):
        raise SystemExit("kvmesh generate: give either a PROMPT or --prompts-file")
    if args.addr:
        if args.prompts_file:
            raise SystemExit("kvmesh generate --addr: give a PROMPT (--prompts-file is local)")
        args.addr = run_file.gateway(args.addr)
        return run_remote_generate(args, _remote_sampling(args))
    sampling = _sampling(args)
    engine = Engine(in_process_config(args))
    if args.prompt:
        prompt = (
            args.prompt
            if args.raw or not (engine.tokenizer and engine.tokenizer.chat_template)
            else {"messages": [{"role": "user", "content": args.prompt}]}
        )
        started = time.perf_counter()
        count = 0
        for text in engine.stream(prompt, sampling):
            count += 1
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[{count} chunks in {time.perf_counter() - started:.2f}s]", file=sys.stderr)
        return 0
    with open(args.prompts_file, encoding="utf-8") as handle:
        inputs = [json.loads(line) for line in handle if line.strip()]
    completions = engine.generate(inputs, sampling)
    lines = []
    for completion in completions:
        record: dict[str, object] = {
            "token_ids": completion.token_ids,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "usage": completion.usage,
        }
        if sampling.logprobs is not None:
            record["logprobs"] = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
                for lp in completion.logprobs
            ]
        lines.append(json.dumps(record) + "\n")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            out.writelines(lines)
    else:
        sys.stdout.writelines(lines)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in DELEGATED:
        os.execv(sys.executable, [sys.executable, "-m", DELEGATED[argv[0]], *argv[1:]])
    args = parse_args_or_exit(build_parser(), argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "chat":
            args.addr = run_file.gateway(args.addr, "127.0.0.1:50051")
            return run_chat(args, _remote_sampling(args))
        if args.command == "up":
            return run_up(args)
        if args.command == "trace":
            return run_trace(args)
        if args.command == "convert":
            return run_convert(args)
        if args.command == "models":
            return run_models(args)
        if args.command == "prepare":
            return run_prepare(args)
        from kvmesh.engine import Engine

        print(json.dumps(Engine(in_process_config(args)).manifest, indent=2))
        return 0
    except KvmeshError as error:
        print(f"kvmesh: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
