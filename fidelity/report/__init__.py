"""Reports people look at: `render(results, out_dir)` writes a self-contained index.html, PNG figures and a Markdown
summary."""

from __future__ import annotations

from .inputs import ReportInputError, load_inputs
from .render import Report, render

__all__ = ["render", "Report", "load_inputs", "ReportInputError"]
