"""Test-session setup.

Without a GPU the Triton kernels run in Triton's interpreter, which `triton.jit` picks at decoration time, so
the variable is set here, before any test imports the kernel module.
"""

import gc
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests on this 2-core machine: avoid oversubscription from intra-op threads in multi-process tests; under
# pytest-xdist (README's test command: two workers, one file each at a time) each worker keeps to one core.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

# The longest files (over a minute of one worker each, measured in CI): collected first, so that the two workers
# (README's `-n 2 --dist loadfile`, which hands out whole files in the order collected) start on them and end
# together on the many short ones (the longest first: a worker left alone with tests/test_compile.py at the end
# added 6 minutes to a 32-minute run).
LONGEST_FIRST = (
    "tests/test_compile.py",
    "tests/engine/test_nodes.py",
    "tests/layers/test_sparse_attention.py",
    "tests/engine/test_gradient_sync.py",
    "tests/training/test_trainer.py",
    "tests/plan/test_activations.py",
    "tests/test_real_width.py",
    "tests/parallel/test_sequence.py",
    "tests/engine/test_checkpoint.py",
    "tests/plan/test_plan.py",
    "tests/plan/test_planner_numbers.py",
    "tests/test_recipes.py",
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny released-layout checkpoints of CONFIG_A: full-scale weights, and 0.3x matrices (where bf16 tracks
    fp32 and a few optimizer steps stay within fp32's rounding): the multi-rank tests' starting points."""
    from tests.model_fixtures import CONFIG_A, save_tiny_hf

    full = tmp_path_factory.mktemp("ep_full")
    calm = tmp_path_factory.mktemp("ep_calm")
    save_tiny_hf(full, CONFIG_A)
    save_tiny_hf(calm, CONFIG_A, matrix_scale=0.3)
    return str(full), str(calm)


# In-process worlds: each engine is released after the test that built it, with the world it ran in, and every
# in-process world after its test module. DeepSpeed's gradient hooks keep an engine, its model and its process
# groups alive from C++ until the engine is closed, and each `init_layout` in a live world adds megatron's groups
# (megatron's destroy only forgets them): left alone, in-process engines and layouts left ~50-100 gloo threads
# each polling in the pytest process (1,800-2,400 threads in a full run, most of its CPU spent there).
_ENGINES_BUILT: list = []
_TRACKING = [True]


def pytest_configure(config):
    from glm53_ds.engine.handle import Glm53Engine

    built = Glm53Engine.__init__

    def recorded(self, *args, **kwargs):
        built(self, *args, **kwargs)
        if _TRACKING[0]:
            _ENGINES_BUILT.append(self)

    Glm53Engine.__init__ = recorded  # type: ignore[method-assign]


def _close_in_process_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from glm53_ds.engine import close_distributed

    while _ENGINES_BUILT:
        _ENGINES_BUILT.pop().close()  # a no-op for an engine the test closed
    if dist.is_initialized() or parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        close_distributed()
    gc.collect()  # the engines' models and groups sit in reference cycles: their threads end when collected


@pytest.fixture(autouse=True)
def _in_process_engines_released():
    yield
    # without an engine, a world a module's fixture built (tests/layers/test_documents.py) stays for its next test
    if _ENGINES_BUILT:
        _close_in_process_world()


@pytest.fixture
def engines_not_tracked():
    """For a test that frees its engines itself and counts what is left: the session does not hold them."""
    _TRACKING[0] = False
    yield
    _TRACKING[0] = True


@pytest.fixture(scope="module", autouse=True)
def _in_process_world_closed_per_module():
    yield  # after the module's own fixtures are torn down
    _close_in_process_world()


# The fast lane (-m "not slow") by rule, not by hand: a test that spawns ranks (DeepSpeed's launcher or the
# multi-process harness) is slow. Collection marks a test whose source calls one of these; at run time the two
# spawners refuse to start from a test left unmarked (a call through a helper), so the rule cannot be missed.
SPAWNS_RANKS = ("run_world(", "deepspeed_run(")
FAST_LANE_TEST = "GLM53_TEST_NOT_SLOW"  # set while a test not marked slow runs


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # a stable sort: each file's tests stay together and in their order
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    for item in items:
        function = getattr(item, "function", None)
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            source = ""
        if any(call in source for call in SPAWNS_RANKS) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fast_lane_spawns_no_ranks(request, monkeypatch):
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv(FAST_LANE_TEST, request.node.nodeid)
    yield


def refuse_in_the_fast_lane(what: str) -> None:
    """Called by the spawners (tests/cli.py, tests/dist_harness.py)."""
    test = os.environ.get(FAST_LANE_TEST)
    if test:
        raise AssertionError(f"{test} {what} but is not marked slow (tests/conftest.py: SPAWNS_RANKS)")
