"""preflight tokenizes rows as the real trainer does, per format: TRL 1.16's SFTTrainer (every token of `messages`
and `text` rows, the completion of prompt-completion rows, tool calls and reasoning rendered by the chat template)
and DPOTrainer (prompt, chosen and rejected ids, the completion mask of its collator), on real tokenizers with
tiny models saved to a folder. The CLI's reading of the rows and ``preflight(trainer=...)`` agree on them."""

from __future__ import annotations

import json
import warnings

import datasets
import pytest
import trl_setups as setups
from transformers import AutoModelForCausalLM

from conftest import real_tokenizer
from helpers import cli
from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.drivers.preflight import preflight
from hf_sanity.measure.encode import EncodeOptions, Encoder
from hf_sanity.measure.formats import detect_format
from hf_sanity.testing import (
    TinyConfig,
    as_prompt_completion,
    as_text,
    demo_conversations,
    demo_preference_pairs,
    reasoning_conversations,
    tiny_model_dir,
    tiny_model_for,
    tool_conversations,
)

pytestmark = pytest.mark.slow  # real vocabularies of up to 152k tokens

SMALL = TinyConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
)
TOKENIZERS = ["qwen2.5-instruct", "llama3-instruct", "smollm2-instruct", "tinyllama-chat"]
ROWS = 8


def rendered_text(tok) -> list[dict[str, str]]:
    """Conversations rendered into `text` rows with the chat template (TRL cannot mask their prompts)."""
    return [
        {"text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in demo_conversations(ROWS)
    ]


# format -> (rows for a tokenizer, the loss mask TRL applies to them by default)
FORMATS = {
    "messages": (lambda tok: demo_conversations(ROWS), "all"),
    "prompt-completion": (
        lambda tok: as_prompt_completion(demo_conversations(ROWS), conversational=True),
        "completion",
    ),
    "prompt-completion-text": (lambda tok: as_prompt_completion(demo_conversations(ROWS)), "completion"),
    "text": (lambda tok: as_text(demo_conversations(ROWS)), "all"),
    "text-rendered-chat": (rendered_text, "all"),
    "tool-calls": (lambda tok: tool_conversations(ROWS, tools_as_json=True), "all"),
    "reasoning": (lambda tok: reasoning_conversations(ROWS), "all"),
}


@pytest.fixture(scope="module", params=TOKENIZERS)
def setup(request, tmp_path_factory):
    """(tokenizer, its tiny model loaded from the folder it was saved to, that folder)."""
    tok = real_tokenizer(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    tiny_model_for(tok, SMALL).save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok, AutoModelForCausalLM.from_pretrained(folder), folder


def sft_trainer(model, tok, rows, tmp_path, **config):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=None,
                     per_device_train_batch_size=4, dataset_num_proc=None, **config)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok
        )


@pytest.mark.clean("prompt-in-loss")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sft_trainer_and_preflight_build_the_same_ids_and_labels(setup, fmt, tmp_path):
    tok, model, _ = setup
    make, mode = FORMATS[fmt]
    rows = make(tok)
    trainer = sft_trainer(model, tok, rows, tmp_path)
    data = datasets.Dataset.from_list(rows)
    encoder = Encoder(tok, EncodeOptions(fmt=detect_format(data.column_names, features=data.features)))
    assert encoder.loss_mask.mode == mode and encoder.loss_mask.source == "trl-default"
    for i, row in enumerate(rows):
        ours, theirs = encoder.encode(row), trainer.train_dataset[i]
        assert ours["error"] == ""
        assert ours["input_ids"] == theirs["input_ids"], f"row {i}: ids differ"
        assert ours["labels"] == theirs["labels"], f"row {i}: labels differ"
        if mode == "all":
            assert IGNORE_INDEX not in theirs["labels"]
        else:
            assert IGNORE_INDEX in theirs["labels"] and theirs["labels"][-1] != IGNORE_INDEX

    # The reading of the rows (the CLI's) and the trainer's batches: the same tokens, the same loss, the same verdict.
    from_rows = preflight(tokenizer=tok, dataset=data, select="prompt-in-loss", use_config=False)
    from_trainer = preflight(trainer=trainer, select="prompt-in-loss", use_config=False)
    for key in ("tokens", "supervised_tokens", "examples"):
        assert from_rows.stats[key] == from_trainer.stats[key], key
    assert from_rows.stats["loss_mask"]["mode"] == from_trainer.stats["loss_mask"]["mode"] == mode
    assert (
        from_rows.stats["loss_mask"]["source"] == from_trainer.stats["loss_mask"]["source"] == "trl-default"
    )
    # A template that drops a message (TinyLlama's renders no tool call) leaves an empty assistant turn, which
    # the tokens alone (the trainer's batches) cannot place: there the counts of prompt tokens may differ.
    drops = any(encoder.encode(row)["n_dropped_supervised"] for row in rows)
    verdicts = [
        [(f.rule, f.severity, f.evidence["cause"], None if drops else f.evidence["prompt_tokens"])
         for f in report.findings]
        for report in (from_rows, from_trainer)
    ]  # fmt: skip
    assert verdicts[0] == verdicts[1]
    if mode == "completion" or fmt == "text":  # completion-only loss; prose, where no turn is a prompt
        assert verdicts[0] == []
    else:  # the prompt in the loss, TRL's default: a warning, never an error
        ((rule, severity, cause, _),) = verdicts[0]
        assert (rule, severity, cause) == ("prompt-in-loss", "warning", "trainer-default")
        assert from_rows.findings[0].evidence["prompt_tokens"] > 0


