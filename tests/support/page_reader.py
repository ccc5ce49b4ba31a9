"""Reading an HTML page the way a person does: the text of elements by id, the rows of the
tables in each section, and every element that is there (to tell markup from text)."""

from __future__ import annotations

from html.parser import HTMLParser

_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link",
                   "meta", "source", "track", "wbr"})


class PageReader(HTMLParser):
    """Feed it a page; then read tags, texts (by element id) and rows (by section id)."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.texts: dict[str, str] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self.title = ""
        self._text: list[str] = []
        self._open: list[tuple[str, str | None, int]] = []
        self._section: str | None = None
        self._row: list[str] = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        ident = dict(attrs).get("id")
        if tag == "section":
            self._section = ident
        if tag == "tr":
            self._row = []
        if tag not in _VOID:
            self._open.append((tag, ident, len(self._text)))

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            opened, ident, start = self._open.pop()
            # Pieces apart, as blocks are on screen.
            text = " ".join(self._text[start:])
            if opened == "title":
                self.title = " ".join(text.split())
            if ident is not None:
                self.texts[ident] = " ".join(text.split())
            if opened in ("td", "th"):
                self._row.append(" ".join(text.split()))
            if opened == "tr":
                self.rows.setdefault(self._section or "", []).append(self._row)
            if opened == tag:
                break

    def handle_data(self, data: str) -> None:
        self._text.append(data)

    def body_rows(self, section: str) -> list[list[str]]:
        """The rows of section's table below its header row."""
        return self.rows.get(section, [])[1:]
