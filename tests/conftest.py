import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_path():
    from mixserve.models.registry import pull

    return str(pull("smollm2-135m-instruct", progress=False))


@pytest.fixture(scope="session")
def qwen05_path():
    from mixserve.models.registry import pull

    return str(pull("qwen2.5-coder-0.5b-instruct", progress=False))
