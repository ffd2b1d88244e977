"""Suite-wide setup: the Triton interpreter on CPU, the ``gpu`` skip, and the ``triton`` marker by folder.

``make test-triton36`` reruns the tests marked ``triton`` under the oldest supported Triton. A test is marked when it
lives under a folder that holds only Triton-running tests (:data:`TRITON_FOLDERS`), when its module says so with
``pytestmark = pytest.mark.triton``, or when its name or a parameter id names the fused backend (contains ``fused``).

What differs between Triton versions is how a kernel compiles (every sm_90a compile check reruns: the GPU machine
has Triton 3.6) and how the interpreter runs it (every kernel's own correctness tests, and the tests that hook the
interpreter: program order, graph capture and replay). So the rerun leaves out:

* tests marked ``one_triton``: those under :data:`ONE_TRITON_FOLDERS` (the layers, the benchmark and its CLI run the
  kernels the kernel tests check) and modules or tests that say so (the fused protocol's stress and error paths,
  whole-model compiles): their Triton dependence is those same kernels;
* with ``COC_TEST_SMALLEST_WORLD=1`` (the Makefile sets it), tests parametrized over ``world`` beyond world 2: every
  kernel path shows at world 2 already; the odd world 3 and world 4 check the index arithmetic, which the newest
  Triton's run covers.
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
ONE_TRITON_FOLDERS = ("autopar", "bench")


def _relative(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(TESTS_ROOT).as_posix()


def _needs_triton(item: pytest.Item) -> bool:
    if any(_relative(item).startswith(folder + "/") for folder in TRITON_FOLDERS):
        return True
    return "fused" in item.name


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs or compiles Triton kernels (selected by make test-triton36)")
    config.addinivalue_line(
        "markers", "one_triton: depends on Triton only through kernels other tests check (left out of test-triton36)"
    )
    config.addinivalue_line(
        "markers", "wheel: builds the wheel and runs it installed, outside the checkout (make test; about 15 s)"
    )


def _beyond_smallest_world(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("world", 0) > 2


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_triton(item):
            item.add_marker(pytest.mark.triton)
        if any(_relative(item).startswith(folder + "/") for folder in ONE_TRITON_FOLDERS):
            item.add_marker(pytest.mark.one_triton)
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
