"""The versions of the libraries hf-sanity reads, against the ranges it supports.

The ranges are declared once, in pyproject.toml (transformers, peft, datasets and accelerate among the
dependencies, TRL in the ``trl`` extra, which ``dev`` includes), and read back here from the installed
package's metadata. They are checked once per process, where a report learns the run's objective (the
callback's train begin, preflight): a library outside its range is one note in the report naming its version
and what may not work. Nothing here runs at ``import hf_sanity``.

TRL's internal tallies (``_metrics``, ``_buffered_inputs``, ``_logs``) are read only under a supported TRL
(:func:`supported`); under another one, the preference and RL step checks read what TRL logs publicly.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata

DISTRIBUTION = "hf-sanity"

# The libraries whose versions are checked, and what may not work outside the supported range.
AT_RISK = {
    "transformers": "the trainer's batches, loss and callback events are read as the supported versions give "
    "them; a check may skip or misread them",
    "trl": "TRL's internal tallies (_metrics, _buffered_inputs, _logs) are not read: the preference and RL step "
    "checks read only the metrics TRL logs, and the rules that need the step-0 values or the rollouts stay silent",
    "peft": "the adapter checks read LoRA configs and wrapped modules as the supported versions lay them out",
    "datasets": "datasets are loaded and mapped as the supported versions do it",
    "accelerate": "the distributed world, the gradient accumulation and sharded parameters are read as the "
    "supported versions expose them",
}


# A requirement line of the installed metadata: the name, its extras, then the specifier before any marker
# (`trl<2,>=0.24; extra == "trl"`, `name (>=1.0)` in older metadata). Read here, not by packaging.requirements,
# whose grammar took ~20 ms to import at the first train begin of every process; the markers are not needed.
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;()]*)\)?")


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them (what ``packaging.utils.canonicalize_name`` returns)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(line: str) -> tuple[str, str] | None:
    """(canonical name, specifier) of one requirement line; None where its specifier does not parse (a URL)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    match = _REQUIREMENT.match(line)
    if match is None:
        return None
    try:
        return canonical(match.group(1)), str(SpecifierSet(match.group(2).strip()))
    except InvalidSpecifier:
        return None


@functools.cache
def declared() -> dict[str, str]:
    """Each checked library's supported range (a specifier such as ``>=5.6,<6``), as hf-sanity's installed
    metadata declares it; {} when hf-sanity runs from a source tree that is not installed."""
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return {}
    ranges: dict[str, str] = {}
    for line in requires:
        parsed = requirement(line)
        if parsed is not None and parsed[0] in AT_RISK and parsed[1]:
            ranges.setdefault(*parsed)
    return ranges


def installed(name: str) -> str | None:
    """The installed version of ``name`` (None when it is not installed)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def outside() -> dict[str, str]:
    """Library -> its installed version, for each installed library outside its declared range (once per
    process)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    found: dict[str, str] = {}
    for name, spec in declared().items():
        version = installed(name)
        if version is None:
            continue
        try:
            inside = SpecifierSet(spec).contains(Version(version), prereleases=True)
        except (InvalidSpecifier, InvalidVersion):
            inside = False
        if not inside:
            found[name] = version
    return found


def supported(name: str) -> bool:
    """Whether ``name``'s installed version is inside its declared range (True when it is not checked)."""
    return name not in outside()


def check() -> list[str]:
    """One line per installed library outside its supported range: its version, the range, what may not work."""
    ranges = declared()
    return [
        f"{name} {version} is outside the versions hf-sanity supports ({name}{ranges[name]}): {AT_RISK[name]}"
        for name, version in outside().items()
    ]
