"""mkdocs hook: notebook pages load no script from the network.

nbconvert's page template (which mkdocs-jupyter renders notebooks with) adds a module script that
imports the mermaid diagram library from a CDN whenever a page could hold a notebook diagram, and
the plugin has no setting for its address. The walkthroughs draw no mermaid diagram, and the site's
own pages load the bundled library (``extra_javascript`` in ``mkdocs.yml``), so the loader is dropped.
"""

from __future__ import annotations

import re
from typing import Any

#: An inline script that imports code from the network (``import("https://...")``).
_NETWORK_LOADER = re.compile(
    r"<script\b[^>]*>(?:(?!</script>).)*?\bimport\s*\(\s*[\"'](?:https?:)?//(?:(?!</script>).)*</script>", re.S | re.I)


def drop_network_loaders(html: str) -> str:
    """``html`` without the inline scripts that import code from the network."""
    return _NETWORK_LOADER.sub("", html)


def on_post_page(output: str, page: Any, config: Any) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    return drop_network_loaders(output)
