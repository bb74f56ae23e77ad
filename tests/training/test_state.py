"""`TrainingState` (training/state.py): the typed record of a training checkpoint's client state, written and read
as the same dict, and checkpoints from before a field existed read with that field absent from `recorded`."""

from __future__ import annotations

import torch

from glm53_ds.training.state import FIELDS, TrainingState


def test_the_client_state_round_trips_and_old_checkpoints_say_what_they_lack():
    state = TrainingState(3, 48, 16, {"corpus": "abc", "samples": [0, 90]}, torch.get_rng_state(),
                          {"lr": 1e-3, "min_lr": 1e-4, "warmup": 1, "train_iters": 10}, None, None)  # fmt: skip
    client = state.client_state()
    assert sorted(client) == sorted(FIELDS)
    again = TrainingState.from_client_state(client)
    assert again.recorded == frozenset(FIELDS) and torch.equal(again.rng, state.rng)
    assert {k: v for k, v in vars(again).items() if k != "rng"} == {
        k: v for k, v in vars(state).items() if k != "rng"
    }
    assert again.saved_global_batch() == 16

    old = TrainingState.from_client_state(
        {"step": 3, "consumed_samples": 48}
    )  # before the batch was recorded
    assert old.saved_global_batch() == 16 and "global_batch_size" not in old.recorded and old.data == {}
    assert TrainingState.from_client_state({"step": 3, "consumed_samples": 47}).saved_global_batch() is None
    converted = TrainingState.from_client_state({})  # a converted checkpoint: nothing recorded, step 0
    assert (
        converted.step == 0 and converted.recorded == frozenset() and converted.saved_global_batch() is None
    )
