"""Sphinx extension: keep the book's pages free of stray scripts.

Jupyter Book 1.x adds *every* ``.js`` and ``.css`` file under ``_static/`` to every
page (``jupyter_book/config.py`` globs the folder). For the vendored MathJax that
would mean loading its extensions, menu and accessibility code as page scripts, and
loading MathJax twice. This extension runs once the configuration is ready and

* drops every script under ``_static/vendor/mathjax/`` (``sphinx.ext.mathjax`` loads
  MathJax from ``mathjax_path``; MathJax fetches its own fonts and extensions from
  that folder when a page needs them), and
* drops duplicates, keeping the first occurrence, so the scripts listed in
  ``_config.yml`` (``vega-offline.js`` first, then Vega, Vega-Lite, Vega-Embed) keep
  their order ahead of anything the glob appended.

It also removes duplicate ``<script>`` tags from each page. With Sphinx 7.4,
inline scripts that extensions add after the builder starts (sphinx-thebe's
``const THEBE_JS_URL = ...``, sphinx-togglebutton's selector) are written twice,
and a repeated ``const`` is a JavaScript error on every page.
"""

from __future__ import annotations

from sphinx.application import Sphinx
from sphinx.config import Config

_MATHJAX_DIR = "vendor/mathjax/"


def _name(entry) -> str:
    return entry[0] if isinstance(entry, (tuple, list)) else entry


def _prune(app: Sphinx, config: Config) -> None:
    seen: set[str] = set()
    kept = []
    for entry in config.html_js_files:
        name = _name(entry)
        if name in seen or name.startswith(_MATHJAX_DIR):
            continue
        seen.add(name)
        kept.append(entry)
    config.html_js_files = kept


def _dedupe_page_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen: set = set()
    unique: list = []
    for script in scripts:
        # An inline script comes once with filename None and once with filename ""
        # (from the registry), so compare on (filename or None, priority, attributes).
        key = (
            getattr(script, "filename", str(script)) or None,
            getattr(script, "priority", 500),
            tuple(sorted((k, str(v)) for k, v in getattr(script, "attributes", {}).items())),
        )
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app: Sphinx) -> dict:
    # Priority < 500 so this runs before Sphinx's own config-inited handlers.
    app.connect("config-inited", _prune, priority=100)
    # Run last, after the themes and extensions have added their page scripts.
    app.connect("html-page-context", _dedupe_page_scripts, priority=900)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
