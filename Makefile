# Two commands on a fresh machine (see README.md): `make demo` and `make test`.
# Both create .venv on first use: torch==2.13.0 first (the CPU wheel; a looser pin pulls a
# multi-GB CUDA build), then this project with its `megatron` and `test` extras, installed as a
# regular (non-editable) package so the tests exercise what `pip install .` ships.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= megatron,test
SOURCES := pyproject.toml $(shell find capture bridge kernels profiling common mcore mopd -type f \( -name '*.py' -o -name '*.cu' -o -name '*.sh' -o -name 'py.typed' \) -not -path '*/results/*' 2>/dev/null)

.PHONY: install dev demo test lint clean

$(VENV)/.stamp: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.stamp

# An editable install for working on the library (the tests then see edits without reinstalling).
dev:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(VENV)/.stamp

demo: $(VENV)/.stamp
	$(VENV)/bin/mopd demo

test: $(VENV)/.stamp
	$(PY) -m pytest

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
