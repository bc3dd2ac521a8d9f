"""Check the user's own training command: ``hf-sanity run -- CMD`` and ``hf-sanity preflight -- CMD``.

Most people who fine-tune never write ``Trainer(...)``: they run ``trl sft ...``, a framework's CLI or a script,
often under ``accelerate launch`` or ``torchrun``. This package reaches the trainers such a command builds, in
every process it starts, without changing the command:

* :mod:`~hf_sanity.launch.protocol`: what the parent tells its children (one environment variable, read by each
  process) and what they send back (files in a private folder the variable names: who attached to which
  trainer, rank 0's report). Plain Python: the parent never imports torch or transformers.
* :mod:`~hf_sanity.launch.bootstrap`: copied as ``sitecustomize.py`` into that folder, put first on
  ``PYTHONPATH``: every Python process of the command runs it at start-up. It imports nothing; it waits for
  ``transformers.trainer`` to load, then calls :mod:`~hf_sanity.launch.hook` (and runs the user's own
  ``sitecustomize``, if any, as Python would have).
* :mod:`~hf_sanity.launch.hook`: in each child, one small callback class added to Trainer's default callbacks,
  so every ``Trainer`` (and subclass: TRL's, a framework's) gets one at construction, with no wrapper around
  ``__init__`` or ``train`` in the user's tracebacks. ``run``: it attaches a ``SanityCallback`` (unless the
  trainer has one) and exports its report; ``preflight``: the trainer's ``train`` is replaced by
  ``preflight(trainer=...)`` on that trainer, and the process ends there.
* :mod:`~hf_sanity.launch.command`: the parent: runs the command with signals forwarded, and reads back what
  the children sent as one :class:`~hf_sanity.report.Report`.

A framework's own hook (a plugin that builds ``SanityCallback()`` itself) needs none of this; the anchor in
:mod:`~hf_sanity.launch.hook` is what such a hook can reuse to find a trainer's watching callback.
"""
