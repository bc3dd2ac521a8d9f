"""`hf-sanity fix` and `hf_sanity.fix`: each remedy planted -> applied to a copy -> the checks run again on the
copy -> the finding gone; the repaired folder loads and trains; the user's folders and objects untouched."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
import trl_setups as setups

from conftest import real_tokenizer
from helpers import assert_one_line_error, cli
from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.testing import (
    TinyConfig,
    build_tokenizer,
    demo_conversations,
    reasoning_conversations,
    tiny_model_dir,
    tiny_model_for,
    tiny_setup,
)

SMALL = TinyConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)  # fmt: skip


# -- planted setups: (model, tokenizer, rows, eval rows, preflight options, the rule it plants) ---------------
def masked_eos_rows(tok, n=24):
    """Pre-tokenized rows as DataCollatorForLanguageModeling labels them when pad == EOS: EOS masked."""
    rows = []
    for row in demo_conversations(n):
        ids = tok.apply_chat_template(row["messages"])["input_ids"]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX if i == tok.pad_token_id else i for i in ids]})
    return rows


def planted(case: str):
    """The setup of one planted bug, as objects."""
    convs = demo_conversations(32)
    if case == "pad-is-eos":
        model, tok = tiny_setup("chatml", "eos")
        return model, tok, masked_eos_rows(tok), None, {}, "eos-not-learned"
    if (
        case == "stop-token"
    ):  # a base tokenizer (EOS <|endoftext|>) with a ChatML template and generation config
        model, tok = tiny_setup("chatml", "distinct")
        model, tok = copy.deepcopy(model), copy.deepcopy(tok)
        tok.eos_token, tok.pad_token = "<|endoftext|>", "<|pad|>"
        model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
        return model, tok, convs, None, {}, "stop-token-mismatch"
    if case == "generation-markers":
        model, tok = tiny_setup("chatml", "distinct")
        return model, tok, convs, None, {"loss_on": "assistant"}, "generation-markers-missing"
    if case == "double-bos":
        model, tok = tiny_setup("llama3", "distinct")
        rows = [{"text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in convs]
        return model, tok, rows, None, {}, "double-bos"
    if case == "truncated":
        model, tok = tiny_setup("chatml", "distinct")
        return model, tok, convs, None, {"max_len": 40}, "truncated-completion"
    if case == "drops-reasoning":
        setups.trl_template("deepseek_r1_distill_training")  # the remedy: TRL's training twin
        tok = real_tokenizer("deepseek-r1-distill")
        return (
            tiny_model_for(tok, SMALL),
            tok,
            reasoning_conversations(16),
            None,
            {},
            "template-drops-content",
        )
    if case == "untrained-tokens":
        model, tok = tiny_setup("chatml", "distinct")
        model = copy.deepcopy(model)
        with torch.no_grad():  # as a base model's rows of template tokens it never trained
            for token in ("<|im_start|>", "<|im_end|>"):
                model.get_input_embeddings().weight[tok.convert_tokens_to_ids(token)] = 0.0
        return model, tok, convs, None, {}, "untrained-special-tokens"
    if case == "data":
        model, tok = tiny_setup("chatml", "distinct")
        rows = [*convs[:24], convs[3], convs[5]]  # two duplicates
        rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]})
        fact = "The capital of Norway is Oslo, a city by the fjord."
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Context: {fact}"},
                    {"role": "assistant", "content": fact},
                ]
            }
        )
        return model, tok, rows, convs[24:32] + convs[:2], {}, "data"
    raise ValueError(case)


DATA_RULES = {"duplicate-examples", "bad-input-values", "label-leakage", "split-leakage"}
CASES = ["pad-is-eos", "stop-token", "generation-markers", "double-bos", "truncated", "drops-reasoning",
         "untrained-tokens", "data"]  # fmt: skip
UNSAFE = {"pad-is-eos", "truncated", "drops-reasoning", "untrained-tokens", "data"}


def rules_of(case: str, rule: str) -> set[str]:
    return DATA_RULES if rule == "data" else {rule}


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- from Python ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(  # drops-reasoning: the real DeepSeek-R1 tokenizer and its model, 15 s
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "drops-reasoning" else c for c in CASES]
)
def test_each_remedy_fixes_its_planted_bug_on_a_copy(case):
    """hf_sanity.fix on objects: the planted finding has a remedy, it is applied to copies (the unsafe ones
    only when asked), the checks run again on the copies and the finding is gone; the user's tokenizer, model,
    generation config and dataset are as they were."""
    import hf_sanity

    model, tok, rows, eval_rows, options, rule = planted(case)
    data = datasets.Dataset.from_list(rows)
    eval_data = datasets.Dataset.from_list(eval_rows) if eval_rows else None
    expected = rules_of(case, rule)
    before_tok, before_weights = json.dumps(tok.init_kwargs, default=str), state(model)
    before_stop, before_template = model.generation_config.eos_token_id, tok.chat_template
    kwargs = dict(
        model=model, tokenizer=tok, dataset=data, eval_dataset=eval_data, use_config=False, **options
    )

    if case in UNSAFE:  # without unsafe=True nothing is applied, and the errors remain
        held = hf_sanity.fix(**kwargs)
        assert not held.changed and {o.status for o in held.outcomes if o.finding.rule in expected} == {
            "not applied"
        }
    fixed = hf_sanity.fix(**kwargs, unsafe=case in UNSAFE)
    found = {f.rule for f in fixed.before.findings}
    assert expected <= found, [f.message for f in fixed.before.findings]
    outcomes = {o.finding.rule: o for o in fixed.outcomes}
    assert {r: outcomes[r].status for r in expected} == dict.fromkeys(expected, "fixed"), fixed.summary()
    assert not expected & {f.rule for f in fixed.report.findings}
    assert [o.finding.rule for o in fixed.outcomes if o.status == "new"] == []
    assert fixed.exit_code == 0 and fixed.changed
    # The user's objects are not the repaired ones, and did not change.
    assert json.dumps(tok.init_kwargs, default=str) == before_tok and tok.chat_template == before_template
    assert model.generation_config.eos_token_id == before_stop
    assert all(torch.equal(v, before_weights[k]) for k, v in state(model).items())
    assert data.to_list() == rows


def test_a_report_with_remedies_crosses_to_another_process():
    """Under torchrun, preflight sends rank 0's report to every rank by pickling it: the remedies go as their
    description (an ``apply`` edits this process's objects; it stays behind)."""
    import pickle

    from hf_sanity.drivers.preflight import preflight

    model, tok, rows, _, options, _ = planted("data")
    report = preflight(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows), use_config=False,
                       **options)  # fmt: skip
    remedied = [f for f in report.findings if f.remedy is not None]
    assert remedied
    copy = pickle.loads(pickle.dumps(report))
    assert [f.remedy.to_dict() for f in copy.findings if f.remedy] == [f.remedy.to_dict() for f in remedied]
    assert all(f.remedy.apply is None for f in copy.findings if f.remedy)
    assert all(f.remedy.apply is not None for f in remedied)  # the original keeps its edit


