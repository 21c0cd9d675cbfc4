"""`kvmesh` command line: generate text from a model in one process."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from shared.config import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes
from shared.errors import KvmeshError
from shared.sampling import SamplingParams


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)"
    )
    group.add_argument("--backend", default="auto", help="compute backend: auto or torch")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--kv-memory", default="1GiB", help="KV cache budget, e.g. 512MiB or 2GiB")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--max-model-len", type=int, help="context length cap (default: the model's)"
    )
    group.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step")
    group.add_argument(
        "--max-num-seqs", type=int, default=128, help="most requests running at once"
    )
    group.add_argument(
        "--chunk-size",
        type=int,
        default=512,
        help="prefill chunk size; 0 turns chunked prefill off",
    )
    group.add_argument(
        "--no-prefix-caching", action="store_true", help="turn automatic prefix caching off"
    )
    group.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_memory_bytes=parse_bytes(args.kv_memory),
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            prefill_chunk_size=args.chunk_size or None,
        ),
    )


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
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__)
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
    _add_engine_flags(generate)
    manifest = commands.add_parser("manifest", help="load a model and print its manifest as JSON")
    _add_engine_flags(manifest)
    return parser


def _run_generate(args: argparse.Namespace) -> int:
    from kvmesh.engine import Engine

    if bool(args.prompt) == bool(args.prompts_file):
        raise SystemExit("kvmesh generate: give either a PROMPT or --prompts-file")
    sampling = _sampling(args)
    engine = Engine(engine_config(args))
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
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        from kvmesh.engine import Engine

        print(json.dumps(Engine(engine_config(args)).manifest, indent=2))
        return 0
    except KvmeshError as error:
        print(f"kvmesh: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
