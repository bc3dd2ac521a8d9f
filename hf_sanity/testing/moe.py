"""A tiny Qwen3-MoE built from its config, on the tiny tokenizer: 16 experts, 2 per token, 2 MoE layers; the
routed experts hold ~72% of its parameters (as in the large MoE checkpoints, where they hold 90% or more).

:func:`tiny_moe_dir` is the random model; :func:`trained_moe_dir` the same model trained on the demo
conversations with a strong load-balancing loss, saved with transformers' defaults (``output_router_logits``
off, ``router_aux_loss_coef`` 0.001): what a released MoE checkpoint is to its fine-tunes, a model whose routers
spread the tokens and stay so under a normal fine-tune. (A random tiny MoE's routers collapse within a few steps
of any fine-tune, with or without the load-balancing loss: its hidden states converge while it learns from
scratch.)"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from hf_sanity.testing.factory import _build_atomically, _key, build_tokenizer, cache_root


@dataclass(frozen=True)
class TinyMoeConfig:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    output_router_logits: bool = (
        False  # transformers' default: a plain forward returns no load-balancing loss
    )
    router_aux_loss_coef: float = 0.001
    seed: int = 0


def build_moe(tokenizer, config: TinyMoeConfig | None = None):
    """A randomly initialised Qwen3MoeForCausalLM whose vocabulary matches ``tokenizer`` (deterministic)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = config or TinyMoeConfig()
    fields = {k: v for k, v in asdict(config).items() if k != "seed"}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id != tokenizer.eos_token_id else None
    qwen = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        intermediate_size=128,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
        tie_word_embeddings=False,
        **fields,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return Qwen3MoeForCausalLM(qwen)


def tiny_moe_dir(template: str = "chatml", config: TinyMoeConfig | None = None) -> Path:
    """A cached folder with the tiny MoE and its tokenizer, loadable with `from_pretrained`."""
    config = config or TinyMoeConfig()
    final = (
        cache_root() / f"tiny-moe-{template}-{_key(kind='qwen3-moe', template=template, **asdict(config))}"
    )

    def build(folder: Path) -> None:
        tokenizer = build_tokenizer(template, "distinct")
        build_moe(tokenizer, config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return _build_atomically(final, build)


PRETRAIN_STEPS = 200
PRETRAIN_AUX = 0.05  # a strong load-balancing weight while it learns: routers that spread the tokens
PRETRAIN_BATCH = 16


def trained_moe_dir(template: str = "chatml") -> Path:
    """A cached folder with the tiny MoE trained on the demo conversations (see the module's doc; ~30 s to
    build on one CPU thread, once)."""
    config = TinyMoeConfig()
    parts = dict(
        kind="qwen3-moe-trained", template=template, steps=PRETRAIN_STEPS, aux=PRETRAIN_AUX, **asdict(config)
    )
    final = cache_root() / f"trained-moe-{template}-{_key(**parts)}"

    def build(folder: Path) -> None:
        from hf_sanity.testing.trained import fine_tune, training_conversations

        tokenizer = build_tokenizer(template, "distinct")
        model = build_moe(tokenizer, config)
        model.config.output_router_logits = True
        model.router_aux_loss_coef = (
            PRETRAIN_AUX  # what the loss reads (the config's is read once, when built)
        )
        fine_tune(
            model, tokenizer, training_conversations("clean"), steps=PRETRAIN_STEPS, batch_size=PRETRAIN_BATCH
        )
        model.config.output_router_logits = config.output_router_logits
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return _build_atomically(final, build)
