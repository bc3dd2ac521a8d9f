"""Length rules: max_len against the data and against the model."""

import pytest
import trl_setups as setups
from transformers import LlamaConfig

from helpers import run
from hf_sanity.testing import demo_conversations


@pytest.mark.planted("truncated-completion")
def test_truncated_completion_severity_and_suggestion(chatml, conversations):
    report = run(chatml, conversations, select="truncated-completion", max_len=40)
    (finding,) = report.findings
    lengths = sorted(len(chatml.apply_chat_template(r["messages"])["input_ids"]) for r in conversations)
    cut = sum(length > 40 for length in lengths)
    assert finding.evidence["cut"] > 0 and finding.evidence["cut"] <= cut
    assert finding.evidence["length_max"] == lengths[-1]
    assert finding.evidence["max_len_for_99pct"] >= lengths[int(0.99 * (len(lengths) - 1))]
    expected = "error" if finding.evidence["fraction"] >= 0.10 else "warning"
    assert finding.severity == expected
    assert finding.example.cut == 40


def test_truncated_completion_is_a_warning_when_few_are_cut(chatml, conversations):
    long_one = {
        "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 200}]
    }
    report = run(chatml, [*conversations, long_one], select="truncated-completion", max_len=128)
    (finding,) = report.findings
    assert finding.severity == "warning" and finding.evidence["rows"] == [len(conversations)]


def test_truncated_completion_never_suggests_a_smaller_max_len(chatml):
    """One very long row: 99% of the examples fit in far less than max_len, so the fix is to drop that row or
    to raise max_len to its length, each with its cost; never "raise" max_len to a smaller value."""
    long_one = {
        "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 300}]
    }
    rows = [*demo_conversations(199), long_one]
    # the loss on the answers (as assistant-only loss puts it), so the cut share is of the answers' tokens
    (finding,) = run(chatml, rows, select="truncated-completion", max_len=128, loss_on="assistant").findings
    longest = len(chatml.apply_chat_template(long_one["messages"])["input_ids"])
    assert finding.evidence["max_len_for_99pct"] < 128 < longest == finding.evidence["max_len_for_all"]
    assert finding.message.endswith(f"the longest is {longest:,} tokens")
    assert "keeps 99%" not in finding.message + finding.fix
    assert finding.fix.startswith("Drop or split the 1 example longer than max_len (0.5% of the examples, ")
    assert f"or raise max_len to {longest:,} to keep every completion whole" in finding.fix
    assert 0.1 < finding.evidence["cut_supervised_fraction"] < 1


@pytest.mark.clean("truncated-completion")
def test_no_truncation_no_finding(chatml, conversations):
    assert run(chatml, conversations, select="truncated-completion", max_len=512).findings == []


@pytest.mark.planted("max-len-exceeds-model")
def test_max_len_exceeds_model_is_an_error_when_rows_reach_past_the_positions(chatml, conversations):
    config = LlamaConfig(max_position_embeddings=256)
    long_one = {
        "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 300}]
    }
    rows = [*conversations[:4], long_one]
    (finding,) = run(chatml, rows, select="max-len-exceeds-model", max_len=1024, model_config=config).findings
    longest = len(chatml.apply_chat_template(long_one["messages"])["input_ids"])
    assert finding.severity == "error" and longest > 256
    assert finding.evidence == {
        "max_len": 1024,
        "max_position_embeddings": 256,
        "longest": longest,
        "beyond": 1,
    }
    assert run(chatml, rows, select="max-len-exceeds-model", max_len=256, model_config=config).findings == []


def test_max_len_exceeds_model_is_a_warning_when_no_row_comes_near(chatml, conversations):
    config = LlamaConfig(max_position_embeddings=256)
    (finding,) = run(
        chatml, conversations, select="max-len-exceeds-model", max_len=1024, model_config=config
    ).findings
    assert finding.severity == "warning" and finding.evidence["beyond"] == 0
    assert finding.evidence["longest"] < 100 and "no row reaches it now" in finding.message


@pytest.mark.planted("context-beyond-window")
def test_context_beyond_sliding_window(chatml, conversations):
    config = LlamaConfig(max_position_embeddings=4096)
    config.sliding_window = 32
    (finding,) = run(chatml, conversations, select="context-beyond-window", model_config=config).findings
    assert finding.severity == "warning" and finding.evidence["window"] == 32
    assert finding.evidence["kind"] == "sliding window"
    config.sliding_window = None
    assert run(chatml, conversations, select="context-beyond-window", model_config=config).findings == []


def sft_trainer(tmp_path, max_length: int | None, callbacks=(), rows=None, steps: int = 4):
    """TRL's SFTTrainer on conversational prompt/completion rows, loss on the completions, cut at max_length
    (None: SFTConfig's default, 1024)."""
    import datasets
    from dist import tinytrain as tt
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import as_prompt_completion

    setups.skip_where_trl_trains_the_prompt()
    model, tok = tt.setup()
    rows = rows if rows is not None else demo_conversations(32)
    data = datasets.Dataset.from_list(as_prompt_completion(rows, conversational=True))
    length = {} if max_length is None else {"max_length": max_length}
    config = SFTConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, completion_only_loss=True,
        **length,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tok, callbacks=list(callbacks)
    )
    return trainer, data


