"""The report as one self-contained HTML page: `--html FILE` on preflight, diagnose and doctor.

One file, nothing fetched: the CSS is inline, plots are embedded as base64 data URIs, no JavaScript, and a
Content-Security-Policy forbids scripts and network access outright. Everything that comes from the user
(messages, evidence, token text such as ``<|im_start|>``, stats, plot titles) is HTML-escaped.

>>> from hf_sanity.html import write_html
>>> write_html(report, "report.html", plots={"loss": png_bytes})
"""

from __future__ import annotations

import base64
import html as htmllib
import json
import os
import re
from pathlib import Path
from typing import Any

from hf_sanity.findings import SEVERITIES, Finding
from hf_sanity.jsonvalues import jsonable
from hf_sanity.outputview import OutputView
from hf_sanity.report import Report, version, write_atomic
from hf_sanity.tokenview import TokenCell, TokenView

# The token colours, as the terminal view uses them: green carries loss, grey does not.
LOSS_BG = "#7ddc8a"
NO_LOSS_BG = "#dcdcdc"
UNKNOWN_BG = "#f3e3a6"  # no labels were given
FOCUS_OUTLINE = "#d7263d"

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"

CSS = f"""
:root {{ color-scheme: light; }}
* {{ box-sizing: border-box; }}
body {{ margin: 0; background: #f6f7f9; color: #1d2026;
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", "Liberation Sans", sans-serif; }}
main, header.page {{ max-width: 1120px; margin: 0 auto; padding: 0 24px; }}
header.page {{ padding-top: 24px; padding-bottom: 8px; }}
h1 {{ font-size: 26px; margin: 0 0 4px; }}
h2 {{ font-size: 19px; margin: 28px 0 10px; border-bottom: 1px solid #d5d8de; padding-bottom: 4px; }}
code, .tokens, table.ids td {{ font-family: "DejaVu Sans Mono", "Liberation Mono", Menlo, Consolas, monospace;
  font-size: 13px; }}
.meta {{ color: #5b616e; margin: 0 0 10px; }}
.counts {{ display: flex; gap: 8px; list-style: none; margin: 0; padding: 0; }}
.badge {{ display: inline-block; border-radius: 4px; padding: 1px 8px; font-weight: 600; font-size: 13px;
  color: #fff; }}
.badge.error {{ background: #c62828; }}
.badge.warning {{ background: #b26a00; }}
.badge.info {{ background: #1565c0; }}
.badge.clean {{ background: #2e6b3a; }}
.badge.zero {{ background: #c3c7cf; color: #4a4f5a; }}
article.finding {{ background: #fff; border: 1px solid #d5d8de; border-left-width: 6px; border-radius: 6px;
  padding: 12px 16px; margin: 0 0 14px; }}
article.finding.error {{ border-left-color: #c62828; }}
article.finding.warning {{ border-left-color: #b26a00; }}
article.finding.info {{ border-left-color: #1565c0; }}
article.finding h3 {{ font-size: 16px; margin: 0 0 4px; display: flex; gap: 10px; align-items: baseline;
  flex-wrap: wrap; }}
.rule {{ font-size: 15px; }}
.stage, .step {{ color: #5b616e; font-weight: normal; font-size: 13px; }}
.message {{ margin: 4px 0 8px; font-size: 15px; white-space: pre-line; }}
.fix {{ margin: 8px 0 4px; white-space: pre-line; }}
.fix strong {{ color: #2e6b3a; }}
.remedy {{ margin: 4px 0; }}
.remedy strong {{ color: #2e6b3a; }}
.fixable {{ color: #2e6b3a; font-weight: 700; font-size: 14px; }}
.about {{ margin: 6px 0 0; color: #5b616e; font-size: 13px; }}
.about dt {{ font-weight: 600; float: left; clear: left; width: 7.5em; }}
.about dd {{ margin: 0 0 2px 7.5em; }}
table {{ border-collapse: collapse; }}
table.kv {{ margin: 4px 0; font-size: 13px; }}
table.kv th {{ text-align: left; font-weight: 600; padding: 1px 14px 1px 0; vertical-align: top;
  white-space: nowrap; color: #3b404a; }}
table.kv td {{ padding: 1px 0; word-break: break-word; }}
table.stats {{ background: #fff; border: 1px solid #d5d8de; }}
table.stats th, table.stats td {{ padding: 3px 12px; border-bottom: 1px solid #eceef1; }}
figure {{ margin: 0; }}
figure.tokenview {{ margin: 10px 0; }}
figure.tokenview figcaption {{ font-size: 13px; color: #3b404a; margin-bottom: 4px; display: flex;
  flex-wrap: wrap; gap: 4px 14px; }}
.legend {{ display: inline-flex; gap: 6px; flex-wrap: wrap; align-items: baseline; }}
.tokens {{ white-space: pre-wrap; word-break: break-all; line-height: 1.9; background: #fff;
  border: 1px solid #e2e4e8; border-radius: 4px; padding: 6px 8px; }}
.tok {{ padding: 1px 0; border-radius: 2px; }}
.tok.loss {{ background: {LOSS_BG}; color: #0b2e12; }}
.tok.noloss {{ background: {NO_LOSS_BG}; color: #4d4d4d; }}
.tok.unknown {{ background: {UNKNOWN_BG}; color: #4a3b00; }}
.tok.focus {{ outline: 2px solid {FOCUS_OUTLINE}; outline-offset: 0; font-weight: 700; }}
.tok.aftercut {{ text-decoration: line-through; text-decoration-color: #c62828; }}
.tok.pad {{ background: #f4f4f4; color: #a0a4ab; text-decoration: line-through; }}
.boundary {{ color: #a0168f; font-weight: 700; padding: 0 2px; }}
table.ids tr.padrow td {{ color: #a0a4ab; }}
table.ids tr.boundaryrow td {{ color: #a0168f; text-align: left; }}
.tok:empty::after {{ content: "\\2205"; color: #8a8f99; }}
.tokens .tok + .tok {{ box-shadow: inset 1px 0 0 rgba(255, 255, 255, 0.9); }}
.cut {{ color: #c62828; font-weight: 700; padding: 0 4px; }}
.more {{ color: #8a8f99; }}
details.ids {{ margin-top: 4px; font-size: 13px; }}
details.ids summary {{ cursor: pointer; color: #5b616e; }}
table.ids th, table.ids td {{ padding: 0 10px; text-align: right; }}
table.ids td.text {{ text-align: left; }}
table.ids tr.focus td {{ font-weight: 700; }}
table.ids tr.cutrow td {{ color: #c62828; text-align: left; }}
section.plots figure {{ background: #fff; border: 1px solid #d5d8de; border-radius: 6px; padding: 10px;
  margin: 0 0 14px; }}
section.plots figcaption {{ font-weight: 600; margin-bottom: 6px; }}
section.plots img {{ max-width: 100%; height: auto; display: block; }}
figure.outputview {{ margin: 10px 0; }}
figure.outputview figcaption {{ font-size: 13px; color: #3b404a; margin-bottom: 4px; }}
table.sidebyside caption {{ text-align: left; font-size: 12px; color: #5b616e; padding: 6px 0 2px; }}
table.sidebyside {{ width: 100%; table-layout: fixed; background: #fff; border: 1px solid #e2e4e8; }}
table.sidebyside th {{ text-align: left; font-size: 13px; padding: 3px 8px; background: #f0f1f4; }}
table.sidebyside td {{ vertical-align: top; padding: 6px 8px; white-space: pre-wrap; word-break: break-word;
  border-left: 1px solid #eceef1; font-family: "DejaVu Sans Mono", "Liberation Mono", Menlo, Consolas, monospace;
  font-size: 13px; }}
mark.stray {{ background: #f6c6cb; color: #7a0c17; font-weight: 700; border-radius: 2px; }}
p.none {{ color: #2e6b3a; font-weight: 600; }}
ul.notes {{ color: #8a5300; margin: 8px 0 0; padding-left: 20px; }}
footer {{ max-width: 1120px; margin: 24px auto; padding: 0 24px; color: #8a8f99; font-size: 12px; }}
"""

