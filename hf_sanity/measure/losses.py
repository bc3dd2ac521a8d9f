"""The loss of a model on supervised tokens, measured without training (one no-grad pass, state kept).

Only the positions that carry loss are scored: the hidden states there are taken at the model's output
embeddings (a forward pre-hook on the LM head) and projected on the vocabulary in chunks, in the model's dtype,
with the log-softmax and its sums in float32. ``[batch, sequence, vocabulary]`` logits never exist: with a
152k vocabulary they are gigabytes per batch, while a chunk is a few megabytes. The LM head itself then runs on
one position per row, so the rest of the forward (a final soft-capping, say) stays as the model defines it and
is applied to the chunks the same way (see :func:`_finish_logits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_sanity import progress
from hf_sanity.constants import IGNORE_INDEX

# Logits per chunk, whatever the vocabulary: 4M (16 MB in float32) stays in cache between the projection and
# the reductions that read it; 16M chunks were 1.5-3x slower on a 2-core CPU with a 152k vocabulary.
CHUNK_ELEMENTS = 1 << 22
SCORED_TOKENS = 512  # supervised positions scored per measurement, spread over every batch


def token_loss(
    model,
    batches: Sequence[dict[str, Any]],
    *,
    max_tokens: int | None = SCORED_TOKENS,
    entropy: bool = False,
) -> dict[str, float]:
    """Mean next-token cross-entropy over supervised tokens, the entropy of the label distribution, and with
    ``entropy`` the model's predictive entropy there (two more passes over each chunk of logits: asked for
    only where a rule reads it). A mean needs no more than ``max_tokens`` positions (a standard error of a few
    percent of the loss): beyond, the positions scored are spread evenly over each batch, the same positions
    for batches with the same labels. The transformer still runs on every example; only the vocabulary
    projection, the costly part with a large vocabulary, is bounded."""
    import torch

    from hf_sanity.measure.tensors import forward_kwargs, model_device, to_device
    from hf_sanity.untouched import untouched

    device = model_device(model)
    quota = -(-max_tokens // max(len(batches), 1)) if max_tokens else None
    scorer = _SupervisedScorer(model, quota, entropy=entropy)
    total, count, entropy_sum = 0.0, 0, 0.0
    label_counts: dict[int, int] = {}
    examples = sum(len(b["labels"]) for b in batches)
    with untouched(model), scorer, progress.phase(f"model: loss on {examples} examples", total=len(batches)):
        for batch in progress.each(batches):
            batch = to_device(batch, device)
            labels = batch["labels"]
            scorer.aim(labels)
            output = model(**forward_kwargs(model, batch, use_cache=False))
            loss_sum, entropy_part, n = scorer.result(output)
            total += loss_sum
            entropy_sum += entropy_part
            count += n
            targets = labels[:, 1:][labels[:, 1:] != IGNORE_INDEX]
            for token, c in zip(*torch.unique(targets, return_counts=True)):
                label_counts[int(token)] = label_counts.get(int(token), 0) + int(c)
    probs = np.array(list(label_counts.values()), dtype=float)
    probs /= max(probs.sum(), 1)
    measured = {
        "loss": total / max(count, 1),
        "tokens": count,
        "examples": examples,
        "label_entropy": float(-(probs * np.log(probs)).sum()) if len(probs) else 0.0,
    }
    if entropy:
        measured["entropy"] = entropy_sum / max(count, 1)  # the model's own predictive entropy there
    return measured


class _SupervisedScorer:
    """Scores the supervised positions of each forward at the LM head's input, in chunks (see the module
    docstring); falls back to the full logits when the model exposes no output embeddings."""

    def __init__(self, model, quota: int | None = None, *, entropy: bool = False) -> None:
        self.model = model
        self.quota = quota  # positions scored per forward at most
        self.entropy = entropy
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = head if head is not None and hasattr(head, "register_forward_pre_hook") else None
        self._handle = None
        self._labels = None
        self._scored: tuple[float, float, int] | None = None
        self._inside = False

    def __enter__(self):
        if self.head is not None:
            self._handle = self.head.register_forward_pre_hook(self._pre_head)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def aim(self, labels) -> None:
        """The labels of the next forward (positions with a label after the shift are scored)."""
        self._labels, self._scored = labels, None

    def result(self, output) -> tuple[float, float, int]:
        """(summed cross-entropy, summed predictive entropy, tokens) of the last forward."""
        if self._scored is None:  # no LM head hook: score the full logits the model returned
            from hf_sanity.measure.tensors import logits_of

            logits = logits_of(output)
            mask = self._labels[:, 1:] != IGNORE_INDEX
            states, targets = self._spread(logits[:, :-1][mask], self._labels[:, 1:][mask])
            self._scored = _score(states, targets, entropy=self.entropy)
        return self._scored

    def _pre_head(self, module, args):
        if self._inside or self._labels is None or not args:
            return None
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[:2] != self._labels.shape[:2]:
            return None  # not the final projection of this batch: let it be
        mask = self._labels[:, 1:] != IGNORE_INDEX
        states, targets = self._spread(hidden[:, :-1][mask], self._labels[:, 1:][mask])
        vocab = int(getattr(module, "out_features", 0) or module.weight.shape[0])
        step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
        loss_sum = entropy_sum = 0.0
        self._inside = True
        try:
            for lo in range(0, len(states), step):
                logits = _finish_logits(self.model, module(states[lo : lo + step]))
                chunk_loss, chunk_entropy, _ = _score(logits, targets[lo : lo + step], entropy=self.entropy)
                loss_sum += chunk_loss
                entropy_sum += chunk_entropy
        finally:
            self._inside = False
        self._scored = (loss_sum, entropy_sum, int(targets.numel()))
        return (hidden[:, -1:],)  # the head's own call: one position per row, whose logits nobody reads

    def _spread(self, rows, targets):
        """At most ``quota`` of the positions, evenly spread (deterministic)."""
        if self.quota is None or len(targets) <= self.quota:
            return rows, targets
        import torch

        keep = torch.linspace(0, len(targets) - 1, self.quota, device=targets.device).round().long()
        return rows[keep], targets[keep]


def _score(logits, targets, *, entropy: bool = False) -> tuple[float, float, int]:
    """(summed cross-entropy, summed predictive entropy or 0, positions) of a chunk, in float32:
    cross-entropy = logsumexp - the target's logit; entropy = logsumexp - E_p[logit]."""
    import torch

    if targets.numel() == 0:
        return 0.0, 0.0, 0
    logits = logits.float()
    normalizer = torch.logsumexp(logits, dim=-1)
    loss = (normalizer - logits.gather(1, targets[:, None])[:, 0]).sum()
    spread = 0.0
    if entropy:
        probs = torch.exp(logits - normalizer[:, None])
        spread = float((normalizer - (probs * logits).sum(-1)).sum())
    return float(loss), spread, int(targets.numel())


def _finish_logits(model, logits):
    """What a causal LM does to the head's output before returning it: a final soft-capping (Gemma 2/3) or a
    logit scale (Cohere), read from its config."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale not in (0, 1):
        logits = logits * scale
    cap = getattr(text, "final_logit_softcapping", None)
    if isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap):
        import torch

        logits = torch.tanh(logits / cap) * cap
    return logits
