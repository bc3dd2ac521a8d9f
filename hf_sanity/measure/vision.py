"""The modality of a run, measured once: text, or vision-language (images or videos beside the tokens).

What says a run is vision-language: a processor with an image (or video) processor, vision tensors in the
collated batch (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...) or an image token id in the model's
config. What it measures for the rules: the ids of the vision tokens (image/video placeholders the processor
expands each picture into, and the vision start/end tokens around them; any negative id, the old LLaVA
convention), and for each row of a batch a digest of its own pictures, so that two rows asking the same
question about different images are not the same row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TEXT = "text"
VISION_LANGUAGE = "vision-language"

# Batch keys only a vision-language collator writes.
VISION_BATCH_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "pixel_values_videos",
    "video_grid_thw",
    "pixel_attention_mask",
    "image_attention_mask",
)
# Dataset columns that hold a row's pictures (TRL's names): a pass that reads only the text leaves them out.
PICTURE_COLUMNS = ("images", "image", "videos", "video")
# Config fields (of the model, or its text config) that hold a vision token's id: the placeholders...
PLACEHOLDER_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
# ... and the tokens that open and close an image's span (Qwen2-VL, Gemma 3, Idefics3).
BOUNDARY_FIELDS = (
    "vision_start_token_id",
    "vision_end_token_id",
    "boi_token_id",
    "eoi_token_id",
    "boi_token_index",
    "eoi_token_index",
)
# The processor's attributes that name them as strings.
PLACEHOLDER_ATTRS = ("image_token", "video_token")
BOUNDARY_ATTRS = (
    "vision_start_token",
    "vision_end_token",
    "fake_image_token",
    "global_image_token",
    "boi_token",
)


def without_pictures(data):
    """``data`` without its picture columns: iterating a dataset decodes every picture of every row it reads,
    which a pass over the conversations' text does not need."""
    columns = [name for name in getattr(data, "column_names", None) or () if name in PICTURE_COLUMNS]
    return data.remove_columns(columns) if columns and hasattr(data, "remove_columns") else data


# A batch's tensors with one entry per picture (LLaVA's): the pictures of its first rows are their first entries.
PER_PICTURE_KEYS = ("pixel_values", "image_sizes")


def leading_rows(batch: Mapping[str, Any], rows: int, placeholder_ids=frozenset()) -> dict[str, Any] | None:
    """The first ``rows`` rows of a collated batch and what belongs to them: each per-row tensor cut to them
    and, in a vision-language batch whose picture tensors hold one entry per picture and every picture the same
    number of placeholders (LLaVA), those rows' pictures. None where the rows' share of a tensor cannot be told
    (patches flattened across pictures, a count of placeholders per picture that varies, a tensor of another
    length such as packed sequences' boundaries): the caller then uses the whole batch."""
    import torch

    ids = batch["input_ids"]
    total = int(ids.shape[0])
    if rows >= total:
        return dict(batch)
    present = [key for key in VISION_BATCH_KEYS if key in batch]
    pictures = 0
    if present:
        if set(present) - set(PER_PICTURE_KEYS) or "pixel_values" not in batch:
            return None
        given = int(batch["pixel_values"].shape[0])
        vision = (ids < 0) | torch.isin(
            ids, torch.tensor(sorted(placeholder_ids), dtype=ids.dtype, device=ids.device)
        )
        per_row = [int(n) for n in vision.sum(dim=1)]
        if not given or sum(per_row) % given:
            return None
        each = sum(per_row) // given
        if not each or any(n % each for n in per_row):
            return None
        pictures = sum(per_row[:rows]) // each
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if not hasattr(value, "shape") or value.dim() == 0:
            out[key] = value
        elif key in PER_PICTURE_KEYS:
            out[key] = value[:pictures]
        elif int(value.shape[0]) == total:
            out[key] = value[:rows]
        else:
            return None
    return out


