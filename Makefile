# Entry points, each self-contained on a fresh machine with Python 3 and git:
#   make demo            build .venv, install the package, run the 4-rank demo (the main job)
#   make test            build .venv, install the package with its test extra, run the test suite
#   make lint            ruff lint and format check (configuration in pyproject.toml)
#   make test-triton36   build .venv-triton36 (same torch, the oldest supported Triton and transformers: the
#                        GPU machine's image) and run the tests whose result can depend on the Triton version
#                        there (marked `triton`, not `one_triton`), at worlds 1-2 (see tests/conftest.py),
#                        then the Hugging Face tests against that transformers
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel where one is available locally; on a GPU machine pip picks the CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist): two keep both cores of a CI machine busy while a test's ranks wait on
# each other, a sleep or a compiler; 0 runs the tests in one process.
PYTEST_WORKERS ?= 2
VENV_TRITON36 ?= .venv-triton36
PY_TRITON36 := $(VENV_TRITON36)/bin/python
TRITON36_VERSION ?= 3.6.0
# The oldest transformers 5.x this package supports (the GPU machine's image has it): its plans name fewer
# modules than the newest (no input embedding, no expert entries), so the dense HF tests run against it too.
# The MoE model tests need the expert entries of newer plans and run in `make test` only.
TRANSFORMERS_OLDEST ?= 5.17.0
HF_TESTS ?= tests/autopar/tp/test_hf.py tests/autopar/tp/test_hf_families.py tests/autopar/tp/test_hf_load.py \
	tests/autopar/tp/test_hf_regions.py tests/autopar/tp/test_hf_registry.py tests/autopar/tp/test_decode.py \
	tests/autopar/tp/test_strided_dcp.py

.PHONY: demo test lint test-triton36 bench venv venv-triton36 clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

# The CPU torch wheel names no Triton, so the pin below decides which one the tests import.
$(VENV_TRITON36)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV_TRITON36)
	$(PY_TRITON36) -m pip install -q "$(TORCH_SPEC)"
	$(PY_TRITON36) -m pip install -q -e ".[test]" "triton==$(TRITON36_VERSION)" "transformers==$(TRANSFORMERS_OLDEST)"
	$(PY_TRITON36) -c "import triton; assert triton.__version__ == '$(TRITON36_VERSION)', triton.__version__"
	$(PY_TRITON36) -c "import transformers as t; assert t.__version__ == '$(TRANSFORMERS_OLDEST)', t.__version__"
	touch $@

venv-triton36: $(VENV_TRITON36)/.installed

demo: venv
	$(PY) -m autopar.demo

test: venv
	$(PY) -m pytest tests -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-triton36: venv-triton36
	COC_TEST_SMALLEST_WORLD=1 $(PY_TRITON36) -m pytest tests -m "triton and not one_triton" -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	$(PY_TRITON36) -m pytest $(HF_TESTS) -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: venv
	$(PY) -m bench --suite tiny

clean:
	rm -rf $(VENV) $(VENV_TRITON36) build *.egg-info
