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
# The newest megatron-core (0.19.x needs Python 3.12): a second environment for `make test-newest`.
# torch for 3.12 is its default build (with its CUDA libraries; it runs on CPU ranks as well).
PYTHON312 ?= $(firstword $(foreach p,python3.12 $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python),$(shell $(p) -c 'import sys; print(sys.executable if sys.version_info[:2] == (3, 12) else "")' 2>/dev/null)))
VENV_NEWEST ?= .venv-newest
MCORE_NEWEST ?= megatron-core>=0.19,<0.20
# the megatron-facing tests: real GPTModels and HybridModels on CPU ranks, megatron's schedules,
# the README's examples
NEWEST_TESTS ?= tests/torchrun/test_capture_megatron.py tests/torchrun/test_cpu_attention.py \
	tests/torchrun/test_mcore_loop.py tests/torchrun/test_mcore_hybrid.py tests/torchrun/test_true_vocab.py \
	tests/torchrun/test_bridge_e2e.py tests/launch/test_readme.py
# not again on the newest release: the worlds' and Ray's examples (examples/train.py's models,
# launched otherwise); the demo's models are the README examples' and test_demo runs once
NEWEST_SELECT ?= not worlds and not ray
SOURCES := pyproject.toml $(shell find capture bridge kernels profiling common mcore mopd -type f \( -name '*.py' -o -name '*.cu' -o -name '*.sh' -o -name 'py.typed' \) -not -path '*/results/*' 2>/dev/null)
# After `make dev`: the editable install sees every edit; only the dependencies can go stale.
EDITABLE := $(wildcard $(VENV)/.editable)
STAMP_DEPS := $(if $(EDITABLE),pyproject.toml,$(SOURCES))
PYTEST := $(PY) -m pytest

.PHONY: install install-newest dev demo test test-unit test-torchrun test-launch test-gpu test-newest lint typecheck clean

$(VENV)/.stamp: $(STAMP_DEPS)
	@echo "make: installing into $(VENV): $(TORCH_PIN), then this package$(if $(EDITABLE), (editable),) with [$(EXTRAS)] (megatron-core and the rest); the first time takes minutes, quietly"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q $(if $(EDITABLE),-e )".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.stamp

# An editable install for working on the library (the tests then see edits without reinstalling).
dev:
	@echo "make: installing into $(VENV): $(TORCH_PIN), then this package (editable) with [$(EXTRAS)]; the first time takes minutes, quietly"
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

$(VENV_NEWEST)/.stamp: $(SOURCES)
	@test -n "$(PYTHON312)" || { echo "make test-newest: no Python 3.12 found; set PYTHON312=/path/to/python3.12"; exit 1; }
	@echo "make: installing into $(VENV_NEWEST) (Python 3.12): $(TORCH_PIN), this package with [test], $(MCORE_NEWEST); the first time downloads a large torch build"
	test -x $(VENV_NEWEST)/bin/python || $(PYTHON312) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VENV_NEWEST)/bin/python -m pip install -q ".[test]" "$(MCORE_NEWEST)"
	touch $@

# The second environment alone (CI installs it while `make test` runs).
install-newest: $(VENV_NEWEST)/.stamp

# The megatron-facing tests on Python 3.12 with the newest megatron-core release.
test-newest: $(VENV_NEWEST)/.stamp
	@$(VENV_NEWEST)/bin/python -c "import sys; from importlib.metadata import version as v; print(f'test-newest: Python {sys.version.split()[0]}, torch {v(\"torch\")}, megatron-core {v(\"megatron-core\")}')"
	$(VENV_NEWEST)/bin/python -m pytest $(NEWEST_TESTS) -k "$(NEWEST_SELECT)"

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.stamp
	PYTHON=$(PY) bash .ci/typecheck

clean:
	rm -rf $(VENV) $(VENV_NEWEST) build *.egg-info .mypy_cache
