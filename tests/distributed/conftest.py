import pytest


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """A random-weight Llama checkpoint (test_tensor_parallel's), shared by the data-parallel and launcher tests."""
    from tests.distributed.test_tensor_parallel import build

    return build(str(tmp_path_factory.mktemp("llama") / "llama"), "llama")
