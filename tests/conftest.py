import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Under pytest-xdist (the default run: ``-n auto`` in pyproject.toml) each worker gets its share of
# the cores, as intra-op threads and for the processes its tests start, so that the workers do not
# oversubscribe the machine. A test that sets OMP_NUM_THREADS itself keeps its own value.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    import torch

    _share = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

# Workers for ``-n auto``: one per core, at most 4: each holds its own torch and models, and the
# suite's longest files, not the count of workers, set its length past that.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def pytest_collection_modifyitems(items):
    # The kernel test files under Triton's interpreter: one test, one fresh process, run first.
    from triton_interpreter import one_fresh_process

    one_fresh_process(items)
    # The kernel tests under a second Triton (one process, a minute or more): second, not last.
    other = [item for item in items if item.path.name == "test_kernels_triton_versions.py"]
    if other:
        rest = [item for item in items if item not in other]
        items[:] = rest[:1] + other + rest[1:]


@pytest.fixture
def one_thread():
    """torch's intra-op threads at 1 for the test (the tiny HF models lose by more), then as
    before; a module takes it for every test with ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
