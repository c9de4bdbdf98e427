# Two entry points that work on a fresh machine with only Python and pip:
#   make demo   installs music3serve (with its server) in .venv and writes demo.wav from the tiny random checkpoint
#   make test   installs the test dependencies in .venv and runs the whole CPU test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned torch (where pip is set up with a local CPU build, as on CI, that one): named in every install, so a
# later install never swaps it for another version. From PyPI, Linux torch wheels bundle CUDA (several GB): set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build (or .../whl/cu130 for a CUDA 13 build).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
# tests/test_kernels_interpreted.py runs the Triton kernels on the CPU through Triton's interpreter, with Triton from a
# folder of its own that only that test's child process puts on its path: the rest of the suite, torch.compile's CPU
# path included, runs as without Triton. Installed once (about 640 MB); where no wheel exists (Triton is built for
# Linux only) that test skips, except on CI.
TRITON ?= triton>=3.6,<3.7
TRITON_SITE := $(VENV)/triton-interpret
# Test worker processes, each handed whole files (their module fixtures build engines once): CI has two cores, and
# the tests run single-threaded (tests/conftest.py); about 8 min in two processes on two cores.
TEST_WORKERS ?= 2

.PHONY: demo test install install-test browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_FROM) "$(TORCH)"

install: $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[tiny,audio,serve]"

install-test: $(BIN)/python $(TRITON_SITE)/triton/__init__.py
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[test]"

$(TRITON_SITE)/triton/__init__.py: | $(BIN)/python
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(TRITON_SITE) "$(TRITON)" \
		|| echo "Triton did not install: tests/test_kernels_interpreted.py will skip"

demo: install
	$(BIN)/music3serve generate --tiny --caption "Warm lo-fi hip hop, mellow piano, soft female vocals" \
		--lyrics @examples/lyrics.txt \
		--duration 12 --seed 42 -o demo.wav
	@echo "Wrote demo.wav. The tiny checkpoint has random weights, so it sounds like noise: it proves the"
	@echo "pipeline end to end, not the music. For real songs (a CUDA GPU), see the README: download"
	@echo "MiniMaxAI/MiniMax-Music3 (57 GB) and run"
	@echo "  $(BIN)/music3serve generate --model PATH --caption ... --lyrics @examples/lyrics.txt --duration 60 -o song.wav"

# The browser tests (tests/test_studio.py, tests/test_examples.py) drive Debian's chromium, and examples/curl.sh
# needs curl, jq and xxd: on CI (CI=true) the missing ones are installed (a missing one fails its tests there);
# elsewhere those tests skip without them. Each package is named as its program.
TOOLS ?= /usr/bin/chromium /usr/bin/curl /usr/bin/jq /usr/bin/xxd
browser:
	@missing=$$(for tool in $(TOOLS); do [ -x $$tool ] || basename $$tool; done); \
	if [ "$(CI)" = true ] && [ -n "$$missing" ]; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

test: install-test browser
	MUSIC3SERVE_TRITON_SITE=$(TRITON_SITE) \
		$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15 tests
