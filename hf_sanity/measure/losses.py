"""The loss of a model on supervised tokens, measured without training (one no-grad pass, state kept).

Only the positions that carry loss are scored: the hidden states there are taken at the model's output
embeddings (a forward pre-hook on the LM head) and projected on the vocabulary in chunks, in the model's dtype,
with the log-softmax and its sums in float32. ``[batch, sequence, vocabulary]`` logits never exist: with a
152k vocabulary they are gigabytes per batch, while a chunk is a few megabytes. The LM head itself then runs on
one position per row, so the rest of the forward (a final soft-capping, say) stays as the model defines it and
is applied to the chunks the same way (see :func:`finish_logits`).
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
    detail: bool = False,
) -> dict[str, Any]:
    """Mean next-token cross-entropy over supervised tokens and the entropy of the label distribution; with
    ``detail``, what `init-loss-off-chance` reads besides (:meth:`Scores.measured`: the model's predictive
    entropy, how often its top guess is the label, the loss under other alignments of the labels), asked for
    only where a rule reads it. A mean needs no more than ``max_tokens`` positions (a standard error of a few
    percent of the loss): beyond, the positions scored are spread evenly over each batch, the same positions
    for batches with the same labels. The transformer still runs on every example; only the vocabulary
    projection, the costly part with a large vocabulary, is bounded."""
    import torch

    from hf_sanity.measure.tensors import call_model, model_device, to_device
    from hf_sanity.untouched import untouched

    device = model_device(model)
    quota = -(-max_tokens // max(len(batches), 1)) if max_tokens else None
    scores = Scores(detail=detail)
    scorer = _SupervisedScorer(model, scores, quota)
    label_counts: dict[int, int] = {}
    examples = sum(len(b["labels"]) for b in batches)
    with untouched(model), scorer, progress.phase(f"model: loss on {examples} examples", total=len(batches)):
        for batch in progress.each(batches):
            batch = to_device(batch, device)
            labels = batch["labels"]
            scorer.aim(labels, batch.get("input_ids"))
            scorer.result(call_model(model, batch, use_cache=False))
            targets = labels[:, 1:][labels[:, 1:] != IGNORE_INDEX]
            for token, c in zip(*torch.unique(targets, return_counts=True)):
                label_counts[int(token)] = label_counts.get(int(token), 0) + int(c)
    probs = np.array(list(label_counts.values()), dtype=float)
    probs /= max(probs.sum(), 1)
    return {
        **scores.measured(),
        "examples": examples,
        "label_entropy": float(-(probs * np.log(probs)).sum()) if len(probs) else 0.0,
    }


# Other alignments of the labels with the model's predictions, scored beside the labels given where they
# differ: the label one position earlier (labels shifted by hand, which the model shifts again), one position
# later (labels that lag the input), and the input's own next token (labels that are not the tokens the model
# reads).
ALIGNMENTS = ("label_before", "label_after", "input_next")


def alignment_targets(labels, input_ids=None) -> dict[str, Any]:
    """For each prediction position t (its logits are scored against ``labels[:, t + 1]``), the target each
    other alignment gives it: ``[batch, sequence - 1]`` tensors, IGNORE_INDEX where there is none."""
    import torch

    none = torch.full_like(labels[:, :1], IGNORE_INDEX)
    out = {"label_before": labels[:, :-1], "label_after": torch.cat([labels[:, 2:], none], dim=1)}
    token_ids = input_ids is not None and not input_ids.is_floating_point()
    if token_ids and tuple(input_ids.shape) == tuple(labels.shape):
        out["input_next"] = input_ids[:, 1:].to(labels.device)
    return out


class Scores:
    """Sums over the scored positions, chunk by chunk, in float32: the cross-entropy and, with ``detail``, the
    model's predictive entropy, its top-1 hits and, for each of :data:`ALIGNMENTS`, the loss of its target and
    of the label given on the positions where the two differ."""

    def __init__(self, *, detail: bool = False) -> None:
        self.detail = detail
        self.loss = self.entropy = 0.0
        self.tokens = self.hits = 0
        self.aligned = {name: [0.0, 0.0, 0] for name in ALIGNMENTS}

    def add(self, logits, targets, others: dict[str, Any] | None = None) -> None:
        """One chunk: ``logits`` ``[n, vocabulary]`` at the scored positions, ``targets`` ``[n]``, ``others``
        the other alignments' targets there (``[n]`` each)."""
        import torch

        if targets.numel() == 0:
            return
        # One log-softmax pass gives every loss asked for (its sums in float32): half the time of a logsumexp
        # and the subtractions it needs, a third with the entropy.
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        losses = -log_probs.gather(1, targets[:, None])[:, 0]
        self.loss += float(losses.sum())
        self.tokens += int(targets.numel())
        if not self.detail:
            return
        self.entropy -= float(torch.linalg.vecdot(log_probs.exp(), log_probs).sum())
        self.hits += int((log_probs.argmax(-1) == targets).sum())
        vocab = log_probs.shape[-1]
        for name, other in (others or {}).items():
            rows = ((other != targets) & (other >= 0) & (other < vocab)).nonzero()[:, 0]
            if len(rows):
                sums = self.aligned[name]
                sums[0] -= float(log_probs[rows, other[rows]].sum())  # the elements only, not the rows
                sums[1] += float(losses[rows].sum())
                sums[2] += len(rows)

    def measured(self) -> dict[str, Any]:
        """``loss`` and ``tokens``; with ``detail`` also ``entropy``, ``top1`` (the share of positions where
        the model's top guess is the label) and ``alignments`` (``{name: {"loss", "given", "tokens"}}``: the
        other target's loss and the given label's, on the ``tokens`` positions where they differ)."""
        n = max(self.tokens, 1)
        out: dict[str, Any] = {"loss": self.loss / n, "tokens": self.tokens}
        if self.detail:
            out["entropy"] = self.entropy / n  # the model's own predictive entropy there
            out["top1"] = self.hits / n
            out["alignments"] = {
                name: {"loss": other / count, "given": given / count, "tokens": count}
                for name, (other, given, count) in self.aligned.items()
                if count
            }
        return out