def test_assistant_only_loss_matches_the_trainers_mask(tmp_path):
    """`--loss-on assistant` against SFTTrainer(assistant_only_loss=True), which swaps in TRL's training twin
    of Qwen2.5's template (its {% generation %} markers): the same labels, and the trainer's mask is reported as
    the trainer's."""
    tok = real_tokenizer("qwen2.5-instruct")
    folder = tmp_path / "model"
    tiny_model_for(tok, SMALL).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    for rows in (demo_conversations(ROWS), tool_conversations(ROWS, tools_as_json=True)):
        trainer = sft_trainer(model, tok, rows, tmp_path, assistant_only_loss=True)
        encoder = Encoder(tok, EncodeOptions(fmt="messages", loss_on="assistant"))
        for i, row in enumerate(rows):
            ours, theirs = encoder.encode(row), trainer.train_dataset[i]
            assert ours["input_ids"] == theirs["input_ids"], f"row {i}"
            # The twin's markers also take the newline after the header and after <|im_end|>: only such
            # template whitespace differs, every answer token and end of turn carries loss in both.
            differ = [k for k, (a, b) in enumerate(zip(ours["labels"], theirs["labels"])) if a != b]
            assert all(tok.decode([theirs["input_ids"][k]]).strip() == "" for k in differ), f"row {i}"
            assert all(ours["labels"][k] == IGNORE_INDEX for k in differ), f"row {i}"
            assert sum(label != IGNORE_INDEX for label in ours["labels"]) > 2 * len(differ)
        report = preflight(trainer=trainer, select="prompt-in-loss", use_config=False)
        assert report.findings == []
        assert report.stats["loss_mask"] == {
            "mode": "assistant", "source": "trainer", "why": "SFTConfig(assistant_only_loss=True)"
        }  # fmt: skip


def test_a_stock_sft_run_with_abort_on_error_is_not_stopped(tmp_path):
    """TRL's default puts the prompt of `messages` rows in the loss: the callback says so (a warning that names
    the trainer's default) and abort_on="error" lets the run train to its last step."""
    from hf_sanity.callback import SanityCallback

    tok = real_tokenizer("smollm2-instruct")
    folder = tmp_path / "model"
    tiny_model_for(tok, SMALL).save_pretrained(folder)
    trainer = sft_trainer(AutoModelForCausalLM.from_pretrained(folder), tok, demo_conversations(16), tmp_path,
                          max_steps=2, logging_steps=1, save_strategy="no")  # fmt: skip
    callback = SanityCallback(
        abort_on="error", select="prompt-in-loss", use_config=False, print_findings=False
    )
    trainer.add_callback(callback)
    trainer.train()
    assert trainer.state.global_step == 2
    (finding,) = callback.report.findings
    assert finding.rule == "prompt-in-loss" and finding.severity == "warning"
    assert finding.evidence["cause"] == "trainer-default" and finding.evidence["loss_mask"]["mode"] == "all"


