"""Tiny models, tokenizers and data for testing fine-tuning code offline.

Public and documented: use them in your own tests.

>>> from hf_sanity.testing import tiny_setup, demo_conversations
>>> model, tokenizer = tiny_setup("chatml", pad="eos")          # a ~0.2M-parameter Llama, built once, cached
>>> rows = demo_conversations(32)                               # [{"messages": [...]}, ...]

Variants (``template``): ``chatml`` (ChatML), ``llama3`` (header template, BOS in the template and added by
the tokenizer), ``generation`` (ChatML with ``{% generation %}`` markers), ``base`` (no chat template).
``pad``: ``distinct`` (pad != EOS), ``eos`` (pad == EOS), ``none``.

Fine-tuned fixtures (``trained_setup(variant)``, :mod:`hf_sanity.testing.trained`): the tiny model trained on
the demo conversations correctly (``clean``: it answers and stops) and with one planted bug each
(``eos-masked``, ``pad-eos``, ``prompt-in-answer``, ``truncated``, ``wrong-template``), plus a LoRA
adapter.
"""

from hf_sanity.testing.data import (
    as_prompt_completion,
    as_text,
    demo_conversations,
    demo_preference_pairs,
    demo_rl_prompts,
    demo_unpaired,
    reasoning_conversations,
    synthetic_conversations,
    tool_conversations,
)
from hf_sanity.testing.factory import (
    CHAT_TEMPLATES,
    TEMPLATES,
    TinyConfig,
    build_model,
    build_tokenizer,
    cache_root,
    tiny_model_dir,
    tiny_model_for,
    tiny_setup,
)
from hf_sanity.testing.trained import (
    ADAPTER_PREFIX,
    VARIANTS,
    fine_tune,
    held_out_conversations,
    trained_adapter_dir,
    trained_model_dir,
    trained_setup,
)

__all__ = [
    "ADAPTER_PREFIX",
    "CHAT_TEMPLATES",
    "TEMPLATES",
    "VARIANTS",
    "TinyConfig",
    "as_prompt_completion",
    "as_text",
    "build_model",
    "build_tokenizer",
    "cache_root",
    "demo_conversations",
    "demo_preference_pairs",
    "demo_rl_prompts",
    "demo_unpaired",
    "fine_tune",
    "held_out_conversations",
    "reasoning_conversations",
    "synthetic_conversations",
    "tiny_model_dir",
    "tiny_model_for",
    "tiny_setup",
    "tool_conversations",
    "trained_adapter_dir",
    "trained_model_dir",
    "trained_setup",
]