def score_logits(logits, labels, input_ids=None, *, detail: bool = False) -> dict[str, Any]:
    """:meth:`Scores.measured` over full ``[batch, sequence, vocabulary]`` logits (a probe's few rows)."""
    scores = Scores(detail=detail)
    mask = labels[:, 1:] != IGNORE_INDEX
    others = alignment_targets(labels, input_ids) if detail else {}
    scores.add(logits[:, :-1][mask], labels[:, 1:][mask], {k: v[mask] for k, v in others.items()})
    return scores.measured()


class _SupervisedScorer:
    """Scores the supervised positions of each forward at the LM head's input, in chunks, into ``scores`` (see
    the module docstring); falls back to the full logits when the model exposes no output embeddings."""

    def __init__(self, model, scores: Scores, quota: int | None = None) -> None:
        self.model, self.scores = model, scores
        self.quota = quota  # positions scored per forward at most
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = head if head is not None and hasattr(head, "register_forward_pre_hook") else None
        self._handle = None
        self._labels = self._input_ids = None
        self._scored = False
        self._inside = False

    def __enter__(self):
        if self.head is not None:
            self._handle = self.head.register_forward_pre_hook(self._pre_head)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def aim(self, labels, input_ids=None) -> None:
        """The labels (and input ids) of the next forward: positions with a label after the shift are scored."""
        self._labels, self._input_ids, self._scored = labels, input_ids, False

    def result(self, output) -> None:
        """Score the last forward from the full logits it returned, unless the LM head's hook scored it."""
        if not self._scored:
            from hf_sanity.measure.tensors import logits_of

            logits = logits_of(output)
            self._score(logits[:, :-1], int(logits.shape[-1]), lambda rows: rows)
            self._scored = True

    def _pre_head(self, module, args):
        if self._inside or self._labels is None or not args:
            return None
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[:2] != self._labels.shape[:2]:
            return None  # not the final projection of this batch: let it be
        vocab = int(getattr(module, "out_features", 0) or module.weight.shape[0])
        self._inside = True
        try:
            self._score(hidden[:, :-1], vocab, lambda rows: finish_logits(self.model, module(rows)))
        finally:
            self._inside = False
        self._scored = True
        return (hidden[:, -1:],)  # the head's own call: one position per row, whose logits nobody reads

    def _score(self, states, vocab: int, to_logits) -> None:
        """The supervised positions of ``states`` (``[batch, sequence - 1, ...]``: hidden states or logits),
        at most ``quota`` of them evenly spread (deterministic), through ``to_logits`` in chunks."""
        labels = self._labels
        mask = labels[:, 1:] != IGNORE_INDEX
        rows, targets = states[mask], labels[:, 1:][mask]
        others = {}
        if self.scores.detail:
            others = {k: v[mask] for k, v in alignment_targets(labels, self._input_ids).items()}
        if self.quota is not None and len(targets) > self.quota:
            import torch

            keep = torch.linspace(0, len(targets) - 1, self.quota, device=targets.device).round().long()
            rows, targets = rows[keep], targets[keep]
            others = {k: v[keep] for k, v in others.items()}
        step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
        for lo in range(0, len(targets), step):
            part = slice(lo, lo + step)
            self.scores.add(to_logits(rows[part]), targets[part], {k: v[part] for k, v in others.items()})


def finish_logits(model, logits):
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
