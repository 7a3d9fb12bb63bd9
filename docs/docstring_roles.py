"""MkDocs hook: Sphinx-style roles in the rendered docstrings become code, linked where the API reference
documents the object.

The docstrings name objects as ``:func:`jaxkern.moe.reduce_fused``` (rendered by Markdown as ``:func:`` followed
by inline code). This hook drops the role prefix and wraps the code in an optional cross-reference, which
mkdocs-autorefs resolves to the object's entry in the API reference or leaves as plain code.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):<code>(~?)([A-Za-z_][\w.]*)</code>")


def _replace(match: re.Match) -> str:
  short, name = match.groups()
  shown = name.rsplit(".", 1)[-1] if short else name
  return f'<autoref identifier="{name}" optional><code>{shown}</code></autoref>'


def on_page_content(html, page, config, files):
  """MkDocs event: rewrite the roles of one rendered page."""
  return _ROLE.sub(_replace, html)
