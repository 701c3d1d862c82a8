"""Printing results: a markdown table of result rows."""

from __future__ import annotations

import math
from typing import Any


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (header, row key, format spec). Missing / None / NaN values print as ``-``."""
    head = "| " + " | ".join(c[0] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key)
            cells.append("-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