@dataclass(frozen=True)
class Modality:
    kind: str = TEXT
    placeholder_ids: frozenset[int] = frozenset()  # image/video placeholders (one per vision feature)
    boundary_ids: frozenset[int] = frozenset()  # vision start/end around them
    said_by: tuple[str, ...] = ()  # what measured it vision-language

    @property
    def is_vision(self) -> bool:
        return self.kind == VISION_LANGUAGE

    @property
    def vision_ids(self) -> frozenset[int]:
        return self.placeholder_ids | self.boundary_ids

    def is_vision_id(self, token_id: int) -> bool:
        return token_id < 0 or token_id in self.vision_ids

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "said_by": list(self.said_by),
            "placeholder_ids": sorted(self.placeholder_ids),
            "boundary_ids": sorted(self.boundary_ids),
        }


TEXT_MODALITY = Modality()


def _ids_of_config(config, fields) -> set[int]:
    out: set[int] = set()
    for cfg in (config, getattr(config, "text_config", None)):
        for name in fields:
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, int) and value >= 0:
                out.add(value)
    return out


def _ids_of_processor(processor, attrs) -> set[int]:
    tokenizer = getattr(processor, "tokenizer", None)
    out: set[int] = set()
    if tokenizer is None:
        return out
    unknown = getattr(tokenizer, "unk_token_id", None)
    for name in attrs:
        token = getattr(processor, name, None)
        if isinstance(token, str) and token:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id >= 0 and token_id != unknown:
                out.add(token_id)
    return out


def has_vision_processor(processor) -> bool:
    return any(getattr(processor, name, None) is not None for name in ("image_processor", "video_processor"))


def measure_modality(processor=None, model=None, batch: Mapping[str, Any] | None = None) -> Modality:
    """The run's modality from what it has: the processor, the model's config, a collated batch."""
    said_by = []
    if processor is not None and has_vision_processor(processor):
        said_by.append(f"processor ({type(processor).__name__} with an image processor)")
    keys = [k for k in VISION_BATCH_KEYS if batch is not None and hasattr(batch.get(k), "shape")]
    if keys:
        said_by.append("batch (" + ", ".join(keys) + ")")
    config = getattr(model, "config", None)
    placeholders = _ids_of_config(config, PLACEHOLDER_FIELDS)
    if placeholders:
        said_by.append(f"model config (image token id {min(placeholders)})")
    if not said_by:
        return TEXT_MODALITY
    placeholders |= _ids_of_processor(processor, PLACEHOLDER_ATTRS)
    boundaries = _ids_of_config(config, BOUNDARY_FIELDS) | _ids_of_processor(processor, BOUNDARY_ATTRS)
    return Modality(
        kind=VISION_LANGUAGE,
        placeholder_ids=frozenset(placeholders),
        boundary_ids=frozenset(boundaries - placeholders),
        said_by=tuple(said_by),
    )


def count_vision(ids, modality: Modality) -> int:
    return sum(1 for t in ids if modality.is_vision_id(int(t)))