_IMAGE_TYPES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def esc(value: Any) -> str:
    """HTML-escape text for element content and quoted attribute values."""
    return htmllib.escape(str(value), quote=True)


def prose(text: str) -> str:
    """Escaped text where `backticks` become <code>, as in the catalog's Markdown."""
    return re.sub(r"`([^`\n]+)`", r"<code>\1</code>", esc(text))


def value_text(value: Any) -> str:
    """An evidence or stats value as compact text: strings bare, floats to 4 digits, the rest as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value, ensure_ascii=False)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 or word == 'info' else 's'}"


def render_html(report: Report, *, plots: dict[str, bytes] | None = None) -> str:
    """The whole report as one HTML page that needs nothing but a browser."""
    title = report.title or "hf-sanity"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="hf-sanity {esc(version())}">',
        f"<title>{esc(title)} · hf-sanity</title>",
        f"<style>{CSS}</style>",
        "</head>",
        "<body>",
        _header(report, title),
        "<main>",
        *([] if report.headline and not report.findings else [_findings(report)]),
        _fixable(report),
        *(render_view(view) for view in report.views),
    ]
    plots = {**report.plots, **(plots or {})}
    if plots:
        parts.append(_plots(plots))
    if report.stats:
        parts.append(_stats(report.stats))
    parts += [
        "</main>",
        f"<footer>hf-sanity {esc(version())} · <code>hf-sanity explain RULE</code> prints any rule's "
        "symptom, detection and fix.</footer>",
        "</body>",
        "</html>",
        "",
    ]
    return "\n".join(parts)


def write_html(report: Report, path: str | os.PathLike, *, plots: dict[str, bytes] | None = None) -> Path:
    """Write the page atomically: a reader sees the previous file or the new one, never half of it."""
    return write_atomic(path, render_html(report, plots=plots))


# -- header ------------------------------------------------------------------------------------------------
def _header(report: Report, title: str) -> str:
    counts = report.counts()
    badges = []
    for severity in SEVERITIES:
        n = counts[severity]
        cls = severity if n else f"{severity} zero"
        badges.append(
            f'<li><span class="badge {cls}" data-severity="{severity}" data-count="{n}">'
            f"{_plural(n, severity)}</span></li>"
        )
    if report.headline and not report.findings:  # a report that runs no checks says what it shows
        badges = [f'<li><span class="badge info">{esc(report.headline)}</span></li>']
    elif not report.findings:
        badges.insert(0, '<li><span class="badge clean">no findings</span></li>')
    notes = "".join(f"<li>{esc(note)}</li>" for note in report.notes)
    return (
        '<header class="page">'
        f"<h1>{esc(title)}</h1>"
        f'<p class="meta">hf-sanity <span class="version">{esc(version())}</span> · '
        f"{len(report.findings)} finding{'' if len(report.findings) == 1 else 's'}</p>"
        f'<ul class="counts">{"".join(badges)}</ul>'
        + (f'<ul class="notes">{notes}</ul>' if notes else "")
        + "</header>"
    )


# -- findings ----------------------------------------------------------------------------------------------
def _findings(report: Report) -> str:
    out = ['<section class="findings"><h2>Findings</h2>']
    ordered = report.ordered()
    if not ordered:
        ran = (
            "every selected check that ran passed (see the notes above)"
            if report.notes
            else "every selected check passed"
        )
        out.append(f'<p class="none">No findings: {ran}.</p>')
    for i, finding in enumerate(ordered, 1):
        out.append(_finding(finding, i, report.apply_command))
    out.append("</section>")
    return "\n".join(out)


def _catalog_rule(slug: str):
    from hf_sanity import catalog

    return catalog.load().get(slug)


def _remedy(remedy, command) -> str:
    """The finding's remedy: what it changes, its safety, and the command that applies it to a copy."""
    if not remedy.applicable:
        return f'<p class="remedy" data-safety="display"><strong>remedy (display only):</strong> {prose(remedy.title)}</p>'
    apply = f" · <code>{esc(command(remedy.safety == 'unsafe'))}</code>" if command is not None else ""
    return (
        f'<p class="remedy" data-safety="{esc(remedy.safety)}"><strong>[*] remedy ({esc(remedy.safety)}):</strong> '
        f"{prose(remedy.title)}{apply}</p>"
    )


