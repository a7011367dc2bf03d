# torchdp: the README's commands. Each target installs what is missing first.
#   make test   build everything, run the C++ tests (ctest), the installed-package check and the
#               Python tests (pytest, against the torchdp._C built in place into python/torchdp)
#   make python build only the torchdp._C extension, in place (python/torchdp/_C*.so)
#   make install-python   pip install --no-build-isolation -e . (the setup.py driven build)
#   make bench  the benchmark suite, all modes side by side, into benchmarks/results/ (GPUs)
#   make soak   many training steps, failing when memory or the thread count grow
#   make demo   train a small masked model with torchdp.DataParallel (Python) and check it, on the
#               installed torchdp (seconds), else on one built in place first
#   make docs   the Sphinx site into $(BUILD)/docs/html, warnings as errors, against the torchdp
#               that imports (after make python or make test; it builds nothing)
#   make check-install   a fresh virtualenv installs torchdp with pip as a user does, imports it
#               from outside the tree and builds a C++ app against it (tests/consumer/fresh_venv.sh)
#   make demo-cpp   the same with torchdp::DataParallel in C++
#   make test-sanitize   the C++ and Python tests against an AddressSanitizer + UBSan build
#   make test-torch TORCH_VERSION=X.Y.Z   `make test` in a fresh virtualenv with that torch (pip's
#               default build: CUDA on Linux); NO_CUDA_TOOLKIT=1 as on a machine without the toolkit
#   make test-freethreaded   the Python tests on a free-threaded CPython built from Debian's source
#               package, failing when the GIL comes back on (tests/python/free_threaded.sh)
# TORCHDP_REQUIRE_CUDA=1 makes a GPU run fail instead of skipping its CUDA cases and requires the
# CUDA and NCCL fast paths at configure time.

PYTHON ?= python3
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
TORCH_VERSION ?= 2.13.0
# pip's default index serves the CUDA build of torch on Linux; a CPU-only machine that reaches the
# internet can take the CPU build with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (the CI
# and development machines have the CPU wheel in pip's local wheel folder and leave it empty).
TORCH_INDEX_URL ?=
# Extra CMake arguments, for every CMake configure here (the build, the consumer app, the sanitizer
# build, and setup.py's build through TORCHDP_CMAKE_ARGS in install-python and check-install).
CMAKE_ARGS ?=
export CMAKE_ARGS
# Extra packages the Python tests use when present (the ecosystem tests: transformers,
# torchvision), installed by deps with torch held at the installed release.
TEST_PACKAGES ?=

ifeq ($(TORCHDP_REQUIRE_CUDA),1)
CUDA_ARGS := -DTORCHDP_WITH_CUDA=ON -DTORCHDP_WITH_NCCL=ON
endif

.PHONY: all deps configure build test test-cpp consumer python test-python install-python demo \
	demo-cpp bench soak clean test-sanitize docs check-install test-torch test-freethreaded lint \
	lint-tools format

all: build

