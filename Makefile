# Two entry points: `make run` (the main job on embedded defaults) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/gpu-dra demo

lint: $(STAMP)
	$(BIN)/ruff check shared services embedded tests bench

typecheck: $(STAMP)
	$(BIN)/mypy shared

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

test: lint typecheck unit

clean:
	rm -rf $(VENV) schemas
