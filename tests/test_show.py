"""The decoded batch: `hf-sanity show`, `preflight --show N` and `SanityCallback(show_first_batch=...)` show the
exact tensors the model is fed (after the trainer's collator with a trainer), every position with its id,
attention, position id, label and loss, the labels' shift, padding and packed sequences marked; in the
terminal, the JSON and the HTML page."""

from __future__ import annotations

import copy
import io
import json

import datasets
import pytest
import torch
from rich.console import Console
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from helpers import cli
from hf_sanity.batchview import BatchView
from hf_sanity.callback import SanityCallback
from hf_sanity.drivers.preflight import preflight
from hf_sanity.drivers.show import show
from hf_sanity.errors import UserInputError
from hf_sanity.testing import as_prompt_completion, demo_conversations, demo_preference_pairs, tiny_setup
from hf_sanity.tokenview import TokenView


class CharTokenizer:
    """One character per token: exact expectations without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def token_rows(tok, n=16):
    return datasets.Dataset.from_list(
        [{"input_ids": tok.apply_chat_template(r["messages"])["input_ids"]} for r in demo_conversations(n)]
    )


def args(tmp_path, **kwargs):
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", seed=0, disable_tqdm=True)  # fmt: skip
    return TrainingArguments(**{**base, **kwargs})


def lm_trainer(tmp_path, side="right", **kwargs):
    model, tok = tiny_setup("chatml")
    padded = copy.deepcopy(tok)
    padded.padding_side = side
    return Trainer(model=model, args=args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                   data_collator=DataCollatorForLanguageModeling(padded, mlm=False), **kwargs)  # fmt: skip


def tokens(view: BatchView, row: int = 0) -> dict[str, list]:
    cells = view.rows[row].cells
    return {
        k: [getattr(c, k) for c in cells]
        for k in ("id", "attention", "position", "label", "loss", "predicts")
    }


# -- the view, exactly -----------------------------------------------------------------------------
def test_a_detailed_row_in_plain_text():
    """Every position, padding folded in the text and marked in its row, a packed sequence's start, and what
    each position is trained to predict (the label of the next one)."""
    ids = [ord(c) for c in "Q:A.q:b."] + [0, 0]
    labels = [-100, -100, ord("A"), ord("."), -100, -100, ord("b"), ord("."), -100, -100]
    view = TokenView.from_ids(CharTokenizer(), ids, labels, window=None, detailed=True, title="row 0",
                              attention_mask=[1] * 8 + [0, 0], position_ids=[0, 1, 2, 3, 0, 1, 2, 3, 0, 0])  # fmt: skip
    assert view.plain().splitlines() == [
        "row 0: tokens 0-9 of 10 (⟦…⟧ carries loss, [n x pad] attention 0, ‖ a packed sequence starts)",
        "  Q:⟦A.⟧‖q:⟦b.⟧[2 x pad]",
        "    pos      id attn pos_id   label  loss  token  predicts",
        "      0      81    1      0    -100    -   Q",
        "      1      58    1      1    -100    -   :  -> A",
        "      2      65    1      2      65   yes  A  -> .",
        "      3      46    1      3      46   yes  .",
        "                 ‖ a packed sequence starts (position id 0)",
        "      4     113    1      0    -100    -   q",
        "      5      58    1      1    -100    -   :  -> b",
        "      6      98    1      2      98   yes  b  -> .",
        "      7      46    1      3      46   yes  .",
        "      8       0    0      0    -100  pad   \x00",
        "      9       0    0      0    -100  pad   \x00",
    ]
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(view)
    assert "predicts" in out.getvalue() and "‖ a packed sequence starts" in out.getvalue()


def test_labels_shifted_by_hand_are_named():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pre = BatchView.from_batch(
        CharTokenizer(), {"input_ids": ids, "labels": torch.tensor([[6, 7, 8, 9, -100]])}
    )
    assert pre.shift == "pre-shifted" and "t+2" in pre.data()["labels"]["meaning"]
    same = BatchView.from_batch(CharTokenizer(), {"input_ids": ids, "labels": ids.clone()})
    assert same.shift == "in-model"


# -- hf-sanity show --------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_show_rows_in_the_terminal_json_and_html(tmp_path):
    from hf_sanity.testing import tiny_model_dir

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(12)))
    out, page = tmp_path / "show.json", tmp_path / "show.html"
    result = cli("show", "--model", tiny_model_dir(), "--dataset", data, "--rows", "0,5", "--max-len", "40",
                 "--json", out, "--html", page)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dataset row 0, dataset row 5" in result.stdout and "predicts" in result.stdout
    [view] = json.loads(out.read_text())["views"]
    assert view["kind"] == "batch" and view["labels"]["shift"] == "in-model"
    first, second = view["rows"]
    assert [first["name"], second["name"]] == ["dataset row 0", "dataset row 5"]
    assert len(first["tokens"]) == first["positions"] == view["shapes"]["input_ids"][1] <= 40
    short = min((first, second), key=lambda row: row["positions"] - row["padding"])
    assert short["padding"] == sum(t["attention"] == 0 for t in short["tokens"]) and short[
        "padding_side"
    ] in (None, "right")
    loss = [t for t in first["tokens"] if t["loss"]]
    assert loss and all(t["label"] == t["id"] for t in loss)
    html = page.read_text()
    assert '<section class="view batch">' in html and "predicts (the next position" in html
    assert "no findings" not in html  # show runs no checks: it does not claim any passed


def test_show_marks_the_loss_trl_puts_on_each_format_and_says_which(chatml):
    """`messages` rows: every token carries loss (TRL's default); prompt-completion rows: the completion;
    `loss_on="assistant"` (`--loss-on assistant`, once refused): the assistant turns. The view and the report's
    stats say which mask and where it came from."""
    rows = demo_conversations(4)

    def shown(data, **options):
        report = show(tokenizer=chatml, dataset=data, rows=[0], **options)
        [view] = report.views
        [row] = view.data()["rows"]
        return report, view, sum(t["loss"] for t in row["tokens"]), len(row["tokens"])

    report, view, loss, n = shown(rows)
    assert loss == n and report.stats["loss_mask"]["mode"] == "all"
    assert report.stats["loss_mask"]["source"] == "trl-default" and "loss mask: every token" in view.source
    report, view, answers, _ = shown(rows, loss_on="assistant")
    assert 0 < answers < n / 2 and report.stats["loss_mask"] == {
        "mode": "assistant", "source": "flag", "why": "--loss-on assistant"
    }  # fmt: skip
    report, view, completion, n = shown(as_prompt_completion(rows, conversational=True))
    assert 0 < completion < n / 2 and report.stats["loss_mask"]["mode"] == "completion"
    assert view.data()["loss_mask"] == report.stats["loss_mask"]
    with pytest.raises(UserInputError, match="--loss-on must be one of completion, assistant, all"):
        show(tokenizer=chatml, dataset=rows, loss_on="prompt")


@pytest.mark.slow
def test_cli_trainer_batch_is_trl_s_own_batch(tmp_path):
    """--trainer-batch builds TRL's SFTTrainer on the rows: the ids and labels shown are its collator's."""
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import tiny_model_dir

    rows = as_prompt_completion(demo_conversations(8), conversational=True)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "show.json"
    result = cli("show", "--model", tiny_model_dir(), "--dataset", data, "--rows", "2,3", "--trainer-batch",
                 "--json", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    [view] = json.loads(out.read_text())["views"]
    model, tok = tiny_setup("chatml")
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path / "t"), report_to=[], use_cpu=True,
                         per_device_train_batch_size=2, bf16=False),
                         train_dataset=datasets.Dataset.from_list(rows[2:4]), processing_class=tok)  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    for r, row in enumerate(view["rows"]):
        assert [t["id"] for t in row["tokens"]] == batch["input_ids"][r].tolist()
        assert [t["label"] for t in row["tokens"]] == batch["labels"][r].tolist()
    assert view["rows"][0]["name"] == "dataset row 2" and "SFTTrainer" in view["source"]


def test_bad_rows_are_user_errors(chatml):
    with pytest.raises(UserInputError, match="past the end"):
        show(tokenizer=chatml, dataset=demo_conversations(4), rows="7")
    with pytest.raises(UserInputError, match="row numbers"):
        show(tokenizer=chatml, dataset=demo_conversations(4), rows="a,b")


# -- with a trainer: after its collator ------------------------------------------------------------
def test_the_trainer_s_first_batch_exactly(tmp_path):
    """show(trainer=...) is the first batch of its dataloader (the RNG kept: the run draws the same one), left
    padding marked on the rows the collator padded."""
    trainer = lm_trainer(tmp_path, side="left")
    state = torch.get_rng_state()
    report = show(trainer=trainer)
    assert torch.equal(state, torch.get_rng_state())
    [view] = report.views
    expected = next(iter(trainer.get_train_dataloader()))
    for r in range(expected["input_ids"].shape[0]):
        got = tokens(view, r)
        assert (
            got["id"] == expected["input_ids"][r].tolist() and got["label"] == expected["labels"][r].tolist()
        )
        assert got["attention"] == expected["attention_mask"][r].tolist()
    padded = [s for s in view.summaries if s["padding"]]
    assert padded and {s["padding_side"] for s in padded} == {"left"}
    assert report.summary().startswith("hf-sanity show: 4 rows as the model is fed them")


def test_rows_of_a_trainer_s_dataset_through_its_collator(tmp_path):
    trainer = lm_trainer(tmp_path)
    [view] = show(trainer=trainer, rows=[3, 1]).views
    assert [s["name"] for s in view.summaries] == ["train dataset row 3", "train dataset row 1"]
    assert (
        tokens(view, 0)["id"][: len(trainer.train_dataset[3]["input_ids"])]
        == trainer.train_dataset[3]["input_ids"]
    )


def test_packed_rows_mark_where_each_sequence_starts(tmp_path):
    from trl import SFTConfig, SFTTrainer

    model, tok = tiny_setup("chatml")
    rows = as_prompt_completion(demo_conversations(24), conversational=True)
    config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], use_cpu=True,
                       max_length=64, packing=True, bf16=False)  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tok
    )
    [view] = show(trainer=trainer).views
    batch = next(iter(trainer.get_train_dataloader()))
    starts = [0, *(torch.nonzero(batch["position_ids"][0][1:] == 0).flatten() + 1).tolist()]
    assert len(starts) > 1 and view.summaries[0]["sequences"] == starts
    assert view.rows[0].plain().count("‖ a packed sequence starts (position id 0)") == len(starts) - 1


# -- preference data: each pair's chosen and rejected sides as fed -------------------------------------------
def test_preference_pairs_show_chosen_and_rejected(chatml):
    [view] = show(tokenizer=chatml, dataset=demo_preference_pairs(6), rows=[1, 4]).views
    names = [s["name"] for s in view.summaries]
    assert names == ["pair 1 chosen", "pair 4 chosen", "pair 1 rejected", "pair 4 rejected"]
    chosen, rejected = tokens(view, 0), tokens(view, 2)
    prompt = next(i for i, loss in enumerate(chosen["loss"]) if loss)
    assert chosen["id"][:prompt] == rejected["id"][:prompt]  # one prompt, two completions
    assert chosen["id"] != rejected["id"]


def test_a_dpo_trainer_s_batch_names_its_halves(tmp_path):
    import trl_setups

    trainer = trl_setups.dpo(tmp_path, demo_preference_pairs(16))
    report = preflight(trainer=trainer, show=1, select="preference-pairs-identical", use_config=False)
    [view] = report.views
    names = [s["name"] for s in view.summaries]
    half = len(names) // 2
    assert names[:half] == [f"batch pair {i} chosen" for i in range(half)] and names[half].endswith(
        "0 rejected"
    )
    assert "completion_mask" in view.notes[0] and any(
        view.rows[0].cells[i].loss for i in range(view.rows[0].total)
    )


# -- preflight --show ------------------------------------------------------------------------------
def test_preflight_show_rows_as_the_checks_read_them(chatml):
    report = preflight(tokenizer=chatml, dataset=demo_conversations(12), show=3, max_len=48, use_config=False,
                       select="prompt-in-loss")  # fmt: skip
    [view] = report.views
    assert [s["name"] for s in view.summaries] == ["dataset row 0", "dataset row 1", "dataset row 2"]
    assert report.to_dict()["views"][0]["kind"] == "batch"


@pytest.mark.slow
def test_cli_preflight_show(tmp_path):
    from hf_sanity.testing import tiny_model_dir

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(12)))
    result = cli(
        "preflight", "--model", tiny_model_dir(), "--dataset", data, "--show", "1", "--ignore", "model"
    )
    assert result.returncode == 0, result.stderr
    assert "the decoded batch: dataset row 0" in result.stdout and "predicts" in result.stdout


# -- SanityCallback(show_first_batch=...) ----------------------------------------------------------
def test_the_callback_prints_the_first_real_batch_and_changes_nothing(tmp_path, capsys):
    runs = []
    for show_it in (False, 2):
        callback = SanityCallback(use_config=False, print_findings=False, show_first_batch=show_it)
        trainer = lm_trainer(tmp_path / str(show_it), callbacks=[callback])
        trainer.train()
        runs.append((trainer, callback))
    printed = capsys.readouterr().err
    assert "the first real batch: row 0, row 1 (input_ids 4x" in printed and "predicts" in printed
    [view] = runs[1][1].report.views
    assert len(view.rows) == 2 and view.shift == "in-model"
    assert runs[0][1].report.views == []
    weights = [t.model.state_dict() for t, _ in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # bit-for-bit the same run


def test_show_first_batch_takes_true_false_or_a_row_count():
    with pytest.raises(ValueError, match="show_first_batch"):
        SanityCallback(show_first_batch=0)
    with pytest.raises(ValueError, match="show_first_batch"):
        SanityCallback(show_first_batch="all")
