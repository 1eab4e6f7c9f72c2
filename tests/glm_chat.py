"""Tiny random GLM checkpoints in GLM's chat format, for the agents' API tests: a byte tokenizer with GLM's role
tokens (special) and its tags as added text tokens (<think>, <tool_call>, <arg_key>, <arg_value>, <tool_response>
and their ends, as GLM's tokenizers have them), and a chat template written here from GLM-5's published format:
tools listed in a system turn with the compact call format, assistant turns with their thinking, calls and tool
results as observations.
- GLM-5.3 (Glm5Next: KDA, DSA, mHC) with a random DFlash 2 drafter: the generation prompt always opens <think>
  (GLM-5.3 always thinks, whatever enable_thinking says).
- GLM-5.2 (GlmMoeDsa: MLA, DSA) with a random DFlash drafter: the generation prompt leaves <think> to the model,
  and enable_thinking false closes an empty section (<think></think>), as GLM-4.5 to 5.2 do."""

import json
from pathlib import Path

from tokenizers import AddedToken

from shared.byte_tokenizer import END_OF_TEXT, build_byte_tokenizer

ROLES = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>", "<tool_response>", "</tool_response>")
VOCAB = 258 + len(ROLES) + len(TAGS)  # the byte tokenizer's 256 bytes and 2 special tokens, then these
EOS = 256  # <|endoftext|>

GLM5_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n# Tools\n\nYou may call functions. Their signatures, in <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\nA call is written "
    "<tool_call>{name}<arg_key>{key}</arg_key><arg_value>{value}</arg_value>...</tool_call>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|><think>{{ m.reasoning_content or '' }}</think>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function.name }}"
    "{% for key, value in call.function.arguments.items() %}<arg_key>{{ key }}</arg_key><arg_value>"
    "{{ value if value is string else value | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)
GLM52_TEMPLATE = GLM5_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def write_glm_tokenizer(target: Path, template: str) -> None:
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens(list(ROLES))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT, "chat_template": template}))


def write_glm5_chat_pair(root: Path) -> tuple[Path, Path]:
    """GLM-5.3's (target folder, drafter folder) under root."""
    from conftest import tiny_draft_config
    from test_glm5_next import TEXT, random_glm5

    from draft_worker.draft_checkpoint import random_drafter, save_drafter
    from shared.draft_config import DFlash2Settings

    target, draft = root / "target", root / "draft"
    random_glm5(seed=5, vocab_size=VOCAB, eos_token_id=EOS, max_position_embeddings=2048).save_pretrained(target)
    write_glm_tokenizer(target, GLM5_TEMPLATE)
    save_drafter(random_drafter(tiny_draft_config(
        target_layers=TEXT["num_hidden_layers"], vocab=VOCAB, hidden=32, target_layer_ids=(1, 3, 5), block_size=8,
        dflash2=DFlash2Settings(conv_group_size=8, selector_rank=8, selector_top_k=4)), seed=3, std=0.2), draft)
    return target, draft


def write_glm52_chat_pair(root: Path) -> tuple[Path, Path]:
    """GLM-5.2's (target folder, DFlash drafter folder) under root."""
    from conftest import tiny_draft_config
    from test_glm_moe_dsa import TINY, random_glm

    from draft_worker.draft_checkpoint import random_drafter, save_drafter

    target, draft = root / "target", root / "draft"
    random_glm(seed=5, vocab_size=VOCAB, eos_token_id=EOS, max_position_embeddings=2048).save_pretrained(target)
    write_glm_tokenizer(target, GLM52_TEMPLATE)
    save_drafter(random_drafter(tiny_draft_config(
        target_layers=TINY["num_hidden_layers"], vocab=VOCAB, hidden=32, target_layer_ids=(1, 2, 3), block_size=8),
        seed=3, std=0.2), draft)
    return target, draft
