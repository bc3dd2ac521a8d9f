"""`sampler-mismatch` on real GRPO runs whose `rollout_func` samples the completions itself (TRL stores its
log-probs and, without vLLM, never corrects for them): from the live policy (clean), from a frozen copy of the
starting weights (stale-weights), at another temperature than the trainer's (temperature), with renormalised
nucleus log-probs (top-p), and with its ids re-encoded from their text (retokenized). The measurement and the
monitor are also driven without a trainer."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import trl_setups as setups
from test_callback_rl import found, ran, rows, silent, watch
from test_rules_rl import one_thread  # noqa: F401 - autouse
from transformers import AutoModelForCausalLM

from hf_sanity.measure import sampler
from hf_sanity.rules.training.sampler import SamplerMonitor, cause_of

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def rollout_func(source=None, *, temperature=None, top_p=None, retokenize=False):
    """A rollout_func as a user writes one around their own sampler: it samples each prompt from ``source`` (the
    live policy when None) at ``temperature`` (the trainer's when None) and returns the ids with their log-probs;
    ``top_p``: renormalised over the nucleus, as a sampler reports them; ``retokenize``: the ids re-encoded from
    the decoded text (``"cropped"``: and the log-probs cropped, or padded with their last, to the new count, so
    that ids and log-probs agree in number)."""

    def rollout(prompts, trainer):
        model = source if source is not None else trainer.model
        tok = trainer.processing_class
        t = temperature or trainer.args.temperature
        enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        sampling = {"top_p": top_p, "top_k": 0} if top_p else {"top_k": 0, "top_p": 1.0}
        was = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=t, max_new_tokens=trainer.args.max_completion_length,
                                 pad_token_id=tok.pad_token_id, **sampling)  # fmt: skip
            width = enc["input_ids"].shape[1]
            completions = out[:, width:]
            attention = torch.cat([enc["attention_mask"], torch.ones_like(completions)], dim=1)
            logits = model(input_ids=out, attention_mask=attention).logits[:, width - 1 : -1].float()
            logps = (
                sampler.nucleus_logps(logits, completions, t, top_p)
                if top_p
                else sampler.token_logps(logits, completions, t)
            )
        model.train(was)
        result = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for i in range(len(prompts)):
            ids = completions[i].tolist()
            n = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
            kept = [t for t, m in zip(enc["input_ids"][i].tolist(), enc["attention_mask"][i].tolist()) if m]
            result["prompt_ids"].append(kept)
            kept_ids = tok.encode(tok.decode(ids[:n]), add_special_tokens=False) if retokenize else ids[:n]
            kept_logps = logps[i, :n].tolist()
            if retokenize == "cropped":
                kept_logps = (kept_logps + kept_logps[-1:] * len(kept_ids))[: len(kept_ids)]
            result["completion_ids"].append(kept_ids)
            result["logprobs"].append(kept_logps)
        return result

    return rollout


def grpo(tmp_path, rollout=None, frozen=False, folder=None, **config):
    """GRPO on the trained tiny model (or the one in ``folder``) with ``rollout`` (a function of the model: the
    frozen copy when ``frozen``)."""
    model = AutoModelForCausalLM.from_pretrained(folder or setups.trained_folder())
    source = copy.deepcopy(model).eval() if frozen else None
    cb = watch("sampler-mismatch", **config.pop("watch", {}))
    trainer = setups.grpo(tmp_path, setups.rendered(rows()), [setups.length_reward], callbacks=[cb], model=model,
                          **config)  # fmt: skip
    trainer.rollout_func = rollout(source)
    trainer.train()
    return cb, trainer


@pytest.mark.clean("sampler-mismatch")
def test_a_rollout_func_sampling_the_live_policy_is_silent(tmp_path):
    cb, trainer = grpo(tmp_path, lambda source: rollout_func())
    silent(cb)
    ran(cb, SamplerMonitor)
    stats = cb.report.stats["sampler_probe"]
    assert stats["probes"] >= 3 and stats["rollout_func"] and not stats["importance_correction"]
    assert stats["initial_policy"] == "initial-copy"
    assert cb.monitors.monitors and trainer.state.global_step == 6


@pytest.mark.planted("sampler-mismatch")
def test_a_sampler_on_the_starting_weights_is_stale(tmp_path):
    """The sampler is a frozen copy of the model: the policy moves (a high LR), the sampler does not."""
    cb, _ = grpo(tmp_path, lambda source: rollout_func(source), frozen=True, learning_rate=3e-3)
    (finding,) = found(cb, "sampler-mismatch")
    assert finding.evidence["cause"] == "stale-weights" and finding.severity == "error"
    assert finding.evidence["initial_gap"] < 0.01 < finding.evidence["gap_mean"]
    assert "no importance correction" in finding.message


@pytest.mark.planted("sampler-mismatch")
def test_a_sampler_at_another_temperature(tmp_path):
    """The trainer scores at 1.2 (rl_config's); the sampler samples and reports its log-probs at 0.7."""
    cb, _ = grpo(tmp_path, lambda source: rollout_func(temperature=0.7), max_steps=4)
    (finding,) = found(cb, "sampler-mismatch")
    assert finding.evidence["cause"] == "temperature", finding.evidence
    assert (
        abs(finding.evidence["apparent_temperature"] - 0.7) < 0.07 and finding.evidence["temperature"] == 1.2
    )


@pytest.mark.planted("sampler-mismatch")
def test_a_sampler_reporting_nucleus_log_probs(tmp_path):
    cb, _ = grpo(tmp_path, lambda source: rollout_func(top_p=0.8), max_steps=4)
    (finding,) = found(cb, "sampler-mismatch")
    assert finding.evidence["cause"] == "top-p", finding.evidence
    assert finding.evidence["delta_mean"] > 0.05 and finding.evidence["above_share"] > 0.5


@pytest.mark.planted("sampler-mismatch")
def test_completion_ids_re_encoded_from_their_text(tmp_path):
    """The untrained tiny model writes random tokens: re-encoded from their text, most change (merged, split)."""
    cb, _ = grpo(tmp_path, lambda source: rollout_func(retokenize=True), max_steps=4, folder=setups.folder())
    (finding,) = found(cb, "sampler-mismatch")
    assert finding.evidence["cause"] == "retokenized", finding.evidence
    assert finding.evidence["rows_logprob_count_differs"] >= 1


@pytest.mark.planted("sampler-mismatch")
def test_re_encoded_ids_with_their_log_probs_cropped_to_the_new_count(tmp_path):
    """Ids and log-probs agree in number, so the count does not give it away: each completion matches the policy
    up to its first re-encoded token and is off by nats from there."""
    cb, _ = grpo(
        tmp_path, lambda source: rollout_func(retokenize="cropped"), max_steps=4, folder=setups.folder()
    )
    (finding,) = found(cb, "sampler-mismatch")
    evidence = finding.evidence
    assert evidence["cause"] == "retokenized", evidence
    assert evidence["rows_logprob_count_differs"] == 0 and evidence["rows_matched_then_broken"] >= 2
    assert "cropped" in finding.message


# -- without a trainer -------------------------------------------------------------------------------------
def batch_of(model, temperature, *, sample_temperature=None, rows=4, width=10, prompt=6, seed=0):
    """A TRL rollout batch of random prompts and completions sampled from ``model`` at ``sample_temperature``,
    with their log-probs as that sampler reports them."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(3, vocab, (rows, prompt), generator=g)
    ids = prompt_ids
    logps = []
    t = sample_temperature or temperature
    with torch.no_grad():
        for _ in range(width):
            logits = model(input_ids=ids).logits[:, -1].float() / t
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            logps.append(torch.log_softmax(logits, -1).gather(-1, nxt))
            ids = torch.cat([ids, nxt], dim=1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": ids[:, prompt:],
        "completion_mask": torch.ones_like(ids[:, prompt:]),
        "sampling_per_token_logps": torch.cat(logps, dim=1),
    }


def test_the_rescoring_probe_measures_a_sampler_without_a_trainer():
    model = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    same = sampler.sampler_facts(model, batch_of(model, 1.0), 1.0)
    assert same["gap_mean"] < 1e-3 and 0.999 < same["sequence_ratio_mean"] < 1.001 and same["tokens"] == 40
    assert "apparent_temperature" not in same and same["rows_logprob_count_differs"] == 0
    assert same["rows_matched_then_broken"] == 0
    assert cause_of({**same, "gap_mean": 0.0}) == "no-correction"  # nothing to explain: nothing named

    hot = sampler.sampler_facts(model, batch_of(model, 1.0, sample_temperature=0.5), 1.0)
    assert hot["gap_mean"] > 0.05 and hot["apparent_temperature"] == pytest.approx(0.5, rel=0.1)
    assert cause_of(hot) == "temperature" and hot["first_token_ratio"] < 0.9
    assert hot["rows_matched_then_broken"] == 0  # a temperature moves the first token too

    shifted = batch_of(model, 1.0)  # each row's ids changed at its 4th token, the log-probs kept as sampled
    shifted["completion_ids"] = shifted["completion_ids"].clone()
    shifted["completion_ids"][:, 3:] = torch.roll(shifted["completion_ids"][:, 3:], 1, dims=1)
    broken = sampler.sampler_facts(model, shifted, 1.0)
    assert broken["rows_logprob_count_differs"] == 0 and broken["rows_matched_then_broken"] >= 3
    assert cause_of(broken) == "retokenized"

    stale = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    moved = sampler.sampler_facts(model, batch_of(stale, 1.0), 1.0, initial=sampler.model_initial(stale),
                                  initial_source="initial-copy")  # fmt: skip
    assert moved["gap_mean"] > 0.05 and moved["initial_gap"] < 1e-3 and cause_of(moved) == "stale-weights"


def test_the_monitor_confirms_over_two_probes_and_reads_trl_metrics():
    facts = {"gap_mean": 0.2, "gap_max": 1.0, "tokens": 40, "sequences": 4, "sequence_ratio_mean": 0.8,
             "sequence_ratio_min": 0.7, "sequence_ratio_max": 0.9, "delta_mean": 0.2, "above_share": 0.97,
             "temperature": 1.0, "importance_correction": False}  # fmt: skip
    monitor = SamplerMonitor()
    assert monitor.update(1, {"sampler_probe": facts}) == []  # one probe alone is not enough
    (finding,) = monitor.update(2, {"sampler_probe": facts})
    assert finding.severity == "error" and finding.evidence["cause"] == "top-p" and finding.step == 1
    quiet = SamplerMonitor()
    for step in (1, 2, 3):
        assert (
            quiet.update(step, {"sampler_probe": {**facts, "gap_mean": 0.01, "sequence_ratio_mean": 1.0}})
            == []
        )
    logged = SamplerMonitor()
    trl = {"sampling/sampling_logp_difference/mean": 0.12, "sampling/importance_sampling_ratio/mean": 0.93}
    assert logged.update(1, {"logs": trl}) == [] and logged.update(2, {"logs": trl}) == []
    (warned,) = logged.update(3, {"logs": trl})
    assert warned.severity == "warning" and warned.evidence["source"] == "trl-metrics"
    healthy = {"sampling/sampling_logp_difference/mean": 0.02, "sampling/importance_sampling_ratio/mean": 1.0}
    calm = SamplerMonitor()
    assert all(calm.update(s, {"logs": healthy}) == [] for s in (1, 2, 3, 4))
