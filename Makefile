# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= config.example.toml

.PHONY: run test test-fast lint fmt clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvgate dev --config $(CONFIG)

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest -q

# Everything but the real-vLLM suite (tests/integration): for local iteration; CI runs `make test`.
test-fast: lint
	$(BIN)/pytest -q -m 'not integration'

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .build .pytest_cache
