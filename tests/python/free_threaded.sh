#!/usr/bin/env bash
# make test-freethreaded: the Python tests on a free-threaded CPython, with the GIL left to the
# modules (PYTHON_GIL unset), so a module that does not declare free-threading support turns it on
# and fails the run. The stages, each timed:
#   1. CPython built with --disable-gil from Debian's source package, into DIR/cpython; skipped when
#      a build is there (rm -r DIR/cpython to rebuild). The chain of trust: the suite's InRelease
#      (gpgv, debian-archive-keyring) -> Sources.xz -> the .dsc -> the upstream (orig) tarball.
#   2. A virtualenv in DIR/venv with torch (pip's default build: CUDA on Linux, several GB) and
#      numpy, without triton (below); kept between runs while it has that torch.
#   3. torchdp built against it: `make build PYTHON=DIR/venv/bin/python BUILD=DIR/build`.
#   4. torch, torchdp._C and the tests' torchdp_testing import with the import warning as an error,
#      and the GIL is off afterwards.
#   5. `make test-python` with that warning as an error in every process (PYTHONWARNINGS), and
#      the GIL checked off before and after every test (TORCHDP_REQUIRE_GIL_OFF=1).
# As `make test-torch`, the extension is built in place and removed afterwards, so that the next
# `make test` relinks its own.
#   tests/python/free_threaded.sh [DIR]           (default: build-freethreaded, in the source tree)
# FT_PYTHON (3.13) and FT_DEBIAN_SUITE (trixie) choose Debian's python3.X source package;
# TORCH_VERSION (2.12.0) the torch; DEBIAN_MIRROR (https://deb.debian.org/debian); JOBS.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
dir=$(realpath -m --relative-to="$root" "${1:-build-freethreaded}")
series=${FT_PYTHON:-3.13}
suite=${FT_DEBIAN_SUITE:-trixie}
torch_version=${TORCH_VERSION:-2.12.0}
mirror=${DEBIAN_MIRROR:-https://deb.debian.org/debian}
jobs=${JOBS:-$(nproc)}
package=python$series
prefix=$root/$dir/cpython
python=$prefix/bin/python${series}t
venv=$root/$dir/venv
stamp=$prefix/torchdp-built-from
gil_warning="The global interpreter lock (GIL) has been enabled"
# The point of the run: CPython's default, the GIL off until a module asks for it.
unset PYTHON_GIL
# Wheels only: a free-threaded Python has wheels for fewer releases (numpy's and matplotlib's
# newest may have none for it), and pip then takes the newest release with one, not an sdist.
export PIP_ONLY_BINARY=:all:

say() { echo "== test-freethreaded: $*"; }
fail() {
  echo "test-freethreaded: $*" >&2
  exit 1
}
minutes() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
timings=()
stage() { # stage NAME FUNCTION: runs it, then says how long it took
  local start=$SECONDS
  say "$1"
  "$2"
  timings+=("$(printf '%-44s %s' "$1" "$(minutes $((SECONDS - start)))")")
  say "$1: done in $(minutes $((SECONDS - start)))"
}

fetch() { # fetch URL FILE
  local error
  error=$(curl -fsSL --retry 3 -o "$2" "$1" 2>&1) && return
  error=${error##*$'\n'}
  if [[ $error == *"(22)"* ]]; then
    fail "cannot download $1 ($error): the mirror lacks it. Set DEBIAN_MIRROR to another" \
      "Debian mirror, or FT_PYTHON and FT_DEBIAN_SUITE to another source package."
  fi
  fail "cannot download $1 ($error). Debian's archive must be reachable: check the network," \
    "or set DEBIAN_MIRROR to a Debian mirror."
}
check_sha256() { # check_sha256 FILE SHA256
  local actual
  actual=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$actual" = "$2" ] || fail "$1: SHA-256 $actual, but $3 lists $2"
}
# The SHA-256 and name of each file of a Checksums-Sha256 field (Release, .dsc).
checksums() {
  awk '/^(Checksums-Sha256|SHA256):/ { s = 1; next } /^[^ ]/ { s = 0 } s { print $1, $3 }' "$1"
}

apt_install_missing() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null | grep -q '^ii' || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return
  say "installing with apt: ${missing[*]}"
  local sudo
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

build_cpython() {
  if [ -x "$python" ] && [ -f "$stamp" ]; then
    say "cached: $(cat "$stamp") in $dir/cpython (rm -r $dir/cpython to rebuild)"
    return
  fi
  command -v dpkg-query >/dev/null || fail "this builds from Debian's source package and" \
    "installs CPython's build dependencies with apt: it needs Debian or a derivative."
  # CPython's build dependencies for pip, torch and the tests (ssl, zlib, ctypes, lzma, bz2,
  # sqlite3, zstd); decimal takes CPython's own libmpdec where Debian has none (12).
  apt_install_missing curl xz-utils gpgv debian-archive-keyring build-essential pkg-config \
    libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev libreadline-dev \
    uuid-dev libzstd-dev
  local downloads=$root/$dir/downloads src=$root/$dir/cpython-src log=$root/$dir/cpython-build.log
  rm -rf "$downloads" "$src" "$prefix"
  mkdir -p "$downloads" "$src"
  cd "$downloads"

  say "the newest $package in Debian $suite, from $mirror"
  fetch "$mirror/dists/$suite/InRelease" InRelease
  gpgv --quiet --keyring /usr/share/keyrings/debian-archive-keyring.gpg --output Release \
    InRelease 2>/dev/null || fail "$mirror/dists/$suite/InRelease: no valid signature of" \
    "Debian's archive keys (/usr/share/keyrings/debian-archive-keyring.gpg)."
  local sources_sha
  sources_sha=$(checksums Release | awk '$2 == "main/source/Sources.xz" { print $1 }')
  [ -n "$sources_sha" ] || fail "$mirror/dists/$suite/InRelease lists no main/source/Sources.xz"
  fetch "$mirror/dists/$suite/main/source/Sources.xz" Sources.xz
  check_sha256 Sources.xz "$sources_sha" "$suite's InRelease"
  # Each $package paragraph of Sources as "version pool-folder dsc-sha256 dsc-name"; the newest.
  local version folder dsc_sha dsc
  read -r version folder dsc_sha dsc < <(xz -dc Sources.xz | awk -v RS= -F '\n' -v pkg="$package" '
    { ok = 0; version = folder = dsc = ""; s = 0
      for (i = 1; i <= NF; i++) {
        if ($i == "Package: " pkg) ok = 1
        if ($i ~ /^Version: /) version = substr($i, 10)
        if ($i ~ /^Directory: /) folder = substr($i, 12)
        if ($i ~ /^Checksums-Sha256:/) { s = 1; continue }
        if ($i !~ /^ /) s = 0
        if (s) { split($i, f, " "); if (f[3] ~ /\.dsc$/) dsc = f[1] " " f[3] }
      }
      if (ok) print version, folder, dsc }' | sort -V | tail -n 1) || true
  [ -n "${dsc:-}" ] || fail "Debian $suite has no $package source package. Set FT_DEBIAN_SUITE" \
    "to a suite that has it (https://packages.debian.org/source/$package lists them)."
  say "$package $version: $mirror/$folder/$dsc"
  fetch "$mirror/$folder/$dsc" "$dsc"
  check_sha256 "$dsc" "$dsc_sha" "$suite's Sources"
  # Upstream's source, as the .dsc lists it. Debian's own tarball (packaging and patches) is
  # left out: its patches fit CPython to Debian's layout (dist-packages, ensurepip disabled),
  # not to a private prefix with virtualenvs.
  local sha name orig=""
  while read -r sha name; do
    if [[ $name == *.orig.tar.* && $name != *.asc ]]; then
      fetch "$mirror/$folder/$name" "$name"
      check_sha256 "$name" "$sha" "$dsc"
      orig=$name
    fi
  done < <(checksums "$dsc")
  [ -n "$orig" ] || fail "$dsc lists no upstream tarball (*.orig.tar.*)"
  tar -xf "$orig" -C "$src" --strip-components=1
  grep -q "$gil_warning" "$src/Python/import.c" ||
    fail "$package $version words the import warning differently: update gil_warning in $0"

  # No profile-guided optimization (it doubles the build): the tests check behavior, not speed.
  say "configure --disable-gil (log: $dir/cpython-build.log)"
  cd "$src"
  nice -n 10 ./configure --prefix="$prefix" --disable-gil --disable-test-modules >"$log" 2>&1 ||
    { tail -n 30 "$log"; fail "CPython's configure failed: $log"; }
  say "make -j $jobs, make install: about 5 minutes on 2 cores"
  { nice -n 10 make -j "$jobs" && make install; } >>"$log" 2>&1 ||
    { tail -n 30 "$log"; fail "CPython's build failed: $log"; }
  "$python" -c "import sysconfig, ssl, zlib, ctypes, lzma, bz2, sqlite3, decimal
assert sysconfig.get_config_var('Py_GIL_DISABLED'), 'built with the GIL'" ||
    fail "$python lacks a module (its build log: $log)"
  echo "$package $version (Debian $suite): $("$python" -V) --disable-gil" >"$stamp"
  cd "$root"
  rm -rf "$src" "$downloads"
  say "built: $(cat "$stamp")"
}

# The version pip asks for wins over a pip constraint file that caps torch, as in `make test-torch`.
# triton comes with pip's CUDA torch, for GPU kernels. Its module (3.7.0 for torch 2.12) does not
# declare free-threading support, and torch._dynamo imports it, which torch.compile and every
# torch.optim optimizer load: it would turn the GIL on in most tests, whatever torchdp does. The
# venv goes without it, as with torch's CPU wheel, which has no triton.
install_torch() {
  if [ ! -x "$venv/bin/python" ] || ! grep -qx "home = $prefix/bin" "$venv/pyvenv.cfg"; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import sys, torch, numpy
sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    say "pip install torch==$torch_version numpy (pip's default torch: CUDA on Linux, several GB)"
    PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install --quiet "torch==$torch_version" numpy
  fi
  "$venv/bin/pip" uninstall --yes --quiet triton 2>/dev/null || true
  "$venv/bin/python" -c "import importlib.util, torch, numpy
assert importlib.util.find_spec('triton') is None
print('== torch', torch.__version__, 'numpy', numpy.__version__, '(no triton)')"
}

# make's build and test-python with this venv and build folder; the extension goes in place.
make_args=(--no-print-directory PYTHON="$venv/bin/python" BUILD="$dir/build"
  TORCH_VERSION="$torch_version" JOBS="$jobs")
remove_in_place_extension() { rm -f python/torchdp/_C.*.so python/torchdp/_build_info.py; }

build_torchdp() {
  trap remove_in_place_extension EXIT
  PIP_CONSTRAINT=/dev/null nice -n 10 make build "${make_args[@]}"
}

check_gil() {
  PYTHONPATH="$root/python:$root/$dir/build/tests/python" \
    "$venv/bin/python" -W error::RuntimeWarning -c "import sys, sysconfig
assert sysconfig.get_config_var('Py_GIL_DISABLED'), 'not a free-threaded Python'
import torch, torchdp, torchdp._C, torchdp_testing
assert sys._is_gil_enabled() is False, 'the GIL is on after import torchdp'
print('== GIL off after importing torch', torch.__version__, 'and torchdp', torchdp.__version__,
      'on Python', sys.version.split()[0] + sys.abiflags)"
}

# tests/python/conftest.py stops the session at the first test that finds the GIL on.
run_tests() {
  PIP_CONSTRAINT=/dev/null PYTHONWARNINGS="error:$gil_warning:RuntimeWarning" \
    TORCHDP_REQUIRE_GIL_OFF=1 make test-python "${make_args[@]}"
}

start=$SECONDS
stage "CPython $series with --disable-gil" build_cpython
stage "venv with torch $torch_version" install_torch
stage "build torchdp" build_torchdp
stage "import with the GIL off" check_gil
stage "pytest, the GIL warning an error" run_tests
say "passed in $(minutes $((SECONDS - start))):"
printf '   %s\n' "${timings[@]}"
