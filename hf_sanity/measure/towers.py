"""Which towers of a vision-language model a PEFT adapter trains: the vision encoder, the projector between it
and the language model, the language model; where the adapter's layers landed and each tower's share of the
trainable parameters.

A module's tower is read from its path (`vision_tower`, `visual`, `vision_model` ... for the encoder;
`multi_modal_projector`, `connector`, `merger` ... for the projector, checked first: Qwen2-VL's merger sits
inside `visual`); the rest is the language model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VISION = "vision encoder"
PROJECTOR = "projector"
LANGUAGE = "language model"
TOWERS = (VISION, PROJECTOR, LANGUAGE)

# Path components (whole, or as a prefix of one) that name a tower.
PROJECTOR_NAMES = ("multi_modal_projector", "mm_projector", "connector", "merger", "aligner", "projector")
VISION_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder", "vision")
# The attributes a vision-language model keeps its language model under (transformers 5: `model.language_model`).
LANGUAGE_ATTRS = ("language_model", "text_model")


def tower_of(path: str) -> str:
    parts = path.split(".")
    if any(part.startswith(PROJECTOR_NAMES) for part in parts):
        return PROJECTOR
    if any(part.startswith(VISION_NAMES) for part in parts):
        return VISION
    return LANGUAGE


def names_a_vision_tower(target: str) -> bool:
    """Whether a ``target_modules`` entry (a name, a suffix, a regex) names the vision encoder or projector."""
    return any(name in target for name in PROJECTOR_NAMES + VISION_NAMES)


@dataclass(frozen=True)
class AdapterTowers:
    """Where a PEFT model's adapter layers are and what trains, per tower."""

    adapted: dict[str, list[str]]  # tower -> the module paths that carry adapter layers
    trainable: dict[
        str, int
    ]  # tower -> its trainable parameters (adapter weights, modules_to_save, unfrozen)
    targets: list[str]  # the config's target_modules, as peft holds them ("all-linear" expanded to names)
    named: list[str]  # the entries (target_modules, modules_to_save) that name a vision tower
    language_path: str | None  # the language model's module path (for a regex on it)

    @property
    def total_trainable(self) -> int:
        return sum(self.trainable.values())

    def share(self) -> dict[str, float]:
        total = self.total_trainable or 1
        return {tower: round(self.trainable[tower] / total, 4) for tower in TOWERS}

    def on_vision(self) -> list[str]:
        return self.adapted[VISION] + self.adapted[PROJECTOR]

    def language_only_regex(self) -> str:
        """A ``target_modules`` regex (peft fullmatches a string against each module's path) that reaches the
        same layers of the language model and none of the vision towers."""
        suffixes = sorted({path.rsplit(".", 1)[-1] for path in self.adapted[LANGUAGE]}) or sorted(
            {path.rsplit(".", 1)[-1] for path in self.on_vision()}
        )
        layers = "(" + "|".join(suffixes) + ")"
        if self.language_path:
            return rf"{re.escape(self.language_path)}\..*\.{layers}"
        towers = "|".join(sorted({p.split(".")[0] for p in self.on_vision()}))
        return rf"^(?!.*({towers})).*\.{layers}"


def _unwrapped_path(name: str) -> str:
    return name.removeprefix("base_model.model.")


def adapter_towers(model) -> AdapterTowers | None:
    """The towers of a PEFT model (``peft_config`` on it); None for a model without one."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted: dict[str, list[str]] = {tower: [] for tower in TOWERS}
    trainable = dict.fromkeys(TOWERS, 0)
    language_path = None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    language = next((getattr(base, a) for a in LANGUAGE_ATTRS if hasattr(base, a)), None)
    inner = getattr(base, "model", None)
    if language is None and inner is not None:
        language = next((getattr(inner, a) for a in LANGUAGE_ATTRS if hasattr(inner, a)), None)
    for name, module in model.named_modules():
        path = _unwrapped_path(name)
        if isinstance(module, BaseTunerLayer):
            adapted[tower_of(path)].append(path)
        if language is not None and module is language and language_path is None:
            language_path = path
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            trainable[tower_of(_unwrapped_path(name))] += parameter.numel()
    targets, named = [], []
    for config in configs.values():
        given = getattr(config, "target_modules", None)
        entries = [given] if isinstance(given, str) else sorted(given or ())
        targets += entries
        named += [
            e
            for e in entries + list(getattr(config, "modules_to_save", None) or ())
            if names_a_vision_tower(e)
        ]
    return AdapterTowers(adapted, trainable, targets, named, language_path)
