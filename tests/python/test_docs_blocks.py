"""Every ```python block of README.md and docs/*.md runs as written.

The blocks are read from the Markdown at collection time (no copies of them live here). Each
block is a complete program: it runs alone, in a fresh module namespace, in a fresh temporary
folder as its working directory, on CPU device lists. An HTML comment on the line right above a
block's opening fence (GitHub and the Sphinx site do not show it) changes that:

    <!-- docs-test: continue -->   the block goes on from the page's previous block: that one
                                   (and what it continues) runs first, in the same namespace
    <!-- docs-test: gpus=2 -->     needs that many CUDA devices (and a CUDA build of torchdp):
                                   skipped without them, failed when TORCHDP_REQUIRE_CUDA=1
    <!-- docs-test: needs=transformers -->   imports that package: skipped where it is not
                                   installed (the ecosystem's packages are optional)

Options combine: ``<!-- docs-test: continue, gpus=2 -->``. A block must leave no global state
behind: the test fails a block that leaves torchdp.patch_torch() applied, a post-replicate hook
registered or a torch.distributed process group, and it restores os.environ. Blocks check their
own results with ``assert``.

C++ blocks are compiled by the consumer build (tests/consumer/doc_blocks.py).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import pathlib
import re
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# An optional marker line, then a ```python fence at the start of a line, up to the closing fence.
_BLOCK = re.compile(
    r"(?:^<!--\s*docs-test:(?P<options>[^>]*?)-->\n)?^```python\n(?P<code>.*?)^```\s*$",
    re.MULTILINE | re.DOTALL,
)
_OPTION = re.compile(r"^(continue|gpus=[1-9]|needs=[A-Za-z_][\w.]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    previous: Block | None  # the block it continues
    gpus: int
    needs: tuple[str, ...] = ()  # packages it imports that may be absent

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def chain(self) -> list[Block]:
        return [*(self.previous.chain() if self.previous else []), self]


def collect() -> list[Block]:
    blocks: list[Block] = []
    for path in PAGES:
        text = path.read_text()
        page = str(path.relative_to(ROOT))
        last: Block | None = None
        for match in _BLOCK.finditer(text):
            options = [o.strip() for o in (match.group("options") or "").split(",") if o.strip()]
            line = text.count("\n", 0, match.start("code"))  # the fence's line, 1-based
            for option in options:
                assert _OPTION.match(option), f"{page}:{line}: unknown docs-test option {option!r}"
            if "continue" in options:
                assert last is not None, f"{page}:{line}: 'continue' on a page's first block"
            gpus = max([int(o[5:]) for o in options if o.startswith("gpus=")], default=0)
            previous = last if "continue" in options else None
            needs = tuple(o[6:] for o in options if o.startswith("needs="))
            last = Block(page, line, match.group("code"), previous, gpus, needs)
            blocks.append(last)
    return blocks


BLOCKS = collect()


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    missing = [n for b in block.chain() for n in b.needs if importlib.util.find_spec(n) is None]
    if missing:
        return [pytest.mark.skip(reason=f"needs {', '.join(missing)}, not installed")]
    gpus = max(b.gpus for b in block.chain())
    if gpus >= 2:
        return [pytest.mark.needs_multi_gpu]
    return [pytest.mark.needs_cuda] if gpus == 1 else []


def test_blocks_collected() -> None:
    # Every fence that opens a Python block was matched (a stray marker or indent would hide one).
    fences = sum(p.read_text().count("\n```python\n") for p in PAGES)
    assert len(BLOCKS) == fences > 0


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name, marks=_marks(b)) for b in BLOCKS])
def test_block_runs(block: Block, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchdp

    monkeypatch.chdir(tmp_path)  # blocks may write files (checkpoints) into the current folder
    environ = dict(os.environ)
    threads = torch.get_num_threads()
    patches, hooks = set(torchdp.patch._active), set(torchdp.hooks._registry)
    # A module of its own in sys.modules, so that pickle finds the classes a block defines.
    name = "docs_block_" + re.sub(r"\W", "_", block.name)
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        for part in block.chain():
            # Padded so that a traceback names the Markdown file's own line numbers.
            code = compile("\n" * part.line + part.code, str(ROOT / part.page), "exec")
            exec(code, module.__dict__)
    finally:
        del sys.modules[name]
        module.__dict__.clear()
        del module
        gc.collect()  # instance hooks go with their modules
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        # Put back what a block left behind, so that the other tests run as without it.
        left_patches = set(torchdp.patch._active) - patches
        for handle_id in left_patches:
            torchdp.patch.TorchPatch(handle_id).undo()
        left_hooks = set(torchdp.hooks._registry) - hooks
        for hook_id in left_hooks:
            torchdp.hooks.PostReplicateHookHandle(hook_id).remove()
        left_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        if left_group:
            torch.distributed.destroy_process_group()
    assert not left_patches, f"{block.name} left torchdp.patch_torch() applied"
    assert not left_hooks, f"{block.name} left post-replicate hooks registered"
    assert not left_group, f"{block.name} left a torch.distributed process group"
