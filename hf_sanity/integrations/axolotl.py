"""An Axolotl plugin that attaches SanityCallback to the trainer Axolotl builds. In the run's config:

    plugins:
      - hf_sanity.integrations.axolotl.SanityPlugin

Axolotl (``axolotl.integrations.base.load_plugin``) imports this module, instantiates the class and calls
``add_callbacks_post_trainer(cfg, trainer)`` once the trainer exists; the callback then watches the batches
Axolotl's own data preparation made (its chat-template strategy, ``train_on_inputs``, ``sequence_len``). The
callback reads its options as everywhere else: ``[tool.hf-sanity]`` in the nearest pyproject.toml.

At ``register`` (the config is read, no dataset yet) the plugin also starts counting the rows Axolotl's data
preparation drops for being longer than ``sequence_len`` (:mod:`hf_sanity.integrations.axolotl_drops`): the
trainer never sees them, so the callback could not.

Importable without Axolotl: the class is Axolotl's ``BasePlugin`` subclass where Axolotl is installed, a
plain class with the same hook where it is not (nothing calls it there).
"""

from __future__ import annotations

from typing import Any

from hf_sanity.integrations.axolotl_drops import watch_preparation

try:  # Axolotl is importing this module when it loads the plugin: its base class is there to subclass
    from axolotl.integrations.base import BasePlugin as _Base
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("axolotl"):
        raise  # Axolotl is there but something it needs is not: its own error, as the user would see it
    _Base = object


class SanityPlugin(_Base):
    """Axolotl's hook for callbacks that need the trainer: one SanityCallback, unless the trainer already has
    one (``hf-sanity run -- axolotl train ...`` attached it, or the user did). At ``register`` (the config is
    read, no dataset yet) it starts counting the rows the data preparation drops for length."""

    def register(self, cfg: Any) -> None:
        watch_preparation()

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list:
        from hf_sanity.callback import SanityCallback
        from hf_sanity.launch.hook import watcher

        if watcher(trainer) is not None:
            return []
        return [SanityCallback()]
