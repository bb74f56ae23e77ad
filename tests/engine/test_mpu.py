"""`DeepSpeedMpu` (engine/mpu.py), the view DeepSpeed gets of the layout, on a world of one."""

from __future__ import annotations

import pytest

import glm53_ds
from glm53_ds.config import Glm53Config
from glm53_ds.engine.deepspeed_internals import install_gradient_sync
from glm53_ds.engine.mpu import DeepSpeedMpu
from glm53_ds.parallel import init_layout
from glm53_ds.parallel.replicas import check_replicas
from tests.model_fixtures import CONFIG_A


def test_single_rank_layout_and_mpu():
    glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A))  # a world-1 process group
    layout = init_layout(1, 1)
    mpu = DeepSpeedMpu(layout)
    assert (layout.ep, layout.etp, layout.world_size) == (1, 1, 1)
    assert mpu.get_model_parallel_world_size() == 1 and mpu.get_data_parallel_world_size() == 1
    assert mpu.get_data_parallel_group_ranks() == [0] and mpu.get_pipeline_model_parallel_world_size() == 1
    model = glm53_ds.build_model(Glm53Config.from_text_dict(CONFIG_A))
    check_replicas(model, layout)  # one replica: nothing to compare, no error

    class FakeEngine:
        optimizer = object()

        def fp16_enabled(self):
            return False

        def bfloat16_enabled(self):
            return False

    engine = FakeEngine()
    assert install_gradient_sync(engine, layout) is False  # DeepSpeed's group is already complete
    with pytest.raises(RuntimeError, match="already installed"):
        install_gradient_sync(engine, layout)
