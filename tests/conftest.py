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


def pytest_collection_modifyitems(config, items):
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
