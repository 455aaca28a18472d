# Two commands on a fresh machine (see README.md): `make demo` and `make test`.
# Both create .venv on first use: torch==2.13.0 first (the CPU wheel; a looser pin pulls a
# multi-GB CUDA build), then this project with its `megatron` and `test` extras, installed as a
# regular (non-editable) package so the tests exercise what `pip install .` ships, reinstalled
# when a source changes. `make dev` makes the install editable instead, and it stays editable:
# then only a change to pyproject.toml reinstalls (editable again). `make clean` starts over.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= megatron,test
SOURCES := pyproject.toml $(shell find capture bridge kernels profiling common mcore mopd -type f \( -name '*.py' -o -name '*.cu' -o -name '*.sh' -o -name 'py.typed' \) -not -path '*/results/*' 2>/dev/null)
# After `make dev`: the editable install sees every edit; only the dependencies can go stale.
EDITABLE := $(wildcard $(VENV)/.editable)
STAMP_DEPS := $(if $(EDITABLE),pyproject.toml,$(SOURCES))
PYTEST := $(PY) -m pytest

.PHONY: install dev demo test test-unit test-torchrun test-launch test-gpu lint typecheck clean

$(VENV)/.stamp: $(STAMP_DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q $(if $(EDITABLE),-e )".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.stamp

# An editable install for working on the library (the tests then see edits without reinstalling).
dev:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(VENV)/.editable $(VENV)/.stamp

demo: $(VENV)/.stamp
	$(VENV)/bin/mopd demo

# Every tier (tier 3 skips, with its reason, without a GPU); one tier: make test-unit, ...
test: $(VENV)/.stamp
	$(PYTEST)

test-unit: $(VENV)/.stamp
	$(PYTEST) tests/unit

test-torchrun: $(VENV)/.stamp
	$(PYTEST) tests/torchrun

test-launch: $(VENV)/.stamp
	$(PYTEST) tests/launch

test-gpu: $(VENV)/.stamp
	$(PYTEST) tests/gpu

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.stamp
	PYTHON=$(PY) bash .ci/typecheck

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache
