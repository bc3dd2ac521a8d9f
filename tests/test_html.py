"""The HTML report page: pure-Python checks of its structure, then the page as headless Chromium shows it."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from hf_sanity import Finding, Report, __version__, catalog
from hf_sanity.html import LOSS_BG, NO_LOSS_BG, render_html, write_html
from hf_sanity.testing import build_tokenizer, demo_conversations
from hf_sanity.tokenview import TokenView

INJECTED = "<script>document.documentElement.setAttribute('data-pwned', '1')</script>"
IMG_INJECTED = '<img src="https://example.invalid/x.png" onerror="alert(1)">'
TAGS = {
    "html", "head", "meta", "title", "style", "body", "header", "h1", "h2", "h3", "p", "span", "ul", "li",
    "main", "section", "article", "table", "tbody", "tr", "th", "td", "code", "strong", "figure",
    "figcaption", "div", "details", "summary", "dl", "dt", "dd", "img", "footer",
}  # fmt: skip


# -- a sample report made of real objects ------------------------------------------------------------------
def completion_bounds(tokenizer, ids: list[int]) -> tuple[int, int]:
    """(first token of the last assistant answer, position of its <|im_end|>)."""
    start_id, end_id = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = max(i for i, t in enumerate(ids) if t == start_id)
    newline = next(i for i in range(header, len(ids)) if tokenizer.decode([ids[i]]) == "\n")
    return newline + 1, max(i for i, t in enumerate(ids) if t == end_id)


@pytest.fixture(scope="module")
def examples():
    """Two ChatML examples; the second has HTML in the user turn, as scraped data often does."""
    tokenizer = build_tokenizer("chatml")
    rows = demo_conversations(2)
    messages = [dict(m) for m in rows[1]["messages"]]
    messages[0]["content"] += " " + INJECTED + " & <b>"
    out = []
    for msgs in (rows[0]["messages"], messages):
        ids = list(tokenizer.apply_chat_template(msgs, tokenize=True)["input_ids"])
        out.append((tokenizer, ids, *completion_bounds(tokenizer, ids)))
    return out


def eos_view(example) -> TokenView:
    """Loss on the answer but not on its <|im_end|> (pad == EOS masked by the collator)."""
    tokenizer, ids, start, end = example
    labels = [t if start <= i < end else -100 for i, t in enumerate(ids)]
    return TokenView.from_ids(tokenizer, ids, labels, focus=end, title="example 0")


def sample_report(examples) -> Report:
    tokenizer, ids, start, _ = examples[1]
    report = Report(title="preflight <run #3>")
    report.add(
        Finding(
            "prompt-in-loss",
            "warning",
            "62% of supervised tokens are prompt tokens (32 of 52)",
            {"prompt_tokens": 32, "supervised_tokens": 52, "fraction": 0.615384},
            catalog.get("prompt-in-loss").fix,
            example=TokenView.from_ids(tokenizer, ids, ids, title="example 1"),
        )
    )
    report.add(
        Finding(
            "eos-not-learned",
            "error",
            "1 end-of-turn token carries no loss (of 1 completion)",
            {"rows": [0], "pad_is_eos": True, "end_tokens": ["<|im_end|>"]},
            "Keep the EOS in the labels: use a pad token distinct from EOS.",
            example=eos_view(examples[0]),
        )
    )
    cut = start + 3
    report.add(
        Finding(
            "truncated-completion",
            "error",
            f"1 completion is cut by max_len={cut}",
            {"max_len": cut, "rows": [1]},
            step=12,
            example=TokenView.from_ids(
                tokenizer, ids, [t if i >= start else -100 for i, t in enumerate(ids)], cut=cut, title="ex 1"
            ),
        )
    )
    report.add(Finding("my-custom-check", "info", f"user text {INJECTED}", {"note": IMG_INJECTED}, "x < y"))
    report.stats.update(examples=2, seconds=0.123456, format="messages", weird="</table><script>")
    return report


def tiny_png(width: int = 3, height: int = 2) -> bytes:
    """A real PNG, written by matplotlib (a dev dependency) when present, else a fixed 1x1 PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return base64.b64decode(
            "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
        )
    fig = plt.figure(figsize=(width, height), dpi=40)
    fig.gca().plot([3, 2, 1.5, 1.2])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