def test_what_each_remedy_changed():
    """The repaired objects carry exactly the change the remedy names."""
    import hf_sanity

    model, tok, rows, _, _, _ = planted("pad-is-eos")
    fixed = hf_sanity.fix(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows), unsafe=True,
                          use_config=False)  # fmt: skip
    assert tok.pad_token == "<|im_end|>" and fixed.tokenizer.pad_token == "<|pad|>"
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    restored = [r["labels"] for r in fixed.dataset.to_list()]
    answers = [sum(m["role"] == "assistant" for m in r["messages"]) for r in demo_conversations(len(rows))]
    assert [labels.count(eot) for labels in restored] == answers  # each answer's end of turn, no other
    assert [r["labels"].count(eot) for r in rows] == [0] * len(rows)
    assert '+  "pad_token": "<|pad|>",' in fixed.diff() and "labels[37]: -100 -> 3" in fixed.diff()

    model, tok, rows, _, _, _ = planted("stop-token")
    fixed = hf_sanity.fix(
        model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows), use_config=False
    )
    assert fixed.generation_config.eos_token_id == [0, 3] and model.generation_config.eos_token_id == 0
    assert fixed.remedies()[0].safety == "safe"

    model, tok, rows, _, options, _ = planted("truncated")
    fixed = hf_sanity.fix(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows), unsafe=True,
                          use_config=False, **options)  # fmt: skip
    longest = max(len(tok.apply_chat_template(r["messages"])["input_ids"]) for r in rows)
    assert fixed.training_args == {"max_length": longest}  # 32 rows: 99% of them is all of them
    assert "-max_length: 40" in fixed.diff() and f"+max_length: {longest}" in fixed.diff()


