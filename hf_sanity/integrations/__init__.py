"""The training frameworks' own hooks for SanityCallback: an Axolotl plugin (:mod:`.axolotl`) and a
LLaMA-Factory entry point (:mod:`.llamafactory`). Neither framework is a dependency: each module imports its
framework only when it is used from it."""