def _fixable(report: Report) -> str:
    """One line under the findings, as ruff ends: how many have a remedy and the command that applies them."""
    fixable = [r for _, r in report.remedies() if r.applicable]
    if not fixable:
        return ""
    unsafe = sum(r.safety == "unsafe" for r in fixable)
    more = f" ({unsafe} unsafe: <code>{esc(report.apply_command(True))}</code>)" if unsafe else ""
    return (
        f'<p class="fixable-summary"><span class="fixable">[*]</span> {len(fixable)} finding'
        f"{'s' if len(fixable) != 1 else ''} with a remedy: <code>{esc(report.apply_command())}</code>{more}</p>"
    )


def _finding(finding: Finding, index: int, command=None) -> str:
    rule = _catalog_rule(finding.rule)
    sev = finding.severity
    head = [
        f'<span class="badge {sev}">{sev}</span>',
        f'<code class="rule">{esc(finding.rule)}</code>',
    ]
    if rule is not None:
        head.append(f'<span class="stage">{esc(rule.stage)}</span>')
    if finding.step is not None:
        head.append(f'<span class="step">@ step {esc(finding.step)}</span>')
    remedy = finding.remedy
    if remedy is not None and remedy.applicable:
        head.append('<span class="fixable" title="hf-sanity fix can repair this on a copy">[*]</span>')
    out = [
        f'<article class="finding {sev}" id="finding-{index}" data-rule="{esc(finding.rule)}" '
        f'data-severity="{sev}">',
        f"<h3>{' '.join(head)}</h3>",
        f'<p class="message">{prose(finding.message)}</p>',
    ]
    if finding.evidence:
        out.append(_kv_table(finding.evidence, "kv evidence"))
    if isinstance(finding.example, OutputView):
        out.append(render_outputview(finding.example))
    elif finding.example is not None:
        out.append(render_tokenview(finding.example))
    fix = finding.fix or (rule.fix if rule is not None else "")
    if fix:
        out.append(f'<p class="fix"><strong>fix:</strong> {prose(fix)}</p>')
    if remedy is not None:
        out.append(_remedy(remedy, command))
    if rule is not None:
        about = [f"<dt>symptom</dt><dd>{prose(rule.symptom)}</dd>"]
        about.append(f"<dt>detected by</dt><dd>{prose(rule.detects)}</dd>")
        if rule.fix and rule.fix != fix:
            about.append(f"<dt>usual fix</dt><dd>{prose(rule.fix)}</dd>")
        about.append(f"<dt>more</dt><dd><code>hf-sanity explain {esc(rule.slug)}</code></dd>")
        out.append(f'<dl class="about">{"".join(about)}</dl>')
    out.append("</article>")
    return "\n".join(out)