def test_a_template_without_markers_and_a_twin_in_trls_library(conversations):
    """Qwen2.5's template is one of TRL's originals: its training twin is the remedy, and since it renders
    every row as the original does, a safe one."""
    import hf_sanity
    from hf_sanity.measure.chat_templates import training_twin

    setups.trl_template("qwen2_5_training")  # the remedy: TRL's training twin
    tok = real_tokenizer("qwen2.5-instruct")
    fixed = hf_sanity.fix(tokenizer=tok, dataset=datasets.Dataset.from_list(conversations), loss_on="assistant",
                          select="template", use_config=False)  # fmt: skip
    (remedy,) = fixed.remedies()
    assert (
        remedy.safety == "safe" and remedy.detail["template"] == "TRL's training twin qwen2_5_training.jinja"
    )
    assert fixed.tokenizer.chat_template == training_twin(tok.chat_template)[1]
    assert fixed.exit_code == 0 and fixed.outcomes[0].status == "fixed"


def test_a_twin_that_renders_other_text_is_unsafe():
    """DeepSeek-R1's twin keeps the reasoning its original drops: the text changes, so it is unsafe, and with
    assistant-only loss asked it answers both findings."""
    import hf_sanity

    setups.trl_template("deepseek_r1_distill_training")  # the remedy: TRL's training twin
    tok = real_tokenizer("deepseek-r1-distill")
    data = datasets.Dataset.from_list(reasoning_conversations(8))
    report = hf_sanity.preflight(tokenizer=tok, dataset=data, loss_on="assistant", use_config=False,
                                 select=["generation-markers-missing", "template-drops-content"])  # fmt: skip
    safety = {f.rule: f.remedy.safety for f, _ in report.remedies()}
    assert safety == {"generation-markers-missing": "unsafe", "template-drops-content": "unsafe"}
    fixed = hf_sanity.fix(tokenizer=tok, dataset=data, report=report, unsafe=True, loss_on="assistant",
                          use_config=False, select=["generation-markers-missing", "template-drops-content"])  # fmt: skip
    assert {o.status for o in fixed.outcomes} == {"fixed"} and fixed.report.findings == []


def test_system_prompts_a_template_drops_are_merged_into_the_first_user_turn(conversations):
    import hf_sanity

    tok = real_tokenizer("phi3-instruct")
    tok.chat_template = tok.chat_template.replace(
        "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif",
        "{% if",
    )
    data = datasets.Dataset.from_list(conversations)
    fixed = hf_sanity.fix(tokenizer=tok, dataset=data, unsafe=True, select="template-drops-content",
                          use_config=False)  # fmt: skip
    (outcome,) = fixed.outcomes
    assert outcome.finding.evidence["cause"] == "system-role-dropped" and outcome.status == "fixed"
    with_system = [i for i, r in enumerate(conversations) if r["messages"][0]["role"] == "system"]
    assert fixed.remedies()[0].detail["rows_edited"] == len(with_system)
    merged = fixed.dataset[with_system[0]]["messages"]
    assert (
        merged[0]["role"] == "user"
        and conversations[with_system[0]]["messages"][0]["content"] in merged[0]["content"]
    )


def test_a_template_that_refuses_the_system_turn_gets_it_merged_and_the_other_bad_rows_dropped(conversations):
    import hf_sanity

    tok = real_tokenizer("mistral-instruct")
    rows = [r for r in conversations[:12] if r["messages"][0]["role"] != "system"]
    rows[1] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    rows.append(conversations[0])  # a system turn Mistral's template refuses
    fixed = hf_sanity.fix(tokenizer=tok, dataset=datasets.Dataset.from_list(rows), unsafe=True,
                          select="bad-input-values", use_config=False)  # fmt: skip
    assert fixed.outcomes[0].status == "fixed" and len(fixed.dataset) == len(rows) - 1
    assert fixed.dataset[len(rows) - 2]["messages"][0]["role"] == "user"  # the merged row, kept


def test_pad_tokens_are_the_tokenizers_own(conversations):
    """Llama-3's reserved pad, Qwen's <|endoftext|> (not its <|vision_pad|> placeholder); none for
    DeepSeek-R1-Distill, whose remedy then adds <pad> and resizes the embeddings (unsafe)."""
    import hf_sanity
    from hf_sanity.rules.masks import pad_candidate

    assert pad_candidate(real_tokenizer("llama3-instruct")) == "<|finetune_right_pad_id|>"
    assert pad_candidate(real_tokenizer("qwen2.5-instruct")) == "<|endoftext|>"
    assert pad_candidate(build_tokenizer("chatml", "eos")) == "<|pad|>"
    tok = real_tokenizer("deepseek-r1-distill")
    assert pad_candidate(tok) is None
    model = tiny_model_for(tok, SMALL)
    fixed = hf_sanity.fix(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(masked_eos_rows(tok, 8)),
                          unsafe=True, select="eos-not-learned", use_config=False)  # fmt: skip
    assert (
        fixed.tokenizer.pad_token == "<pad>"
        and fixed.model.get_input_embeddings().num_embeddings == len(tok) + 1
    )
    assert model.get_input_embeddings().num_embeddings == len(tok)  # the user's model is not resized
    assert fixed.outcomes[0].status == "fixed" and fixed.report.findings == []