def row_image_digests(batch: Mapping[str, Any], modality: Modality) -> list[str | None] | None:
    """Per row of ``batch``, a digest of the pictures that row carries; None when the batch's layout does not
    say which pictures belong to which row (then no two picture rows are judged alike).

    Layouts read: per-row pixels (``pixel_values`` of shape (rows, images, ...): Idefics3, SmolVLM); one
    entry per picture in row order (LLaVA: (images, C, H, W)), each row taking as many pictures as its
    placeholders hold; flattened patches with ``image_grid_thw`` (Qwen2-VL), each picture t*h*w patches."""
    ids = batch.get("input_ids")
    pixels = batch.get("pixel_values")
    if ids is None or not hasattr(pixels, "shape"):
        return None
    rows = int(ids.shape[0])
    placeholders = [
        sum(1 for t in ids[r].tolist() if t in modality.placeholder_ids or t < 0) for r in range(rows)
    ]
    grid = batch.get("image_grid_thw")
    if hasattr(grid, "shape"):
        patches = [int(t * h * w) for t, h, w in grid.tolist()]
        pieces, start = [], 0
        for count in patches:
            pieces.append(pixels[start : start + count])
            start += count
    elif pixels.dim() >= 5 and int(pixels.shape[0]) == rows:
        return [_digest([pixels[r]]) if placeholders[r] else None for r in range(rows)]
    else:
        pieces = [pixels[i] for i in range(int(pixels.shape[0]))]
    total = sum(placeholders)
    if not pieces or total == 0:
        return None
    if hasattr(grid, "shape"):
        merge = max(
            1, round((sum(patches) / total) ** 0.5)
        )  # the merge size: patches per placeholder, squared
        per_image = [count // (merge * merge) for count in patches]
    elif total % len(pieces) == 0:
        per_image = [total // len(pieces)] * len(pieces)
    else:
        return None  # pictures of varying token counts without a grid (LLaVA-NeXT's tiles): not assigned
    out: list[str | None] = []
    k = 0
    for r in range(rows):
        need, mine = placeholders[r], []
        while need > 0 and k < len(pieces):
            mine.append(pieces[k])
            need -= per_image[k]
            k += 1
        if need != 0:
            return None
        out.append(_digest(mine) if mine else None)
    return out


def _digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class VisionTokens:
    """Per row of a context: its vision tokens, those that carry loss, and the first such position (-1)."""

    total: Any  # np.ndarray of int
    supervised: Any
    first_supervised: Any


def vision_tokens(encoded, modality: Modality) -> VisionTokens:
    """Count, per encoded row, the vision tokens and those whose label is not -100."""
    import numpy as np

    ids_column, labels_column = encoded["input_ids"], encoded["labels"]
    n = len(ids_column)
    total, supervised, first = np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64)
    vision = np.array(sorted(modality.vision_ids), dtype=np.int64)
    for r in range(n):
        ids = np.asarray(ids_column[r], dtype=np.int64)
        labels = np.asarray(labels_column[r], dtype=np.int64) if labels_column[r] is not None else None
        is_vision = np.isin(ids, vision) | (ids < 0)
        total[r] = int(is_vision.sum())
        if labels is not None and len(labels) == len(ids):
            hit = np.flatnonzero(is_vision & (labels != -100))
            supervised[r] = len(hit)
            first[r] = int(hit[0]) if len(hit) else -1
    return VisionTokens(total, supervised, first)


SPAN_ROWS = 2000  # rows of the trainer's dataset whose image spans are checked


@dataclass(frozen=True)
class ImageSpans:
    """Per checked row of the trainer's dataset: the vision tokens the processor writes for its pictures and
    those that survive the collator's ``max_length`` (it keeps the start)."""

    max_length: int
    rows_checked: int
    rows_total: int
    cut: list[dict[str, int]]  # {"row", "expected", "surviving", "length"} for every cut row
    refused: list[str]  # errors of the batches the collator refused while preflight drew them
    vision: list[int]  # per checked row, its vision tokens (placeholders) before the cut
    per_image: dict[str, int]  # picture size ("WxH") -> the placeholders one picture of it takes


def image_spans(trainer, modality: Modality, refused: list[str], limit: int = SPAN_ROWS) -> ImageSpans | None:
    """Each row of ``trainer.train_dataset`` (up to ``limit``) through a copy of the trainer's own collator
    without its ``max_length``: the placeholders it expands the row's pictures into (the processor's count:
    patches and merge size, image splitting) against those in the first ``max_length`` tokens. None when the
    collator has no ``max_length`` (a collator of the user's: its cut is not known) or no dataset.

    The placeholders a picture takes depend on its size, not on what it shows: after the first batch, collated
    with its real pictures, the rows go through the collator with blank stand-ins (:class:`StandIns`) where
    that first batch gives the same ids with them, so that no picture is decoded or resized twice for a count."""
    import copy

    collator = getattr(trainer, "data_collator", None)
    max_length = getattr(collator, "max_length", None)
    data = getattr(trainer, "train_dataset", None)
    if not max_length or data is None or not hasattr(data, "__len__"):
        return None
    whole = copy.copy(collator)
    whole.max_length = None
    processor = getattr(trainer, "processing_class", None)
    cut, vision, per_image = [], [], {}
    checked = min(len(data), limit)
    stand_ins: StandIns | None = None
    for start in range(0, checked, SPAN_BATCH):
        rows = range(start, min(start + SPAN_BATCH, checked))
        examples = None
        if stand_ins is not None:
            try:
                examples = stand_ins.examples(rows, processor, modality, per_image)
            except Exception:  # a header PIL cannot read, a missing picture: this batch's real pictures
                examples = None
        if examples is None:
            examples = [dict(data[row]) for row in rows]
            for example in examples:
                _tokens_by_size(processor, example, modality, per_image)
        uncut = _uncut_rows(whole, examples)
        if start == 0 and checked > len(rows):  # whether blank pictures give these rows the same ids
            # Only the rows checked are cast to undecoded pictures.
            within = data.select(range(checked)) if hasattr(data, "select") else data
            stand_ins = StandIns.calibrated(within, whole, processor, modality, rows, uncut)
        for row, ids in zip(rows, uncut, strict=True):
            expected = sum(1 for t in ids if t in modality.placeholder_ids or t < 0)
            surviving = sum(1 for t in ids[:max_length] if t in modality.placeholder_ids or t < 0)
            vision.append(expected)
            if surviving < expected:
                cut.append({"row": row, "expected": expected, "surviving": surviving, "length": len(ids)})
    return ImageSpans(int(max_length), checked, len(data), cut, list(refused), vision, per_image)


SPAN_BATCH = 32  # rows collated together (padding adds no placeholder: each row's count is its own)
STAND_IN_SIZE = (64, 64)  # the blank picture that stands in where the placeholders do not depend on the size
# Sizes and shapes a processor that counts by size (tiles, patches at native resolution, any-res grids) counts
# apart: where all of them take the same placeholders, every size does.
PROBE_SIZES = (STAND_IN_SIZE, (256, 64), (64, 256), (1024, 768), (333, 517))


class StandIns:
    """The dataset's rows with their pictures left undecoded (the ``Image`` features' ``decode=False``), and for
    each picture a blank one that the processor expands into the same placeholders: of the picture's own size
    (read from its file's header), or one small picture for all where every size takes the same number."""

    def __init__(self, light, columns: list[str], fixed: bool) -> None:
        self.light, self.columns, self.fixed = light, columns, fixed

    @classmethod
    def calibrated(cls, data, collator, processor, modality: Modality, rows, uncut) -> StandIns | None:
        """Stand-ins for ``data`` where the rows ``rows`` collated with them give ``uncut``, the ids their real
        pictures gave; None where they do not (or the pictures are not ``Image`` features)."""
        light, columns = _undecoded(data)
        if light is None or not hasattr(processor, "image_token"):
            return None
        try:
            fixed = (
                len({placeholders_per_picture(processor, _blank(size), modality) for size in PROBE_SIZES})
                == 1
            )
            for candidate in ([cls(light, columns, True)] if fixed else []) + [cls(light, columns, False)]:
                if _uncut_rows(collator, candidate.examples(rows, processor, modality, {})) == uncut:
                    return candidate
        except Exception:  # a processor that refuses blank pictures: the real ones are collated
            return None
        return None

    def examples(self, rows, processor, modality: Modality, per_image: dict[str, int]) -> list[dict]:
        """The rows ``rows`` with blank stand-ins for their pictures; each new picture size counted in
        ``per_image`` (its blank processed alone)."""
        batch = self.light[rows.start : rows.stop]
        out = [{name: values[i] for name, values in batch.items()} for i in range(len(rows))]
        for example in out:
            for name in self.columns:
                value = example[name]
                if value is None:  # a row without pictures
                    continue
                many = isinstance(value, list)
                sizes = [_size(v) for v in (value if many else [value])]
                for size in sizes:
                    _count_size(processor, size, _blank(size), modality, per_image)
                blanks = [_blank(STAND_IN_SIZE if self.fixed else size) for size in sizes]
                example[name] = blanks if many else blanks[0]
        return out


def _undecoded(data):
    """``data`` with its picture columns read without decoding (a dict of bytes and path per picture), and
    those columns; (None, []) where a picture column is not an ``Image`` feature (or a list of them)."""
    features = getattr(data, "features", None) or {}
    columns = [name for name in PICTURE_COLUMNS if name in features]
    if not columns or not hasattr(data, "cast_column"):
        return None, []
    for name in columns:
        feature = _without_decoding(features[name])
        if feature is None:
            return None, []
        data = data.cast_column(name, feature)
    return data, columns


def _without_decoding(feature):
    import copy

    from datasets import Image

    if isinstance(feature, Image):
        return Image(decode=False)
    inner = getattr(feature, "feature", None)
    changed = _without_decoding(inner) if inner is not None else None
    if changed is None:
        return None
    feature = copy.copy(feature)
    feature.feature = changed
    return feature


def _size(picture) -> tuple[int, int]:
    """An undecoded picture's (width, height), from its file's header (PIL reads no pixels for it)."""
    import io

    from PIL import Image

    source = io.BytesIO(picture["bytes"]) if picture.get("bytes") else picture["path"]
    with Image.open(source) as opened:
        return opened.size


_BLANKS: dict[tuple[int, int], Any] = {}


def _blank(size: tuple[int, int]):
    from PIL import Image

    if size not in _BLANKS:
        if len(_BLANKS) > 64:
            _BLANKS.clear()
        _BLANKS[size] = Image.new("RGB", size)
    return _BLANKS[size]


def _uncut_rows(collator, examples: list[dict]) -> list[list[int]]:
    """Each example's ids as ``collator`` (without its cut) writes them, padding dropped: the examples
    collated together, or one by one where the batch is refused (rows with and without pictures)."""
    try:
        batch = collator(examples)
    except (ValueError, RuntimeError, TypeError):
        return [collator([example])["input_ids"][0].tolist() for example in examples]
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    if mask is None:
        return [row.tolist() for row in ids]
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]


