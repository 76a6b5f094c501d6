"""What a check returns, what a mistake is, and where the book explains it."""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _anchor(title: str) -> str:
    """The HTML id Sphinx gives a section titled ``title`` (docutils' ``make_id``)."""
    text = (
        unicodedata.normalize("NFKD", title.lower())
        .encode("ascii", "ignore")
        .decode("ascii")
    )
    text = re.sub(r"[^a-z0-9]+", "-", " ".join(text.split()))
    return re.sub(r"^[-0-9]+|-+$", "", text)


@dataclass(frozen=True)
class Section:
    """A section of the book to re-read: its notebook's ``page`` under ``chapters/``
    (``"05_masking"``, ``"appendix/a_errata"``) and the heading's ``title``."""

    page: str
    title: str
    # when the section has a label of its own instead of the heading's id
    anchor: str = ""

    @property
    def chapter(self) -> int | str:
        """The chapter's number, or an appendix's letter (``"A"``), from the page's name."""
        name = self.page.removeprefix("appendix/")
        return int(name[:2]) if name[:2].isdigit() else name[0].upper()

    @property
    def link(self) -> str:
        """The page and anchor, relative to a chapter's page (``03_attention.html#...``)."""
        return f"{self.page}.html#{self.anchor or _anchor(self.title)}"

    def __str__(self) -> str:
        where = "appendix A" if self.chapter == "A" else f"chapter {self.chapter}"
        return f"{where}, “{self.title}”"


@dataclass(frozen=True)
class Page:
    """A notebook ``name`` under ``chapters/``; ``page[title]`` is its section so headed."""

    name: str

    def __getitem__(self, title: str) -> Section:
        return Section(self.name, title)


def _errata_link(row: int) -> str:
    return f"errata row {row} (appendix A, appendix/a_errata.html#errata-{row})"


@dataclass(frozen=True)
class Mistake:
    """One mistake of the catalogue.

    ``did`` says what the reader did (to them: "divided by d_k"), ``does`` what a version with this
    mistake computes, ``section`` where the book explains
    the right thing, ``errata`` the rows of the errata appendix whose source makes it. ``variants``
    are broken versions with the component's own signature: a reader's version that gives the
    same results as any one of them on every input has made this mistake.
    """

    name: str
    does: str
    variants: tuple[Any, ...]
    section: Section | None = None
    errata: tuple[int, ...] = ()
    did: str = ""  # what the reader wrote, said to them: "divided the scores by d_k"
    outputs: tuple[str, ...] = ()  # recognised on these outputs only (all when empty)


def mistake_maker(
    variant: Callable[..., Any], section: Section | None = None
) -> Callable[..., Mistake]:
    """The maker of a part's catalogue entries whose broken versions come from one
    ``variant`` factory (which makes a version, or a tuple of versions, from some changes).

    ``mistake(name, did, does, **changes)`` reads as one entry: the mistake's name, what the
    reader did, what a version with it computes, and the changes that make its version
    ``variant(**changes)``. More versions of the same mistake follow ``does``, each a dict of
    changes or a version itself. ``section`` says where the book explains the mistake (the
    maker's ``section`` by default, else the part's own), ``errata`` which rows of the errata
    appendix make it, ``outputs`` on which outputs alone it is recognised.
    """

    def mistake(
        name: str,
        did: str,
        does: str,
        *more: dict[str, Any] | Callable[..., Any],
        section: Section | None = section,
        errata: tuple[int, ...] = (),
        outputs: tuple[str, ...] = (),
        **changes: Any,
    ) -> Mistake:
        made = [variant(**changes)] if changes else []
        made += [variant(**item) if isinstance(item, dict) else item for item in more]
        versions = tuple(v for m in made for v in (m if isinstance(m, tuple) else (m,)))
        return Mistake(
            name, does, versions, section, errata=errata, did=did, outputs=outputs
        )

    return mistake


@dataclass
class CheckResult:
    """The verdict of :func:`check`. ``bool(result)`` is ``result.passed``.

    ``mistake`` is the name of the recognised mistake (``None`` when it passed or when the
    difference matches no mistake of the catalogue); ``message`` says what differs and where,
    and which section to re-read.
    """

    name: str
    passed: bool
    mistake: str | None
    message: str
    section: Section | None = None
    errata: tuple[int, ...] = ()
    cases: int = 0
    printed: str = ""  # what the reader's code printed while it was checked

    def __bool__(self) -> bool:
        return self.passed

    @property
    def headline(self) -> str:
        if self.passed:
            return f"✅ {self.name}: passed"
        return f"❌ {self.name}: " + (
            f"mistake “{self.mistake}”" if self.mistake else "not passed"
        )

    def __str__(self) -> str:
        return f"{self.headline}\n{self.message}"

    def __repr__(self) -> str:
        return f"CheckResult(name={self.name!r}, passed={self.passed}, mistake={self.mistake!r})\n{self.message}"

    def _repr_markdown_(self) -> str:
        body = re.sub(
            r"\(((?:[\w-]+/)*[\w-]+\.html#[\w-]+)\)", r"([\1](\1))", self.message
        )
        return f"**{self.headline}**\n\n" + body.replace("\n", "\n\n")

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.passed else "#c62828"
        body = html.escape(self.message).replace("\n", "<br>")
        body = re.sub(
            r"((?:[\w-]+/)*[\w-]+\.html#[\w-]+)", r'<a href="\1">\1</a>', body
        )
        return (
            f'<div style="border-left: 4px solid {colour}; padding: 0.3em 0.8em; margin: 0.3em 0">'
            f"<strong>{html.escape(self.headline)}</strong><br>{body}</div>"
        )
