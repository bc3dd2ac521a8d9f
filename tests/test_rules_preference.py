"""Preference fine-tuning before training: the rules of `hf_sanity/rules/preference.py` and `reward.py`, each
planted through the real TRL trainer (`preflight(trainer=...)`) or the rows a user passes, and the clean
setups of every preference trainer silent, with no SFT rule read into their batches."""

from __future__ import annotations

import json

import datasets
import pytest
import trl_setups as setups

import hf_sanity
from helpers import assert_one_line_error, cli
from hf_sanity.testing import demo_preference_pairs, demo_unpaired, tiny_setup

CLEAN_PREFERENCE = ("preference-pairs-identical", "preference-trivially-separable", "preference-template-leak",
                    "preference-unmixed-batches", "preference-beta-misset", "reward-head-frozen",
                    "reward-score-position")  # fmt: skip


def findings(report, slug=None):
    return [f for f in report.findings if slug is None or f.rule == slug]


def only(report, slug):
    found = [f for f in report.findings if f.severity != "info"]
    assert [f.rule for f in found] == [slug], [f"{f.rule}: {f.message}" for f in found]
    return found[0]


def silent(report):
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []


def check(trainer, **kwargs):
    return hf_sanity.preflight(trainer=trainer, use_config=False, **kwargs)


def shared_prefix_pairs(n=24):
    """Pairs whose chosen and rejected share a long opening and differ only at the end."""
    opening = "Let me think about this carefully and answer in a complete sentence: "
    rows = []
    for pair in demo_preference_pairs(n):
        rows.append({
            "prompt": pair["prompt"],
            "chosen": [{"role": "assistant", "content": opening + pair["chosen"][0]["content"]}],
            "rejected": [{"role": "assistant", "content": opening + pair["rejected"][0]["content"]}],
        })  # fmt: skip
    return rows


# -- preference-pairs-identical -----------------------------------------------------------------------------
@pytest.mark.planted("preference-pairs-identical")
def test_pairs_identical_after_the_trainers_cut(tmp_path):
    trainer = setups.dpo(tmp_path, shared_prefix_pairs(), max_length=40)
    report = check(trainer)
    # Both true: the cut leaves the pairs identical, and it cuts every chosen answer.
    assert {f.rule for f in report.findings} == {"preference-pairs-identical", "truncated-completion"}
    found = findings(report, "preference-pairs-identical")[0]
    assert found.severity == "error"
    assert found.evidence["cause"] == "truncation"
    assert found.evidence["fraction"] == 1.0 and found.evidence["max_length"] == 40
    assert "Raise max_length to at least 59" in found.fix
    assert check(trainer).stats["objective"] == "preference"


@pytest.mark.planted("preference-pairs-identical")
def test_pairs_identical_text_and_the_rows_trl_drops(tmp_path):
    rows = demo_preference_pairs(40)
    for row in rows[:10]:
        row["rejected"] = row["chosen"]
    report = hf_sanity.preflight(
        tokenizer=setups.tokenizer(), dataset=datasets.Dataset.from_list(rows), max_len=256, use_config=False
    )
    found = only(report, "preference-pairs-identical")
    assert found.evidence["cause"] == "identical-text" and found.evidence["identical"] == 10
    assert found.severity == "error" and found.evidence["rows"] == list(range(10))
    # A prompt that fills max_length alone: TRL drops the row without a word; it is counted.
    long_prompt = [{"role": "user", "content": "word " * 80}]
    rows = demo_preference_pairs(30)
    for row in rows[:5]:
        row["prompt"] = long_prompt
    report = hf_sanity.preflight(
        tokenizer=setups.tokenizer(), dataset=datasets.Dataset.from_list(rows), max_len=64, use_config=False,
        select="preference-pairs-identical",
    )  # fmt: skip
    found = only(report, "preference-pairs-identical")
    assert found.evidence["cause"] == "prompt-fills-max-length"
    assert found.evidence["dropped"] == 5 and report.stats["rows_given"] == 30 and report.stats["pairs"] == 25


