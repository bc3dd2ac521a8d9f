"""Selecting and silencing rules the way linters do: `--select`/`--ignore`, `select=`/`ignore=`,
and a `[tool.hf-sanity]` table in the user's pyproject.toml.

A selector is a rule slug, a stage name (`tokens`, `training`, ...) or `ALL`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from hf_sanity import catalog
from hf_sanity.errors import UserInputError
from hf_sanity.findings import SEVERITIES, Finding, Severity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _split(values: str | Iterable[str] | None) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out = [part.strip() for value in values for part in value.split(",")]
    return [part for part in out if part]


def _expand(selectors: Sequence[str], origin: str) -> set[str]:
    if not selectors:  # nothing to check against the catalog: loading every rule module costs ~0.5 s
        return set()
    rules = catalog.load()
    slugs: set[str] = set()
    for selector in selectors:
        if selector == "ALL":
            slugs |= set(rules)
        elif selector in catalog.STAGES:
            slugs |= {slug for slug, rule in rules.items() if rule.stage == selector}
        elif selector in rules:
            slugs.add(selector)
        else:
            hint = catalog.did_you_mean(selector, [*rules, *catalog.STAGES])
            raise UserInputError(
                f"unknown rule or stage {selector!r} in {origin}; "
                + (f"{hint} Otherwise use" if hint else "use")
                + f" a slug from `hf-sanity rules`, a stage ({', '.join(catalog.STAGES)}) or ALL"
            )
    return slugs


@dataclass(frozen=True)
class Selection:
    """Which rules run and at which severity. The default runs every rule at its catalog severity."""

    select: frozenset[str] | None = None  # None: every rule
    ignore: frozenset[str] = frozenset()
    severity: dict[str, Severity] = field(default_factory=dict)
    objective: str | None = None  # the training objective's kind, once known (`for_objective`)

    def enabled(self, slug: str) -> bool:
        if slug in ("internal-error", "checks-skipped"):  # what hf-sanity could not check is always said
            return True
        return (self.select is None or slug in self.select) and slug not in self.ignore

    def apply(self, finding: Finding) -> Finding | None:
        """The finding as the user configured it, or None when its rule is silenced."""
        if not self.enabled(finding.rule):
            return None
        override = self.severity.get(finding.rule)
        if override and override != finding.severity:
            finding.severity = override
        return finding

    def restricted(self, slugs: set[str] | frozenset[str]) -> Selection:
        """This selection narrowed to ``slugs`` (ignores and severity overrides kept)."""
        select = frozenset(slugs) if self.select is None else self.select & frozenset(slugs)
        return replace(self, select=select)

    def for_objective(self, objective: str) -> Selection:
        """This selection narrowed to the rules written for the training ``objective`` (a kind of
        `measure.objective.KINDS`): on a DPO run no SFT rule is enabled, whatever was selected."""
        rules = catalog.load()
        narrowed = self.restricted({slug for slug, rule in rules.items() if rule.applies_to(objective)})
        return replace(narrowed, objective=objective)

    @classmethod
    def build(
        cls,
        select: str | Iterable[str] | None = None,
        ignore: str | Iterable[str] | None = None,
        *,
        config: dict | None = None,
        origin: str = "[tool.hf-sanity]",
    ) -> Selection:
        """Combine explicit select/ignore with a `[tool.hf-sanity]` config table.

        An explicit `select` replaces the config's; `ignore` adds to it (as ruff's `--extend-ignore`).
        """
        config = config or {}
        explicit = "select/ignore"
        if select is not None:
            selected = _expand(_split(select), explicit)
        elif config.get("select") is not None:
            selected = _expand(_split(config["select"]), origin)
        else:
            selected = None
        ignored = _expand(_split(config.get("ignore")) or [], origin) | _expand(
            _split(ignore) or [], explicit
        )
        severity = {}
        for slug, level in (config.get("severity") or {}).items():
            if slug not in catalog.load() or level not in SEVERITIES:
                raise UserInputError(
                    f"severity {slug} = {level!r} in {origin}: use a slug from `hf-sanity rules` "
                    f"and one of {', '.join(SEVERITIES)}"
                )
            severity[slug] = level
        return cls(
            select=frozenset(selected) if selected is not None else None,
            ignore=frozenset(ignored),
            severity=severity,
        )


def find_config(start: Path | None = None) -> tuple[dict, Path | None]:
    """The `[tool.hf-sanity]` table of the nearest pyproject.toml at or above `start` (cwd)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise UserInputError(f"cannot read {candidate}: {exc}; fix the TOML syntax") from None
            table = data.get("tool", {}).get("hf-sanity")
            if table is not None:
                if not isinstance(table, dict):
                    raise UserInputError(f"[tool.hf-sanity] in {candidate} must be a table")
                return table, candidate
            return {}, None
    return {}, None


def resolve(
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    *,
    use_config: bool = True,
) -> Selection:
    """The selection for a run: explicit arguments over the nearest `[tool.hf-sanity]` table."""
    config, path = find_config() if use_config else ({}, None)
    return Selection.build(select, ignore, config=config, origin=f"[tool.hf-sanity] of {path}")
