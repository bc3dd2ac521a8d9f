"""LLaMA-Factory's entry point with SanityCallback attached: ``run_exp(args, callbacks=[SanityCallback()])``.

    python -m hf_sanity.integrations.llamafactory train_lora.yaml     # in place of llamafactory-cli train

or from Python::

    from hf_sanity.integrations.llamafactory import run
    run("train_lora.yaml")

LLaMA-Factory (``llamafactory.train.tuner.run_exp``) passes the callbacks to the trainer it builds for the
config's stage, so the callback watches the batches LLaMA-Factory prepared (its ``template``, ``cutoff_len``,
``train_on_prompt``). The callback reads its options from ``[tool.hf-sanity]`` in the nearest pyproject.toml.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hf_sanity.errors import UserInputError

CUTOFF_LEN_DEFAULT = 2048  # LLaMA-Factory 0.9's DataArguments.cutoff_len


def read_config(path: str | Path) -> dict[str, Any]:
    """The YAML (or JSON) config as LLaMA-Factory's CLI reads it: one mapping of its arguments."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"no LLaMA-Factory config at {path}")
    args = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(args, dict):
        raise UserInputError(f"{path} does not hold a mapping of LLaMA-Factory arguments")
    return args


def run(config: str | Path | dict[str, Any], *, callback=None, **overrides: Any) -> None:
    """``run_exp`` on ``config`` (a path, or the arguments as a dict; ``overrides`` replace keys of it) with
    ``callback`` (default: ``SanityCallback()``) attached."""
    args = dict(config) if isinstance(config, dict) else read_config(config)
    args.update(overrides)
    try:
        from llamafactory.train.tuner import run_exp
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("llamafactory"):
            raise  # LLaMA-Factory is there but something it needs is not: its own error
        raise UserInputError("LLaMA-Factory is not installed here (pip install llamafactory)") from None

    from hf_sanity.callback import SanityCallback

    callback = callback if callback is not None else SanityCallback()
    callback.framework_cut = cut_of(args)
    run_exp(args, callbacks=[callback])


def cut_of(args: dict[str, Any]) -> int | None:
    """The length LLaMA-Factory cuts each row to before its collator (``cutoff_len``, 2048 by default), which its
    trainer never sees; None with packing (it packs whole rows into cutoff_len - 1: no row is cut)."""
    cutoff = args.get("cutoff_len", CUTOFF_LEN_DEFAULT)
    if args.get("packing") or args.get("neat_packing"):
        return None
    return cutoff if isinstance(cutoff, int) and not isinstance(cutoff, bool) and cutoff > 0 else None


def cut_of_command(argv: list[str]) -> int | None:
    """``cut_of`` the config a LLaMA-Factory process reads from its command line (as its ``read_args`` does: the
    first argument after the program and its subcommand that is a .yaml/.yml/.json file, with ``key=value``
    overrides after it); None where there is none or it cannot be read. For `hf-sanity run -- llamafactory-cli
    train cfg.yaml`, whose trainer gets its callback from the import hook."""
    for i, arg in enumerate(argv[1:3], start=1):
        if arg.endswith((".yaml", ".yml", ".json")):
            try:
                args = read_config(arg)
            except Exception:  # not readable here: LLaMA-Factory says so itself
                return None
            for override in argv[i + 1 :]:
                key, _, value = override.partition("=")
                if key in ("cutoff_len", "packing", "neat_packing") and value:
                    args[key] = int(value) if value.isdigit() else value.lower() in ("true", "1")
            return cut_of(args)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hf_sanity.integrations.llamafactory CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        run(argv[0])
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
