"""Settings for the converter tests, scoped to this directory."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One intra-op thread while a converter test module runs, then the previous count again (other
    test directories keep theirs). The test models are tiny; with several test runs sharing two cores,
    more intra-op threads only spin and wait for each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
