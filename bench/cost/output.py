"""What the cost tools write besides the tables they print: their figures as JSON (``--json``), as committed under
bench/results and quoted in docs/bench.md."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str | None, figures: dict[str, Any]) -> None:
    """``figures`` as indented JSON at ``path``; nothing without a path (``--json`` not given)."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
