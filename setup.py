"""torchdp's setup.py: a thin driver of the one CMake build (CMakeLists.txt), in the style of
pybind/cmake_example and pytorch/torchcodec. No source lists live here: CMake builds the core
library and the torchdp._C module, and this file only configures, builds and places the module.

Install with the torch that is already installed (build isolation would pull another torch):

    pip install --no-build-isolation .
    pip install --no-build-isolation -e .

Environment variables:
    TORCHDP_CMAKE_ARGS   extra CMake arguments, e.g. "-DTORCHDP_WITH_CUDA=ON -DTORCHDP_WITH_NCCL=ON"
    MAX_JOBS             parallel compile jobs (as torch.utils.cpp_extension); else
                         CMAKE_BUILD_PARALLEL_LEVEL, else the number of CPUs
    DEBUG=1              a Debug build (default: Release)
    TORCHDP_CMAKE_BUILD_DIR  the CMake build folder (default: build-setup/<python tag> in the
                         repository, so that repeated and editable installs rebuild incrementally;
                         a change of options or torch configures it afresh)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    """The version from project(TorchDP VERSION x.y.z) in CMakeLists.txt, the one source of truth."""
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(\s*TorchDP\s+VERSION\s+([0-9][0-9A-Za-z.+-]*)", text)
    if match is None:
        raise RuntimeError("setup.py: no project(TorchDP VERSION ...) in CMakeLists.txt")
    return match.group(1)


def supported_torch() -> str:
    """The torch releases torchdp is tested with, from TORCHDP_TORCH_OLDEST and
    TORCHDP_TORCH_NEWEST in CMakeLists.txt (which checks the torch it builds against too)."""
    text = (ROOT / "CMakeLists.txt").read_text()
    oldest = re.search(r"set\(TORCHDP_TORCH_OLDEST\s+([0-9.]+)\)", text)
    newest = re.search(r"set\(TORCHDP_TORCH_NEWEST\s+([0-9]+)\.([0-9]+)\)", text)
    if oldest is None or newest is None:
        raise RuntimeError("setup.py: no TORCHDP_TORCH_OLDEST/NEWEST in CMakeLists.txt")
    return f">={oldest.group(1)},<{newest.group(1)}.{int(newest.group(2)) + 1}"


def torch_requirement() -> list[str]:
    """torch pinned to the release this build links against (local tags such as +cpu dropped, so
    that the CPU and CUDA builds of that release both satisfy it; torchdp's import checks the full
    version). Without torch (metadata only, as for an sdist), the supported range."""
    try:
        import torch
    except ImportError:
        return [f"torch{supported_torch()}"]  # build_ext reports the missing torch
    return [f"torch=={torch.__version__.split('+')[0]}"]


class CMakeExtension(Extension):
    """An extension built by CMake: no sources here, CMakeLists.txt lists them."""

    def __init__(self, name: str, source_dir: Path = ROOT) -> None:
        super().__init__(name, sources=[])
        self.source_dir = Path(source_dir).resolve()


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        try:
            import torch.utils
        except ImportError as error:  # pragma: no cover - the message is the point
            raise RuntimeError(
                "torchdp needs torch at build time: install torch first, then "
                "`pip install --no-build-isolation .`"
            ) from error

        # The folder where setuptools expects the module (build_lib, or the source tree for an
        # in-place build); CMake writes _C<EXT_SUFFIX> there directly.
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        ext_dir = ext_path.parent
        ext_dir.mkdir(parents=True, exist_ok=True)
        expected_suffix = sysconfig.get_config_var("EXT_SUFFIX")

        build_type = "Debug" if os.environ.get("DEBUG", "0") not in ("", "0") else "Release"
        build_dir = Path(
            os.environ.get("TORCHDP_CMAKE_BUILD_DIR")
            or ext.source_dir / "build-setup" / f"{sys.implementation.cache_tag}-{build_type}"
        ).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)

        cmake_args = [
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DTORCHDP_BUILD_PYTHON=ON",
            f"-DTORCHDP_PYTHON_OUTPUT_DIR={ext_dir}",
            "-DTORCHDP_BUILD_TESTS=OFF",
            "-DTORCHDP_BUILD_EXAMPLES=OFF",
            "-DTORCHDP_BUILD_BENCHMARKS=OFF",
            # The wheel carries the C++ package too (headers, the core library, the CMake
            # files), installed next to _C below: torchdp.cmake_prefix_path points there.
            "-DTORCHDP_INSTALL=ON",
            "-DCMAKE_INSTALL_LIBDIR=lib",
            "-DBUILD_SHARED_LIBS=OFF",
        ]
        cmake_args += shlex.split(os.environ.get("TORCHDP_CMAKE_ARGS", ""))
        # CMake keeps the options of the last configure in its cache, also of one that failed, so
        # that a later install without them would still see them: a configure whose arguments or
        # torch differ from the last successful one, or that follows a failed one, starts afresh.
        # The object files stay, so the build after it is still incremental.
        stamp = build_dir / "torchdp-configure.txt"
        key = "\n".join([torch.__version__, str(Path(torch.__file__).parent), *cmake_args])
        cache = build_dir / "CMakeCache.txt"
        if cache.exists() and not (stamp.exists() and stamp.read_text() == key):
            print(f"torchdp: the CMake options or torch changed: configuring {build_dir} afresh")
            cache.unlink()
        stamp.unlink(missing_ok=True)
        # A generator is chosen only for a fresh build folder: CMake refuses to switch later.
        if not cache.exists() and "CMAKE_GENERATOR" not in os.environ and shutil.which("ninja"):
            cmake_args.append("-GNinja")

        jobs = os.environ.get("MAX_JOBS") or os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL")
        jobs = jobs or str(os.cpu_count() or 1)
        build_args = ["--config", build_type, "--target", "_C", "--parallel", jobs]

        print(
            f"torchdp: building the C++ extension with CMake in {build_dir} ({jobs} jobs): the "
            "first build takes about 6 minutes on 2 cores, later ones rebuild what changed; "
            "`pip install -v` shows the compiler's progress",
            flush=True,
        )
        self._run(["cmake", "-S", str(ext.source_dir), "-B", str(build_dir), *cmake_args])
        stamp.write_text(key)
        self._run(["cmake", "--build", str(build_dir), *build_args])
        # An editable install runs from the source tree, which gets only the module.
        if not (self.inplace or getattr(self, "editable_mode", False)):
            self._run(
                [
                    "cmake",
                    "--install",
                    str(build_dir),
                    "--config",
                    build_type,
                    "--prefix",
                    str(ext_dir),
                ]
            )

        if not ext_path.exists():
            raise RuntimeError(
                f"setup.py: CMake did not produce {ext_path} (expected a module named "
                f"_C{expected_suffix} in {ext_dir})"
            )

    def _run(self, command: list[str]) -> None:
        print("+", shlex.join(command), flush=True)
        subprocess.run(command, check=True)


setup(
    name="torchdp",
    version=read_version(),
    packages=find_packages(where="python"),
    package_dir={"": "python"},
    package_data={"torchdp": ["py.typed", "*.pyi"]},
    install_requires=torch_requirement(),
    ext_modules=[CMakeExtension("torchdp._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    # setuptools' own build folders (lib.*, temp.*, bdist.*) next to the CMake one, away from
    # build/, which the Makefile's CMake build uses.
    options={"build": {"build_base": "build-setup"}},
)
