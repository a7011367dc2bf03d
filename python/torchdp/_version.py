"""The torchdp version.

Kept in step with ``project(TorchDP VERSION ...)`` in the top-level CMakeLists.txt, which is the one
source of truth: setup.py reads the version from there and the extension reports it as
``torchdp._C.__version__`` (tests/python/test_core_bindings.py checks that the two agree).
"""

__version__ = "0.1.0"