# Installs only what is missing: torch (the version pinned above) with pip; CMake, a C++ compiler
# and Catch2 with apt, and then Ninja and ccache too (they speed builds up but are optional, so a
# machine without network access that has the required tools, like the GPU machine, installs nothing).
deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "== installing torch==$(TORCH_VERSION)"; \
	  $(PYTHON) -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) \
	    "torch==$(TORCH_VERSION)"; }
	@missing=""; \
	command -v cmake >/dev/null || missing="$$missing cmake"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	{ [ -e /usr/include/catch2/catch.hpp ] || [ -e /usr/include/catch2/catch_all.hpp ] || \
	  [ -e /usr/local/include/catch2/catch_all.hpp ]; } || missing="$$missing catch2"; \
	if [ -n "$$missing" ]; then \
	  command -v ninja >/dev/null || missing="$$missing ninja-build"; \
	  command -v ccache >/dev/null || missing="$$missing ccache"; \
	  echo "== installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@$(PYTHON) -c "import pytest, hypothesis, matplotlib" 2>/dev/null || { \
	  echo "== installing pytest hypothesis matplotlib"; \
	  $(PYTHON) -m pip install --quiet pytest hypothesis matplotlib; }
	@[ -z "$(strip $(TEST_PACKAGES))" ] || $(PYTHON) -c "import re, sys, importlib.metadata as m; \
	  [m.distribution(re.split(r'[<>=!~;\[ ]', p)[0]) for p in sys.argv[1:]]" $(TEST_PACKAGES) \
	  2>/dev/null || { echo "== installing $(TEST_PACKAGES)"; mkdir -p $(BUILD); \
	  $(PYTHON) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" \
	    >$(BUILD)/torch-constraint.txt; \
	  $(PYTHON) -m pip install --quiet -c $(BUILD)/torch-constraint.txt $(TEST_PACKAGES); }

# The one build also builds the torchdp._C extension straight into python/torchdp, so that
# PYTHONPATH=python imports it (the in-place build used by test-python).
configure: deps
	@prefix=$$($(PYTHON) -c "import torch.utils; print(torch.utils.cmake_prefix_path)"); \
	gen=$$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles"); \
	cmake -S . -B $(BUILD) -G "$$gen" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_PREFIX_PATH="$$prefix" \
	  -DPython3_EXECUTABLE=$$($(PYTHON) -c "import sys; print(sys.executable)") \
	  -DTORCHDP_BUILD_PYTHON=ON -DTORCHDP_PYTHON_OUTPUT_DIR=$(CURDIR)/python/torchdp \
	  -DTORCHDP_BUILD_BENCHMARKS=ON \
	  -DCMAKE_INSTALL_PREFIX=$(CURDIR)/$(BUILD)/_install $(CUDA_ARGS) $(CMAKE_ARGS)

build: configure
	@[ -n "$$(find $(BUILD) -name '*.o' -print -quit)" ] || echo \
	  "== make: the first build compiles about 50 C++ files against LibTorch: 10 to 15 minutes on" \
	  "2 cores ($(JOBS) jobs; JOBS=N sets them), later builds only what changed"
	cmake --build $(BUILD) -j $(JOBS)

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Installs the package into $(BUILD)/_install and builds tests/consumer against it.
consumer: build
	cmake --install $(BUILD) >/dev/null
	@prefix=$$($(PYTHON) -c "import torch.utils; print(torch.utils.cmake_prefix_path)"); \
	gen=$$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles"); \
	cmake -S tests/consumer -B $(BUILD)/consumer -G "$$gen" \
	  -DCMAKE_PREFIX_PATH="$(CURDIR)/$(BUILD)/_install;$$prefix" $(CMAKE_ARGS) >/dev/null
	cmake --build $(BUILD)/consumer
	$(BUILD)/consumer/torchdp_consumer
	$(BUILD)/consumer/torchdp_two_outputs
	$(BUILD)/consumer/torchdp_scripted_model

# Only the extension (and the core library it links), in place into python/torchdp.
python: configure
	cmake --build $(BUILD) -j $(JOBS) --target _C

# pytest exits with 5 when it collects no tests, which fails this target as it should.
# The benchmark smoke test (tests/python/test_benchmarks_smoke.py) runs the C++ benchmark too.
test-python: build
	TORCHDP_BENCH_CPP=$(CURDIR)/$(BUILD)/benchmarks/cpp/torchdp_bench_cpp \
	  TORCHDP_TEST_EXTENSION=required PYTHONPATH=$(CURDIR)/python:$(CURDIR)/$(BUILD)/tests/python \
	  $(PYTHON) -m pytest

# The setup.py driven build, as a user installs it (editable: python/torchdp is the package).
install-python: deps
	MAX_JOBS=$(JOBS) TORCHDP_CMAKE_ARGS="$(strip $(CUDA_ARGS) $(TORCHDP_CMAKE_ARGS) $(CMAKE_ARGS))" \
	  $(PYTHON) -m pip install --no-build-isolation -e .

test: lint test-cpp consumer test-python
# One cmake --build at a time in $(BUILD) (each is parallel inside) even under make -j.
.NOTPARALLEL: test

# The linters, pinned (pyproject.toml holds ruff's rule set, .clang-format the C++ style): ruff
# check, ruff format --check and clang-format over the tracked Python and C++ files; the pinned
# tools are installed into $(PYTHON) first when missing. `make format` applies both formatters.
RUFF_VERSION := 0.17.6
# make lint also fails on any tracked file longer than this: split it.
MAX_FILE_LINES := 800
CLANG_FORMAT_VERSION := 23.1.5
CXX_SOURCES = $(shell git ls-files '*.h' '*.cpp' '*.cu' 2>/dev/null)
CLANG_FORMAT = $$($(PYTHON) -c "import clang_format as c, os; \
  print(os.path.join(os.path.dirname(c.__file__), 'data', 'bin', 'clang-format'))")
lint-tools:
	@$(PYTHON) -m ruff --version 2>/dev/null | grep -qx "ruff $(RUFF_VERSION)" && \
	$(PYTHON) -c "import importlib.metadata as m, sys; \
	  sys.exit(m.version('clang-format') != '$(CLANG_FORMAT_VERSION)')" 2>/dev/null || { \
	  echo "== installing ruff==$(RUFF_VERSION) clang-format==$(CLANG_FORMAT_VERSION)"; \
	  $(PYTHON) -m pip install --quiet ruff==$(RUFF_VERSION) clang-format==$(CLANG_FORMAT_VERSION); }

lint: lint-tools
	$(PYTHON) -m ruff check --no-cache .
	$(PYTHON) -m ruff format --no-cache --check .
	@[ -n "$(CXX_SOURCES)" ] || { echo "make lint: no git checkout: nothing for clang-format"; exit 1; }
	@$(CLANG_FORMAT) --dry-run --Werror $(CXX_SOURCES) && \
	  echo "== clang-format: $(words $(CXX_SOURCES)) C++ files formatted"
	@long=$$(git grep -I -c '' -- . | \
	  awk -F: '$$NF > $(MAX_FILE_LINES) {print $$1 " (" $$NF " lines)"}'); \
	  [ -z "$$long" ] || { echo "make lint: files over $(MAX_FILE_LINES) lines, split them:"; \
	  echo "$$long"; exit 1; }

format: lint-tools
	$(PYTHON) -m ruff check --no-cache --fix .
	$(PYTHON) -m ruff format --no-cache .
	$(CLANG_FORMAT) -i $(CXX_SOURCES)

# The Python example: a cplxmodule-style masked model trained with torchdp.DataParallel on all
# GPUs (two CPU replicas without GPUs), checked against single-device training. It runs on the
# torchdp that is installed (pip install), in seconds; only without one is the extension built in
# place first (several minutes), its output going to a log shown when the build fails.
demo:
	@if (cd /tmp && $(PYTHON) -c "import torchdp") >/dev/null 2>&1; then \
	  echo "== make demo: the installed torchdp ($$(cd /tmp && $(PYTHON) -c \
	    'import torchdp; print(torchdp.__version__, "in", torchdp.__file__)'))"; \
	  cd /tmp && $(PYTHON) $(CURDIR)/examples/python/train_masked.py; \
	else \
	  echo "== make demo: no installed torchdp: building the extension in place first (the first"; \
	  echo "   time about 6 minutes on 2 cores; 'pip install --no-build-isolation .' installs it)"; \
	  mkdir -p $(BUILD); echo "== building (log: $(BUILD)/demo-build.log)"; \
	  $(MAKE) --no-print-directory python >$(BUILD)/demo-build.log 2>&1 || { \
	    tail -n 40 $(BUILD)/demo-build.log; echo "== the build failed: $(BUILD)/demo-build.log"; \
	    exit 1; }; \
	  PYTHONPATH=$(CURDIR)/python $(PYTHON) examples/python/train_masked.py; \
	fi

# The C++ example: the same idea with torchdp::DataParallel and a post-replicate hook.
demo-cpp: build
	$(BUILD)/examples/cpp/torchdp_example_train_masked

# The benchmark suite side by side on all GPUs (see benchmarks/run_all.py); results, Markdown table
# and plots go to benchmarks/results. BENCH_ARGS="--gpus 1,2" or "--only train_step" narrow it.
# Then the per-phase profile of torchdp's steps (benchmarks/profiling.py step; PROFILE_ARGS="--out F").
bench: python
	cmake --build $(BUILD) -j $(JOBS) --target torchdp_bench_cpp
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/run_all.py \
	  --cpp-bin $(BUILD)/benchmarks/cpp/torchdp_bench_cpp $(BENCH_ARGS)
	PYTHONPATH=$(CURDIR)/python $(PYTHON) benchmarks/profiling.py step $(PROFILE_ARGS)

# The soak test: 2,000 training steps through torchdp.DataParallel (cuda:0,cuda:0 with a GPU,
# else cpu,cpu), failing when RSS, the thread count or CUDA memory grow past its bounds.
# SOAK_ARGS="--devices cuda:0,cuda:0 --steps 5000" changes it (tests/python/soak.py --help).
soak: python
	PYTHONPATH=$(CURDIR)/python $(PYTHON) tests/python/soak.py $(SOAK_ARGS)

# The docs site (docs/), with warnings as errors. The API pages document the torchdp that imports:
# this tree's when its extension is built in place, else an installed one (as docs/conf.py does).
# Nothing is built: without an importable torchdp it stops and says what to run. The docs tools,
# when missing, are installed (pinned, announced), as `deps` installs pytest.
docs:
	@$(PYTHON) -c "import sphinx, myst_parser, furo" 2>/dev/null || { \
	  echo "== make docs: installing the docs tools into $(PYTHON) (docs/requirements.txt)"; \
	  $(PYTHON) -m pip install --quiet -r docs/requirements.txt; }
	@where=$$($(if $(wildcard python/torchdp/_C*.so),PYTHONPATH=$(CURDIR)/python) $(PYTHON) -c \
	  "import torchdp; print(torchdp.__version__, 'from', torchdp.__file__)" 2>&1) || { \
	  echo "$$where" | tail -n 1; \
	  echo "make docs: no importable torchdp. Build the extension in place with 'make python'" \
	    "(or 'make test'), or install torchdp ('pip install --no-build-isolation .'), then run" \
	    "'make docs' again."; exit 1; }; \
	echo "== make docs: the API pages document torchdp $$where"
	$(PYTHON) -m sphinx -W --keep-going -q -b html -d $(BUILD)/docs/doctrees docs $(BUILD)/docs/html
	@echo "== docs: $(BUILD)/docs/html/index.html"

# The user's install in a fresh virtualenv (its own Release build, in build-setup/).
check-install: deps
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX_URL=$(TORCH_INDEX_URL) \
	  MAX_JOBS=$(JOBS) bash tests/consumer/fresh_venv.sh $(BUILD)/fresh-venv

# AddressSanitizer + UndefinedBehaviorSanitizer over the core, the extension and the C++ tests, built
# in $(SAN_BUILD) (the extension goes to $(SAN_BUILD)/python/torchdp, next to a copy of the package's
# Python files); then ctest, and pytest with the sanitizer runtimes preloaded into Python. Any report
# fails the run. Slow (a Debug build of its own), so not part of `make test`; without GPUs it runs the
# CPU cases. Leak detection is off: libtorch and CPython keep allocations until exit by design.
SAN_BUILD ?= $(BUILD)-sanitize
SAN_FLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer
SAN_ENV := ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
test-sanitize: deps
	@prefix=$$($(PYTHON) -c "import torch.utils; print(torch.utils.cmake_prefix_path)"); \
	gen=$$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles"); \
	cmake -S . -B $(SAN_BUILD) -G "$$gen" -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_CXX_FLAGS="$(SAN_FLAGS) -O1" -DCMAKE_EXE_LINKER_FLAGS="$(SAN_FLAGS)" \
	  -DCMAKE_SHARED_LINKER_FLAGS="$(SAN_FLAGS)" -DCMAKE_PREFIX_PATH="$$prefix" \
	  -DPython3_EXECUTABLE=$$($(PYTHON) -c "import sys; print(sys.executable)") \
	  -DTORCHDP_BUILD_PYTHON=ON -DTORCHDP_PYTHON_OUTPUT_DIR=$(CURDIR)/$(SAN_BUILD)/python/torchdp \
	  -DTORCHDP_BUILD_EXAMPLES=OFF $(CUDA_ARGS) $(CMAKE_ARGS)
	cmake --build $(SAN_BUILD) -j $(JOBS)
	cp python/torchdp/*.py python/torchdp/py.typed $(SAN_BUILD)/python/torchdp/
	cd $(SAN_BUILD) && $(SAN_ENV) ctest --output-on-failure -j $(JOBS)
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
	  $(SAN_ENV) TORCHDP_TEST_EXTENSION=required \
	  PYTHONPATH=$(CURDIR)/$(SAN_BUILD)/python:$(CURDIR)/$(SAN_BUILD)/tests/python \
	  $(PYTHON) -m pytest -p no:cacheprovider tests/python

# `make test` against another torch: a fresh virtualenv in $(TORCH_VENV) with torch==$(TORCH_VERSION)
# (pip's default build, a CUDA one on Linux; TORCH_INDEX_URL picks another), its own build in
# $(TORCH_BUILD), then the whole of `make test` there. The version asked for wins over a pip
# constraint file that caps torch (PIP_CONSTRAINT is emptied for this virtualenv's installs).
# NO_CUDA_TOOLKIT=1 runs it as on a machine without the CUDA toolkit (tests/consumer/
# without_cuda_toolkit.sh). The extension is built in place, as by `make test`: it is removed
# afterwards, so that the next `make test` relinks its own.
TORCH_BUILD ?= build-torch$(TORCH_VERSION)
TORCH_VENV ?= $(CURDIR)/$(TORCH_BUILD)/venv
test-torch:
	rm -rf $(TORCH_VENV)
	$(PYTHON) -m venv $(TORCH_VENV)
	@echo "== $(TORCH_VENV): torch==$(TORCH_VERSION), build in $(TORCH_BUILD)/build"
	@status=0; PIP_CONSTRAINT=/dev/null \
	  $(if $(filter 1,$(NO_CUDA_TOOLKIT)),bash tests/consumer/without_cuda_toolkit.sh) \
	  $(MAKE) --no-print-directory test PYTHON=$(TORCH_VENV)/bin/python BUILD=$(TORCH_BUILD)/build \
	  TORCH_VERSION=$(TORCH_VERSION) || status=$$?; \
	rm -f python/torchdp/_C.*.so python/torchdp/_build_info.py; exit $$status

# The Python tests on a free-threaded CPython, with the GIL left to the modules (PYTHON_GIL unset),
# in $(FT_BUILD) (tests/python/free_threaded.sh): CPython $(FT_PYTHON) built with --disable-gil from
# the source package of Debian $(FT_DEBIAN_SUITE) (deb.debian.org, checked from the signed InRelease
# down to the tarball; kept, so later runs skip it), then, as `make test-torch` does, a virtualenv
# with torch==$(FT_TORCH_VERSION) (pip's default build, without triton), `make build` and `make
# test-python` there, failing when the GIL comes on. 3.13t with torch 2.12, the newest torch with a
# wheel for 3.13t: torch 2.15 has one for 3.14t (FT_PYTHON=3.14 FT_DEBIAN_SUITE=forky
# FT_TORCH_VERSION=2.15.0), but deb.debian.org as the development machines reach it serves no
# python3.14 source (404), so that is untested. About 13 minutes on 2 cores the first time (and
# torch's download, 4 GB with its CUDA libraries), 2 to 3 later; not in CI (see CONTRIBUTING.md).
FT_BUILD ?= build-freethreaded
FT_PYTHON ?= 3.13
FT_DEBIAN_SUITE ?= trixie
FT_TORCH_VERSION ?= 2.12.0
test-freethreaded:
	FT_PYTHON=$(FT_PYTHON) FT_DEBIAN_SUITE=$(FT_DEBIAN_SUITE) TORCH_VERSION=$(FT_TORCH_VERSION) \
	  JOBS=$(JOBS) bash tests/python/free_threaded.sh $(FT_BUILD)

clean:
	rm -rf $(BUILD) $(SAN_BUILD)
