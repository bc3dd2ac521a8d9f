"""LoRA adapters for the protocol: read a config (an adapter_config.json or --lora-* flags) and attach it."""

from __future__ import annotations

import os
from pathlib import Path

from hf_sanity.errors import UserInputError


def is_peft(model) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict) and bool(model.peft_config)


def adapter_dict(model) -> dict | None:
    if not is_peft(model):
        return None
    config = next(iter(model.peft_config.values()))
    out = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v)) for k, v in out.items()}


def lora_config(
    adapter_config: str | os.PathLike | None = None,
    r: int | None = None,
    alpha: int | None = None,
    target: list[str] | None = None,
):
    """A peft LoraConfig from an adapter_config.json (file or folder) or from --lora-r/--lora-alpha/--lora-target."""
    if adapter_config is None and r is None:
        if alpha is not None or target:
            raise UserInputError("--lora-alpha/--lora-target need --lora-r (or pass --adapter-config)")
        return None
    if adapter_config is not None and r is not None:
        raise UserInputError("pass --adapter-config or --lora-r, not both")
    from peft import LoraConfig

    if adapter_config is not None:
        import json

        path = Path(adapter_config)
        if path.is_dir():
            path = path / "adapter_config.json"
        if not path.is_file():
            raise UserInputError(
                f"adapter config {str(adapter_config)!r} does not exist; pass adapter_config.json"
            )
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserInputError(f"cannot read adapter config {str(path)!r}: {exc}") from None
        if not isinstance(values, dict):
            raise UserInputError(f"adapter config {str(path)!r} is not a JSON object")
        peft_type = str(values.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise UserInputError(
                f"adapter config {str(path)!r} is {peft_type}; only LoRA configs are supported"
            )
        known = set(LoraConfig.__dataclass_fields__)
        kwargs = {
            k: v
            for k, v in values.items()
            if k in known and k not in ("peft_type", "base_model_name_or_path")
        }
        kwargs.setdefault("task_type", "CAUSAL_LM")
    else:
        if r <= 0:
            raise UserInputError(f"--lora-r must be positive, got {r}")
        targets = [t for value in (target or []) for t in value.split(",") if t.strip()]
        kwargs = {
            "r": r,
            "lora_alpha": alpha if alpha is not None else 2 * r,
            "target_modules": targets if targets and targets != ["all-linear"] else "all-linear",
            "task_type": "CAUSAL_LM",
        }
    try:
        return LoraConfig(**kwargs)
    except Exception as exc:
        raise UserInputError(f"invalid LoRA config: {type(exc).__name__}: {exc}") from None


def attach_lora(model, config):
    import warnings

    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config)
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"cannot attach the LoRA adapter: {text}") from None