def test_preference_pairs_keep_their_rows_and_get_the_remedies_that_hold_for_any_objective():
    """A DPO dataset preflights as pairs: no remedy edits or drops rows by an index that is not the dataset's;
    the generation config's stop token, which holds for any objective, is repaired."""
    import hf_sanity
    from hf_sanity.testing import demo_preference_pairs

    model, tok, _, _, _, _ = planted("stop-token")
    pairs = demo_preference_pairs(24)
    data = datasets.Dataset.from_list([*pairs, pairs[0]])
    fixed = hf_sanity.fix(
        model=model, tokenizer=tok, dataset=data, max_len=512, unsafe=True, use_config=False
    )
    assert fixed.before.stats["objective"] == "preference"
    assert [(o.finding.rule, o.status) for o in fixed.outcomes] == [("stop-token-mismatch", "fixed")]
    assert fixed.dataset is data and not fixed.repair.data_changed() and fixed.exit_code == 0


def test_a_clean_setup_changes_nothing_and_writes_only_the_verification(tmp_path, conversations):
    import hf_sanity

    model, tok = tiny_setup("chatml", "distinct")
    fixed = hf_sanity.fix(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(conversations),
                          unsafe=True, use_config=False, loss_on="completion")  # fmt: skip
    assert not fixed.changed and fixed.outcomes == [] and fixed.diff() == "" and fixed.exit_code == 0
    assert fixed.tokenizer is tok and fixed.model is model
    fixed.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["fixes.json", "fixes.md"]
    assert json.loads((tmp_path / "out" / "fixes.json").read_text())["changes"] == []


def test_an_error_without_a_remedy_remains_and_fails_the_fix(chatml, conversations):
    """Labels shifted by hand: no remedy can tell what the labels were meant to be. The duplicate is dropped;
    the error remains, and the exit code says so."""
    import hf_sanity

    rows = []
    for r in conversations[:8]:
        ids = chatml.apply_chat_template(r["messages"])["input_ids"]
        rows.append({"input_ids": ids, "labels": ids[1:] + [IGNORE_INDEX]})
    rows.append(rows[0])
    fixed = hf_sanity.fix(tokenizer=chatml, dataset=datasets.Dataset.from_list(rows), unsafe=True,
                          select=["labels-misaligned", "duplicate-examples"], use_config=False)  # fmt: skip
    status = {o.finding.rule: o.status for o in fixed.outcomes}
    assert status == {"labels-misaligned": "no remedy", "duplicate-examples": "fixed"}
    assert fixed.exit_code == 1 and "1 error remains" in fixed.summary()


def test_the_report_marks_findings_with_a_remedy(tmp_path):
    """As ruff marks a fixable diagnostic [*]: in the terminal, with the command that applies it, in JSON and
    on the HTML page."""
    import io

    from rich.console import Console

    import hf_sanity
    from hf_sanity.html import render_html

    model, tok, rows, _, _, _ = planted("pad-is-eos")
    report = hf_sanity.preflight(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows),
                                 use_config=False, select=["eos-not-learned", "prompt-in-loss"])  # fmt: skip
    report.fix_command = "hf-sanity fix --model m --dataset d --out DIR"
    out = io.StringIO()
    report.print(Console(file=out, width=200))
    text = out.getvalue()
    flat = " ".join(text.split())  # the remedy's line wraps
    assert "error   eos-not-learned [*]  " in text and "warning prompt-in-loss  " in text
    assert "[*] remedy (unsafe): set the pad token to '<|pad|>'" in flat
    assert "— hf-sanity fix --model m --dataset d --out DIR --unsafe-fixes" in flat
    assert (
        "[*] 1 finding with a remedy: hf-sanity fix --model m --dataset d --out DIR (1 unsafe: add --unsafe-fixes)"
        in flat
    )
    (eos,) = [f for f in report.to_dict()["findings"] if f["rule"] == "eos-not-learned"]
    assert eos["remedy"]["safety"] == "unsafe" and eos["remedy"]["changes"] == ["tokenizer", "dataset"]
    page = render_html(report)
    assert page.count('<span class="fixable"') == 2  # the finding's mark and the summary's
    assert 'data-safety="unsafe"' in page and "--out DIR --unsafe-fixes</code>" in page


