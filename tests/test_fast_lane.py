"""The fast lane by rule (tests/conftest.py): a test that spawns ranks is marked slow at collection, and a spawner
called from an unmarked test (through a helper the rule cannot see) refuses to start."""

from __future__ import annotations

import pytest

from tests import conftest


class _Item:
    def __init__(self, function, marked: bool = False):
        self.function, self.markers = function, (["slow"] if marked else [])
        self.nodeid = f"tests/test_fast_lane.py::{function.__name__}"  # what the collection hook orders by

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, marker):
        self.markers.append(marker.name)


def _spawns(tmp_path):
    from tests.cli import deepspeed_run

    deepspeed_run(2, "--train-iters", "1")


def _runs_one_process(tmp_path):
    from tests.cli import python_run

    python_run("--train-iters", "1")


def test_a_test_that_spawns_ranks_is_marked_slow():
    spawning, single = _Item(_spawns), _Item(_runs_one_process)
    conftest.pytest_collection_modifyitems(None, [spawning, single])
    assert spawning.markers == ["slow"] and single.markers == []


def test_a_spawner_refuses_an_unmarked_test(request):
    with pytest.raises(AssertionError, match=f"{request.node.nodeid} starts 2 ranks .* is not marked slow"):
        _spawns(None)
