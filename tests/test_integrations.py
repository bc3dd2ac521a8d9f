"""The frameworks' native hooks: the Axolotl plugin (`plugins: [hf_sanity.integrations.axolotl.SanityPlugin]`)
and LLaMA-Factory's entry point (`run_exp(args, callbacks=[SanityCallback()])`).

The runs through the real framework need its own virtualenv at the versions it pins (Axolotl 0.19: transformers
5.16.1, TRL 1.9): HF_SANITY_AXOLOTL_VENV (default /work/venvs/ax), built with
`python3 -m venv DIR && DIR/bin/pip install torch==2.13.0 && DIR/bin/pip install axolotl==0.19.0`. Without it
they skip and say so."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist import tinytrain as tt

from hf_sanity import SanityCallback
from hf_sanity.testing import demo_conversations, tiny_setup

ROOT = Path(__file__).resolve().parents[1]
AXOLOTL_VENV = Path(os.environ.get("HF_SANITY_AXOLOTL_VENV", "/work/venvs/ax"))


def test_the_axolotl_plugin_imports_without_axolotl_and_attaches_one_callback(tmp_path):
    code = (
        "import sys; import hf_sanity.integrations.axolotl as m; "
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('axolotl', 'torch', 'transformers')))"
    )
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert (
        imported.stdout.strip() == "[]"
    )  # nothing heavy at import: Axolotl imports it while loading plugins
    from hf_sanity import SanityCallback
    from hf_sanity.integrations.axolotl import SanityPlugin

    trainer = tt.trainer(tmp_path / "out", max_steps=2)
    (added,) = SanityPlugin().add_callbacks_post_trainer({}, trainer)
    assert type(added) is SanityCallback
    trainer.add_callback(added)
    assert SanityPlugin().add_callbacks_post_trainer({}, trainer) == []  # never a second one
    trainer.train()
    assert added.report.stats["steps"] == 2 and (tmp_path / "out" / "hf-sanity" / "report.json").is_file()


def test_the_llamafactory_entry_point_reads_the_config_and_says_a_bad_one_in_one_line(tmp_path):
    from hf_sanity.integrations.llamafactory import main, read_config

    config = tmp_path / "train.yaml"
    config.write_text("model_name_or_path: m\nstage: sft\ncutoff_len: 40\n")
    assert read_config(config) == {"model_name_or_path": "m", "stage": "sft", "cutoff_len": 40}
    result = subprocess.run([sys.executable, "-m", "hf_sanity.integrations.llamafactory", tmp_path / "none.yaml"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: no LLaMA-Factory config at {tmp_path / 'none.yaml'}"
    ]
    assert main([]) == 2
    if importlib.util.find_spec("llamafactory") is None:  # a good config, and no LLaMA-Factory: said so
        result = subprocess.run([sys.executable, "-m", "hf_sanity.integrations.llamafactory", config],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            "error: LLaMA-Factory is not installed here (pip install llamafactory)"
        ]


# -- the rows Axolotl's preparation drops for length, counted (no Axolotl needed) --------------------------------
AXOLOTL_TRAINERS = (
    "axolotl.core.trainers.base"  # where Axolotl's trainer class lives: its framework, by module
)


def axolotl_like_drop(dataset, sequence_len, cfg):
    """What Axolotl 0.19's `handle_long_seq_in_dataset` does with `excess_length_strategy` unset ("drop") or
    "truncate": keep the rows of 2 to sequence_len tokens, or cut the longer ones."""
    if (cfg.get("excess_length_strategy") or "drop") == "truncate":
        return dataset.map(lambda row: {k: row[k][:sequence_len] for k in ("input_ids", "labels")})
    return dataset.filter(lambda row: 2 <= len(row["input_ids"]) <= sequence_len)


# Axolotl 0.19's SFT preparation, in the calls the counting goes through: `_load_tokenized_prepared_datasets` loads
# the rows an earlier preparation saved under the config's hash, else `_load_raw_datasets` prepares them (the length
# handling) and saves them.
AXOLOTL_SFT = """
def _load_tokenized_prepared_datasets(dataset, cfg, split):
    loaded = load_preprocessed_dataset(cfg, cfg["hash"])
    return loaded if loaded is not None else _load_raw_datasets(dataset, cfg, split)

