import os

import pytest
import torch

from tests import program_order

# Without a GPU, Triton kernels can only run through the interpreter; set it before any test
# module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# COC_TEST_PROGRAM_ORDER=reverse|shuffle:SEED permutes the programs of every interpreted launch in
# this process too (kernels launched outside rank pools); the pools' ranks apply it per call.
program_order.install_if_requested()


# Modules whose tests run or compile Triton kernels (besides test_fused_*.py and tests named *fused*):
# `make test-triton36` runs the tests marked `triton` again under the oldest supported Triton.
# test_gpu_check is left out: its --allow-cpu flow runs the same fused ops as test_fused_*.py and
# would add minutes to a CI that must stay within 15.
TRITON_MODULES = {"test_heap", "test_dt_fused", "test_quant", "test_quant_linear", "test_soc", "test_program_order",
                  "test_interpreter_compat"}


def _needs_triton(item: pytest.Item) -> bool:
    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return module in TRITON_MODULES or module.startswith("test_fused") or "fused" in item.name


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs or compiles Triton kernels (selected by make test-triton36)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_triton(item):
            item.add_marker(pytest.mark.triton)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from tests.harness import close_pools

    close_pools()
