import pytest


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """A random-weight Llama checkpoint (test_tensor_parallel's), shared by the data-parallel and launcher tests."""
    from tests.distributed.test_tensor_parallel import build

    return build(str(tmp_path_factory.mktemp("llama") / "llama"), "llama")


@pytest.fixture(scope="session", autouse=True)
def shm_build_hurried(tier_prebuild):
    """The ranks of these tests build the shared-memory collectives, or wait for the session's background
    build of them (tests/tier_prebuild.py): that build, if still running, at normal priority from here."""
    if tier_prebuild is not None:
        from tests.tier_prebuild import SHM

        tier_prebuild.hurry(SHM)