# -- through the CLI ---------------------------------------------------------------------------------------
def snapshot(*paths: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``paths``: (modification time, sha256)."""
    out = {}
    for root in paths:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            out[str(path)] = (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def folder_of(tmp_path: Path, model, tok) -> Path:
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def cli_args(case: str, options: dict) -> list[str]:
    args = ["--unsafe-fixes"] if case in UNSAFE else []
    if "loss_on" in options:
        args += ["--loss-on", options["loss_on"]]
    if "max_len" in options:
        args += ["--max-len", str(options["max_len"])]
    return args


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_each_remedy_through_the_cli_to_a_folder_that_loads_and_trains(tmp_path, case):
    """`hf-sanity fix --model M --dataset D --out DIR`: exit 0, each planted finding fixed; DIR is a model folder
    that AutoTokenizer and AutoModelForCausalLM load, preflight on DIR (and DIR/dataset.jsonl) no longer finds
    the bug, and a real Trainer trains a few steps on it; M and D are byte for byte what they were."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_sanity

    model, tok, rows, eval_rows, options, rule = planted(case)
    folder = folder_of(tmp_path, model, tok)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    extra = ["--eval-dataset", str(write_jsonl(tmp_path / "eval.jsonl", eval_rows))] if eval_rows else []
    before = snapshot(folder, *[p for p in tmp_path.glob("*.jsonl")])
    out = tmp_path / "fixed"
    result = cli("fix", "--model", folder, "--dataset", data, "--out", out, *extra, *cli_args(case, options))
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshot(folder, *[p for p in tmp_path.glob("*.jsonl")]) == before
    expected = rules_of(case, rule)
    fixes = json.loads((out / "fixes.json").read_text())
    status = {o["rule"]: o["status"] for o in fixes["outcomes"]}
    assert {r: status.get(r) for r in expected} == dict.fromkeys(expected, "fixed"), result.stdout
    for line in (f"fixed{' ' * 8}", "every error fixed"):
        assert line in result.stdout, result.stdout
    assert (out / "fixes.md").read_text().startswith("# hf-sanity fix:")

    repaired_tok = AutoTokenizer.from_pretrained(out)
    repaired = AutoModelForCausalLM.from_pretrained(out)
    repaired_rows = [json.loads(line) for line in (out / "dataset.jsonl").read_text().splitlines()] if (
        out / "dataset.jsonl").is_file() else rows  # fmt: skip
    max_len = fixes["training_args"].get("max_length")
    again = hf_sanity.preflight(
        model=repaired, tokenizer=repaired_tok, dataset=datasets.Dataset.from_list(repaired_rows),
        max_len=max_len, loss_on=options.get("loss_on", "completion"), use_config=False,
        eval_dataset=datasets.Dataset.from_list(
            [json.loads(x) for x in (out / "eval_dataset.jsonl").read_text().splitlines()]
        ) if eval_rows else None,
    )  # fmt: skip
    assert not expected & {f.rule for f in again.findings}, [f.message for f in again.findings]
    trained = train_a_few_steps(case, out, repaired, repaired_tok, repaired_rows, max_len, tmp_path)
    assert not expected & {f.rule for f in trained.findings}, [f.message for f in trained.findings]


def train_a_few_steps(case, folder, model, tok, rows, max_len, tmp_path):
    """A real Trainer (TRL's SFTTrainer for conversations) for 3 steps on the repaired folder, with
    SanityCallback watching; preflight on the trainer's own batches first. Both reports' findings."""
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    import hf_sanity
    from hf_sanity.report import Report

    common = dict(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, report_to=[],
                  use_cpu=True, save_strategy="no", disable_tqdm=True)  # fmt: skip
    if case in ("pad-is-eos", "double-bos"):  # tokenized by hand, collated as so many scripts do
        if case == "double-bos":
            rows = [{"input_ids": tok(r["text"])["input_ids"]} for r in rows]
        data = datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
        collator = DataCollatorForLanguageModeling(tok, mlm=False)  # masks every pad id in the labels
        if case == "pad-is-eos":  # the labels as repaired, padded with -100
            data = datasets.Dataset.from_list(rows)
            collator = DataCollatorForSeq2Seq(tok, padding=True)
        trainer = Trainer(
            model=model, args=TrainingArguments(**common), train_dataset=data, data_collator=collator
        )
    else:
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, max_length=max_len or 512, dataset_num_proc=None,
                           assistant_only_loss=case == "generation-markers")  # fmt: skip
        trainer = SFTTrainer(model=model, args=config, processing_class=tok,
                             train_dataset=datasets.Dataset.from_list(rows))  # fmt: skip
        if case == "generation-markers":  # TRL used the folder's template: it has the markers
            assert trainer.chat_template is None
    before = hf_sanity.preflight(trainer=trainer, use_config=False)
    watch = hf_sanity.SanityCallback(use_config=False, print_findings=False)
    trainer.add_callback(watch)
    trainer.train()
    assert trainer.state.global_step == 3
    return Report(findings=before.findings + watch.report.findings)


