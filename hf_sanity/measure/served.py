"""What is served against what was trained: the served model (merged and reloaded, or the base with the
adapter loaded by a server), the trained model (base + adapter) and the base, compared on the same batch
and weight by weight where a merge loses things (embedding rows of added tokens, a tied or saved head)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EMBEDDING_CHUNK = 8192  # embedding rows compared per step: bounded memory on 152k-row vocabularies


@dataclass(frozen=True)
class ServedComparison:
    logit_scale: float
    served_vs_trained: float  # the largest logit difference on the probe batch
    served_vs_base: float | None = None
    trained_vs_base: float | None = None
    half: bool = False  # a bf16/fp16 model on either side: rounding is larger
    # Input-embedding rows of the served model that differ from the trained model's (token ids), and how many
    # rows each side has.
    embedding_rows_differ: list[int] = field(default_factory=list)
    embedding_rows: tuple[int, int] = (0, 0)
    head_difference: float | None = None  # the largest output-embedding (LM head) weight difference
    head_scale: float = 1.0
    tied: tuple[bool, bool] = (False, False)  # (trained, served) input and output embeddings tied

    @property
    def tolerance(self) -> float:
        """Relative weight differences below this are rounding: float32 is exact to ~1e-6, bf16 to ~4e-3."""
        return 3e-2 if self.half else 1e-3

    @property
    def logit_limit(self) -> float:
        """The logit difference that is still rounding. A float32 merge computes what was trained to ~1e-6 of
        the logits' scale. In bf16/fp16 every layer rounds, so the merged model may drift by a few percent
        of what the adapter changes (merging rounds the update into the weights): a tenth of it is allowed."""
        limit = self.tolerance * self.logit_scale
        if self.half and self.trained_vs_base is not None:
            limit = max(limit, 0.1 * self.trained_vs_base)
        return limit


def logits(model, batch):
    from hf_sanity.measure.tensors import forward_kwargs, model_device, to_device
    from hf_sanity.untouched import untouched

    with untouched(model):
        inputs = forward_kwargs(model, to_device(batch, model_device(model)), use_cache=False)
        return model(**inputs).logits.float().cpu()


def compare_served(
    trained, served, batch: dict[str, Any], *, base_logits=None, base=None
) -> ServedComparison:
    """The served model against the trained one (and the base model's logits on ``batch``, when given, or the
    ``base`` model's, run here), and their input embeddings and LM heads weight by weight."""
    import torch

    if base is not None:
        base_logits = logits(base, batch)
    trained_logits, served_logits = logits(trained, batch), logits(served, batch)
    scale = float(trained_logits.abs().max()) or 1.0
    gaps: dict[str, Any] = {"served_vs_trained": _gap(served_logits, trained_logits)}
    if base_logits is not None:
        gaps["served_vs_base"] = _gap(served_logits, base_logits)
        gaps["trained_vs_base"] = _gap(trained_logits, base_logits)
    half = any(_dtype(m) in (torch.float16, torch.bfloat16) for m in (trained, served))
    rows, sizes = _embedding_rows_differ(trained, served, tolerance=3e-2 if half else 1e-3)
    head, head_scale = _head_difference(trained, served)
    return ServedComparison(
        logit_scale=scale, half=half, embedding_rows_differ=rows, embedding_rows=sizes,
        head_difference=head, head_scale=head_scale, tied=(_tied(trained), _tied(served)), **gaps,
    )  # fmt: skip


def _gap(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


def _dtype(model):
    for p in model.parameters():
        return p.dtype
    return None


def _embed(model):
    get = getattr(model, "get_input_embeddings", None)
    return get() if get is not None else None


def _embedding_rows_differ(trained, served, *, tolerance: float) -> tuple[list[int], tuple[int, int]]:
    """Rows of the served input embedding that differ from the trained one's, by running both embedding
    modules on every token id (so peft's wrappers for trained embeddings or tokens answer as in training)."""
    import torch

    from hf_sanity.measure.tensors import model_device

    a, b = _embed(trained), _embed(served)
    if a is None or b is None:
        return [], (0, 0)
    n_a, n_b = (int(getattr(m, "num_embeddings", 0) or _rows_of(m)) for m in (a, b))
    differ: list[int] = []
    with torch.no_grad():
        for lo in range(0, min(n_a, n_b), EMBEDDING_CHUNK):
            hi = min(lo + EMBEDDING_CHUNK, n_a, n_b)
            ids_a = torch.arange(lo, hi, device=model_device(trained))
            ids_b = torch.arange(lo, hi, device=model_device(served))
            ea, eb = a(ids_a).float().cpu(), b(ids_b).float().cpu()
            scale = ea.abs().amax(dim=-1).clamp_min(1e-6)
            bad = ((ea - eb).abs().amax(dim=-1) > tolerance * scale).nonzero().flatten()
            differ.extend(int(i) + lo for i in bad)
    return differ, (n_a, n_b)


def _rows_of(module) -> int:
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None else 0


def _head_weight(model):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None
    weight = getattr(head, "weight", None)
    if weight is None and hasattr(head, "modules_to_save"):  # peft's wrapper of a trained head
        active = getattr(head, "active_adapter", None)
        active = active[0] if isinstance(active, list | tuple) else active
        weight = getattr(head.modules_to_save.get(active, head.original_module), "weight", None)
    return weight


def _head_difference(trained, served) -> tuple[float | None, float]:
    a, b = _head_weight(trained), _head_weight(served)
    if a is None or b is None:
        return None, 1.0
    if a.shape != b.shape:
        return float("inf"), 1.0
    import torch

    with torch.no_grad():
        diff = scale = 0.0
        for lo in range(0, a.shape[0], EMBEDDING_CHUNK):  # in chunks: no float32 copy of a 152k-row head
            x, y = a[lo : lo + EMBEDDING_CHUNK].float().cpu(), b[lo : lo + EMBEDDING_CHUNK].float().cpu()
            diff, scale = max(diff, float((x - y).abs().max())), max(scale, float(x.abs().max()))
        return diff, scale or 1.0


def _tied(model) -> bool:
    a, b = _embed(model), _head_weight(model)
    weight = getattr(a, "weight", None)
    return weight is not None and b is not None and weight.data_ptr() == b.data_ptr()
