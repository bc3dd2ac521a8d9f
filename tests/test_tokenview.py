import io

from rich.console import Console

from hf_sanity.tokenview import TokenView


class CharTokenizer:
    """One character per token: exact expectations without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_plain_view_shows_ids_loss_and_text():
    ids = [ord(c) for c in "Q?\nA."]
    labels = [-100, -100, -100, ord("A"), ord(".")]
    view = TokenView.from_ids(CharTokenizer(), ids, labels, title="example 3")
    assert view.plain().splitlines() == [
        "example 3: tokens 0-4 of 5 (⟦…⟧ carries loss)",
        "  Q?\\n⟦A.⟧",
        "    pos      id  loss  token",
        "      0      81    -   Q",
        "      1      63    -   ?",
        "      2      10    -   \\n",
        "      3      65   yes  A",
        "      4      46   yes  .",
    ]


def test_window_centres_on_the_focus_and_marks_it():
    ids = list(range(65, 65 + 26))
    view = TokenView.from_ids(CharTokenizer(), ids, ids, focus=20, window=6)
    assert [c.pos for c in view.cells] == [17, 18, 19, 20, 21, 22]
    assert "  <-" in view.plain().splitlines()[6]


def test_cut_marker_at_max_len():
    ids = [ord(c) for c in "abcdef"]
    view = TokenView.from_ids(CharTokenizer(), ids, ids, cut=4)
    plain = view.plain()
    assert "max_len=4: the rest is cut" in plain
    assert plain.index("max_len=4") < plain.index("      4     101")


def test_without_labels_loss_is_unknown():
    view = TokenView.from_ids(CharTokenizer(), [97, 98], None)
    assert [c.loss for c in view.cells] == [None, None]


def test_rich_rendering_colours_loss_tokens():
    ids = [ord(c) for c in "ab"]
    view = TokenView.from_ids(CharTokenizer(), ids, [-100, 98])
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=True, color_system="standard").print(view)
    text = out.getvalue()
    assert "\x1b[" in text and "b" in text  # styled
    plain = io.StringIO()
    Console(file=plain, width=80, color_system=None).print(view)
    assert "ab" in plain.getvalue()
