"""A single-batch reproduction of a broken layer: the batch as safetensors, what was measured, and a script.

The folder is the one the user passes, or a fresh one under ``./hf-sanity-repro/`` in the current directory;
never a folder inside the model, tokenizer or dataset folders (those are read-only to hf-sanity).
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.jsonvalues import jsonable
from hf_sanity.report import write_atomic

DEFAULT_FOLDER = "hf-sanity-repro"

SCRIPT = '''"""Single-batch reproduction written by hf-sanity diagnose.

Broken: {layer}: {message}

Run:    python {script}  [--model MODEL]
It loads the saved batch and the model (with the LoRA config of the run, if any), runs one forward and one
backward pass with the model's own loss, and prints what hf-sanity measured on the gradient path. A custom
Trainer.compute_loss or optimizer is not replayed here: repro.json names them.
"""

import argparse
import json
import pathlib
import warnings

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

warnings.filterwarnings("ignore", category=FutureWarning)
HERE = pathlib.Path(__file__).resolve().parent
parser = argparse.ArgumentParser()
parser.add_argument("--model", default={model!r}, required={required!r})
args = parser.parse_args()

batches = {{}}
for key, tensor in load_file(str(HERE / "batch.safetensors")).items():
    index, name = key.split(".", 1)
    batches.setdefault(int(index), {{}})[name] = tensor
model = AutoModelForCausalLM.from_pretrained(args.model)
if (HERE / "adapter_config.json").is_file():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig.from_pretrained(str(HERE)))
model.train()
for index, batch in sorted(batches.items()):
    inputs = {{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}}
    labels = inputs.get("labels")
    supervised = int((labels[:, 1:] != -100).sum()) if labels is not None else None
    loss = model(**inputs).loss
    grad_fn = type(loss.grad_fn).__name__ if loss.grad_fn is not None else None
    print(f"batch {{index}}: input_ids {{tuple(inputs['input_ids'].shape)}}, {{supervised}} label positions carry loss, "
          f"loss {{loss.item():.4f}}, grad_fn {{grad_fn}}")
    if loss.requires_grad:
        loss.backward()
trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
moving = [n for n, p in trainable if p.grad is not None and bool(p.grad.abs().sum() > 0)]
print(f"{{len(trainable)}} trainable tensors, {{len(moving)}} with a non-zero gradient")
measured = json.loads((HERE / "repro.json").read_text())
print("hf-sanity measured:", json.dumps(measured["measured"], indent=1))
'''


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def repro_folder(requested: str | Path | None, protected: list[Path]) -> Path:
    """The folder to write into: ``requested``, or a fresh one under ./hf-sanity-repro/ (a temporary one
    when the current directory is itself inside a protected folder)."""
    if requested is not None:
        folder = Path(requested).expanduser()
        for guarded in protected:
            if _inside(folder, guarded):
                raise UserInputError(
                    f"--repro {str(requested)!r} is inside {str(guarded)!r}; hf-sanity never writes into the model "
                    "or data folders: pass another folder"
                )
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    base = Path.cwd() / DEFAULT_FOLDER
    if any(_inside(base, guarded) for guarded in protected):
        return Path(tempfile.mkdtemp(prefix="hf-sanity-repro-"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = base / stamp
    suffix = 1
    while folder.exists():
        suffix += 1
        folder = base / f"{stamp}-{suffix}"
    folder.mkdir(parents=True)
    return folder


def command_line(argv: list[str] | None) -> str | None:
    if not argv:
        return None
    return shlex.join(["hf-sanity", *argv[1:]] if argv[0].endswith(("cli.py", "hf-sanity")) else argv)


def save_repro(
    pipeline, folder: Path, *, layer: str, message: str, cause: str | None, measured: dict
) -> dict[str, Any]:
    """Write the batch, the measurements and the reproduction script; return where and how to run it."""
    from safetensors.torch import save_file

    tensors = {}
    for i, batch in enumerate(pipeline.batches):
        for key, value in batch.items():
            if hasattr(value, "shape") and hasattr(value, "contiguous"):
                tensors[f"{i}.{key}"] = value.detach().cpu().contiguous()
    save_file(tensors, str(folder / "batch.safetensors"), metadata={"layer": layer, "cause": cause or ""})
    if pipeline.adapter:
        config = {
            k: v for k, v in pipeline.adapter.items() if k not in ("base_model_name_or_path", "revision")
        }
        write_atomic(folder / "adapter_config.json", json.dumps(jsonable(config), indent=2) + "\n")
    script = folder / "reproduce.py"
    write_atomic(
        script,
        SCRIPT.format(
            layer=layer,
            message=message.replace('"""', "'''"),
            script=shlex.quote(str(script)),
            model=pipeline.model_ref,
            required=pipeline.model_ref is None,
        ),
    )
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"
    again = command_line(pipeline.command)
    info = {
        "folder": str(folder),
        "command": command,
        "diagnose": again,
        "layer": layer,
        "cause": cause,
        "message": message,
        "model": pipeline.model_ref,
        "source": pipeline.source,
        "optimizer": pipeline.optimizer_name,
        "tensors": {k: list(v.shape) for k, v in tensors.items()},
        "measured": measured,
    }
    write_atomic(folder / "repro.json", json.dumps(jsonable(info), indent=2, ensure_ascii=False) + "\n")
    return {"folder": str(folder), "command": command, "diagnose": again}
