# Two entry points: `make run` (the main job on embedded defaults) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit clean sandbox browser bytecode

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

# bubblewrap runs the local cluster's containers (gpu-dra up/demo, tests/cluster); best effort: without it
# the kubelet emulator says so and runs pods with --runtime none.
sandbox:
	@if command -v bwrap >/dev/null; then echo "sandbox: bubblewrap found at $$(command -v bwrap)"; \
	elif ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ]; then \
	  echo "sandbox: bubblewrap missing and not installed (needs apt-get as root): containers will not run"; \
	else echo "sandbox: installing bubblewrap (apt-get install -y -q bubblewrap)"; \
	  (apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1)) \
	  && echo "sandbox: bubblewrap installed at $$(command -v bwrap)" \
	  || echo "sandbox: apt-get could not install bubblewrap: containers will not run"; fi

# Debian's chromium drives the dashboard's browser tests (tests/dashboard); best effort: without it they skip
# and say why.
browser:
	@if command -v chromium >/dev/null || [ -n "$$CHROMIUM" ]; then echo "browser: chromium found at $$(command -v chromium || echo $$CHROMIUM)"; \
	elif ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ]; then \
	  echo "browser: chromium missing and not installed (needs apt-get as root): the browser tests will skip"; \
	else echo "browser: installing chromium (apt-get install -y -q chromium)"; \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
	  && echo "browser: chromium installed at $$(command -v chromium)" \
	  || echo "browser: apt-get could not install chromium: the browser tests will skip"; fi

# Every process of the local cluster and of the suite imports the same ~100 modules of this tree; where the
# environment says PYTHONDONTWRITEBYTECODE, as many do, each would compile them again at each start (75-220 ms of
# CPU a process). They are compiled here once; an up-to-date file is skipped, and an edited one is recompiled.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q shared services embedded

run: $(STAMP) sandbox bytecode
	$(BIN)/gpu-dra demo

lint: $(STAMP)
	$(BIN)/ruff format --check shared services embedded tests bench
	$(BIN)/ruff check shared services embedded tests bench

typecheck: $(STAMP)
	$(BIN)/mypy shared services embedded
	$(BIN)/mypy tests

# Two workers, a test file each at a time (its module fixtures stay in one process): alone, the suite keeps
# 2 cores about 40% busy, since its tests mostly wait on the processes they start.
# A worker that dies (the watchdog of tests/watchdog.py ends one whose test hangs) ends the run: xdist would
# replace it and hand the new one the same file, whose hang then came back at each of its 8 restarts.
unit: $(STAMP) sandbox browser bytecode
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --max-worker-restart 0

test: lint typecheck unit

clean:
	rm -rf $(VENV) schemas