def _kv_table(values: dict[str, Any], cls: str) -> str:
    rows = []
    for key, value in values.items():
        text = value_text(value)
        full = ""
        if len(text) > 200:
            full, text = f' title="{esc(text)}"', text[:199] + "…"
        rows.append(f"<tr><th>{esc(key)}</th><td{full}><code>{esc(text)}</code></td></tr>")
    return f'<table class="{cls}">{"".join(rows)}</table>'


# -- token view --------------------------------------------------------------------------------------------
_LOSS_CLASS = {True: "loss", False: "noloss", None: "unknown"}
_LOSS_WORD = {True: "loss", False: "no loss", None: "no labels"}


def _cell_class(view: TokenView, cell: TokenCell) -> str:
    cls = ["tok", "pad" if cell.padding else _LOSS_CLASS[cell.loss]]
    if cell.pos == view.focus:
        cls.append("focus")
    if view.cut is not None and cell.pos >= view.cut:
        cls.append("aftercut")
    return " ".join(cls)


def _cell_tooltip(view: TokenView, cell: TokenCell) -> str:
    tip = f"pos {cell.pos} · id {cell.id} · {_LOSS_WORD[cell.loss]}"
    if view.detailed:
        extra = {"attention": cell.attention, "position id": cell.position, "label": cell.label}
        tip += "".join(f" · {k} {v}" for k, v in extra.items() if v is not None)
        tip += f" · trained to predict {cell.predicts}" if cell.predicts is not None else ""
    if cell.pos == view.focus:
        tip += " · the token this finding is about"
    if view.cut is not None and cell.pos >= view.cut:
        tip += f" · cut by max_len={view.cut}"
    return tip


