"""The markdown table format every benchmark prints its results in, one row at a time.

    >>> print(table_header("kind", "tok/s", numeric=True))
    | kind | tok/s |
    |---|---:|
    >>> table_row("static", f"{154.31:.1f}")
    '| static | 154.3 |'
"""
from __future__ import annotations


def table_header(*columns: str, numeric: bool = False) -> str:
    """The header line and the separator; numeric=True right-aligns all but the first column."""
    align = ["---"] + ["---:" if numeric else "---"] * (len(columns) - 1)
    return f"{table_row(*columns)}\n|{'|'.join(align)}|"


def table_row(*cells) -> str:
    """One row; cells are formatted by the caller (str() of anything else)."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"