@pytest.mark.clean("preference-pairs-identical")
def test_pairs_that_diverge_inside_max_length_are_silent(tmp_path):
    trainer = setups.dpo(tmp_path, shared_prefix_pairs(), max_length=128)
    report = check(trainer, select="preference-pairs-identical")
    silent(report)
    assert report.stats["pairs"] == 24 and report.stats["rows_given"] == 24


# -- preference-trivially-separable -----------------------------------------------------------------------
@pytest.mark.planted("preference-trivially-separable")
def test_chosen_always_longer_is_separable_by_length(tmp_path):
    rows = demo_preference_pairs(32)
    for row in rows:
        row["chosen"][0]["content"] += " I hope this helps, and let me know if you need more."
    found = only(check(setups.dpo(tmp_path, rows)), "preference-trivially-separable")
    assert found.evidence["cause"] == "length" and found.evidence["rule"] == "longer-wins"
    assert found.evidence["accuracy"] == 1.0 and found.severity == "error"


@pytest.mark.planted("preference-trivially-separable")
def test_chosen_in_another_script_is_separable_by_language():
    rows = demo_preference_pairs(32, conversational=False)
    for i, row in enumerate(
        rows
    ):  # half the chosen answers shorter than the rejected: length does not separate
        row["rejected"] = "Нет."
        row["chosen"] = row["chosen"] if i % 2 else "Yes."
    report = hf_sanity.preflight(
        tokenizer=setups.tokenizer(), dataset=datasets.Dataset.from_list(rows), max_len=256, use_config=False,
        select="preference-trivially-separable",
    )  # fmt: skip
    found = only(report, "preference-trivially-separable")
    assert found.evidence["cause"] == "language" and found.evidence["rule"] == "chosen-is-latin"


@pytest.mark.clean("preference-trivially-separable", "preference-template-leak")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_pairs_are_not_separable(tmp_path, seed):
    report = check(setups.dpo(tmp_path, demo_preference_pairs(48, seed=seed)))
    silent(report)
    rules = separability_of(report, tmp_path, seed)
    assert max(rules.values()) < 0.8, rules


def separability_of(report, tmp_path, seed):
    from hf_sanity.measure.objective import of_columns
    from hf_sanity.measure.preference import rows_context, separability

    data = datasets.Dataset.from_list(demo_preference_pairs(48, seed=seed))
    ctx = rows_context(setups.tokenizer(), data, objective=of_columns(data.column_names), max_len=256)
    return separability(ctx.pairs)


# -- preference-template-leak -----------------------------------------------------------------------------
@pytest.mark.planted("preference-template-leak")
def test_completions_that_repeat_the_user_turn(tmp_path):
    rows = []
    for pair in demo_preference_pairs(24):
        rows.append({"prompt": pair["prompt"], "chosen": pair["prompt"] + pair["chosen"],
                     "rejected": pair["prompt"] + pair["rejected"]})  # fmt: skip
    found = only(
        check(setups.dpo(tmp_path, rows), select="preference-template-leak"), "preference-template-leak"
    )
    assert found.evidence["cause"] == "prompt-repeated" and found.evidence["fraction"] == 1.0
    assert found.severity == "error"


@pytest.mark.planted("preference-template-leak")
def test_text_rows_rendered_by_a_template_that_writes_bos_get_two(tmp_path):
    tok = setups.tokenizer("llama3")
    rows = []
    for pair in demo_preference_pairs(24):
        prompt = tok.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
        rows.append({"prompt": prompt, "chosen": pair["chosen"][0]["content"],
                     "rejected": pair["rejected"][0]["content"]})  # fmt: skip
    trainer = setups.dpo(tmp_path, rows, template="llama3")
    found = only(check(trainer, select="preference-template-leak"), "preference-template-leak")
    assert found.evidence["cause"] == "double-bos" and found.evidence["counts"]["double-bos"] == 24


