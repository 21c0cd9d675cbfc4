"""`make eval-smoke`: EleutherAI's lm-eval, unchanged, against a `kvmesh up` mesh through its
OpenAI front (`local-completions`, `--batch_size 4`): a small multiple-choice task and a
perplexity task from loadtest/eval_tasks. The multiple-choice accuracy must equal the one
computed from transformers' logprobs on the same weights (float32), request by request.

lm-eval runs from its own virtual environment (the make target builds it): it is a client,
as a user's would be, and its dependencies stay out of the project's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import torch

from kvmesh.convert import to_safetensors
from kvmesh.mesh.config import MeshConfig
from kvmesh.mesh.launcher import Mesh
from shared.model_paths import resolve_model_path

TASKS = Path(__file__).parent / "eval_tasks"
TOLERANCE = 1e-3  # nats per request: float32 weights and KV on both sides

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
{rest}"""
MULTIPLE_CHOICE = """doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
PERPLEXITY = """doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


def write_tasks(directory: Path) -> None:
    for name, data, output_type, rest in (
        ("kvmesh_capitals_mc", "capitals_mc.jsonl", "multiple_choice", MULTIPLE_CHOICE),
        ("kvmesh_short_texts_ppl", "short_texts.jsonl", "loglikelihood_rolling", PERPLEXITY),
    ):
        text = TASK_YAML.format(
            name=name, data=TASKS / data, output_type=output_type, rest=rest.format()
        )
        (directory / f"{name}.yaml").write_text(text)


def run_lm_eval(lm_eval: str, mesh: Mesh, model: str, tokenizer: str, out: Path) -> dict:
    model_args = ",".join(
        (
            f"model={model}",
            f"base_url={mesh.http_url}/completions",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",
        )
    )
    command = [
        lm_eval,
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", "kvmesh_capitals_mc,kvmesh_short_texts_ppl",
        "--include_path", str(out),
        "--batch_size", "4",
        "--output_path", str(out / "results"),
        "--log_samples",
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env)
    (results,) = out.glob("results/**/results_*.json")
    (samples,) = out.glob("results/**/samples_kvmesh_capitals_mc_*.jsonl")
    return {
        "results": json.loads(results.read_text())["results"],
        "samples": [json.loads(line) for line in samples.read_text().splitlines()],
    }


def transformers_scores(checkpoint: str, samples: list[dict]) -> list[list[float]]:
    """Each sample's choices scored as lm-eval's API models encode them: context, then the
    continuation's tokens, the continuation's logprobs summed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    scores = []
    for sample in samples:
        row = []
        requests = sorted(sample["arguments"].items(), key=lambda item: int(item[0].split("_")[-1]))
        for context, continuation in ((a["arg_0"], a["arg_1"]) for _, a in requests):
            spaces = len(context) - len(context.rstrip())  # lm-eval moves them to the answer
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, head = encode(context + continuation), encode(context)
            with torch.inference_mode():
                logits = model(torch.tensor([whole])).logits[0].float()
            log_probs = torch.log_softmax(logits, dim=-1)
            row.append(sum(float(log_probs[p - 1, whole[p]]) for p in range(len(head), len(whole))))
        scores.append(row)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command to run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-eval-") as scratch:
        out = Path(scratch)
        checkpoint = str(out / "checkpoint")
        # Safetensors and the tokenizer files, which lm-eval's tokenizer and transformers read.
        to_safetensors(resolve_model_path(None), checkpoint)
        write_tasks(out)
        config = MeshConfig(model=checkpoint, worker_args=["--weights", "float32"])
        with Mesh(config) as mesh:
            with urllib.request.urlopen(f"{mesh.http_url}/models") as response:
                model = json.load(response)["data"][0]["id"]
            found = run_lm_eval(args.lm_eval, mesh, model, checkpoint, out)
        samples = found["samples"]
        reference = transformers_scores(checkpoint, samples)
    ours = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    worst = max(
        abs(a - b) for o, r in zip(ours, reference, strict=True) for a, b in zip(o, r, strict=True)
    )
    accuracy = found["results"]["kvmesh_capitals_mc"]["acc,none"]
    truth = [int(s["target"]) for s in samples]
    expected = sum(
        max(range(len(r)), key=r.__getitem__) == t for r, t in zip(reference, truth, strict=True)
    ) / len(samples)
    perplexity = found["results"]["kvmesh_short_texts_ppl"]["word_perplexity,none"]
    print(
        f"multiple choice: acc {accuracy:.3f} (transformers float32: {expected:.3f}), "
        f"{len(samples)} questions; largest |logprob difference| {worst:.2e} nats"
    )
    print(f"perplexity: word_perplexity {perplexity:.2f}")
    if accuracy != expected or worst > TOLERANCE:
        sys.exit("lm-eval through kvmesh disagrees with transformers")


if __name__ == "__main__":
    main()