def render_tokenview(view: TokenView) -> str:
    """Tokens inline, green with loss and grey without, focus outlined, ✂ at the max_len cut, ids on hover."""
    cells = view.cells
    cut_shown = view.cut is not None and any(c.pos == view.cut for c in cells)
    caption = [f'<span class="span">{esc(view.title + ": " if view.title else "")}{esc(view.span)}</span>']
    legend = [
        f'<span class="tok {_LOSS_CLASS[flag]}">{_LOSS_WORD[flag]}</span>'
        for flag in (True, False, None)
        if flag is not None or any(c.loss is None for c in cells)
    ]
    if view.focus is not None:
        legend.append('<span class="tok noloss focus">focus</span>')
    if view.detailed and any(c.padding for c in cells):
        legend.append('<span class="tok pad">padding</span>')
    if any(c.starts_sequence for c in cells):
        legend.append('<span class="boundary">‖ a packed sequence starts</span>')
    if cut_shown:
        legend.append(f'<span class="cut">✂ max_len={view.cut} cut</span>')
    caption.append(f'<span class="legend">{"".join(legend)}</span>')
    if view.cut is not None and not cut_shown:
        caption.append(
            f'<span class="cutnote">max_len cut at position {view.cut} (outside this window)</span>'
        )
    caption.append('<span class="hint">hover a token for its position and id</span>')

    inline = []
    if cells and cells[0].pos > 0:
        inline.append(f'<span class="more" title="{cells[0].pos} earlier tokens not shown">…</span>')
    for cell in cells:
        if cell.pos == view.cut:
            inline.append(
                f'<span class="cut" title="max_len={view.cut}: from position {view.cut} on, '
                f'tokens are cut">✂ max_len={view.cut} ✂</span>'
            )
        if cell.starts_sequence:
            inline.append('<span class="boundary" title="a packed sequence starts: position id 0">‖</span>')
        inline.append(
            f'<span class="{_cell_class(view, cell)}" data-pos="{cell.pos}" data-id="{cell.id}" '
            f'title="{esc(_cell_tooltip(view, cell))}">{esc(cell.text)}</span>'
        )
    if cells and cells[-1].pos < view.total - 1:
        later = view.total - 1 - cells[-1].pos
        inline.append(f'<span class="more" title="{later} later tokens not shown">…</span>')

    extra = [c for c in view.columns() if c != "predicts"]
    predicts = "predicts" in view.columns()
    width = 4 + len(extra) + predicts
    rows = []
    for cell in cells:
        if cell.pos == view.cut:
            rows.append(f'<tr class="cutrow"><td colspan="{width}">✂ max_len={view.cut}</td></tr>')
        if cell.starts_sequence:
            rows.append(f'<tr class="boundaryrow"><td colspan="{width}">‖ a packed sequence starts</td></tr>')
        cls = "focus" if cell.pos == view.focus else "padrow" if cell.padding else ""
        mark = "pad" if cell.padding else {True: "yes", False: "-", None: "?"}[cell.loss]
        values = view._extra(cell)
        rows.append(
            f'<tr class="{cls}"><td>{cell.pos}</td><td>{cell.id}</td>'
            + "".join(f"<td>{esc(values[c])}</td>" for c in extra)
            + f"<td>{mark}</td>"
            f'<td class="text"><span class="{_cell_class(view, cell)}">{esc(cell.text)}</span></td>'
            + (f'<td class="text">{esc(values["predicts"])}</td>' if predicts else "")
            + "</tr>"
        )
    heads = [
        "pos",
        "id",
        *extra,
        "loss",
        "token",
        *(["predicts (the next position's label)"] if predicts else []),
    ]
    table = (
        f'<details class="ids"{" open" if view.detailed else ""}><summary>positions and ids</summary>'
        f'<table class="ids"><tr>{"".join(f"<th>{esc(h)}</th>" for h in heads)}</tr>'
        f"{''.join(rows)}</table></details>"
    )
    return (
        '<figure class="tokenview">'
        f"<figcaption>{''.join(caption)}</figcaption>"
        f'<div class="tokens">{"".join(inline)}</div>'
        f"{table}</figure>"
    )