# -- preference-unmixed-batches ---------------------------------------------------------------------------
@pytest.mark.planted("preference-unmixed-batches")
def test_kto_on_paired_data_gets_batches_of_one_label(tmp_path):
    trainer = setups.kto(tmp_path, demo_preference_pairs(16))
    found = only(check(trainer), "preference-unmixed-batches")
    assert found.evidence["cause"] == "auto-unpaired"
    assert found.evidence["batch_label_means"] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert check(trainer).stats["objective"] == "preference-unpaired"


@pytest.mark.slow  # a subprocess
@pytest.mark.planted("preference-unmixed-batches")
def test_kto_rows_sorted_by_label_from_the_cli(tmp_path):
    rows = sorted(demo_unpaired(48), key=lambda r: r["label"])
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("preflight", "--model", setups.folder(), "--dataset", data, "--max-len", 256, "--json",
                 tmp_path / "r.json", cwd=tmp_path)  # fmt: skip
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["stats"]["objective"] == "preference-unpaired", result.stderr
    assert [f["rule"] for f in report["findings"]] == ["preference-unmixed-batches"], result.stdout
    assert report["findings"][0]["evidence"]["cause"] == "sorted-by-label"


@pytest.mark.clean("preference-unmixed-batches", "tokens")  # no data-stage rule is written for KTO rows
def test_kto_on_shuffled_unpaired_rows_is_silent(tmp_path):
    report = check(setups.kto(tmp_path, demo_unpaired(48)))
    silent(report)
    assert report.stats["objective"] == "preference-unpaired" and report.stats["rows"] == 48


# -- preference-beta-misset ---------------------------------------------------------------------------------
@pytest.mark.planted("preference-beta-misset")
def test_simpo_at_trls_default_beta_and_ipo_at_a_tiny_beta(tmp_path):
    trainer = setups.cpo(tmp_path, demo_preference_pairs(16), loss_type="simpo", beta=0.1)
    found = only(check(trainer), "preference-beta-misset")
    assert found.evidence["variant"] == "simpo" and found.evidence["paper_beta"] == 2.5
    trainer = setups.dpo(tmp_path, demo_preference_pairs(16), loss_type=["ipo"], beta=0.05)
    found = only(check(trainer), "preference-beta-misset")
    assert found.evidence["variant"] == "ipo" and found.evidence["target_gap"] == 10


@pytest.mark.clean("preference-beta-misset", "ALL")
def test_simpo_with_the_papers_beta_orpo_and_ipo_are_silent(tmp_path):
    rows = demo_preference_pairs(24)
    for trainer in (
        setups.cpo(tmp_path, rows, loss_type="simpo", beta=2.5, simpo_gamma=1.375),
        setups.orpo(tmp_path, rows),
        setups.dpo(tmp_path, rows, loss_type=["ipo"], beta=0.5),
    ):
        report = check(trainer)
        silent(report)
        assert report.stats["objective"] == "preference"