RESOLUTIONS = 16  # picture sizes whose token count is measured


def _tokens_by_size(processor, example: Mapping[str, Any], modality: Modality, out: dict[str, int]) -> None:
    """For each picture size ("WxH") of the row not yet in ``out``: the placeholders the processor expands one
    picture of it into (PIL images in TRL's ``image`` / ``images`` columns; others not read)."""
    token = getattr(processor, "image_token", None)
    pictures = example.get("images", example.get("image"))
    pictures = pictures if isinstance(pictures, list) else [pictures]
    for picture in pictures:
        size = getattr(picture, "size", None)
        if not isinstance(token, str) or not isinstance(size, tuple) or len(out) >= RESOLUTIONS:
            return
        _count_size(processor, size, picture, modality, out)


def _count_size(processor, size: tuple[int, int], picture, modality: Modality, out: dict[str, int]) -> None:
    """Into ``out`` ("WxH"): the placeholders one ``picture`` of ``size`` takes, where that size is new and
    ``out`` holds fewer than :data:`RESOLUTIONS` sizes."""
    key = f"{size[0]}x{size[1]}"
    if key not in out and len(out) < RESOLUTIONS:
        out[key] = placeholders_per_picture(processor, picture, modality)


def placeholders_per_picture(processor, picture, modality: Modality) -> int:
    """The placeholders ``processor`` expands one ``picture`` (a PIL image) into: its image token, processed
    with the picture as a one-picture row."""
    ids = processor(text=[processor.image_token], images=[[picture]], return_tensors="pt")["input_ids"][0]
    return sum(1 for t in ids.tolist() if t in modality.placeholder_ids or t < 0)
