"""SmoothQuant for packed weights: move activation outliers into the weights before int8.

Per-token int8 activations lose the small channels of a row to its few huge ones (a row's scale
is its largest value). For each projection input channel j, a scale s_j = a_j^alpha / w_j^(1-alpha)
(a_j: the channel's largest activation seen in a calibration pass of the float model, w_j: the
largest weight reading it) divides the activation and multiplies the weight column: the product
is unchanged, the activation far flatter. Every division is folded into what produces the
activation, so a step runs no extra op:

- Q/K/V and gate/up inputs: the RMSNorm weight before them;
- the output projection's input (attention output): V's rows, one scale per KV-head channel,
  shared by the query heads of its group (their outputs are sums of those V rows);
- the down projection's input (silu(gate) * up): up's rows;
- the head's input: the final norm's weight (a tied head is its own copy here).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

from services.engine_worker.architecture import ModelArchitecture
from services.engine_worker.linear import Projection
from services.engine_worker.torch_weights import TorchWeights
from services.engine_worker.weights import LayerWeights, ModelWeights

ALPHA = 0.5
CALIBRATION_TOKENS = 512


@dataclasses.dataclass
class InputMaxima:
    """Largest |activation| per input channel of each projection, over a calibration pass."""

    qkv: list[torch.Tensor]
    o_proj: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    head: torch.Tensor


class _Recording:
    """Wraps a projection; keeps the running max |x| per input channel."""

    def __init__(self, inner: Projection, width: int) -> None:
        self.inner = inner
        self.maxima = torch.zeros(width)

    @property
    def resident_bytes(self) -> int:
        return self.inner.resident_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.maxima, x.detach().abs().amax(dim=0).float(), out=self.maxima)
        return self.inner(x)


def calibration_ids(vocab_size: int, count: int = CALIBRATION_TOKENS) -> list[int]:
    """Fixed pseudo-random token ids: outlier channels are a property of the model more than of
    the text (the same few channels peak on any input), and no tokenizer is needed."""
    rng = random.Random(1234)
    low = min(100, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(count)]


def measure_input_maxima(
    arch: ModelArchitecture, weights: ModelWeights, run_prefill: Callable[[TorchWeights], None]
) -> InputMaxima:
    """`run_prefill(torch_weights)` runs a prefill of the calibration ids on float weights built
    from `torch_weights`; the projections record what they see."""
    dense = TorchWeights.from_float(weights, "float32", torch.float32)
    layers = []
    for layer in dense.layers:
        layers.append(
            dataclasses.replace(
                layer,
                qkv=_Recording(layer.qkv, arch.hidden_size),
                o_proj=_Recording(layer.o_proj, arch.q_size),
                gate_up=_Recording(layer.gate_up, arch.hidden_size),
                down=_Recording(layer.down, arch.intermediate_size),
            )
        )
    head = _Recording(dense.lm_head, arch.hidden_size)
    recording = dataclasses.replace(dense, layers=tuple(layers), lm_head=head)
    run_prefill(recording)

    def seen(projection: Projection) -> torch.Tensor:
        assert isinstance(projection, _Recording)
        return projection.maxima

    return InputMaxima(
        qkv=[seen(layer.qkv) for layer in layers],
        o_proj=[seen(layer.o_proj) for layer in layers],
        gate_up=[seen(layer.gate_up) for layer in layers],
        down=[seen(layer.down) for layer in layers],
        head=head.maxima,
    )


def calibrated(arch: ModelArchitecture, weights: ModelWeights, block_size: int) -> ModelWeights:
    """`weights` smoothed by a float prefill of the calibration ids (logits at every row, so the
    head sees as many inputs as the layers)."""
    from services.engine_worker.batch import RequestState, build_batch
    from services.engine_worker.kv_cache import KVCache, KVCacheShape
    from services.engine_worker.model import CausalLM
    from shared.sampling import SamplingParams

    ids = calibration_ids(arch.vocab_size, min(CALIBRATION_TOKENS, arch.max_position_embeddings))
    blocks = -(-len(ids) // block_size)

    def run_prefill(torch_weights: TorchWeights) -> None:
        model = CausalLM(arch, torch_weights, len(ids), torch.float32)
        shape = KVCacheShape(blocks, block_size, arch.num_kv_heads, arch.head_dim, arch.num_layers)
        state = RequestState(
            "calibration", ids, list(range(blocks)), 0, SamplingParams(max_tokens=1), len(ids)
        )
        batch = build_batch(
            [(state, len(ids))], block_size, arch.num_kv_heads, arch.num_heads, arch.head_dim
        )
        model.forward(
            batch.input_ids,
            batch.positions,
            KVCache(shape, torch.float32),
            batch.meta,
            torch.arange(len(ids)),
        )

    return smoothed(arch, weights, measure_input_maxima(arch, weights, run_prefill))


def _scales(activation_max: torch.Tensor, transposed_weight: torch.Tensor) -> torch.Tensor:
    """s_j for each input channel j of a (in, out) weight."""
    weight_max = transposed_weight.abs().amax(dim=1).float().clamp_min(1e-5)
    scale = activation_max.clamp_min(1e-5).pow(ALPHA) / weight_max.pow(1 - ALPHA)
    return scale.clamp(1e-2, 1e2)


def smoothed(arch: ModelArchitecture, weights: ModelWeights, maxima: InputMaxima) -> ModelWeights:
    """The same function as `weights`, with every projection's outliers moved into it."""
    group = arch.num_heads // arch.num_kv_heads
    v_start = arch.q_size + arch.kv_size
    layers = []
    for index, layer in enumerate(weights.layers):
        s_qkv = _scales(maxima.qkv[index], layer.qkv)
        s_gate_up = _scales(maxima.gate_up[index], layer.gate_up)
        # One scale per KV-head channel: the max over the query heads that read it.
        per_query = _scales(maxima.o_proj[index], layer.o_proj).view(
            arch.num_kv_heads, group, arch.head_dim
        )
        s_kv = per_query.amax(dim=1)  # (kv_heads, head_dim)
        s_o = s_kv.repeat_interleave(group, dim=0).flatten()  # (q_size,)
        s_down = _scales(maxima.down[index], layer.down)
        qkv = layer.qkv * s_qkv[:, None]
        qkv[:, v_start:] /= s_kv.flatten()[None, :]
        qkv_bias = layer.qkv_bias
        if qkv_bias is not None:
            qkv_bias = qkv_bias.clone()
            qkv_bias[v_start:] /= s_kv.flatten()
        gate_up = layer.gate_up * s_gate_up[:, None]
        gate_up[:, arch.intermediate_size :] /= s_down[None, :]
        layers.append(
            LayerWeights(
                input_norm=layer.input_norm / s_qkv,
                qkv=qkv,
                qkv_bias=qkv_bias,
                o_proj=layer.o_proj * s_o[:, None],
                o_bias=layer.o_bias,
                post_norm=layer.post_norm / s_gate_up,
                gate_up=gate_up,
                down=layer.down * s_down[:, None],
            )
        )
    s_head = _scales(maxima.head, weights.lm_head)
    return ModelWeights(
        embed=weights.embed,
        layers=tuple(layers),
        final_norm=weights.final_norm / s_head,
        lm_head=weights.lm_head * s_head[:, None],
        tied=False,  # the head is now its own (scaled) copy
    )
