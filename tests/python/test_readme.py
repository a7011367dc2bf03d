"""The README's examples are real: its C++ application is the file that tests/consumer builds
against the installed package (its Python blocks run in test_docs_blocks.py)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def test_readme_within_limits() -> None:
    assert len(README.splitlines()) <= 300
    assert len(README.encode()) <= 20 * 1024


def test_cpp_application_is_the_consumer_app() -> None:
    (app,) = blocks("cpp")
    assert app == (ROOT / "tests" / "consumer" / "readme_app.cpp").read_text()


def test_linked_files_exist() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
