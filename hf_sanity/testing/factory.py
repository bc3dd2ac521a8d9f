"""Tiny tokenizers and causal LMs, built offline, deterministically and in seconds.

The tokenizer is a byte-level BPE trained with the `tokenizers` library on a corpus shipped with the
package; every variant shares one vocabulary, so one tiny model fits all of them. Built folders are
cached under ``$HF_SANITY_CACHE`` (default ``~/.cache/hf-sanity``), keyed by their parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

from hf_sanity.cache import cache_root
from hf_sanity.testing.data import demo_conversations

Template = Literal["chatml", "llama3", "generation", "base"]
Pad = Literal["distinct", "eos", "none"]
TEMPLATES: tuple[str, ...] = ("chatml", "llama3", "generation", "base")
BPE_VOCAB_SIZE = 1000
# Bump when what a cached folder contains changes, so stale folders are not reused.
FACTORY_REVISION = 2

# Every variant carries all of these at fixed ids, so the vocabulary (and the model) is shared.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]

CHAT_TEMPLATES: dict[str, str | None] = {
    # ChatML, as Qwen2.5 and SmolLM2 use it.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama-3 style headers; the template emits BOS itself (and the tokenizer adds one too, as Llama-3's does).
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # ChatML with {% generation %} markers, so `return_assistant_tokens_mask` works (TRL's assistant_only_loss).
    "generation": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{{ '\\n' }}"
        "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "base": None,
}

# (bos, eos, distinct pad) per template.
SPECIALS = {
    "chatml": (None, "<|im_end|>", "<|endoftext|>"),
    "generation": (None, "<|im_end|>", "<|endoftext|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
    "base": (None, "<|endoftext|>", "<|pad|>"),
}


@dataclass(frozen=True)
class TinyConfig:
    """A few-layer Llama. The defaults train at dozens of steps per second on one CPU core."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    seed: int = 0


def corpus() -> str:
    """The shipped prose plus the demo conversations: what the tiny tokenizer is trained on."""
    prose = resources.files("hf_sanity.testing").joinpath("corpus.txt").read_text(encoding="utf-8")
    dialogue = "\n".join(m["content"] for row in demo_conversations(256) for m in row["messages"])
    return prose + "\n" + dialogue


@lru_cache(maxsize=1)
def _bpe_json() -> str:
    """The trained BPE model as tokenizer.json text (special tokens first, at ids 0..8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus().splitlines(), trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(template: Template = "chatml", pad: Pad = "distinct"):
    """A fast tokenizer with the given chat template and pad policy.

    ``pad``: ``"distinct"`` (a pad token other than EOS), ``"eos"`` (pad == EOS, the collator trap), or
    ``"none"`` (no pad token at all).
    """
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    if template not in CHAT_TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    if pad not in ("distinct", "eos", "none"):
        raise ValueError(f"pad must be 'distinct', 'eos' or 'none', got {pad!r}")
    bos, eos, distinct_pad = SPECIALS[template]
    backend = Tokenizer.from_str(_bpe_json())
    if bos is not None:  # like Llama-3: the tokenizer prepends BOS to every encoded text
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    pad_token = {"distinct": distinct_pad, "eos": eos, "none": None}[pad]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad_token,
        chat_template=CHAT_TEMPLATES[template],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    # Structural tokens must never be split or stripped.
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in {bos, eos, pad_token}]}
    )
    return tokenizer


def build_model(
    vocab_size: int,
    config: TinyConfig | None = None,
    *,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
):
    """A randomly initialised LlamaForCausalLM (deterministic for a given seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = config or TinyConfig()
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
    )
    devices = []  # fork_rng on the CPU only; the caller's global RNG is left untouched
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.seed)
        return LlamaForCausalLM(llama)


def _key(**parts) -> str:
    """Everything the folder depends on, the trained vocabulary included (the corpus can change)."""
    from hf_sanity.version import __version__

    vocab = hashlib.sha256(_bpe_json().encode()).hexdigest()
    blob = json.dumps(
        {"version": __version__, "revision": FACTORY_REVISION, "vocab": vocab, **parts},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _build_atomically(final: Path, build) -> Path:
    """Build into a temporary sibling folder and rename it into place; concurrent builders are harmless."""
    if (final / "config.json").is_file() or (final / "tokenizer_config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race: its folder is as good as ours
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def tiny_model_dir(
    template: Template = "chatml", pad: Pad = "distinct", config: TinyConfig | None = None
) -> Path:
    """A cached folder with a tiny model and its tokenizer, loadable with `from_pretrained`."""
    config = config or TinyConfig()
    final = cache_root() / f"tiny-{template}-{pad}-{_key(template=template, pad=pad, **asdict(config))}"

    def build(folder: Path) -> None:
        tokenizer = build_tokenizer(template, pad)
        model = tiny_model_for(tokenizer, config)
        tokenizer.save_pretrained(folder)
        model.save_pretrained(folder)

    return _build_atomically(final, build)


def tiny_model_for(tokenizer, config: TinyConfig | None = None):
    """A tiny random model whose vocabulary matches ``tokenizer`` (for real tokenizers and templates)."""
    # pad_token_id becomes the embedding's padding_idx: a zero row that never receives gradient. When pad is
    # EOS that would freeze EOS itself, so the config only names a pad that is a token of its own.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id != tokenizer.eos_token_id else None
    model = build_model(
        len(tokenizer),
        config,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    # As the instruct checkpoints ship it: generation stops on EOS and on the template's end-of-turn token.
    from hf_sanity.measure.markers import derive_markers

    stops = [tokenizer.eos_token_id, *derive_markers(tokenizer).end_of_turn[-1:]]
    stops = sorted({i for i in stops if i is not None})
    model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
    return model


def tiny_setup(template: Template = "chatml", pad: Pad = "distinct", config: TinyConfig | None = None):
    """``(model, tokenizer)`` loaded from the cached folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dir(template, pad, config)
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