# -- reward models ------------------------------------------------------------------------------------------
@pytest.mark.planted("reward-head-frozen")
def test_lora_without_seq_cls_leaves_the_score_head_frozen(tmp_path):
    from peft import LoraConfig

    trainer = setups.reward(tmp_path, demo_preference_pairs(16),
                            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    found = only(check(trainer), "reward-head-frozen")
    assert any("score" in name for name in found.evidence["head_parameters"]) and found.evidence["peft"]


@pytest.mark.clean("reward-head-frozen", "reward-score-position", "ALL")
def test_reward_model_with_seq_cls_lora_and_full_fine_tune_are_silent(tmp_path):
    from peft import LoraConfig

    rows = demo_preference_pairs(24)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    for trainer in (setups.reward(tmp_path, rows, peft_config=lora), setups.reward(tmp_path, rows)):
        report = check(trainer)
        silent(report)
        assert report.stats["objective"] == "reward"


@pytest.mark.planted("reward-score-position")
def test_a_config_pad_that_is_not_the_tokenizers_scores_padding(tmp_path):
    trainer = setups.reward(tmp_path, demo_preference_pairs(16))
    trainer.model.config.pad_token_id = trainer.processing_class.eos_token_id
    found = only(check(trainer, select="reward-score-position"), "reward-score-position")
    assert found.evidence["cause"] == "config-pad-differs"


# -- entry points ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.planted("preference-pairs-identical")
def test_the_cli_reads_preference_pairs_and_says_what_it_checked(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in shared_prefix_pairs()))
    result = cli("preflight", "--model", setups.folder(), "--dataset", data, "--max-len", 40, "--json",
                 tmp_path / "r.json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["stats"]["objective"] == "preference" and report["stats"]["format"] == "preference"
    assert "preference-pairs-identical" in {f["rule"] for f in report["findings"]}
    assert "duplicate-examples" not in result.stdout and "prompt-in-loss" not in result.stdout
    # Text pairs, with the format named.
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_preference_pairs(24, conversational=False)))
    result = cli("preflight", "--model", setups.folder(), "--dataset", data, "--format", "preference",
                 "--max-len", 256, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    result = cli("preflight", "--model", setups.folder(), "--dataset", data, "--format", "preference-unpaired",
                 cwd=tmp_path)  # fmt: skip
    assert_one_line_error(result, "--format preference-unpaired needs column(s)")


@pytest.mark.clean("tokens", "data", "template", "model")  # no trainer: the trainer stage has nothing to read
@pytest.mark.parametrize("conversational", [True, False])
def test_clean_pairs_run_no_sft_rule(conversational):
    model, tok = tiny_setup("chatml", "distinct")
    data = datasets.Dataset.from_list(demo_preference_pairs(40, conversational=conversational))
    report = hf_sanity.preflight(model=model, tokenizer=tok, dataset=data, max_len=256, use_config=False)
    silent(report)
    assert report.stats["objective"] == "preference" and report.stats["pairs"] == 40


# -- after training: policy-drift -----------------------------------------------------------------------------
@pytest.mark.planted("policy-drift")
def test_a_tuned_model_that_stopped_ending_its_turn_drifted_from_its_base():
    from hf_sanity.testing import trained_setup

    tuned, tok = trained_setup("eos-masked")  # never ends its turn
    base, _ = trained_setup("clean")
    held_out = datasets.Dataset.from_list(demo_preference_pairs(16, seed=7))
    report = hf_sanity.outputs(model=tuned, tokenizer=tok, dataset=held_out, base=base, n=8, max_new_tokens=48,
                               select="policy-drift", use_config=False)  # fmt: skip
    found = only(report, "policy-drift")
    assert "stops-less" in found.evidence["causes"] and found.evidence["base_stopped"] == 1.0
    assert report.stats["objective"] == "preference"


@pytest.mark.clean("policy-drift", "outputs")
def test_no_drift_against_itself_and_no_policy_drift_after_sft():
    from transformers import AutoModelForCausalLM

    from hf_sanity.testing import held_out_conversations, trained_model_dir, trained_setup

    model, tok = trained_setup("clean")
    twin = AutoModelForCausalLM.from_pretrained(trained_model_dir("clean"))
    pairs = datasets.Dataset.from_list(demo_preference_pairs(16, seed=7))
    report = hf_sanity.outputs(model=model, tokenizer=tok, dataset=pairs, base=twin, n=8, max_new_tokens=48,
                               use_config=False)  # fmt: skip
    silent(report)
    assert report.stats["objective"] == "preference" and report.stats["prompts"] == 8
    # After SFT the same drift is not policy-drift's to judge (the objective comes from the columns)
    tuned, _ = trained_setup("eos-masked")
    chats = datasets.Dataset.from_list(held_out_conversations(8))
    report = hf_sanity.outputs(model=tuned, tokenizer=tok, dataset=chats, base=twin, n=8, max_new_tokens=48,
                               use_config=False, select="policy-drift")  # fmt: skip
    silent(report)
    assert report.stats["objective"] == "sft"