@pytest.mark.planted("truncated-completion")
@pytest.mark.parametrize("max_length", [30, 40])
def test_answers_cut_by_sft_trainer_are_truncation_not_a_masked_eos(tmp_path, max_length):
    """SFTTrainer cuts at max_length before hf-sanity sees a batch: the completion that lost its end-of-turn
    is truncated-completion (cause: the trainer's max_length), not eos-not-learned with a pad-token fix; the
    rows the cut left without a completion token, which TRL drops, are counted against the dataset given."""
    from hf_sanity import preflight
    from hf_sanity.callback import SanityCallback

    watch = SanityCallback(use_config=False, print_findings=False)
    trainer, data = sft_trainer(tmp_path, max_length, [watch])
    dropped = len(data) - len(trainer.train_dataset)
    assert dropped > 0  # the planted bug: rows whose prompt fills max_length
    for report in (preflight(trainer=trainer), preflight(trainer=trainer, dataset=data)):
        assert "eos-not-learned" not in {f.rule for f in report.findings}
        (finding,) = report.by_rule("truncated-completion")
        assert finding.evidence["cause"] == "trainer-max-length"
        assert finding.evidence["dropped_by_trainer"] == dropped and finding.evidence["rows_passed"] == 32
        assert finding.severity == "error" and "max_length" in finding.fix
    trainer.train()
    found = {f.rule: f for f in watch.report.findings}
    assert "eos-not-learned" not in found and "internal-error" not in found
    assert found["truncated-completion"].evidence["cause"] == "trainer-max-length"


def assistant_only_trainer(tmp_path, max_length: int, callbacks=()):
    """TRL's SFTTrainer on multi-turn conversations (every second row has two exchanges) with
    `assistant_only_loss=True`, on the template with `{% generation %}` markers, cut at max_length."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import tiny_setup

    model, tok = tiny_setup("generation")
    data = datasets.Dataset.from_list(demo_conversations(32, multi_turn_every=2))
    config = SFTConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True, assistant_only_loss=True, max_length=max_length,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tok, callbacks=list(callbacks)
    )
    return trainer, data


@pytest.mark.planted("truncated-completion")
def test_a_later_answer_removed_whole_by_sft_trainers_max_length(tmp_path):
    """assistant_only_loss=True with max_length=40: the cut removes the last answer of multi-turn rows whose
    first answer still carries loss, so TRL keeps them. Their rows end in a turn with no supervised token
    left: caught before training and at the first step, as the trainer's cut."""
    from hf_sanity import preflight
    from hf_sanity.callback import SanityCallback

    watch = SanityCallback(use_config=False, print_findings=False)
    trainer, data = assistant_only_trainer(tmp_path, 40, [watch])
    assert len(trainer.train_dataset) == len(data)  # every row keeps an answer: TRL drops none
    before = preflight(trainer=trainer, dataset=data, use_config=False)
    trainer.train()
    for report in (before, watch.report):
        found = {f.rule: f for f in report.findings if f.severity != "info"}
        assert set(found) == {"truncated-completion"}, [f.message for f in report.findings]
        finding = found["truncated-completion"]
        assert finding.evidence["cause"] == "trainer-max-length" and finding.evidence["answer_lost"] > 0
        assert "later answer" in finding.message and "max_length" in finding.fix
    assert before.by_rule("truncated-completion")[0].severity == "error"


@pytest.mark.clean("truncated-completion", "eos-not-learned")
def test_sft_trainer_on_multi_turn_rows_whose_max_length_fits_is_silent(tmp_path):
    from hf_sanity import preflight
    from hf_sanity.callback import SanityCallback

    watch = SanityCallback(use_config=False, print_findings=False, select=["truncated-completion"])
    trainer, data = assistant_only_trainer(tmp_path, 128, [watch])
    report = preflight(trainer=trainer, dataset=data, use_config=False)
    assert [f.rule for f in report.findings if f.severity != "info"] == []
    trainer.train()
    assert watch.report.findings == []
    assert report.stats["max_len"] == 128


@pytest.mark.clean("truncated-completion", "eos-not-learned")
def test_sft_trainer_whose_max_length_fits_is_silent(tmp_path):
    from hf_sanity import preflight

    trainer, data = sft_trainer(tmp_path, 128)
    report = preflight(trainer=trainer, dataset=data)
    assert [f.rule for f in report.findings if f.severity != "info"] == []


@pytest.mark.clean("max-len-exceeds-model")
def test_sft_trainer_default_max_length_on_a_512_position_model_is_a_warning(tmp_path):
    """TRL's default max_length=1024 on the tiny model's 512 positions, every row under 100 tokens: nothing
    breaks, so preflight(trainer=) and the callback warn, and abort_on="error" does not stop the run."""
    from hf_sanity import preflight
    from hf_sanity.callback import SanityCallback

    watch = SanityCallback(abort_on="error", select="tokens", use_config=False, print_findings=False)
    trainer, data = sft_trainer(tmp_path, None, [watch])
    assert trainer.args.max_length == 1024 and trainer.model.config.max_position_embeddings == 512
    (finding,) = preflight(trainer=trainer, dataset=data, select="max-len-exceeds-model").findings
    assert finding.severity == "warning" and finding.evidence["longest"] < 100
    trainer.train()
    (online,) = watch.report.by_rule("max-len-exceeds-model")
    assert online.severity == "warning" and trainer.state.global_step == 4
    assert [f.rule for f in watch.report.findings if f.severity == "error"] == []


@pytest.mark.planted("max-len-exceeds-model")
def test_sft_trainer_rows_past_the_model_positions_are_an_error(tmp_path):
    long_one = {
        "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 600}]
    }
    trainer, data = sft_trainer(tmp_path, None, rows=[long_one, *demo_conversations(31)])
    from hf_sanity import preflight

    (finding,) = preflight(trainer=trainer, dataset=data, select="max-len-exceeds-model").findings
    assert finding.severity == "error" and finding.evidence["beyond"] >= 1
    assert 512 < finding.evidence["longest"] <= 1024
