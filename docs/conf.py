"""Sphinx configuration of the torchdp docs (`make docs`: warnings are errors)."""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The API pages document the torchdp that imports: the package of this tree when its extension is
# built in place (`make python`, `make test`, an editable install), else an installed one.
if any((ROOT / "python" / "torchdp").glob("_C*.so")):
    sys.path.insert(0, str(ROOT / "python"))

try:
    import torchdp
except ImportError as error:
    raise RuntimeError(
        f"the docs need an importable torchdp ({error}): build it in place with `make python` "
        "(or `make test`), or install it with `pip install --no-build-isolation .`"
    ) from error

project = "torchdp"
copyright = "2026, the torchdp contributors"
author = "the torchdp contributors"
release = torchdp.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_generated"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Links to Python's and PyTorch's docs need their inventories, which a build without network
# access cannot fetch: intersphinx is configured empty so that nothing is downloaded.
intersphinx_mapping: dict = {}
nitpicky = False

html_theme = "furo"
html_title = f"torchdp {release}"
html_theme_options = {"source_edit_link": None}
html_static_path: list[str] = []


def _notes_index() -> str:
    """A table of the `Note [Title]` blocks of the sources: the heading line of each, alone on its
    line (references to a Note stand inside other text)."""
    heading = re.compile(r"^\s*(?://|#) Note \[([^\]]+)\]\s*$")
    rows = []
    for folder in ("csrc", "python"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in {".h", ".cpp", ".py"}:
                continue
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                match = heading.match(line)
                if match:
                    rows.append((match.group(1), f"{path.relative_to(ROOT)}:{number}"))
    lines = ["| Note | where |", "|---|---|"]
    lines += [
        f"| {title} | `{where}` |" for title, where in sorted(rows, key=lambda r: r[0].lower())
    ]
    return "\n".join(lines) + "\n"


_generated = pathlib.Path(__file__).parent / "_generated"
_generated.mkdir(exist_ok=True)
(_generated / "notes.md").write_text(_notes_index())
