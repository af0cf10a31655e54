"""Tables that fit the terminal: columns left out by priority rather than cut.

rich squeezes a table wider than the terminal by cutting every column, headers
included, to `chang…`. A `FittedTable` decides when it is drawn, for the width it is
drawn at: the columns in order of importance until the next does not fit (a column whose cells
never wrap, as a run id, needs its widest cell; one whose cells may wrap needs its
longest word, or a few more), the others left out and named under the table;
the room left goes to the wrapping columns. No header is ever cut.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

# The narrowest a wrapping column is made (fewer where its text is shorter): narrower,
# its text would take a line for every word.
_WRAP_FLOOR = 12
# A wrapping column is at least as wide as its longest word up to this (a run id, a
# release id): only a longer one is folded.
_WHOLE_WORD = 32


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    priority: int  # the lowest is the most important: the last to be left out
    wrap: bool = False  # the cells may wrap at spaces (a word wider than the column folds)


class FittedTable:
    """A table of plain-text cells, its columns fitted to the width it is drawn at."""

    def __init__(self, title: str, columns: Sequence[Column], rows: Iterable[Sequence[str]]):
        self.title = title
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)

    def _needs(self, index: int) -> tuple[int, int]:
        """(the least width, the widest cell's) of column `index`, padding left out."""
        column = self.columns[index]
        full = max([cell_len(column.header), *(cell_len(row[index]) for row in self.rows)])
        if not column.wrap:
            return full, full
        header_word = max(cell_len(word) for word in column.header.split())
        cell_word = max([0, *(cell_len(word) for row in self.rows for word in row[index].split())])
        return max(header_word, min(max(cell_word, min(full, _WRAP_FLOOR)), _WHOLE_WORD)), full

    def table(self, width: int) -> Table:
        """The rich Table for `width` columns of text."""
        needs = [self._needs(i) for i in range(len(self.columns))]
        kept: list[int] = []
        used = 1  # the table's left edge; each column adds its width, 2 of padding and an edge
        for index in sorted(range(len(self.columns)), key=lambda i: self.columns[i].priority):
            if kept and used + needs[index][0] + 3 > width:  # the most important always shows
                break
            kept.append(index)
            used += needs[index][0] + 3
        widths = {index: needs[index][0] for index in kept}
        # The room left, to the wrapping columns: one more character at a time to the
        # narrowest that would use it, so that none is left a word wide beside a wide one.
        while used < width:
            growing = [index for index in kept if widths[index] < needs[index][1]]
            if not growing:
                break
            widths[min(growing, key=lambda index: widths[index])] += 1
            used += 1
        kept.sort()
        table = Table(title=self.title, title_justify="left")
        for index in kept:
            column = self.columns[index]
            table.add_column(column.header, width=widths[index], no_wrap=not column.wrap,
                             overflow="fold" if column.wrap else "ellipsis")
        for row in self.rows:
            table.add_row(*(Text(row[index]) for index in kept))  # plain text: run names may hold [brackets]
        left_out = [self.columns[i].header for i in range(len(self.columns)) if i not in widths]
        if left_out:
            table.caption = (f"left out for want of width: {', '.join(left_out)} "
                             "(a wider terminal or --json shows them)")
            table.caption_justify = "left"
        return table
