"""Generate docs/rules.md from the rule catalog (`python -m hf_sanity.docs docs/rules.md`) and the report's JSON
Schema from its typed model (`python -m hf_sanity.docs docs/report.schema.json`): `make docs` writes both."""

from __future__ import annotations

import sys
from pathlib import Path

from hf_sanity import catalog
from hf_sanity.report import write_atomic

HEADER = """# Rules

Generated from the rule catalog by `make docs`; do not edit by hand. `hf-sanity rules` lists the same
rules and `hf-sanity explain SLUG` prints one. Select or silence rules with `--select`/`--ignore` (slugs,
stage names or `ALL`), `select=`/`ignore=` in Python, or a `[tool.hf-sanity]` table in your pyproject.toml:

```toml
[tool.hf-sanity]
ignore = ["duplicate-examples"]
severity = { "prompt-in-loss" = "error" }
```

The *remedy* column says what `hf-sanity fix` can do about a rule's findings, on a copy of your setup: *safe*
(cannot change what a correct setup trains on: applied by default), *unsafe* (changes the data, the vocabulary
or the weights: applied with `--unsafe-fixes`), *display* (a change in your code, shown only); "safe or unsafe":
the finding says which.
"""


def render() -> str:
    rules = catalog.all_rules()
    lines = [HEADER, "| rule | severity | stage | remedy | symptom |", "|---|---|---|---|---|"]
    for rule in rules:
        remedy = rule.remedy.safety if rule.remedy else "—"
        lines.append(
            f"| [`{rule.slug}`](#{rule.slug}) | {rule.severity} | {rule.stage} | {remedy} | {rule.symptom} |"
        )
    for stage, title in catalog.STAGES.items():
        members = [rule for rule in rules if rule.stage == stage]
        if not members:
            continue
        lines += ["", f"# Stage `{stage}`: {title}", ""]
        for rule in members:
            lines += [rule.explain(), f"Defined in `{rule.module}`.", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    target = Path(argv[0] if argv else "docs/rules.md")
    if target.name.endswith(".schema.json"):
        from hf_sanity.report_schema import SCHEMA_VERSION, render_schema

        write_atomic(target, render_schema())
        print(f"wrote {target} (report schema version {SCHEMA_VERSION})")
        return
    write_atomic(target, render())
    print(f"wrote {target} ({len(catalog.all_rules())} rules)")


if __name__ == "__main__":
    main()
