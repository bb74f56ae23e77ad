"""The converters' tests start from one tiny released-layout checkpoint (the tiny preset, with MTP)."""

import pytest

from tests.cli import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    tiny_hf_checkpoint(path)
    return path
