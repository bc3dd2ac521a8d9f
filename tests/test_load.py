"""The commands' one loader (hf_sanity/drivers/load.py): the early check of the paths says, word for word, what
the loaders would say after their imports; the setup it loads is the one the commands check."""

import json

import pytest

from hf_sanity.drivers import load
from hf_sanity.errors import UserInputError
from hf_sanity.measure.sources import load_config, load_dataset_ref
from hf_sanity.testing import demo_conversations, tiny_model_dir


def message(call, *args, **kwargs) -> str:
    with pytest.raises(UserInputError) as raised:
        call(*args, **kwargs)
    return str(raised.value)


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("nope.jsonl", None, "does not exist"),
        ("rows.txt", "a row\n", "unknown file type"),
        ("empty.jsonl", "", "is empty"),
    ],
)
def test_the_early_check_of_a_dataset_says_what_its_loader_says(tmp_path, name, content, says):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    early = message(load.check_paths, dataset=str(path))
    assert says in early
    assert early == message(load_dataset_ref, str(path))


@pytest.mark.parametrize("kind", ["missing", "a file", "no weights"])
def test_the_early_check_of_a_model_folder_says_what_its_loader_says(tmp_path, kind):
    folder = tmp_path / "model"
    if kind == "a file":
        folder.write_text("{}")
    elif kind == "no weights":
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    early = message(load.check_paths, str(folder))
    assert early == message(load_config, str(folder))


def test_a_model_folder_without_weights_passes_when_the_checks_read_no_weights(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    load.check_paths(str(folder), weights=False)


def test_from_paths_loads_the_setup_and_the_held_out_split_falls_back_to_validation(tmp_path):
    lines = "\n".join(json.dumps(r) for r in demo_conversations(4)) + "\n"
    held_out, train_only = tmp_path / "held-out", tmp_path / "train-only"
    for folder, split in ((held_out, "validation"), (train_only, "train")):
        folder.mkdir()
        (folder / f"{split}.jsonl").write_text(lines)
    model = str(tiny_model_dir("chatml", "distinct"))
    setup = load.from_paths(model, str(held_out), split=None, held_out=True)
    assert len(setup.dataset) == 4 and setup.tokenizer.chat_template and setup.config.model_type
    assert message(load.from_paths, model, str(train_only), split=None, held_out=True) == (
        f"dataset {str(train_only)!r} has no test or validation split: pass --split with the held-out one"
    )
