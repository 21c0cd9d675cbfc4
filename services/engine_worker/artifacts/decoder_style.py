"""How a decoder family departs from Llama's layer, beyond shapes: Gemma 2 and 3's norms,
activation, embedding scale, attention scale and soft-capping, and layers that attend to a
sliding window only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine_worker.artifacts.rope import RopeSpec
from shared.errors import ModelValidationError

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' default layer pattern when a config lists no layer_types: every
# `pattern`th layer global, the others sliding (Gemma 2: 2, Gemma 3: 6).
_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
_27B_LAYERS = {"Gemma2ForCausalLM": 46, "Gemma3ForCausalLM": 62}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}


@dataclass(frozen=True)
class DecoderStyle:
    # Added to every RMSNorm weight at load: Gemma scales by (1 + w). A GGUF holds 1 + w already.
    norm_offset: float = 0.0
    # Gemma's attention and MLP outputs are normed again before their residual adds.
    sandwich_norms: bool = False
    activation: str = "silu"  # silu | gelu_tanh, of the gate
    embed_scale: float | None = None  # embeddings times sqrt(hidden) (Gemma)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    sliding_window: int | None = None  # keys a sliding layer sees, its own position included
    sliding_layers: frozenset[int] = frozenset()
    local_rope: RopeSpec | None = None  # sliding layers' own RoPE (Gemma 3)

    @property
    def is_llama(self) -> bool:
        """Llama's layer: what the compiled CPU step and the cupy backend are written for."""
        return self == DecoderStyle()

    @staticmethod
    def from_hf_config(config: dict[str, Any], name: str, path: str) -> DecoderStyle:
        if name not in GEMMA_ARCHITECTURES:
            return DecoderStyle()
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        activation = config.get("hidden_activation") or config.get("hidden_act")
        if activation not in _ACTIVATIONS:
            raise ModelValidationError(
                path, "unsupported activation", expected=sorted(_ACTIVATIONS), found=activation
            )
        pattern = int(config.get("sliding_window_pattern") or _SLIDING_PATTERN[name])
        kinds = config.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
        params = config.get("rope_parameters") or {}
        local_rope = None
        if name == "Gemma3ForCausalLM":
            local = params.get("sliding_attention") or {
                "rope_theta": config.get("rope_local_base_freq", 10_000.0)
            }
            local_rope = RopeSpec.from_hf_config({"rope_parameters": local}, path)
        window = int(config["sliding_window"]) if config.get("sliding_window") else None
        return DecoderStyle(
            norm_offset=1.0,
            sandwich_norms=True,
            activation=_ACTIVATIONS[activation],
            embed_scale=hidden**0.5,
            attention_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
            attn_softcap=_positive(config.get("attn_logit_softcapping")),
            final_softcap=_positive(config.get("final_logit_softcapping")),
            sliding_window=window,
            sliding_layers=frozenset(
                i for i, k in enumerate(kinds) if k == "sliding_attention" and window
            ),
            local_rope=local_rope,
        )

    @staticmethod
    def from_gguf_metadata(meta: dict[str, Any], arch: str, name: str) -> DecoderStyle:
        """As llama.cpp reads a Gemma GGUF: the converter added 1 to every norm weight; the
        layer pattern and the sliding layers' RoPE base are the family's own, not in the file;
        the 27B models scale queries by hidden / heads, the others by head_dim."""
        if name not in GEMMA_ARCHITECTURES:
            return DecoderStyle()
        layers, hidden = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
        heads = int(meta[f"{arch}.attention.head_count"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern") or _SLIDING_PATTERN[name]
        sliding = (
            [bool(x) for x in pattern]
            if isinstance(pattern, list)
            else [(i + 1) % int(pattern) != 0 for i in range(layers)]
        )
        window = meta.get(f"{arch}.attention.sliding_window")
        return DecoderStyle(
            sandwich_norms=True,
            activation="gelu_tanh",
            embed_scale=hidden**0.5,
            attention_scale=(hidden / heads if layers == _27B_LAYERS[name] else head_dim) ** -0.5,
            attn_softcap=_positive(meta.get(f"{arch}.attn_logit_softcapping")),
            final_softcap=_positive(meta.get(f"{arch}.final_logit_softcapping")),
            sliding_window=int(window) if window else None,
            sliding_layers=frozenset(i for i, s in enumerate(sliding) if s and window),
            local_rope=RopeSpec(theta=10_000.0) if name == "Gemma3ForCausalLM" else None,
        )


def global_rope_config(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The config RopeSpec reads for the global layers: Gemma 3 keys its rope parameters by
    layer kind (transformers 5.x)."""
    params = config.get("rope_parameters") or {}
    if name == "Gemma3ForCausalLM" and "full_attention" in params:
        return {**config, "rope_parameters": params["full_attention"]}
    return config


def _positive(value: Any) -> float | None:
    return float(value) if value else None
