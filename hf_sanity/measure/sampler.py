"""The sampler of an online RL run against the policy it is meant to be: the log-probabilities the rollouts came
with (a ``rollout_func``'s ``logprobs``, vLLM's) against the policy's own on the same tokens, and what explains a
gap (for `sampler-mismatch`, `hf_sanity.rules.training.sampler`).

A rescoring probe (:func:`sampler_facts`) takes the first few completions of a TRL rollout batch (prompt ids
left-padded, completion ids right-padded, ``sampling_per_token_logps`` beside them) and runs one forward of the
policy, without grad in eval mode, everything restored. From the completion positions' logits it computes:

- the gap: the mean and max of |sampled - policy| per token (policy: log-softmax(logits / T), T the trainer's
  temperature, as TRL scores its completions), the signed mean, the share of tokens whose sampled log-prob is
  above the policy's, and per sequence the length-normalised ratio exp(mean(policy - sampled)) (and the first
  token's ratio, where a temperature shows most);
- when the gap is over :data:`EXPLAIN_ABOVE` (a gap within float roundoff needs no explanation), what would
  explain it: the temperature whose log-softmax fits the sampled log-probs best (``apparent_temperature``), the
  nucleus (top-p, renormalised log-probs) that fits them best at the trainer's temperature (``apparent_top_p``),
  and the same gap against an earlier policy (``initial_gap``: the reference model, the adapter disabled, or a
  copy of the weights the run started from, whichever the caller hands in);
- token integrity: rows whose sampled log-probs and completion ids differ in count (the ids were changed after
  sampling: a decode and re-encode merges or splits tokens), rows whose log-probs match the policy's up to a token
  and are far off from there on (``rows_matched_then_broken``: ids changed after sampling with the log-probs
  cropped or padded to the new count; a weight, temperature or top-p difference moves the first tokens too), and the share of completions whose ids change on a decode/encode round trip
  (``round_trip_changed``).

Cost: one forward of :data:`ROWS` sequences, a second with an earlier policy when the gap needs explaining, and a
few dozen log-softmaxes over the probe's completion tokens (at most ROWS x the completion length rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

ROWS = 4  # completions rescored per probe
EXPLAIN_ABOVE = 0.01  # nat/token: a smaller gap is roundoff (fp32 ~0.002, bf16 ~0.03): nothing to explain
# Temperatures tried for the apparent one (log-spaced 0.25 .. 4, the trainer's own and 1.0 added).
TEMPERATURES = tuple(round(0.25 * 2 ** (i / 6), 4) for i in range(25))
# A row is "matched then broken" when its first tokens' sampled log-probs are each within MATCHED of the policy's
# (bf16 roundoff is ~0.03 a token) and the tokens from the first one past MATCHED on are off by BROKEN_RATIO times
# the matched ones' mean gap and by 2 x MATCHED at least: from there they are other tokens' log-probs.
MATCHED, BROKEN_RATIO = 0.05, 4.0
TOP_PS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99)


def rollout_rows(inputs: Mapping[str, Any], rows: int = ROWS) -> dict[str, Any] | None:
    """The first ``rows`` completions of a TRL rollout batch with the log-probs their sampler gave, or None when the
    batch has none (TRL's own generation without vLLM)."""
    sampled = inputs.get("sampling_per_token_logps")
    if sampled is None or "completion_ids" not in inputs or "prompt_ids" not in inputs:
        return None
    import torch

    completion_ids = inputs["completion_ids"][:rows]
    mask = inputs.get("completion_mask", torch.ones_like(completion_ids))[:rows]
    if (
        inputs.get("tool_mask") is not None
    ):  # tool results are not the sampler's: TRL fills their log-probs with 0
        mask = mask * inputs["tool_mask"][:rows]
    prompt_ids = inputs["prompt_ids"][:rows]
    return {
        "prompt_ids": prompt_ids.detach(),
        "prompt_mask": inputs.get("prompt_mask", torch.ones_like(prompt_ids))[:rows].detach(),
        "completion_ids": completion_ids.detach(),
        "completion_mask": inputs.get("completion_mask", torch.ones_like(completion_ids))[:rows].detach(),
        "mask": mask.detach().bool(),
        "sampled": sampled[:rows].detach().float(),
    }


def completion_logits(model, rows: Mapping[str, Any]):
    """The logits that predict each completion token (rows x completion length x vocab, float32), from one
    forward of prompt + completion as TRL feeds them, without grad in eval mode; None if the output has none."""
    import torch

    from hf_sanity.measure.tensors import forward_kwargs, logits_of
    from hf_sanity.untouched import untouched

    prompt, completion = rows["prompt_ids"], rows["completion_ids"]
    inputs = {
        "input_ids": torch.cat([prompt, completion], dim=1),
        "attention_mask": torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1),
    }
    with untouched(model):
        logits = logits_of(model(**forward_kwargs(model, inputs, use_cache=False)))
    if logits is None or logits.dim() != 3 or logits.shape[1] != inputs["input_ids"].shape[1]:
        return None
    width = completion.shape[1]
    return logits[:, prompt.shape[1] - 1 : prompt.shape[1] - 1 + width].float()


