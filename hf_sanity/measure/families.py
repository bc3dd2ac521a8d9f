"""Chat formats by family, recognised by their markers: inside message content a marker is stray; inside a
`text` dataset it tells which format the text was rendered with."""

from __future__ import annotations

FORMAT_MARKERS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama-3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "llama-2/mistral": ("[INST]", "[/INST]"),
    "alpaca": ("### Instruction:", "### Response:"),
    "zephyr/phi-3": ("<|user|>", "<|assistant|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "deepseek": ("<｜User｜>", "<｜Assistant｜>"),
}
FAMILY_OF = {marker: family for family, markers in FORMAT_MARKERS.items() for marker in markers}

# The encoding error of a conversation row when the tokenizer has no template (missing-chat-template).
NO_TEMPLATE = "the tokenizer has no chat template"


def own_families(tokenizer) -> frozenset[str]:
    """The marker families the tokenizer's own template renders (a probe conversation)."""
    if not getattr(tokenizer, "chat_template", None):
        return frozenset()
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:
        return frozenset()
    return frozenset(FAMILY_OF[m] for m in FAMILY_OF if m in text)
