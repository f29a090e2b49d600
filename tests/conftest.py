import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers import ServerProcess  # noqa: E402
from torch_bps.security import new_secret  # noqa: E402

# Authentication is on in the suite: every server a test starts (helpers.ServerProcess) requires this pool
# credential, and every worker, client and raw peer (which inherit the environment) presents it.
os.environ.setdefault("BPS_POOL_CREDENTIAL", new_secret())


@pytest.fixture(scope="session")
def server():
    """One summation server shared by the session's tests: each test uses its own job id."""
    s = ServerProcess()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def servers():
    """Three shared summation servers."""
    ss = [ServerProcess() for _ in range(3)]
    yield ss
    for s in ss:
        s.stop()


@pytest.fixture
def job_id(request):
    """A job id unique to this test, so tests sharing servers never see each other's keys."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(request.node.nodeid.encode(), digest_size=8).digest(), "little")
