"""A one-line stacked bar with a caption under it (page pool use, step composition)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.widget import Widget


@dataclass(frozen=True, slots=True)
class Segment:
    """A part of the bar: ``count`` units drawn with ``char`` in ``style`` (a Textual style,
    theme variables allowed)."""

    count: int
    style: str
    char: str = "█"


def split_cells(counts: list[int], total: int, width: int) -> list[int]:
    """Cells per segment for a bar ``width`` cells wide showing ``counts`` out of ``total``.

    Largest-remainder rounding, so the cells add up exactly and a non-zero count never vanishes
    when there is room for it.
    """
    if width <= 0 or total <= 0:
        return [0] * len(counts)
    exact = [c * width / total for c in counts]
    cells = [max(int(x), 1 if c > 0 else 0) for x, c in zip(exact, counts)]
    visible = sum(1 for c in counts if c > 0)
    budget = width if sum(counts) >= total else min(width, max(round(sum(exact)), visible))
    while sum(cells) > budget:
        shrinkable = [j for j in range(len(cells)) if cells[j] > 1] or [j for j in range(len(cells)) if cells[j]]
        i = max(shrinkable, key=lambda j: cells[j] - exact[j])
        cells[i] -= 1
    for i in sorted(range(len(counts)), key=lambda j: exact[j] - cells[j], reverse=True):
        if sum(cells) >= budget:
            break
        if exact[i] > cells[i]:
            cells[i] += 1
    return cells


class StackedBar(Widget):
    """Segments drawn left to right over ``total`` units; the rest of the bar is the empty track."""

    DEFAULT_CSS = """
    StackedBar {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._segments: tuple[Segment, ...] = ()
        self._total = 0
        self.caption = ""

    def set(self, segments: list[Segment], total: int, caption: str) -> None:
        """Show ``segments`` out of ``total`` with ``caption`` (one or more lines) below; refreshes
        only on change."""
        segs = tuple(segments)
        if segs == self._segments and total == self._total and caption == self.caption:
            return
        # The caption changes at every stats tick (step count, pages): only a change in its
        # number of lines needs a layout pass of the screen; otherwise repaint this bar.
        resize = len(caption.splitlines()) != len(self.caption.splitlines())
        self._segments, self._total = segs, total
        self.caption = caption
        self.refresh(layout=resize)

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001 - Textual's signature
        return 1 + len(self.caption.splitlines())

    def render(self) -> Content:
        width = self.content_size.width
        cells = split_cells([s.count for s in self._segments], self._total, width)
        parts: list[tuple[str, str] | str] = [(s.char * n, s.style) for s, n in zip(self._segments, cells) if n]
        rest = width - sum(cells)
        if rest > 0:
            parts.append(("░" * rest, "$foreground 25%"))
        return Content.assemble(*parts, "\n", (self.caption, "$text-muted"))