def _load_raw_datasets(dataset, cfg, split):
    dataset = handle_long_seq_in_dataset(dataset, cfg["sequence_len"], cfg)
    save_preprocessed_dataset(cfg, dataset, cfg["hash"], split)
    return dataset
"""


@pytest.fixture
def axolotl_preparation(monkeypatch, tmp_path):
    """Axolotl's SFT preparation module as the plugin finds it (``axolotl.utils.data.sft``, which imports the
    length handler by name), with the handler above and a prepared-rows folder in ``tmp_path``; hf-sanity's cache
    there too; this process's counts forgotten after the test."""
    import types

    import datasets

    from hf_sanity.integrations import axolotl_drops
    from hf_sanity.measure import frameworks

    prepared = tmp_path / "last_run_prepared"

    def save_preprocessed_dataset(cfg, dataset, dataset_hash, split):
        dataset.save_to_disk(str(prepared / dataset_hash))

    def load_preprocessed_dataset(cfg, dataset_hash):
        folder = prepared / dataset_hash
        return datasets.load_from_disk(str(folder)) if folder.is_dir() else None

    utils = types.ModuleType(axolotl_drops.DEFINED_IN)
    sft = types.ModuleType(axolotl_drops.CALLED_FROM)
    utils.handle_long_seq_in_dataset = sft.handle_long_seq_in_dataset = axolotl_like_drop
    sft.save_preprocessed_dataset = save_preprocessed_dataset
    sft.load_preprocessed_dataset = load_preprocessed_dataset
    exec(AXOLOTL_SFT, vars(sft))
    monkeypatch.setitem(sys.modules, axolotl_drops.DEFINED_IN, utils)
    monkeypatch.setitem(sys.modules, axolotl_drops.CALLED_FROM, sft)
    monkeypatch.setenv("HF_SANITY_CACHE", str(tmp_path / "hf-sanity-cache"))
    yield sft
    frameworks.forget_prepared_drops()


def axolotl_rows(tok, n: int = 32) -> list[dict]:
    """Single-turn rows tokenized as Axolotl's chat_template strategy does: the whole conversation, the prompt's
    labels masked."""
    out = []
    for row in demo_conversations(n, multi_turn_every=0):
        ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        prompt = tok.apply_chat_template(row["messages"][:-1], tokenize=True, return_dict=True,
                                         add_generation_prompt=True)["input_ids"]  # fmt: skip
        out.append({"input_ids": ids, "labels": [-100] * len(prompt) + ids[len(prompt) :]})
    return out


def axolotl_trainer(tmp_path, rows, sequence_len: int, callbacks):
    """A real Trainer whose class lives where Axolotl's does and whose arguments carry `sequence_len`, as
    Axolotl's do."""
    import dataclasses

    import datasets
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    model, tok = tiny_setup("chatml")
    args_cls = dataclasses.make_dataclass(
        "AxolotlTrainingArguments", [("sequence_len", int, 512)], bases=(TrainingArguments,)
    )
    trainer_cls = type("AxolotlTrainer", (Trainer,), {"__module__": AXOLOTL_TRAINERS})
    args = args_cls(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False,
        sequence_len=sequence_len,
    )  # fmt: skip
    collator = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100)
    data = rows if isinstance(rows, datasets.Dataset) else datasets.Dataset.from_list(rows)
    return trainer_cls(model=model, args=args, train_dataset=data,
                       data_collator=collator, processing_class=tok, callbacks=list(callbacks))  # fmt: skip


