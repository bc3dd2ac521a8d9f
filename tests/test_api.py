"""The public Python API as a user imports it."""

import importlib

import datasets

import hf_sanity
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
