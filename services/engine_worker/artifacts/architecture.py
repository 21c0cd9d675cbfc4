"""One description of a decoder-only model, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.engine_worker.artifacts.decoder_style import (
    GEMMA_ARCHITECTURES,
    DecoderStyle,
    global_rope_config,
)
from services.engine_worker.artifacts.rope import RopeSpec
from shared.errors import ModelValidationError

# HF architecture name -> whether q/k/v projections carry a bias.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
    "Phi3ForCausalLM": False,
    "Gemma2ForCausalLM": False,
    "Gemma3ForCausalLM": False,
}
# GGUF architecture -> its HF name.
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Each query and key head RMS-normed over head_dim before the rotary (Qwen3).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
# Q, K and V stored as one qkv_proj, gate and up as one gate_up_proj (Phi-3).
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


def token_ids_of(value: Any) -> tuple[int, ...]:
    """An id, a list of ids, or nothing, as configs spell end-of-sequence tokens."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


@dataclass(frozen=True)
class ModelArchitecture:
    name: str  # HF spelling, e.g. LlamaForCausalLM
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    qk_norm: bool = False
    fused_projections: bool = False
    style: DecoderStyle = field(default_factory=DecoderStyle)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # any of them ends generation (unless ignore_eos)

    @property
    def llama_layer(self) -> bool:
        """Llama's layer and rotary: what the compiled CPU step and the cupy backend are
        written for (Gemma's layer, a partial rotary and LongRoPE run on the eager model)."""
        rope = self.rope
        return self.style.is_llama and rope.partial == 1.0 and rope.rope_type != "longrope"

    @property
    def cupy_layer(self) -> bool:
        """What the cupy backend runs: Llama's layer, or Gemma's without soft-capped scores
        (Gemma 3), with a full rotary and no LongRoPE."""
        rope, style = self.rope, self.style
        return (
            style.attn_softcap is None
            and style.final_softcap is None
            and rope.partial == 1.0
            and rope.rope_type != "longrope"
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.kv_size * element_size

    @property
    def num_parameters(self) -> int:
        """Counted from the shapes, before any tensor is read (the fit check needs it first)."""
        hidden, q, kv = self.hidden_size, self.q_size, self.kv_size
        attention = hidden * q + 2 * hidden * kv + q * hidden
        attention += (q + 2 * kv) * self.qkv_bias + hidden * self.o_bias
        attention += 2 * self.head_dim * self.qk_norm
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden
        layer += 2 * hidden * self.style.sandwich_norms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + hidden

    def step_workspace_bytes(self, max_tokens: int, max_seqs: int, element_size: int) -> int:
        """A step's largest activations: every projection's output for `max_tokens` rows, and
        float32 logits for `max_seqs` sampled rows (an upper bound, not an exact count)."""
        row = 3 * self.hidden_size + self.q_size + 2 * self.kv_size + 2 * self.intermediate_size
        return max_tokens * row * element_size + max_seqs * self.vocab_size * 4

    def check(self, path: str) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ModelValidationError(
                    path, f"{name} must be positive", found=getattr(self, name)
                )
        if self.num_heads % self.num_kv_heads:
            raise ModelValidationError(
                path,
                "num_heads must be a multiple of num_kv_heads",
                expected=f"a divisor of {self.num_heads}",
                found=self.num_kv_heads,
            )

    @staticmethod
    def from_hf_config(config: dict[str, Any], path: str) -> ModelArchitecture:
        names = config.get("architectures") or []
        name = names[0] if names else None
        if name not in SUPPORTED_HF_ARCHITECTURES:
            raise ModelValidationError(
                path,
                "unsupported architecture",
                expected=sorted(SUPPORTED_HF_ARCHITECTURES),
                found=name,
            )
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            rope = RopeSpec.from_hf_config(global_rope_config(config, name), path)
            architecture = ModelArchitecture(
                name=name,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=_attended_length(config, name, rope),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=SUPPORTED_HF_ARCHITECTURES[name] or bool(config.get("attention_bias")),
                o_bias=bool(config.get("attention_bias")),
                qk_norm=name in QK_NORM_ARCHITECTURES,
                fused_projections=name in FUSED_ARCHITECTURES,
                style=DecoderStyle.from_hf_config(config, name, path),
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=token_ids_of(config.get("eos_token_id")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ModelValidationError(
                path, f"config.json is missing or has a bad field: {error}"
            ) from None
        if config.get("mlp_bias"):
            raise ModelValidationError(
                path, "mlp_bias is not supported", expected=False, found=True
            )
        architecture.check(path)
        return architecture

    @staticmethod
    def from_gguf_metadata(
        meta: dict[str, Any], path: str, has_output_tensor: bool
    ) -> ModelArchitecture:
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ModelValidationError(
                path,
                "unsupported GGUF architecture",
                expected=sorted(SUPPORTED_GGUF_ARCHITECTURES),
                found=arch,
            )
        hf_name = SUPPORTED_GGUF_ARCHITECTURES[arch]

        def key(suffix: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{suffix}", default)
            if value is None:
                raise ModelValidationError(path, f"GGUF metadata key {arch}.{suffix} is missing")
            return value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        tokens = meta.get("tokenizer.ggml.tokens")
        architecture = ModelArchitecture(
            name=hf_name,
            vocab_size=int(meta.get(f"{arch}.vocab_size") or len(tokens or ())),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope=RopeSpec.from_gguf_metadata(meta, arch, head_dim),
            max_position_embeddings=_attended_length(
                {
                    "max_position_embeddings": key("context_length"),
                    "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
                },
                hf_name,
            ),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=SUPPORTED_HF_ARCHITECTURES[hf_name],
            qk_norm=hf_name in QK_NORM_ARCHITECTURES,
            fused_projections=hf_name in FUSED_ARCHITECTURES,
            style=DecoderStyle.from_gguf_metadata(meta, arch, hf_name),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=token_ids_of(meta.get("tokenizer.ggml.eos_token_id")),
        )
        architecture.check(path)
        return architecture


def _attended_length(config: dict[str, Any], name: str = "", rope: RopeSpec | None = None) -> int:
    """The context served: a sliding window on every layer (Mistral 7B v0.1, Phi-3-mini) caps
    it, since those layers here attend to the whole context; up to the window the two are the
    same. Gemma's sliding layers read their window only (DecoderStyle). LongRoPE (Phi-3 128k,
    Phi-4-mini) is served within its original context (RopeSpec.short_factor)."""
    length = int(config.get("max_position_embeddings", 2048))
    if rope is not None and rope.rope_type == "longrope":
        length = min(length, rope.original_max_position_embeddings)
    window = None if name in GEMMA_ARCHITECTURES else config.get("sliding_window")
    uses_window = config.get("use_sliding_window", True)  # Qwen2 and Qwen3 write it off
    return min(length, int(window)) if window and uses_window else length
