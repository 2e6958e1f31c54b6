"""Conversation titles: drawn from a first message, or chosen by an agent, always clean."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatlane.titles import TITLE_LIMIT, clean_title, title_from


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("Trip to Lisbon", "Trip to Lisbon"),
        ("  plan\tthe   trip  \nand the rest", "plan the trip"),
        ("\n\n   \nsecond line first", "second line first"),
        ("# A heading\nbody", "A heading"),
        ("> quoted words", "quoted words"),
        ("```python\nprint('hi')\n```", "print('hi')"),
        ("ab\u202ecd\u200b ef\x07", "abcd ef"),
        ("👨\u200d👩\u200d👧 family", "👨\u200d👩\u200d👧 family"),
        ("e\u0301", "é"),
        ("", ""),
        (" \n\t\u200b\n", ""),
    ],
)
def test_title_from(text: str, title: str) -> None:
    assert title_from(text) == title


def test_a_long_line_is_cut_at_a_word_with_an_ellipsis() -> None:
    title = title_from("word " * 40)
    assert title.endswith("word…")
    assert len(title) <= TITLE_LIMIT
    unbroken = title_from("x" * 200)
    assert unbroken == "x" * (TITLE_LIMIT - 1) + "…"


def test_a_character_keeps_its_marks_when_cut() -> None:
    text = "x" * (TITLE_LIMIT - 2) + "a\u0308\u0323" + "y" * 10  # ä with a dot below
    title = title_from(text)
    assert title == "x" * (TITLE_LIMIT - 2) + "…"


def test_what_is_dropped_leaves_a_composed_title() -> None:
    assert title_from("e\x00\u0301") == "\u00e9"


def test_piled_up_marks_are_thinned() -> None:
    title = title_from("Z" + "\u0336" * 50 + "algo")
    assert title == "Z" + "\u0336" * 4 + "algo"


def test_clean_title_refuses_what_has_nothing_to_show() -> None:
    for bad in ("", "   ", "\u200b\u202e\x00", "\n\n"):
        with pytest.raises(ValueError, match="visible text"):
            clean_title(bad)
    with pytest.raises(TypeError, match="not int"):
        clean_title(42)


def test_clean_title_keeps_every_line_as_one() -> None:
    assert clean_title("Two\nlines\r\nhere") == "Two lines here"
    assert len(clean_title("x" * 10_000)) == TITLE_LIMIT


@given(st.text())
def test_any_text_gives_a_clean_title(text: str) -> None:
    title = title_from(text)
    assert len(title) <= TITLE_LIMIT
    assert title == title.strip()
    assert "  " not in title
    assert unicodedata.is_normalized("NFC", title)
    for char in title:
        category = unicodedata.category(char)
        assert category not in ("Cc", "Cs", "Co", "Cn", "Zl", "Zp")
        assert category != "Cf" or char in "\u200c\u200d"
        assert char == " " or not char.isspace()
