"""hf-sanity's own cache folder: ``$HF_SANITY_CACHE``, else ``~/.cache/hf-sanity``. What hf-sanity keeps between
runs (the tiny test models, the counts of the preparations Axolotl saved) goes there, never into the user's
folders."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("HF_SANITY_CACHE") or Path.home() / ".cache" / "hf-sanity")
