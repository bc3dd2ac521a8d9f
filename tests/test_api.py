"""The public Python API as a user imports it."""

import importlib
import io

import datasets
import pytest

import hf_sanity
from hf_sanity.errors import UserInputError
from hf_sanity.testing import build_tokenizer, synthetic_conversations


def test_top_level_preflight_is_the_function():
    tok = build_tokenizer("chatml")
    data = datasets.Dataset.from_list(synthetic_conversations(8))
    report = hf_sanity.preflight(tokenizer=tok, dataset=data, max_len=16, use_config=False)
    assert isinstance(report, hf_sanity.Report) and "truncated-completion" in report.rules()
    importlib.import_module("hf_sanity.measure.sources")  # the package stays importable beside the function
    importlib.import_module("hf_sanity.measure.batches")
    assert callable(hf_sanity.preflight)


def test_num_proc_gives_the_same_report():
    tok = build_tokenizer("chatml")
    data = datasets.Dataset.from_list(synthetic_conversations(300))
    one = hf_sanity.preflight(tokenizer=tok, dataset=data, max_len=64, use_config=False)
    two = hf_sanity.preflight(tokenizer=tok, dataset=data, max_len=64, num_proc=2, use_config=False)
    assert one.to_dict()["findings"] == two.to_dict()["findings"] and one.findings


def test_lazy_exports():
    assert hf_sanity.SanityCallback.__name__ == "SanityCallback"
    assert callable(hf_sanity.overfit) and callable(hf_sanity.diagnose) and callable(hf_sanity.doctor)


def test_nothing_is_written_into_a_saved_dataset_folder(tmp_path):
    from hf_sanity.measure.sources import load_dataset_ref
    from hf_sanity.testing import demo_conversations

    folder = tmp_path / "data"
    datasets.Dataset.from_list(demo_conversations(30)).save_to_disk(str(folder))
    before = sorted(p.name for p in folder.iterdir())
    for num_proc in (None, 2):
        report = hf_sanity.preflight(
            tokenizer=build_tokenizer("chatml"),
            dataset=load_dataset_ref(str(folder)),
            num_proc=num_proc,
            use_config=False,
        )
        assert report.stats["examples"] == 30
    assert sorted(p.name for p in folder.iterdir()) == before  # datasets would drop cache-*.arrow files here


def test_preflight_takes_a_list_of_rows_as_the_readme_shows():
    """README: ``hf_sanity.preflight(..., dataset=train, eval_dataset=val)`` with rows built in Python."""
    from hf_sanity.testing import demo_conversations, tiny_setup

    model, tok = tiny_setup("chatml", "distinct")
    rows, held = demo_conversations(24), demo_conversations(8, seed=7)
    report = hf_sanity.preflight(
        model=model, tokenizer=tok, dataset=rows, eval_dataset=held, max_len=12, use_config=False
    )
    same = hf_sanity.preflight(
        model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows),
        eval_dataset=datasets.Dataset.from_list(held), max_len=12, use_config=False,
    )  # fmt: skip
    assert report.stats["examples"] == 24 and "truncated-completion" in report.rules()
    assert report.to_dict()["findings"] == same.to_dict()["findings"]
    frame = datasets.Dataset.from_list(rows).to_pandas()  # a DataFrame, as read with pandas
    assert hf_sanity.preflight(
        model=model, tokenizer=tok, dataset=frame, max_len=12, use_config=False
    ).rules() == (
        hf_sanity.preflight(model=model, tokenizer=tok, dataset=rows, max_len=12, use_config=False).rules()
    )


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([], "empty list"),
        ([{"text": "a"}, "b"], "row 1 is a str"),
        ("train.jsonl", "is a str; pass a"),
        ({"train": None}, None),
    ],
    ids=["empty", "not-dicts", "a-path", "dataset-dict"],
)
def test_rows_that_are_not_a_dataset_are_bad_input(rows, needle):
    tok = build_tokenizer("chatml")
    if needle is None:  # a DatasetDict (load_dataset without split=): one split is wanted
        rows = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])})
        needle = "pass one split"
    with pytest.raises(UserInputError, match=needle):
        hf_sanity.preflight(tokenizer=tok, dataset=rows, use_config=False)


def test_a_preflight_without_a_model_says_the_model_checks_did_not_run():
    """'no findings' never stands for checks that did not run: the report says so under its summary."""
    from rich.console import Console

    from hf_sanity.testing import demo_conversations, tiny_setup

    tok = build_tokenizer("chatml")
    report = hf_sanity.preflight(
        tokenizer=tok, dataset=demo_conversations(24), use_config=False, loss_on="completion"
    )
    out = io.StringIO()
    report.print(Console(file=out, width=200))
    lines = out.getvalue().splitlines()
    assert lines[0] == "hf-sanity preflight: no findings"
    # the header says which tokens the checks took as carrying loss, and what decided it
    assert lines[1] == "loss mask: the completions only (flag; --loss-on completion)"
    assert lines[2].startswith(
        "note: no model was given: the model-stage checks that read its weights did not run"
    )
    assert report.to_dict()["notes"] == [lines[2][len("note: ") :]]
    # With a model, or with the model stage ignored, nothing is left out.
    model, tok = tiny_setup("chatml", "distinct")
    with_model = hf_sanity.preflight(
        model=model, tokenizer=tok, dataset=demo_conversations(24), use_config=False, loss_on="completion"
    )
    assert with_model.notes == [] and with_model.findings == []
    ignored = hf_sanity.preflight(
        tokenizer=tok, dataset=demo_conversations(24), ignore="model", use_config=False, loss_on="completion"
    )
    assert ignored.notes == [] and ignored.findings == []


def test_the_utf8_check_counts_bytes_across_its_read_chunks(tmp_path):
    """A character cut by the 1 MiB read is not an error; a bad byte after it is named at its file offset."""
    from hf_sanity.measure.sources import check_utf8

    head = b'{"text": "' + b"a" * ((1 << 20) - 11)  # "é" (2 bytes) straddles the first read
    good = tmp_path / "good.jsonl"
    good.write_bytes(head + "é".encode() + b'"}\n')
    check_utf8(good, "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    content = head + "é".encode() + b'\n{"text": "\xff"}\n'
    bad.write_bytes(content)
    offset = content.index(b"\xff")
    with pytest.raises(UserInputError, match=rf"byte {offset} \(line 2\) is 0xff"):
        check_utf8(bad, "bad.jsonl")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b'{"text": "' + "é".encode()[:1])
    with pytest.raises(UserInputError, match="ends inside a multi-byte character"):
        check_utf8(cut, "cut.jsonl")
