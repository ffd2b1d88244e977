# Two entry points, each self-contained on a fresh machine with Python 3 and git:
#   make demo   build .venv, install the package, run the 4-rank demo (the main job)
#   make test   build .venv, install the package with its test extra, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel where one is available locally; on a GPU machine pip picks the CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test bench venv clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m autopar.demo

test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: venv
	$(PY) -m bench --suite tiny

clean:
	rm -rf $(VENV) build *.egg-info