@pytest.mark.slow
def test_the_pad_fix_is_what_keeps_a_collator_from_masking_eos(tmp_path):
    """DataCollatorForLanguageModeling masks every pad id in the labels: with the folder's own tokenizer
    (pad == EOS) it masks EOS, with the repaired one it does not."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    import hf_sanity

    model, tok, rows, _, _, _ = planted("pad-is-eos")
    folder = folder_of(tmp_path, model, tok)
    out = tmp_path / "fixed"
    result = cli("fix", "--model", folder, "--dataset", write_jsonl(tmp_path / "t.jsonl", rows), "--out", out,
                 "--unsafe-fixes", "--select", "eos-not-learned")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    pad = AutoTokenizer.from_pretrained(out).pad_token_id
    assert pad != tok.pad_token_id
    for name in (
        "config.json",
        "generation_config.json",
    ):  # none, or the old pad (EOS), would come back at load
        assert json.loads((out / name).read_text())["pad_token_id"] == pad, name
    data = datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no")  # fmt: skip
    found = {}
    for name, path in (("given", folder), ("repaired", out)):
        collator = DataCollatorForLanguageModeling(AutoTokenizer.from_pretrained(path), mlm=False)
        trainer = Trainer(model=copy.deepcopy(model), args=args, train_dataset=data, data_collator=collator)
        found[name] = {f.rule for f in hf_sanity.preflight(trainer=trainer, use_config=False).findings}
    assert "eos-not-learned" in found["given"] and "eos-not-learned" not in found["repaired"]


@pytest.mark.slow
def test_diff_prints_the_changes_and_writes_nothing(tmp_path):
    model, tok, rows, _, _, _ = planted("stop-token")
    folder = folder_of(tmp_path, model, tok)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    before = snapshot(tmp_path)
    result = cli("fix", "--model", folder, "--dataset", data, "--diff")
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshot(tmp_path) == before  # nothing written anywhere under it
    assert "--- a/generation_config.json" in result.stdout and "+    3" in result.stdout
    assert "# [*] stop-token-mismatch (safe): add '<|im_end|>' (id 3)" in result.stdout
    assert "fixed" in result.stdout and "every error fixed" in result.stdout


@pytest.mark.slow
def test_preflight_fix_and_a_clean_setup_through_the_cli(tmp_path):
    """`preflight --fix --fix-out DIR` prints the report, then the outcomes, and writes DIR; on a clean setup
    `fix` writes only the verification."""
    folder = str(tiny_model_dir("chatml", "distinct"))
    data = write_jsonl(tmp_path / "train.jsonl", demo_conversations(24))
    # a run that trains the answers (TRL's default for `messages` rows, every token, is a prompt-in-loss warning)
    result = cli(
        "fix", "--model", folder, "--dataset", data, "--out", tmp_path / "clean", "--loss-on", "completion"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hf-sanity fix: nothing to fix" in result.stdout
    assert sorted(p.name for p in (tmp_path / "clean").iterdir()) == ["fixes.json", "fixes.md"]

    model, tok, _, _, _, _ = planted("stop-token")
    folder = folder_of(tmp_path, model, tok)
    result = cli("preflight", "--model", folder, "--dataset", data, "--fix", "--fix-out", tmp_path / "fixed",
                 "--json", tmp_path / "report.json", "--loss-on", "completion")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (finding,) = json.loads((tmp_path / "report.json").read_text())[
        "findings"
    ]  # the report's files, as without --fix
    assert finding["rule"] == "stop-token-mismatch" and finding["remedy"]["safety"] == "safe"
    report, outcomes = result.stdout.split("hf-sanity fix:", 1)
    assert "error   stop-token-mismatch [*]" in report and "[*] remedy (safe)" in report
    assert "fixed" in outcomes and (tmp_path / "fixed" / "generation_config.json").is_file()
    config = json.loads((tmp_path / "fixed" / "generation_config.json").read_text())
    assert config["eos_token_id"] == [0, 3]


@pytest.mark.slow
def test_bad_fix_options_are_one_line(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("chatml", "distinct"), folder)
    data = write_jsonl(tmp_path / "train.jsonl", demo_conversations(8))
    assert_one_line_error(cli("fix", "--model", folder, "--dataset", data), "pass --out DIR")
    assert_one_line_error(cli("fix", "--model", folder, "--dataset", data, "--out", folder / "fixed"),
                          "inside", "never writes into your model or data folders")  # fmt: skip
    assert_one_line_error(
        cli("fix", "--model", folder, "--dataset", data, "--out", folder), "not an empty folder"
    )
    assert_one_line_error(cli("preflight", "--model", folder, "--dataset", data, "--fix"), "--fix-out")
    assert not (folder / "fixed").exists()


# -- what `fix` writes: only what changed ---------------------------------------------------------------------
def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))


@pytest.mark.slow
def test_a_tokenizer_only_fix_links_the_weights_and_updates_the_pad_ids(tmp_path):
    """pad-token-missing's remedy changes the tokenizer only: the weights of the copy are hard links to the
    user's (same inode, two links), not copies; config.json and generation_config.json of the copy name the
    new pad token's id (the user's said none); the folder loads with from_pretrained, the user's folder is
    byte for byte as it was, and preflight on the copy no longer finds the rule."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny_setup("chatml", "distinct")
    model, tok = copy.deepcopy(model), copy.deepcopy(tok)
    tok.pad_token = None
    model.config.pad_token_id = model.generation_config.pad_token_id = None
    folder = folder_of(tmp_path, model, tok)
    data = write_jsonl(tmp_path / "train.jsonl", demo_conversations(16))
    before = snapshot(folder, data)
    out = tmp_path / "fixed"
    result = cli("fix", "--model", folder, "--dataset", data, "--out", out, "--select", "pad-token-missing")
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshot(folder, data) == before
    (weights,) = weight_files(folder)
    mine, copied = (folder / weights).stat(), (out / weights).stat()
    assert (copied.st_ino, copied.st_dev) == (mine.st_ino, mine.st_dev) and copied.st_nlink == 2
    assert f"hard-linked from {folder}" in " ".join(result.stdout.split()) and weights in result.stdout
    assert not (out / "dataset.jsonl").exists()  # no remedy changed the data
    repaired_tok = AutoTokenizer.from_pretrained(out)
    pad = repaired_tok.pad_token_id
    assert pad is not None and tok.convert_ids_to_tokens(pad) == repaired_tok.pad_token
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text())["pad_token_id"] == pad, name
        assert json.loads((folder / name).read_text()).get("pad_token_id") is None, name
        assert (out / name).stat().st_ino != (folder / name).stat().st_ino  # written, not linked
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.pad_token_id == pad == loaded.generation_config.pad_token_id
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    again = cli("preflight", "--model", folder, "--dataset", data, "--json", tmp_path / "before.json")
    assert "pad-token-missing" in {
        f["rule"] for f in json.loads((tmp_path / "before.json").read_text())["findings"]
    }
    again = cli("preflight", "--model", out, "--dataset", data, "--json", tmp_path / "after.json")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "pad-token-missing" not in {
        f["rule"] for f in json.loads((tmp_path / "after.json").read_text())["findings"]
    }
    assert "hard links to the original model folder's" in (out / "fixes.md").read_text()