# -- side by side ------------------------------------------------------------------------------------------
def render_outputview(view: OutputView) -> str:
    """Each example's prompt, generation and reference in columns; what the finding is about highlighted."""
    out = ['<figure class="outputview">', f"<figcaption>{esc(view.title)}</figcaption>"]
    for example in view.examples:
        heads = "".join(f"<th>{esc(label)}</th>" for label, _ in example.columns)
        cells = []
        for _, text in example.columns:
            pieces = [
                f'<mark class="stray">{esc(piece)}</mark>' if marked else esc(piece)
                for piece, marked in example.segments(text)
            ]
            cells.append(f"<td>{''.join(pieces)}</td>")
        out.append(
            f'<table class="sidebyside" data-row="{example.row}"><caption>{esc(example.caption)}</caption>'
            f"<tr>{heads}</tr><tr>{''.join(cells)}</tr></table>"
        )
    out.append("</figure>")
    return "".join(out)


# -- views: what a report shows besides its findings ------------------------------------------------------
def render_view(view) -> str:
    """One of a report's views (a per-class table, a decoded batch) as a section of the page."""
    from hf_sanity.classtable import ClassTable

    if isinstance(view, ClassTable):
        heads = "".join(
            f"<th>{h}</th>" for h in ("label", "support", "accuracy", "predicted", "most confused with")
        )
        rows = []
        for row in view.rows:
            confused = (
                f"{row['most_confused_with']} ({row['confused']})" if row["most_confused_with"] else "-"
            )
            rows.append(
                f"<tr><td><code>{esc(row['label'])}</code></td><td>{row['support']}</td>"
                f"<td>{row['accuracy']:.1%}</td><td>{row['predicted']}</td><td>{esc(confused)}</td></tr>"
            )
        table = f'<table class="stats perclass"><tr>{heads}</tr>{"".join(rows)}</table>'
        return f'<section class="view"><h2>{esc(view.title)}</h2>{table}</section>'
    from hf_sanity.batchview import BatchView

    if isinstance(view, BatchView):
        about = "".join(f"<li>{prose(line)}</li>" for line in view.describe())
        rows = "".join(render_tokenview(row) for row in view.rows)
        return f'<section class="view batch"><h2>{esc(view.headline())}</h2><ul class="about">{about}</ul>{rows}</section>'
    return f'<section class="view"><h2>{esc(getattr(view, "title", "view"))}</h2><pre>{esc(view.data())}</pre></section>'


# -- plots and stats ---------------------------------------------------------------------------------------
def image_type(data: bytes) -> str:
    """The MIME type of an image, from its first bytes."""
    for magic, mime in _IMAGE_TYPES:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    raise ValueError(f"a plot must be PNG (or JPEG, GIF, WebP) bytes; got bytes starting {data[:8]!r}")


def data_uri(data: bytes) -> str:
    return f"data:{image_type(data)};base64,{base64.b64encode(data).decode('ascii')}"


def _plots(plots: dict[str, bytes]) -> str:
    out = ['<section class="plots"><h2>Plots</h2>']
    for i, (name, data) in enumerate(plots.items(), 1):
        out.append(
            f'<figure id="plot-{i}"><figcaption>{esc(name)}</figcaption>'
            f'<img src="{data_uri(bytes(data))}" alt="{esc(name)}"></figure>'
        )
    out.append("</section>")
    return "\n".join(out)


def _stats(stats: dict[str, Any]) -> str:
    return f'<section class="stats"><h2>Stats</h2>{_kv_table(jsonable(stats), "kv stats")}</section>'
