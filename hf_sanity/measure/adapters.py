"""A saved PEFT/LoRA adapter: its tensors and config read safely, and attached to a model for a scoped look."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

from hf_sanity.errors import UserInputError


def adapter_state(folder: str | Path) -> dict:
    """The adapter's saved tensors (safetensors, or a .bin read with weights_only=True)."""
    folder = Path(folder)
    safetensors_file = folder / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = folder / "adapter_model.bin"
    if bin_file.is_file():
        import torch

        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise UserInputError(f"adapter folder {str(folder)!r} has no adapter_model.safetensors; pass the folder written "
                         "by peft's save_pretrained")  # fmt: skip


def adapter_config(folder: str | Path) -> dict:
    path = Path(folder) / "adapter_config.json"
    if not path.is_file():
        raise UserInputError(f"adapter folder {str(folder)!r} has no adapter_config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path} is not valid JSON: {exc}") from None


def module_path(key: str) -> str:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``model.layers.0.self_attn.q_proj``."""
    name = key.split(".lora_")[0]
    return name.removeprefix("base_model.model.")


def lora_keys(state: dict, which: str) -> dict[str, object]:
    return {k: v for k, v in state.items() if f".lora_{which}." in k}


@contextlib.contextmanager
def attached_adapter(model, folder: str | Path):
    """``model`` with the saved adapter attached, for the duration of the block; on exit the adapter's layers
    are removed again, ``model`` is the same object it was and every parameter's ``requires_grad`` is what it
    was (peft freezes the base model when it loads an adapter for inference). peft 0.18's ``unload()`` (not
    newer ones') leaves the ``peft_config`` it put on ``model``: it is removed, or the model would pass for a
    PEFT model afterwards (to hf-sanity's adapter checks and to the user)."""
    from peft import PeftModel

    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    had_peft_config = "peft_config" in vars(model)
    with warnings.catch_warnings():  # peft reads transformers' deprecated name; the user cannot act on it
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        peft_model = PeftModel.from_pretrained(model, str(folder))
    try:
        yield peft_model
    finally:
        restored = peft_model.unload()
        if restored is not model:  # peft unloads in place; anything else would leave the adapter behind
            raise RuntimeError(
                "peft's unload() returned another model object than the one the adapter was on"
            )
        if not had_peft_config and "peft_config" in vars(model):
            del model.peft_config
        for name, p in model.named_parameters():
            p.requires_grad_(trainable.get(name, p.requires_grad))


def fit_to_adapter(model, state: dict) -> None:
    """Resize ``model``'s token embeddings to the saved adapter's trained embedding (``modules_to_save``), as
    the model was resized for training when tokens were added; a model that fits is left alone."""
    rows = [
        int(t.shape[0])
        for k, t in state.items()
        if "embed_tokens" in k and "lora_" not in k and t.dim() == 2 and t.numel()
    ]
    embeddings = model.get_input_embeddings()
    if rows and embeddings is not None and max(rows) > embeddings.num_embeddings:
        model.resize_token_embeddings(max(rows))


def saved_adapter_changes_outputs(model, folder: str | Path, batch) -> bool:
    """Whether the saved adapter in ``folder``, attached to ``model`` for the call, changes its logits on
    ``batch`` at all (the model is left as it was)."""
    import torch

    from hf_sanity.measure.served import logits

    base = logits(model, batch)
    with attached_adapter(model, folder) as adapted:
        return not torch.equal(base, logits(adapted, batch))


def attached_adapter_changes_outputs(model, batch) -> bool:
    """Whether the adapter ``model`` (a PEFT model) carries changes its logits on ``batch``: against the same
    model with its adapter disabled."""
    import torch

    from hf_sanity.measure.served import logits

    adapted = logits(model, batch)
    with model.disable_adapter():
        base = logits(model, batch)
    return not torch.equal(base, adapted)
