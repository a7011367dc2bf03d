#!/usr/bin/env bash
# The user's install, checked end to end: a fresh virtualenv, torch, then
# `pip install --no-build-isolation .`; torchdp imported from outside the source tree; the wheel's
# metadata (license, pinned torch) and its stripped module; a failed configure that does not stick;
# `make demo` on the installed package; and this folder's C++ app built against the pip-installed
# package through torchdp.cmake_prefix_path alone.
#   tests/consumer/fresh_venv.sh [VENV_DIR]      (default: build/fresh-venv)
# TORCH_VERSION (default 2.13.0) and TORCH_INDEX_URL choose the torch that goes into the venv;
# CMAKE_ARGS (shell words) go to both CMake configures (setup.py's through TORCHDP_CMAKE_ARGS).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=$(realpath -m "${1:-$root/build/fresh-venv}")
python=${PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
eval "cmake_args=(${CMAKE_ARGS:-})"
export TORCHDP_CMAKE_ARGS="${TORCHDP_CMAKE_ARGS:-} ${CMAKE_ARGS:-}"

rm -rf "$venv"
"$python" -m venv "$venv"
echo "== fresh venv $venv: $("$venv/bin/pip" --version | cut -d' ' -f1-2)," \
  "$("$venv/bin/python" -c 'import setuptools; print("setuptools", setuptools.__version__)' 2>&1)"
"$venv/bin/pip" install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$torch_version"
start=$(date +%s)
(cd "$root" && "$venv/bin/pip" install --quiet --no-build-isolation .)
echo "== pip install --no-build-isolation . took $(( $(date +%s) - start )) s"

# A failed configure must not stick: an option that cannot hold here (NCCL without CUDA) fails,
# then the plain install configures afresh and succeeds, rebuilding nothing that was built.
if (cd "$root" && TORCHDP_CMAKE_ARGS="-DTORCHDP_WITH_CUDA=OFF -DTORCHDP_WITH_NCCL=ON" \
    "$venv/bin/pip" install --quiet --no-build-isolation . >/dev/null 2>&1); then
  echo "fresh_venv.sh: TORCHDP_WITH_NCCL=ON without CUDA should have failed" >&2; exit 1
fi
start=$(date +%s)
(cd "$root" && "$venv/bin/pip" install --quiet --no-build-isolation .)
echo "== after a failed configure, pip install again took $(( $(date +%s) - start )) s"

# The README's demo runs on the installed package, without building anything.
start=$(date +%s)
demo=$(make -C "$root" --no-print-directory demo PYTHON="$venv/bin/python" 2>&1) || {
  echo "$demo"; exit 1; }
if grep -q "building the extension in place" <<<"$demo"; then
  echo "$demo"; echo "fresh_venv.sh: make demo built the extension despite the install" >&2; exit 1
fi
echo "== make demo ran on the installed package in $(( $(date +%s) - start )) s"

cd "$(mktemp -d)"   # away from the source tree, so the installed package is what is imported
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, subprocess, torch, torchdp
assert "site-packages" in torchdp.__file__, torchdp.__file__
dist = md.distribution("torchdp")
requires = dist.requires or []
release = torch.__version__.split("+")[0]
assert f"torch=={release}" in requires, requires
assert dist.metadata["License-Expression"] == "BSD-3-Clause", dist.metadata["License-Expression"]
files = [str(f) for f in dist.files]
assert any(f.endswith("licenses/LICENSE") or f.endswith("LICENSE") for f in files), files
module = pathlib.Path(torchdp._C.__file__)
sections = subprocess.run(["readelf", "-S", str(module)], capture_output=True, text=True).stdout
assert ".symtab" not in sections and ".debug_info" not in sections, "the module is not stripped"
prefix = pathlib.Path(torchdp.cmake_prefix_path)
assert (prefix / "TorchDP" / "TorchDPConfig.cmake").is_file(), prefix
assert (prefix.parent.parent / "include" / "torchdp" / "torchdp.h").is_file()
print(f"== torchdp {torchdp.__version__} from {torchdp.__file__}: Requires-Dist {requires[0]}, "
      f"License BSD-3-Clause, {module.name} stripped ({module.stat().st_size // 1024} KiB)")
PY

prefix=$("$venv/bin/python" -c 'import torchdp; print(torchdp.cmake_prefix_path)')
gen=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
cmake -S "$root/tests/consumer" -B consumer -G "$gen" -DCMAKE_PREFIX_PATH="$prefix" \
  "${cmake_args[@]}" >/dev/null
cmake --build consumer >/dev/null
./consumer/torchdp_consumer
./consumer/torchdp_readme_app >/dev/null
./consumer/torchdp_two_outputs >/dev/null
./consumer/torchdp_scripted_model >/dev/null
echo "== the C++ apps built against the pip-installed package ran"