def token_logps(logits, ids, temperature: float):
    """log-softmax(logits / T) at ``ids`` (rows x positions)."""
    import torch

    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def nucleus_logps(logits, ids, temperature: float, top_p: float):
    """The log-probs of ``ids`` under top-p sampling at ``temperature`` as transformers' TopPLogitsWarper keeps the
    nucleus (renormalised over it); -inf for a token outside it."""
    import torch

    logp = torch.log_softmax(logits / temperature, dim=-1)
    ascending, order = logp.sort(dim=-1)
    cumulative = ascending.exp().cumsum(dim=-1)
    removed_sorted = cumulative <= 1 - top_p
    removed_sorted[..., -1] = False  # the most likely token always stays
    removed = removed_sorted.scatter(-1, order, removed_sorted)
    kept_mass = logp.exp().masked_fill(removed, 0.0).sum(-1)
    chosen = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    outside = removed.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return (chosen - kept_mass.clamp_min(1e-30).log()).masked_fill(outside, -math.inf)


def _mean_gap(sampled, scored, mask) -> float:
    import torch

    diff = (sampled - scored)[mask]
    if not diff.numel():
        return math.nan
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, 1e4))
    return float(diff.abs().mean())


def compare(sampled, policy, mask) -> dict[str, Any]:
    """The gap between the sampler's and the policy's log-probs on the tokens ``mask`` keeps."""
    import torch

    delta = (sampled - policy).masked_fill(~mask, 0.0)
    tokens = mask.sum(-1)
    kept = tokens > 0
    per_row = (-delta).sum(-1)[kept] / tokens[kept]  # mean(policy - sampled) per sequence
    ratios = per_row.exp()
    first = [int(torch.nonzero(row)[0]) for row in mask[kept]]
    first_ratio = torch.stack([(-delta[kept][i, j]).exp() for i, j in enumerate(first)]) if first else None
    flat = delta[mask]
    return {
        "rows_matched_then_broken": matched_then_broken(delta, mask),
        "tokens": int(mask.sum()),
        "sequences": int(kept.sum()),
        "gap_mean": float(flat.abs().mean()),
        "gap_max": float(flat.abs().max()),
        "delta_mean": float(flat.mean()),  # sampled - policy: > 0 when the sampler is surer than the policy
        "above_share": float((flat > 1e-4).float().mean()),
        "sequence_ratio_mean": float(ratios.mean()),
        "sequence_ratio_min": float(ratios.min()),
        "sequence_ratio_max": float(ratios.max()),
        "first_token_ratio": float(first_ratio.mean()) if first_ratio is not None else None,
    }


def matched_then_broken(delta, mask) -> int:
    """Rows whose first kept tokens match the policy's log-probs (each within :data:`MATCHED`) and whose tokens
    from the first unmatched one on are far off (see :data:`BROKEN_RATIO`): from there the log-probs belong to
    other ids (see the module docstring)."""
    count = 0
    for row, kept in zip(delta.abs().tolist(), mask.tolist(), strict=True):
        gaps = [g for g, k in zip(row, kept, strict=True) if k]
        split = next((i for i, g in enumerate(gaps) if g > MATCHED), None)
        if not split:  # no matched prefix, or nothing unmatched
            continue
        matched, rest = sum(gaps[:split]) / split, sum(gaps[split:]) / (len(gaps) - split)
        if rest >= max(2 * MATCHED, BROKEN_RATIO * matched):
            count += 1
    return count


