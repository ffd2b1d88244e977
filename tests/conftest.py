"""Suite-wide setup: the Triton interpreter on CPU, the ``gpu`` skip, and the ``triton`` marker by folder.

``make test-triton36`` reruns the tests marked ``triton`` under the oldest supported Triton. A test is marked when it
lives under a folder that holds only Triton-running tests (:data:`TRITON_FOLDERS`), when its module says so with
``pytestmark = pytest.mark.triton``, or when its name or a parameter id names the fused backend (contains ``fused``).

That rerun sets ``COC_TEST_SMALLEST_WORLD=1``: a test parametrized over ``world`` then runs at world 1 and 2 only.
What differs between Triton versions is how a kernel compiles and interprets, which every kernel path shows at
world 2 already; the odd world 3 and world 4 check the index arithmetic, which the newest Triton's run covers.
"""

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels can only run through the interpreter; set it before anything
# imports kernels (hence triton), the testing toolkit included.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.testing import program_order  # noqa: E402

# COC_TEST_PROGRAM_ORDER=reverse|shuffle:SEED permutes the programs of every interpreted launch in
# this process too (kernels launched outside rank pools); the pools' ranks apply it per call.
program_order.install_if_requested()

TESTS_ROOT = Path(__file__).resolve().parent
TRITON_FOLDERS = ("kernels/fused", "kernels/heap")


def _needs_triton(item: pytest.Item) -> bool:
    rel = Path(str(item.path)).resolve().relative_to(TESTS_ROOT).as_posix()
    if any(rel.startswith(folder + "/") for folder in TRITON_FOLDERS):
        return True
    return "fused" in item.name


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs or compiles Triton kernels (selected by make test-triton36)")


def _beyond_smallest_world(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("world", 0) > 2


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_triton(item):
            item.add_marker(pytest.mark.triton)
    if os.environ.get("COC_TEST_SMALLEST_WORLD") == "1":
        dropped = [item for item in items if _beyond_smallest_world(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not _beyond_smallest_world(item)]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from kernels.testing import close_pools

    close_pools()