# -- preference pairs: DPOTrainer's prepared columns and its collator's completion mask -----------------------
@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "text"])
def test_dpo_trainer_and_preflight_build_the_same_pairs(setup, conversational, tmp_path):
    DPOConfig, DPOTrainer = setups.from_trl("trl", "DPOConfig", "DPOTrainer")

    from hf_sanity.drivers.show import preference_view
    from hf_sanity.measure.preference import tokenize_pair

    tok, _, folder = setup
    rows = demo_preference_pairs(ROWS, conversational=conversational)
    args = DPOConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=None,
                     per_device_train_batch_size=ROWS, dataset_num_proc=None)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder), args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)  # fmt: skip
    prepared = trainer.train_dataset
    for i, row in enumerate(rows):
        prompt, chosen, rejected, _ = tokenize_pair(tok, row)
        assert prompt == prepared[i]["prompt_ids"], f"pair {i}: prompt ids differ"
        assert chosen == prepared[i]["chosen_ids"] and rejected == prepared[i]["rejected_ids"], f"pair {i}"
    # The collator's batch: every chosen side, then every rejected side, the loss where completion_mask is 1;
    # `show` lays the pairs out the same way, with the loss on the same positions.
    batch = trainer.data_collator([prepared[i] for i in range(ROWS)])
    view = preference_view(tok, datasets.Dataset.from_list(rows), list(range(ROWS)), objective="preference")
    for k, summary in enumerate(view.data()["rows"]):
        kept = batch["attention_mask"][k].bool()
        ids = batch["input_ids"][k][kept].tolist()
        loss_at = [p for p, m in enumerate(batch["completion_mask"][k][kept].tolist()) if m]
        tokens = [t for t in summary["tokens"] if t["attention"]]
        assert [t["id"] for t in tokens] == ids, summary["name"]
        assert [t["pos"] for t in tokens if t["label"] not in (None, IGNORE_INDEX)] == loss_at, summary[
            "name"
        ]


# -- the CLI, as a user runs it on the demo `messages` rows ---------------------------------------------------
@pytest.mark.planted("prompt-in-loss")
def test_the_cli_says_trls_default_for_messages_rows(tmp_path):
    """The issue's demo row: `show` marks every token as carrying loss, as the SFTTrainer batch does
    (`--trainer-batch`); preflight reports prompt-in-loss as TRL's default (a warning, exit 0) and says the mask
    in its header; `--loss-on assistant` (Axolotl's, LLaMA-Factory's default) puts the loss on the answers."""
    folder = tiny_model_dir("chatml", "distinct")
    data = tmp_path / "messages.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(24)))

    def shown(*extra):
        out = tmp_path / f"show{len(extra)}.json"
        result = cli(
            "show", "--model", folder, "--dataset", data, "--rows", "0", "--json", out, *extra, cwd=tmp_path
        )
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(out.read_text())
        (view,) = report["views"]
        (row,) = view["rows"]
        return report, row

    report, row = shown()
    with_loss = [t for t in row["tokens"] if t["loss"]]
    assert len(with_loss) == len(row["tokens"])  # the "39 of 39": every token carries loss
    assert (
        report["stats"]["loss_mask"]["mode"] == "all"
        and "loss mask: every token" in report["views"][0]["source"]
    )
    _, trainer_row = shown("--trainer-batch")  # TRL's SFTTrainer on the same row
    assert [t["id"] for t in trainer_row["tokens"]] == [t["id"] for t in row["tokens"]]
    assert [t["loss"] for t in trainer_row["tokens"]] == [t["loss"] for t in row["tokens"]]
    _, assistant_row = shown("--loss-on", "assistant")
    assert 0 < sum(t["loss"] for t in assistant_row["tokens"]) < len(with_loss) / 2

    out = tmp_path / "preflight.json"
    result = cli("preflight", "--model", folder, "--dataset", data, "--select", "prompt-in-loss", "--json", out,
                 cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr  # a warning: exit 0
    assert "loss mask: every token (trl-default; TRL's SFTTrainer trains on every token" in result.stdout
    report = json.loads(out.read_text())
    (finding,) = report["findings"]
    assert finding["rule"] == "prompt-in-loss" and finding["severity"] == "warning"
    assert finding["evidence"]["cause"] == "trainer-default" and finding["evidence"]["fraction"] > 0.5
    assert "assistant_only_loss=True" in finding["fix"] and "--loss-on all" in finding["fix"]
    assert report["stats"]["loss_mask"]["source"] == "trl-default"

    result = cli("preflight", "--model", folder, "--dataset", data, "--select", "prompt-in-loss", "--loss-on",
                 "assistant", "--json", out, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["findings"] == []
    assert report["stats"]["loss_mask"] == {
        "mode": "assistant",
        "source": "flag",
        "why": "--loss-on assistant",
    }
    assert report["stats"]["supervised_tokens"] < report["stats"]["tokens"] / 2  # the answers only