def logprob_counts(rows: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """Per row: the completion's ids and the sampler's log-probs (TRL right-pads both separately, the log-probs
    with 0.0, which no sampled token at a temperature of the policy's gets)."""
    import torch

    ids = [int(n) for n in rows["completion_mask"].sum(-1)]
    sampled = rows["sampled"]
    nonzero = sampled != 0
    positions = torch.arange(sampled.shape[1], device=sampled.device).expand_as(sampled)
    last = torch.where(nonzero, positions + 1, torch.zeros_like(positions)).max(-1).values
    return ids, [int(n) for n in last]


def round_trip_changed(tokenizer, rows: Mapping[str, Any]) -> float | None:
    """The share of completions whose ids change when decoded and re-encoded (as a multi-turn loop that re-renders
    its text does): their log-probs would belong to tokens that were never sampled."""
    if tokenizer is None:
        return None
    changed = total = 0
    for ids, mask in zip(rows["completion_ids"].tolist(), rows["completion_mask"].tolist(), strict=True):
        ids = [t for t, m in zip(ids, mask, strict=True) if m]
        if not ids:
            continue
        again = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)
        changed, total = changed + (again != ids), total + 1
    return changed / total if total else None


def aligned(rows: Mapping[str, Any]):
    """The sampler's log-probs cropped or zero-padded to the completion ids' width (they differ when the ids were
    changed after sampling)."""
    import torch

    sampled, width = rows["sampled"], rows["completion_ids"].shape[1]
    if sampled.shape[1] >= width:
        return sampled[:, :width]
    pad = torch.zeros(sampled.shape[0], width - sampled.shape[1], dtype=sampled.dtype, device=sampled.device)
    return torch.cat([sampled, pad], dim=1)


def sampler_facts(
    model, inputs: Mapping[str, Any], temperature: float = 1.0, *, rows: int = ROWS, initial=None,
    initial_source: str | None = None, tokenizer=None,
) -> dict[str, Any] | None:  # fmt: skip
    """The rescoring probe on the first ``rows`` completions of the TRL rollout batch ``inputs`` (see the module
    docstring); ``initial``: a callable giving an earlier policy's completion logits for the rows (the sampler
    may match it: stale weights), named by ``initial_source``. None when the batch carries no sampler log-probs or
    the forward gives no logits."""
    import torch

    picked = rollout_rows(inputs, rows)
    if picked is None:
        return None
    ids_count, logp_count = logprob_counts(picked)
    mismatched = [i for i, (a, b) in enumerate(zip(ids_count, logp_count, strict=True)) if a and a != b]
    sampled = aligned(picked)
    mask = picked["mask"] & torch.isfinite(sampled)  # vLLM's unscored tokens (NaN) say nothing
    if not bool(mask.any()):
        return None
    with torch.no_grad():
        logits = completion_logits(model, picked)
        if logits is None:
            return None
        ids = picked["completion_ids"]
        policy = token_logps(logits, ids, temperature)
        facts = compare(sampled, policy, mask)
        facts.update(
            temperature=temperature,
            rows_logprob_count_differs=len(mismatched),
            logprob_counts=[[ids_count[i], logp_count[i]] for i in mismatched[:4]],
            round_trip_changed=round_trip_changed(tokenizer, picked),
            initial_source=initial_source,
        )
        if facts["gap_mean"] > EXPLAIN_ABOVE:
            facts.update(_explained(logits, ids, sampled, mask, temperature))
            if initial is not None:
                earlier = initial(picked)
                if earlier is not None:
                    facts["initial_gap"] = _mean_gap(sampled, token_logps(earlier, ids, temperature), mask)
    return facts


def _explained(logits, ids, sampled, mask, temperature: float) -> dict[str, Any]:
    """The temperature and the nucleus whose log-probs fit the sampled ones best, with their gaps."""
    tried = sorted({*TEMPERATURES, 1.0, float(temperature)})
    gaps = [(_mean_gap(sampled, token_logps(logits, ids, t), mask), t) for t in tried]
    best_gap, best_t = min(gaps)
    nuclei = [(_mean_gap(sampled, nucleus_logps(logits, ids, temperature, p), mask), p) for p in TOP_PS]
    nucleus_gap, best_p = min(nuclei)
    return {
        "apparent_temperature": best_t,
        "apparent_temperature_gap": best_gap,
        "apparent_top_p": best_p,
        "apparent_top_p_gap": nucleus_gap,
    }


def peft_initial(model):
    """For a PEFT model with an adapter: a scorer of the rows with the adapter disabled (the policy the run started
    from, when the adapter starts as the identity, as LoRA does); else None."""
    if not hasattr(model, "disable_adapter") or not getattr(model, "peft_config", None):
        return None

    def score(rows):
        with model.disable_adapter():
            return completion_logits(model, rows)

    return score


def model_initial(reference):
    """A scorer of the rows with ``reference`` (TRL's reference model, or a copy of the initial weights)."""

    def score(rows):
        return completion_logits(reference, rows)

    return score