# -- parsing what we (or the browser) wrote -----------------------------------------------------------------
class Page(HTMLParser):
    """Every element (tag, attributes, own text) in document order, and all text."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[dict] = []
        self.stack: list[dict] = []
        self.text: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.elements.append(element)
        if tag not in {"meta", "img", "br", "link", "input"}:
            self.stack.append(element)

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        self.text.append(data)
        for element in self.stack:
            element["text"] += data

    def find(self, tag: str | None = None, cls: str | None = None) -> list[dict]:
        return [
            e
            for e in self.elements
            if (tag is None or e["tag"] == tag)
            and (cls is None or cls in e["attrs"].get("class", "").split())
        ]

    @property
    def all_text(self) -> str:
        return "".join(self.text)


# -- pure Python ---------------------------------------------------------------------------------------------
def test_header_findings_in_order_with_evidence_fix_and_rule_text(examples):
    report = sample_report(examples)
    page = Page(render_html(report))
    assert page.find("h1")[0]["text"] == "preflight <run #3>"
    assert page.find("title")[0]["text"].startswith("preflight <run #3>")
    assert page.find("span", "version")[0]["text"] == __version__
    counts = {
        b["attrs"]["data-severity"]: b["text"]
        for b in page.find("span", "badge")
        if "data-count" in b["attrs"]
    }
    assert counts == {"error": "2 errors", "warning": "1 warning", "info": "1 info"}

    articles = page.find("article")
    assert [a["attrs"]["data-rule"] for a in articles] == [f.rule for f in report.ordered()]
    assert [a["attrs"]["data-rule"] for a in articles] == [
        "eos-not-learned",
        "truncated-completion",
        "prompt-in-loss",
        "my-custom-check",
    ]
    eos, truncated, prompt, custom = articles
    assert "1 end-of-turn token carries no loss" in eos["text"]
    assert "fix: Keep the EOS in the labels" in eos["text"]
    rule = catalog.get("eos-not-learned")
    assert rule.symptom[:40] in eos["text"] and "hf-sanity explain eos-not-learned" in eos["text"]
    assert "usual fix" in eos["text"]  # the finding's own fix differs from the catalog's
    assert "usual fix" not in prompt["text"]  # ... here it is the catalog's: shown once
    assert "@ step 12" in truncated["text"] and "@ step" not in eos["text"]
    # truncated-completion has no fix of its own: the catalog's is shown as the fix
    assert "fix: " + catalog.get("truncated-completion").fix.replace("`", "")[:30] in truncated["text"]
    assert "symptom" not in custom["text"]  # not in the catalog: no rule text, no error

    evidence = page.find("table", "evidence")[0]
    assert "pad_is_eos" in evidence["text"] and "true" in evidence["text"]
    assert '["<|im_end|>"]' in evidence["text"]
    stats = page.find("table", "stats")[0]["text"]
    assert "examples2" in stats and "seconds0.1235" in stats and "formatmessages" in stats


def test_user_text_is_escaped_never_parsed(examples):
    markup = render_html(sample_report(examples))
    page = Page(markup)
    assert {e["tag"] for e in page.elements} <= TAGS
    assert not page.find("script") and all("onerror" not in e["attrs"] for e in page.elements)
    text = page.all_text
    for raw in (INJECTED, IMG_INJECTED, "</table><script>", "<|im_start|>", "<|im_end|>", "x < y"):
        assert raw in text
    assert "&lt;|im_start|&gt;" in markup and "<|im_start|>" not in markup


def test_no_external_resources_and_no_javascript(examples):
    page = Page(render_html(sample_report(examples), plots={"loss": tiny_png()}))
    assert not page.find("script") and not page.find("link") and not page.find("iframe")
    urls = [v for e in page.elements for k, v in e["attrs"].items() if k in ("src", "href", "action")]
    assert urls and all(u.startswith("data:image/png;base64,") for u in urls)
    csp = next(e["attrs"]["content"] for e in page.find("meta") if e["attrs"].get("http-equiv"))
    assert "default-src 'none'" in csp and "img-src data:" in csp


def test_token_view_colours_focus_cut_and_tooltips(examples):
    page = Page(render_html(sample_report(examples)))
    views = page.find("figure", "tokenview")
    assert len(views) == 3
    tokens = [e for e in page.find("span", "tok") if "data-pos" in e["attrs"]]

    eos_tokens = tokens[: len(eos_view(examples[0]).cells)]
    _, ids, start, end = examples[0]
    assert [int(t["attrs"]["data-id"]) for t in eos_tokens] == ids
    loss = [t["attrs"]["data-pos"] for t in eos_tokens if "loss" in t["attrs"]["class"].split()]
    assert loss == [str(i) for i in range(start, end)]
    focus = [t for t in tokens if "focus" in t["attrs"]["class"].split()]
    assert len(focus) == 1 and focus[0]["text"] == "<|im_end|>"
    assert focus[0]["attrs"]["class"].split()[:2] == ["tok", "noloss"]
    assert focus[0]["attrs"]["title"].startswith(f"pos {end} · id {ids[end]} · no loss")
    assert all(re.match(r"pos \d+ · id \d+ · (loss|no loss)", t["attrs"]["title"]) for t in tokens)
    assert "\\n" in "".join(t["text"] for t in eos_tokens)  # whitespace stays visible

    legend = page.find("span", "legend")[0]["text"]
    assert "loss" in legend and "no loss" in legend and "focus" in legend
    # the ✂ marker sits right before the first cut token, and everything from there on is struck
    cut_view = views[1]["text"]
    _, ids1, start1, _ = examples[1]
    cut = start1 + 3
    assert f"✂ max_len={cut} ✂" in cut_view
    inline = page.find("div", "tokens")[1]["text"]
    _, after = inline.split(f"✂ max_len={cut} ✂")
    assert after.startswith(TokenView.from_ids(examples[1][0], ids1[cut : cut + 1]).cells[0].text)
    struck = [int(t["attrs"]["data-pos"]) for t in page.find("span", "aftercut") if "data-pos" in t["attrs"]]
    assert struck == list(range(cut, len(ids1)))


def test_plots_are_embedded_as_base64_figures():
    png = tiny_png()
    page = Page(render_html(Report(title="t"), plots={"train <loss>": png, "grad norm": tiny_png(2, 2)}))
    figures = [f for f in page.find("figure") if f["attrs"].get("id", "").startswith("plot-")]
    assert [f["text"] for f in figures] == ["train <loss>", "grad norm"]
    img = page.find("img")[0]
    assert img["attrs"]["alt"] == "train <loss>"
    assert base64.b64decode(img["attrs"]["src"].removeprefix("data:image/png;base64,")) == png
    with pytest.raises(ValueError, match="PNG"):
        render_html(Report(), plots={"bad": b"not an image"})


def test_clean_report_says_so_and_has_no_empty_sections():
    page = Page(render_html(Report(title="all good")))
    assert "No findings" in page.all_text and not page.find("article")
    assert [h["text"] for h in page.find("h2")] == ["Findings"]  # no plots, no stats


def test_write_html_is_atomic(tmp_path, examples, monkeypatch):
    target = tmp_path / "out" / "report.html"
    assert write_html(sample_report(examples), target) == target
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in target.parent.iterdir()] == ["report.html"]

    def disk_full(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        write_html(Report(title="new"), target)
    assert "preflight &lt;run #3&gt;" in target.read_text(encoding="utf-8")  # the old page, whole
    assert [p.name for p in target.parent.iterdir()] == ["report.html"]


# -- in a real browser ---------------------------------------------------------------------------------------
def chromium(tmp_path, *args: str) -> str:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install -y chromium); CI installs it")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--force-color-profile=srgb",
        "--hide-scrollbars",
    ]
    done = subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_chromium_parses_findings_in_order_and_runs_no_injected_script(tmp_path, examples):
    report = sample_report(examples)
    path = write_html(report, tmp_path / "report.html", plots={"loss": tiny_png()})
    dom = chromium(tmp_path, "--dump-dom", path.as_uri())
    page = Page(dom)
    assert [a["attrs"]["data-rule"] for a in page.find("article")] == [f.rule for f in report.ordered()]
    assert [a["attrs"]["data-severity"] for a in page.find("article")] == [
        "error",
        "error",
        "warning",
        "info",
    ]
    assert not page.find("script") and "data-pwned" not in page.elements[0]["attrs"]
    assert {e["tag"] for e in page.elements} <= TAGS
    text = page.all_text
    assert INJECTED in text and IMG_INJECTED in text and "<|im_start|>" in text and "✂ max_len=" in text
    focus = [s for s in page.find("span", "focus") if "data-pos" in s["attrs"]]
    assert [s["text"] for s in focus] == ["<|im_end|>"]
    assert page.find("img")[0]["attrs"]["src"].startswith("data:image/png;base64,")


def solid_pixels(png_path, hex_colour: str) -> int:
    """Pixels of this colour whose four neighbours have it too: filled areas, not anti-aliased text edges."""
    image = pytest.importorskip(
        "PIL.Image", reason="Pillow (installed with matplotlib) decodes the screenshot"
    )
    import numpy as np

    rgb = np.asarray(image.open(png_path).convert("RGB")).astype(int)
    target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
    m = np.abs(rgb - target).max(axis=-1) <= 2
    return int((m[1:-1, 1:-1] & m[:-2, 1:-1] & m[2:, 1:-1] & m[1:-1, :-2] & m[1:-1, 2:]).sum())


@pytest.mark.slow
def test_chromium_screenshot_shows_loss_green_and_no_loss_grey(tmp_path, examples):
    report = sample_report(examples)
    control = Report(
        title=report.title, findings=[Finding(f.rule, f.severity, f.message) for f in report.findings]
    )
    shots = {}
    for name, rep in (("page", report), ("control", control)):
        path = write_html(rep, tmp_path / f"{name}.html")
        shot = tmp_path / f"{name}.png"
        chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2000", path.as_uri())
        assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        shots[name] = shot
    # tokens are drawn with the loss green and the no-loss grey, and neither colour comes from anywhere else:
    # the same findings without token views show none of them
    assert solid_pixels(shots["page"], LOSS_BG) > 2000
    assert solid_pixels(shots["page"], NO_LOSS_BG) > 2000
    assert solid_pixels(shots["control"], LOSS_BG) == 0
    assert solid_pixels(shots["control"], NO_LOSS_BG) == 0
