"""mkdocs hook: a page's `<!-- reference:NAME -->` becomes kvmesh.reference_docs' section NAME."""

from __future__ import annotations

import re
from typing import Any

from kvmesh.reference_docs import SECTIONS, section

MARKER = re.compile(r"<!-- reference:([a-z-]+) -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in SECTIONS:
            raise ValueError(f"{page.file.src_path}: no generated section {name!r}")
        return section(name)

    return MARKER.sub(generated, markdown)