def test_where_the_file_system_refuses_a_link_the_file_is_copied_and_said(tmp_path, monkeypatch):
    """os.link fails across file systems (EXDEV): the unchanged file is copied, and the summary says why."""
    import errno
    import os

    import hf_sanity

    model, tok, rows, _, _, _ = planted("stop-token")
    folder = folder_of(tmp_path, model, tok)
    fixed = hf_sanity.fix(
        model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows), use_config=False
    )

    def refuse(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src))

    monkeypatch.setattr(os, "link", refuse)
    where = fixed.save(tmp_path / "fixed", model_folder=folder)
    (weights,) = weight_files(folder)
    assert (where / weights).read_bytes() == (folder / weights).read_bytes()
    assert (where / weights).stat().st_ino != (folder / weights).stat().st_ino
    assert fixed.written[weights] == "copied"
    summary = fixed.saved_summary(where, folder)
    assert f"copied (os.link failed, OSError: {os.strerror(errno.EXDEV)}): " in summary and weights in summary


@pytest.mark.slow
def test_parquet_data_stays_parquet_with_its_types_and_its_nan(tmp_path):
    """A data remedy on a Parquet file: the repaired data is dataset.parquet with the same schema (an int and a
    float column, NaN kept as NaN), one duplicate row fewer; JSONL input stays JSONL, with NaN written as NaN
    (not "nan"), and the copy's data passes preflight without the rule."""
    import math

    import pyarrow.parquet as pq

    folder = str(tiny_model_dir("chatml", "distinct"))
    rows = [{**r, "score": float("nan") if i % 3 == 0 else i / 2, "id": i}
            for i, r in enumerate(demo_conversations(16))]  # fmt: skip
    rows.append({**rows[4], "id": 99})  # the same conversation again
    given = datasets.Dataset.from_list(rows)
    (tmp_path / "data").mkdir()
    parquet = tmp_path / "data" / "train.parquet"
    given.to_parquet(str(parquet))
    out = tmp_path / "fixed"
    result = cli("fix", "--model", folder, "--dataset", parquet, "--out", out, "--unsafe-fixes",
                 "--select", "duplicate-examples")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (out / "dataset.jsonl").exists()
    table, original = pq.read_table(out / "dataset.parquet"), pq.read_table(parquet)
    assert table.schema.types == original.schema.types and table.num_rows == len(rows) - 1
    scores = table.column("score").to_pylist()
    assert [math.isnan(s) for s in scores] == [i % 3 == 0 for i in range(16)]
    assert table.column("id").to_pylist() == list(range(16))

    data = write_jsonl(tmp_path / "train.jsonl", rows)
    result = cli("fix", "--model", folder, "--dataset", data, "--out", tmp_path / "fixed-jsonl", "--unsafe-fixes",
                 "--select", "duplicate-examples")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "fixed-jsonl" / "dataset.jsonl").read_text()
    assert '"score": NaN' in text and '"nan"' not in text
    again = [json.loads(line) for line in text.splitlines()]
    assert len(again) == 16 and math.isnan(again[0]["score"]) and again[1]["score"] == 0.5
    check = cli("preflight", "--model", folder, "--dataset", out / "dataset.parquet", "--select",
                "duplicate-examples")  # fmt: skip
    assert check.returncode == 0 and "no findings" in check.stdout, check.stdout + check.stderr


