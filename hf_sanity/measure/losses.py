"""The loss of a model on supervised tokens, measured without training (one no-grad pass, state kept)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_sanity.constants import IGNORE_INDEX


def token_loss(model, batches: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean next-token cross-entropy over supervised tokens, the model's predictive entropy there, and the
    entropy of the label distribution."""
    import torch
    import torch.nn.functional as F

    from hf_sanity.measure.tensors import model_device, to_device
    from hf_sanity.untouched import untouched

    device = model_device(model)
    total, count, entropy_sum = 0.0, 0, 0.0
    label_counts: dict[int, int] = {}
    with untouched(model):
        for batch in batches:
            batch = to_device(batch, device)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            shift_logits = logits[:, :-1].float()
            shift_labels = batch["labels"][:, 1:]
            loss = F.cross_entropy(
                shift_logits.reshape(-1, shift_logits.size(-1)),
                shift_labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            supervised = shift_labels != IGNORE_INDEX
            n = int(supervised.sum())
            log_probs = torch.log_softmax(shift_logits[supervised], dim=-1)
            entropy_sum += float(-(log_probs.exp() * log_probs).sum())
            total += float(loss)
            count += n
            for token, c in zip(*torch.unique(shift_labels[supervised], return_counts=True)):
                label_counts[int(token)] = label_counts.get(int(token), 0) + int(c)
    probs = np.array(list(label_counts.values()), dtype=float)
    probs /= max(probs.sum(), 1)
    entropy = float(-(probs * np.log(probs)).sum()) if len(probs) else 0.0
    return {
        "loss": total / max(count, 1),
        "entropy": entropy_sum / max(count, 1),  # the model's own predictive entropy at those positions
        "tokens": count,
        "label_entropy": entropy,
    }