@pytest.mark.planted("truncated-completion")
def test_the_rows_axolotls_preparation_drops_for_length_are_counted_and_said_in_axolotls_terms(
    tmp_path, axolotl_preparation, capsys
):
    """The plugin wraps Axolotl's length handling where its preparation calls it; the training rows longer than
    sequence_len that Axolotl's default `drop` filters out are counted, and the callback on Axolotl's trainer
    (which never sees them) says how many, why and what to change in the config."""

    from hf_sanity.integrations.axolotl import SanityPlugin

    _, tok = tiny_setup("chatml")
    rows = axolotl_rows(tok)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    sequence_len = lengths[len(lengths) * 3 // 4]  # a quarter of the rows, or about, are longer
    longer = sum(n > sequence_len for n in lengths)
    assert 0 < longer < len(rows)

    SanityPlugin().register({})
    SanityPlugin().register({})  # registered twice (two configs in one process): wrapped once
    kept = prepare(axolotl_preparation, rows, sequence_len=sequence_len)
    assert len(kept) == len(rows) - longer  # Axolotl's own result, passed on

    watch = SanityCallback(use_config=False, print_findings=False)
    axolotl_trainer(
        tmp_path, kept, sequence_len, [watch]
    ).train()  # the filtered dataset, as Axolotl passes it
    found = {f.rule: f for f in watch.report.findings}
    assert "internal-error" not in found, found
    finding = found["truncated-completion"]
    evidence = finding.evidence
    assert evidence["dropped_too_long"] == longer and evidence["rows_prepared"] == len(rows)
    assert evidence["longest_dropped"] == lengths[-1] and evidence["strategy_is_default"] is True
    assert evidence["excess_length_strategy"] == "drop" and evidence["framework"] == "Axolotl"
    assert evidence["dropped_by_trainer"] == 0  # Axolotl's preparation dropped them, not its trainer
    assert finding.message.startswith(
        f"Axolotl's sequence_len={sequence_len} dropped {longer} of the {len(rows)} rows its data preparation "
        "tokenized"
    )
    assert "`excess_length_strategy: drop`, Axolotl's default" in finding.message
    assert finding.fix.startswith(f"Raise `sequence_len` in the Axolotl config to {lengths[-1]} ")
    assert "`excess_length_strategy: truncate`" in finding.fix and "shorten or split the rows" in finding.fix
    assert finding.severity == ("error" if longer / len(rows) >= 0.10 else "warning")
    assert "hf-sanity:" not in capsys.readouterr().err  # counted without a word on stderr


def prepare(sft, rows, **cfg):
    """Axolotl's preparation of the training split on ``rows``: the rows it saved under the config's hash, else
    prepared now (and saved)."""
    import datasets

    cfg.setdefault("hash", f"h{cfg['sequence_len']}")
    return sft._load_tokenized_prepared_datasets(datasets.Dataset.from_list(rows), cfg, "train")


@pytest.mark.clean("truncated-completion")
def test_axolotls_preparation_that_drops_no_row_for_length_is_silent(tmp_path, axolotl_preparation):
    """Every row fits sequence_len: the default `drop` drops none, nothing is said."""
    from hf_sanity.integrations.axolotl import SanityPlugin
    from hf_sanity.measure import frameworks

    _, tok = tiny_setup("chatml")
    rows = axolotl_rows(tok, 16)
    sequence_len = max(len(r["input_ids"]) for r in rows)
    SanityPlugin().register({})
    kept = prepare(axolotl_preparation, rows, sequence_len=sequence_len)
    drop = frameworks.prepared_drop(frameworks.AXOLOTL)
    assert drop.too_long == 0 and drop.rows_prepared == drop.rows_kept == len(kept) == len(rows)
    watch = SanityCallback(use_config=False, print_findings=False)
    axolotl_trainer(tmp_path, kept.to_list(), sequence_len, [watch]).train()
    assert watch.report.findings == []


def test_axolotls_truncate_strategy_cuts_rows_and_drops_none(axolotl_preparation):
    """`excess_length_strategy: truncate`: the long rows are cut, not dropped (truncated-completion reads the cut
    on the batches, tests/test_integrations.py's real run): none is counted as dropped."""
    from hf_sanity.integrations.axolotl_drops import watch_preparation
    from hf_sanity.measure import frameworks

    _, tok = tiny_setup("chatml")
    rows = axolotl_rows(tok, 16)
    watch_preparation()  # as `hf-sanity run -- axolotl train ...`'s import hook calls it
    sequence_len = max(len(r["input_ids"]) for r in rows) - 4
    kept = prepare(axolotl_preparation, rows, sequence_len=sequence_len, excess_length_strategy="truncate")
    assert len(kept) == len(rows) and max(len(ids) for ids in kept["input_ids"]) == sequence_len
    drop = frameworks.prepared_drop(frameworks.AXOLOTL)
    assert drop.too_long == 0 and drop.strategy == "truncate" and drop.strategy_set


def test_the_count_of_a_preparation_axolotl_saved_is_recalled_when_a_later_run_loads_it(axolotl_preparation):
    """`axolotl preprocess`, then `axolotl train` (or a second run of the same config): the second process loads
    the rows the first saved, drops nothing itself, and the first one's count is what it reports."""
    from hf_sanity.integrations.axolotl import SanityPlugin
    from hf_sanity.integrations.axolotl_drops import memory_dir
    from hf_sanity.measure import frameworks

    _, tok = tiny_setup("chatml")
    rows = axolotl_rows(tok)
    lengths = sorted(len(r["input_ids"]) for r in rows)
    sequence_len = lengths[len(lengths) * 3 // 4]
    longer = sum(n > sequence_len for n in lengths)
    SanityPlugin().register({})
    first = prepare(axolotl_preparation, rows, sequence_len=sequence_len)
    counted = frameworks.prepared_drop(frameworks.AXOLOTL)
    assert counted.too_long == longer and not counted.prepared_earlier
    assert [p.name for p in memory_dir().iterdir()] == [f"h{sequence_len}.json"]  # hf-sanity's cache only

    frameworks.forget_prepared_drops()  # the next process
    again = prepare(axolotl_preparation, rows, sequence_len=sequence_len)
    assert len(again) == len(first)
    recalled = frameworks.prepared_drop(frameworks.AXOLOTL)
    assert recalled.prepared_earlier and recalled.too_long == longer and recalled.rows_prepared == len(rows)

    # Rows saved again without hf-sanity: the count kept does not match them, and the one recalled before in this
    # process does not stand for them either.
    (memory_dir() / f"h{sequence_len}.json").write_text(
        (memory_dir() / f"h{sequence_len}.json").read_text().replace('"saved_rows": ', '"saved_rows": 1')
    )
    prepare(axolotl_preparation, rows, sequence_len=sequence_len)
    assert frameworks.prepared_drop(frameworks.AXOLOTL) is None


def test_an_axolotl_without_the_length_handler_is_one_line_and_no_count(monkeypatch, capsys):
    """Axolotl's internals differ (another version): one line says the count is missing; nothing raises."""
    import types

    from hf_sanity.integrations import axolotl_drops
    from hf_sanity.measure import frameworks

    monkeypatch.setitem(sys.modules, axolotl_drops.CALLED_FROM, types.ModuleType(axolotl_drops.CALLED_FROM))
    axolotl_drops.watch_preparation()
    assert capsys.readouterr().err.strip().splitlines() == [
        "hf-sanity: cannot count the rows Axolotl drops for being longer than sequence_len "
        "(axolotl.utils.data.sft has no handle_long_seq_in_dataset: another Axolotl than 0.19); the run goes on, "
        "and the report does not say how many"
    ]
    assert frameworks.prepared_drop(frameworks.AXOLOTL) is None


# -- through the real Axolotl -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def axolotl_files(tmp_path_factory):
    if not (AXOLOTL_VENV / "bin" / "axolotl").is_file():
        pytest.skip(
            f"NOT RUN: no Axolotl virtualenv at {AXOLOTL_VENV} (set HF_SANITY_AXOLOTL_VENV, or build it: python3 -m "
            f"venv {AXOLOTL_VENV} && {AXOLOTL_VENV}/bin/pip install torch==2.13.0 && {AXOLOTL_VENV}/bin/pip "
            "install axolotl==0.19.0)"
        )
    from conftest import real_tokenizer
    from hf_sanity.testing import demo_conversations, tiny_model_for

    root = tmp_path_factory.mktemp("axolotl")
    tok = real_tokenizer("qwen2.5-instruct")
    tiny_model_for(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = demo_conversations(32, multi_turn_every=0)
    (root / "train.jsonl").write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    return root


def axolotl_train(
    root: Path, out: Path, *, through: str = "plugin", **keys
) -> tuple[subprocess.CompletedProcess, dict]:
    """`axolotl train config.yml` as a user runs it (its own virtualenv, offline): with the plugin listed
    (``through="plugin"``), after `axolotl preprocess config.yml` (``through="preprocessed"``: the result's output
    is both commands'), or under `hf-sanity run --json ... -- axolotl train config.yml` without the plugin
    (``through="run"``)."""
    config = {
        "base_model": str(root / "model"), "chat_template": "tokenizer_default",
        "datasets": [{"path": str(root / "train.jsonl"), "ds_type": "json", "type": "chat_template",
                      "field_messages": "messages"}],
        "sequence_len": 256, "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 4,
        "num_epochs": 1, "learning_rate": 0.001, "optimizer": "adamw_torch", "lr_scheduler": "constant",
        "output_dir": str(out), "dataset_prepared_path": str(out.parent / f"{out.name}-prepared"),
        "save_strategy": "no", "logging_steps": 1, "bf16": False, "fp16": False, "tf32": False,
        "plugins": ["hf_sanity.integrations.axolotl.SanityPlugin"], **keys,
    }  # fmt: skip
    path = out.parent / f"{out.name}.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "PATH": f"{AXOLOTL_VENV / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "AXOLOTL_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_SANITY_CACHE": str(root / "hf-sanity-cache")}  # fmt: skip
    env.pop("VIRTUAL_ENV", None)
    command = [str(AXOLOTL_VENV / "bin" / "axolotl"), "train", str(path)]
    reported = out / "hf-sanity" / "report.json"
    if through == "run":
        config.pop("plugins")
        path.write_text(json.dumps(config))
        reported = out.parent / f"{out.name}-report.json"
        command = [sys.executable, "-m", "hf_sanity.cli", "run", "--json", str(reported), "--", *command]
    before = ""
    if through == "preprocessed":
        pre = subprocess.run([command[0], "preprocess", str(path)], capture_output=True, text=True, timeout=900,
                             cwd=out.parent, env=env)  # fmt: skip
        assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
        before = pre.stdout + pre.stderr
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=out.parent, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    result.stdout = before + result.stdout
    loaded = (
        "Plugin loaded successfully: hf_sanity.integrations.axolotl.SanityPlugin"
        in result.stdout + result.stderr
    )
    assert loaded == (through != "run")
    return result, json.loads(reported.read_text())


@pytest.mark.slow
def test_a_clean_axolotl_run_with_the_plugin_is_watched_and_silent(axolotl_files):
    _, report = axolotl_train(axolotl_files, axolotl_files / "clean")
    assert report["findings"] == []
    assert report["stats"]["steps"] == 4  # the callback watched every step of Axolotl's trainer


@pytest.mark.slow
def test_an_axolotl_learning_rate_far_too_high_is_caught(axolotl_files):
    _, report = axolotl_train(axolotl_files, axolotl_files / "lr", learning_rate=3.0, max_steps=8)
    rules = {f["rule"] for f in report["findings"]}
    assert "loss-diverged" in rules and "internal-error" not in rules, report["findings"]


@pytest.mark.slow
@pytest.mark.planted("truncated-completion")
def test_an_axolotl_sequence_len_that_truncates_the_answers_is_named_in_axolotls_terms(axolotl_files):
    """`sequence_len: 40` with `excess_length_strategy: truncate`: the rows arrive cut at 40, their answers without
    an end of turn: truncation in Axolotl's terms, not an end-of-turn masking bug."""
    _, report = axolotl_train(
        axolotl_files, axolotl_files / "cut", sequence_len=40, excess_length_strategy="truncate"
    )
    found = {f["rule"]: f for f in report["findings"]}
    assert "eos-not-learned" not in found and "internal-error" not in found, report["findings"]
    finding = found["truncated-completion"]
    assert (
        finding["evidence"]["cause"] == "trainer-max-length" and finding["evidence"]["framework"] == "Axolotl"
    )
    assert (
        finding["evidence"]["setting"] == "sequence_len"
        and finding["evidence"]["cut_read_from"] == "arguments"
    )
    assert finding["message"].startswith("Axolotl's sequence_len=40 ")
    assert "`sequence_len` in the Axolotl config" in finding["fix"]
    assert report["stats"]["trainer"]["framework"] == "Axolotl"


@pytest.mark.slow
@pytest.mark.planted("truncated-completion")
@pytest.mark.parametrize("through", ["plugin", "run", "preprocessed"])
def test_the_rows_axolotl_drops_for_being_longer_than_sequence_len_are_counted(axolotl_files, through):
    """Axolotl's default `excess_length_strategy: drop` with a `sequence_len` a quarter of the rows exceed: its
    preparation drops them before any trainer exists (one log line); the report says how many of how many, why,
    and the fix in Axolotl's terms: with the plugin listed, under `hf-sanity run -- axolotl train`, and in
    `axolotl train` after `axolotl preprocess` (which prepared and saved the rows: the count kept then)."""
    from conftest import real_tokenizer

    tok = real_tokenizer("qwen2.5-instruct")
    rows = [json.loads(line) for line in (axolotl_files / "train.jsonl").read_text().splitlines()]
    lengths = sorted(
        len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
        for r in rows
    )
    sequence_len = lengths[len(lengths) * 3 // 4]
    longer = sum(n > sequence_len for n in lengths)  # the rows of the raw file longer than sequence_len
    assert 0 < longer <= len(rows) // 4
    result, report = axolotl_train(
        axolotl_files, axolotl_files / f"dropped-{through}", through=through, sequence_len=sequence_len
    )
    logged = re.search(
        r"Dropped (\d+) sequences outside valid range \(\[\w+, (\d+)\]\)", result.stdout + result.stderr
    )
    assert logged is not None and (int(logged[1]), int(logged[2])) == (
        longer,
        sequence_len,
    )  # Axolotl's own count
    found = {f["rule"]: f for f in report["findings"]}
    assert "internal-error" not in found, report["findings"]
    finding = found["truncated-completion"]
    evidence = finding["evidence"]
    assert (evidence["dropped_too_long"], evidence["rows_prepared"]) == (longer, len(rows))
    assert evidence["longest_dropped"] == lengths[-1] and evidence["max_len"] == sequence_len
    assert evidence["excess_length_strategy"] == "drop" and evidence["strategy_is_default"] is True
    assert evidence["framework"] == "Axolotl" and evidence["setting"] == "sequence_len"
    assert evidence["dropped_by_trainer"] == 0 and "no completion token" not in finding["message"]
    assert finding["message"].startswith(
        f"Axolotl's sequence_len={sequence_len} dropped {longer} of the {len(rows)} rows its data preparation "
        "tokenized"
    )
    assert "(`excess_length_strategy: drop`, Axolotl's default)" in finding["message"]
    assert finding["fix"].startswith(f"Raise `sequence_len` in the Axolotl config to {lengths[-1]} ")
    assert (
        "`excess_length_strategy: truncate`" in finding["fix"]
        and "shorten or split the rows" in finding["fix"]
    )
    assert "hf-sanity: cannot count" not in result.stderr
    if through == "preprocessed":  # train loaded the rows preprocess saved: the count is the one kept then
        assert "Loading prepared dataset from disk" in result.stdout + result.stderr
        assert (
            evidence["prepared_earlier"] is True
            and "loaded from `dataset_prepared_path`" in finding["message"]
        )
    else:
        assert "prepared_earlier" not in evidence