@pytest.mark.slow
def test_out_inside_the_data_folder_is_refused_and_nothing_is_written(tmp_path):
    folder = str(tiny_model_dir("chatml", "distinct"))
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "train.jsonl", demo_conversations(8))
    before = snapshot(tmp_path)
    for command in (("fix", "--out"), ("preflight", "--fix", "--fix-out")):
        result = cli(
            *command[:-1], "--model", folder, "--dataset", data, command[-1], tmp_path / "data" / "fixed"
        )
        assert_one_line_error(
            result, "is inside the folder of", "never writes into your model or data folders"
        )
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.slow
def test_the_options_that_shape_the_checks_pass_through_fix_and_its_suggested_command(tmp_path):
    """An answer quoted from its context is label-leakage for a generative task and not for an extractive one:
    preflight --task extractive suggests `hf-sanity fix ... --task extractive`, and fix with it finds nothing
    to fix, where fix without it drops the row. --adapter and --inference-tokenizer pass through too."""
    model, tok, rows, _, _, _ = planted("data")
    folder = folder_of(tmp_path, model, tok)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    result = cli("preflight", "--model", folder, "--dataset", data, "--select", "label-leakage,pad-token-missing",
                 "--inference-tokenizer", folder, "--sample", "64")  # fmt: skip
    flat = " ".join(result.stdout.split())
    assert (
        f"hf-sanity fix --model {folder} --dataset {data} --inference-tokenizer {folder} --sample 64" in flat
    )
    generative = cli("fix", "--model", folder, "--dataset", data, "--select", "label-leakage", "--diff",
                     "--unsafe-fixes")  # fmt: skip
    assert "label-leakage" in generative.stdout and "drop the 1 row" in generative.stdout, generative.stdout
    extractive = cli("fix", "--model", folder, "--dataset", data, "--select", "label-leakage", "--diff",
                     "--unsafe-fixes", "--task", "extractive", "--inference-tokenizer", folder)  # fmt: skip
    assert extractive.returncode == 0, extractive.stdout + extractive.stderr
    assert "hf-sanity fix: nothing to fix" in extractive.stdout
    bad = cli("fix", "--model", folder, "--dataset", data, "--diff", "--adapter", tmp_path / "absent")
    assert_one_line_error(bad, "adapter")
