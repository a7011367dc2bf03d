"""Writes each ```cpp block of README.md and docs/*.md to a .cpp file of its own, for the consumer
build to compile (CMakeLists.txt next to this file runs it at configure time):

    doc_blocks.py SOURCE_ROOT OUT_DIR

Every block is a complete translation unit (its own #include lines); a `#line` directive makes the
compiler's messages name the Markdown file and line. OUT_DIR/doc_blocks.cmake sets
TORCHDP_DOC_BLOCKS (the .cpp files) and TORCHDP_DOC_PAGES (the pages read, so that editing one
reconfigures). Files whose text is unchanged are left alone, so nothing recompiles needlessly.
"""

from __future__ import annotations

import pathlib
import re
import sys

_BLOCK = re.compile(r"^```cpp\n(?P<code>.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def main(root: pathlib.Path, out: pathlib.Path) -> int:
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for page in pages:
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1  # the block's first line
            relative = page.relative_to(root).as_posix()
            name = re.sub(r"\W", "_", f"{relative}_{line}") + ".cpp"
            source = f'#line {line} "{page.as_posix()}"\n{match.group("code")}'
            path = out / name
            if not path.exists() or path.read_text() != source:
                path.write_text(source)
            written.append(path)
    if not written:
        print(f"doc_blocks.py: no ```cpp blocks found under {root}", file=sys.stderr)
        return 1
    listing = "".join(f'  "{p.as_posix()}"\n' for p in written)
    page_listing = "".join(f'  "{p.as_posix()}"\n' for p in pages)
    cmake = f"set(TORCHDP_DOC_BLOCKS\n{listing})\nset(TORCHDP_DOC_PAGES\n{page_listing})\n"
    index = out / "doc_blocks.cmake"
    if not index.exists() or index.read_text() != cmake:
        index.write_text(cmake)
    print(f"doc_blocks.py: {len(written)} C++ blocks from {len(pages)} pages")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]).resolve()))
