"""The facts about a target checkpoint that more than one role reads, for every family (torch-free).

The gateway needs the vocabulary, the context length and the eos ids; the draft worker needs where the
embedding and the lm_head live and the checkpoint's dtype; the verify worker's family config (verify_worker/
families/) parses everything else. Multimodal configs keep the text model's keys under "text_config".
"""

from dataclasses import dataclass

from shared.config_values import config_int
from shared.errors import ConfigError

# architecture -> the prefix of the text model's tensors in its published checkpoints
TEXT_PREFIXES = {
    "Qwen3ForCausalLM": "model.",
    "LlamaForCausalLM": "model.",
    "GlmMoeDsaForCausalLM": "model.",
    "Glm5NextForConditionalGeneration": "model.language_model.",  # multimodal; flat text-only exports: "model."
}


def text_config(config: dict) -> dict:
    """The text model's keys: the nested "text_config" of a multimodal config, else the config itself."""
    nested = config.get("text_config")
    if nested is None:
        return config
    if not isinstance(nested, dict):
        raise ConfigError("config.json: 'text_config' must be a JSON object")
    return nested


def eos_ids(config: dict) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())


@dataclass(frozen=True)
class TargetFacts:
    architecture: str  # the first of config.json's "architectures" (or "" when it names none)
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str
    tie_word_embeddings: bool
    embed_names: tuple[str, ...]  # the input embedding's tensor name, in the order to look for it
    head_name: str  # the lm_head's tensor name (absent from the checkpoint when tied)

    @classmethod
    def from_config(cls, config: dict) -> "TargetFacts":
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in TEXT_PREFIXES), archs[0] if archs else "")
        text = text_config(config)
        prefix = TEXT_PREFIXES.get(arch, "model.")
        dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
        return cls(
            architecture=str(arch),
            vocab_size=config_int(text, "vocab_size"),
            hidden_size=config_int(text, "hidden_size"),
            num_layers=config_int(text, "num_hidden_layers"),
            max_position_embeddings=config_int(text, "max_position_embeddings", 4096),
            eos_token_ids=eos_ids(text) or eos_ids(config),
            checkpoint_dtype=str(dtype or "float32"),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            embed_names=tuple(dict.fromkeys((prefix + "embed_tokens.weight", "model.embed_tokens.weight"))),
            head_name="lm_head.weight",
        )
