"""The image settings of the processor a model was trained with (saved in its folder) against the processor it is
served with: the placeholders one reference picture becomes on each side, and the settings that differ
(resolution, pixel bounds, image splitting, tokens per tile).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

REFERENCE = (512, 512)  # the reference picture's size (W, H): a photo's size after a typical resize
# The settings that decide how many tokens a picture becomes, in the order a cause is named by.
TOKEN_SETTINGS = (
    "do_image_splitting",
    "max_pixels",
    "min_pixels",
    "size",
    "max_image_size",
    "longest_edge",
    "crop_size",
    "image_seq_len",
    "num_image_tokens",
    "patch_size",
    "merge_size",
    "do_resize",
)
PROCESSOR_ATTRS = ("image_seq_len", "num_image_tokens", "patch_size", "num_additional_image_tokens")


@dataclass(frozen=True)
class ImageSettings:
    """Tokens one reference picture takes in training and at serving, and the settings that differ."""

    reference: str  # "WxH"
    training_tokens: int
    serving_tokens: int
    differing: dict[str, dict[str, Any]]  # setting -> {"training": ..., "serving": ...}

    @property
    def ratio(self) -> float:
        low, high = sorted((self.training_tokens, self.serving_tokens))
        return high / low if low else float("inf") if high else 1.0

    @property
    def cause(self) -> str:
        """The setting that changes the count: the first token-deciding one that differs, else the first."""
        named = [s for s in TOKEN_SETTINGS if s in self.differing]
        return (named or list(self.differing) or ["unknown"])[0]


def settings_of(processor) -> dict[str, Any]:
    """The image processor's settings (its ``to_dict``, but the normalisation constants) and the processor's
    own image-token settings."""
    image_processor = getattr(processor, "image_processor", None)
    out = dict(image_processor.to_dict()) if hasattr(image_processor, "to_dict") else {}
    for name in ("image_processor_type", "processor_class", "image_mean", "image_std", "rescale_factor"):
        out.pop(name, None)
    for name in PROCESSOR_ATTRS:
        value = getattr(processor, name, None)
        if isinstance(value, int | float):
            out[name] = value
    # As saved: a processor object and one loaded from its folder compare equal (tuples become lists).
    return json.loads(json.dumps(out, default=str))


def compare_image_settings(training, serving) -> ImageSettings:
    """``training`` (the processor saved beside the model) against ``serving`` (the server's) on one
    reference picture."""
    from PIL import Image

    from hf_sanity.measure.vision import measure_modality, placeholders_per_picture

    picture = Image.new("RGB", REFERENCE, (128, 128, 128))
    counts = [placeholders_per_picture(p, picture, measure_modality(p)) for p in (training, serving)]
    trained, served = settings_of(training), settings_of(serving)
    differing = {
        name: {"training": trained.get(name), "serving": served.get(name)}
        for name in sorted(set(trained) | set(served))
        if trained.get(name) != served.get(name)
    }
    return ImageSettings(f"{REFERENCE[0]}x{REFERENCE[1]}", counts[0], counts[1], differing)
