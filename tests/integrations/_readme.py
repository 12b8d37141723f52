"""The README's integration snippets, taken from the README itself so the tests run what users read."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_snippet(heading: str) -> str:
    """The first ```python block under the README heading ``### {heading}``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n### {heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no python block under ### {heading}"
    return match.group(1)
