import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests import reaper  # noqa: E402
from tests.helpers import ServerProcess  # noqa: E402
from torch_bps.security import new_secret  # noqa: E402

# Authentication is on in the suite: every server a test starts (helpers.ServerProcess) requires this pool
# credential, and every worker, client and raw peer (which inherit the environment) presents it.
os.environ.setdefault("BPS_POOL_CREDENTIAL", new_secret())

_reaper: subprocess.Popen | None = None
_children_tmp: str | None = None


def pytest_configure(config):
    """Mark every process the session starts (through the environment they inherit) and start the reaper,
    which kills the marked ones left running once pytest exits, also through pytest-timeout's os._exit."""
    global _reaper
    if os.environ.get(reaper.ENV):  # a pytest run inside a test: the outer session's reaper covers it
        return
    token = f"{os.getpid()}-{os.urandom(6).hex()}"
    _reaper = subprocess.Popen([sys.executable, "-m", "tests.reaper", token], stdin=subprocess.PIPE, cwd=REPO,
                               start_new_session=True)  # fmt: skip
    os.environ[reaper.ENV] = token  # after the reaper started, so it does not carry the token itself
    # What the started processes leave in their temporary folder (torchrun's `torchelastic_*` log folders, which
    # torch never removes) goes with the session: their TMPDIR is one folder, deleted at the end.
    global _children_tmp
    tempfile.gettempdir()  # this process keeps its own (pytest's tmp_path lives there)
    _children_tmp = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="bps-tests-")


def _lives_with_pytest(cmd: str) -> bool:
    # multiprocessing's helper processes stop on their own when pytest exits (their pipe to it closes).
    return "multiprocessing.resource_tracker" in cmd or "multiprocessing.forkserver" in cmd


def _stop_multiprocessing_helpers() -> None:
    """Stop the forkserver (helpers.rank_context) and the resource tracker now: left to stop when pytest exits,
    they race the reaper, which then kills and names them. `_stop` is how CPython's own tests stop them."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)  # private: absent in some Python, then the reaper's fallback stands
        if stop is not None:
            stop()


def pytest_sessionfinish(session, exitstatus):
    """Stop multiprocessing's helpers; kill, and name, what the tests left running."""
    token = os.environ.get(reaper.ENV)
    if _reaper is None or not token:
        return
    _stop_multiprocessing_helpers()
    left = reaper.reap(token, grace=5.0, keep=_lives_with_pytest)
    if left:
        lines = "".join(f"\n  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        session.config.get_terminal_writer().line(
            f"conftest: killed {len(left)} process(es) the tests left running:{lines}", yellow=True
        )
    if _children_tmp:
        shutil.rmtree(_children_tmp, ignore_errors=True)


def pytest_unconfigure(config):
    if _reaper is not None:
        _reaper.stdin.close()  # the reaper takes over: anything still marked once pytest is gone gets killed


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
