"""Wrong S3 credentials are ``REMOTE_DENIED``, apart from an unreachable remote (``REMOTE_UNAVAILABLE``).

A real S3 server that checks signatures: moto's standalone server with its IAM authentication on
(``INITIAL_NO_AUTH_ACTION_COUNT``: the first requests, which make the user, its key, its policy
and the bucket, pass unsigned; every later one must be signed by a known key). hwrd gets its
credentials from the standard chain's environment variables, as in production. Each test starts
a real hwrd with good, wrong or no credentials and looks through ``hwrctl status``, ``hwrctl
remote ls``, ``hwrctl push``, ``hwrctl pull`` and a client's acquire (a pull on miss).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hwr.client import connect
from hwr.client.errors import RemoteDenied, RemoteUnavailable
from hwr.daemon.app.launcher import DaemonProcess
from hwr.daemon.ctl import cli as ctl
from tests.e2e.fleet_fixtures import S3Server, free_port

pytestmark = pytest.mark.timeout(240)

PREFIX = "hwr-fleet"
#: The first requests made without signatures: create_user, create_access_key, put_user_policy,
#: create_bucket. From the next one on, moto checks every request's signature and key.
UNSIGNED_SETUP_REQUESTS = 4
_POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*","Resource":"*"}]}'
_BASE_ENV = {"AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
             "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/hwr-test", "AWS_CONFIG_FILE": "/nonexistent/hwr-test"}


class CheckingS3(S3Server):
    """moto's S3 server with signature checks on, one user whose key may do everything."""

    def __init__(self, log: Path) -> None:
        super().__init__(log, env={**_BASE_ENV, "INITIAL_NO_AUTH_ACTION_COUNT": str(UNSIGNED_SETUP_REQUESTS)})
        self.key_id = self.secret = ""
        self.bucket = "hwr-denied-test"

    def start(self, timeout: float = 60.0) -> CheckingS3:
        import boto3

        super().start(timeout)
        setup = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                      region_name="us-east-1")
        iam = setup.client("iam", endpoint_url=self.endpoint)
        iam.create_user(UserName="hwrd")
        key = iam.create_access_key(UserName="hwrd")["AccessKey"]
        iam.put_user_policy(UserName="hwrd", PolicyName="s3", PolicyDocument=_POLICY)
        setup.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=self.bucket)
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        return self


@pytest.fixture(scope="module")
def checking_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckingS3]:
    pytest.importorskip("boto3", reason="the fleet tier's s3 tests need the s3 extra (boto3)")
    pytest.importorskip("moto.server", reason="the fleet tier's s3 tests need moto[server] (the test extra)")
    server = CheckingS3(tmp_path_factory.mktemp("moto-auth") / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()


def _node(base: Path, endpoint: str, credentials: dict[str, str]) -> DaemonProcess:
    daemon = DaemonProcess(base / "store", base / "hwrd.sock", "--remote", f"s3://hwr-denied-test/{PREFIX}",
                           "--remote-endpoint-url", endpoint)
    # Only these credentials: none of the test runner's own may leak into hwrd's chain.
    env = {k: v for k, v in daemon.env.items() if not k.startswith("AWS_")}
    daemon.env = {**env, **_BASE_ENV, **credentials}
    return daemon


def _hwrctl(daemon: DaemonProcess, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = ctl.main(["--socket", str(daemon.socket), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _remote_status(daemon: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    rc, out, err = _hwrctl(daemon, "status", "--json", capsys=capsys)
    assert rc == 0, err
    return json.loads(out)["remote"]


def _publish_one(daemon: DaemonProcess) -> str:
    import torch

    from hwr.client import ArtifactIdentity

    with connect(daemon.socket, timeout=30) as client:
        return client.publish(ArtifactIdentity.simple("denied/test"), {"w": torch.arange(1024, dtype=torch.float32)})


WRONG = {
    "a wrong secret (SignatureDoesNotMatch)": lambda s: {"AWS_ACCESS_KEY_ID": s.key_id,
                                                         "AWS_SECRET_ACCESS_KEY": "not-the-secret"},
    "an unknown key (InvalidAccessKeyId)": lambda s: {"AWS_ACCESS_KEY_ID": "AKIAHWRTESTUNKNOWN00",
                                                      "AWS_SECRET_ACCESS_KEY": "whatever"},
}


@pytest.mark.parametrize("credentials", list(WRONG), ids=["wrong-secret", "unknown-key"])
def test_wrong_credentials_are_remote_denied_everywhere(checking_s3: CheckingS3, short_tmp: Path,
                                                       credentials: str, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = _node(short_tmp, checking_s3.endpoint, WRONG[credentials](checking_s3)).start()
    try:
        remote = _remote_status(daemon, capsys)
        assert remote["reachable"] is False
        assert remote["error_code"] == "REMOTE_DENIED", remote
        assert "denied access" in remote["error"] and "unreachable" not in remote["error"]
        rc, out, _ = _hwrctl(daemon, "status", capsys=capsys)
        assert rc == 0 and "DENIED (" in out and "UNREACHABLE" not in out

        rc, _, err = _hwrctl(daemon, "remote", "ls", capsys=capsys)
        assert rc == 1 and err.startswith("hwrctl: REMOTE_DENIED: "), err

        key = _publish_one(daemon)
        rc, _, err = _hwrctl(daemon, "push", key, capsys=capsys)
        assert rc == 1 and err.startswith("hwrctl: REMOTE_DENIED: "), err
        assert checking_s3.secret not in err

        missing = "ab" * 32
        rc, _, err = _hwrctl(daemon, "pull", missing, capsys=capsys)
        assert rc == 1 and err.startswith("hwrctl: REMOTE_DENIED: "), err
        with connect(daemon.socket, timeout=30) as client, pytest.raises(RemoteDenied) as refused:
            client.acquire(missing)  # a miss: the pull on miss is refused by the remote
        assert refused.value.code == "REMOTE_DENIED" and not refused.value.retryable
        assert isinstance(refused.value, RemoteUnavailable)  # callers that fall back on an unreachable remote do
        assert refused.value.details["remote"].startswith("s3://")
    finally:
        assert daemon.stop() == 0


def test_no_credentials_at_all_are_remote_denied(checking_s3: CheckingS3, short_tmp: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    daemon = _node(short_tmp, checking_s3.endpoint, {}).start()
    try:
        remote = _remote_status(daemon, capsys)
        assert remote["error_code"] == "REMOTE_DENIED", remote
        assert "no usable credentials" in remote["error"]
    finally:
        assert daemon.stop() == 0


def test_good_credentials_reach_the_remote_and_a_dead_endpoint_is_unreachable_not_denied(
        checking_s3: CheckingS3, short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"AWS_ACCESS_KEY_ID": checking_s3.key_id, "AWS_SECRET_ACCESS_KEY": checking_s3.secret}
    (short_tmp / "good").mkdir()
    daemon = _node(short_tmp / "good", checking_s3.endpoint, good).start()
    try:
        remote = _remote_status(daemon, capsys)
        assert remote["reachable"] is True and remote["error_code"] is None, remote
        key = _publish_one(daemon)
        rc, out, err = _hwrctl(daemon, "push", key, capsys=capsys)
        assert rc == 0, err
    finally:
        assert daemon.stop() == 0
    (short_tmp / "dead").mkdir()
    dead = _node(short_tmp / "dead", f"http://127.0.0.1:{free_port()}", good).start()
    try:
        remote = _remote_status(dead, capsys)
        assert remote["reachable"] is False and remote["error_code"] == "REMOTE_UNAVAILABLE", remote
        assert "unreachable" in remote["error"]
        rc, out, _ = _hwrctl(dead, "status", capsys=capsys)
        assert "UNREACHABLE (" in out
    finally:
        assert dead.stop() == 0


def test_a_file_remote_the_daemon_user_may_not_open_is_denied_and_a_missing_one_unreachable(
        short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.daemon_proc import HWRD, finish_daemon, make_daemon

    closed = short_tmp / "closed-remote"
    closed.mkdir(mode=0o700)  # root's alone: the unit's user may not open it
    daemon = make_daemon(short_tmp, "--remote", f"file://{closed}", user=HWRD).start()
    try:
        remote = _remote_status(daemon, capsys)
        assert remote["error_code"] == "REMOTE_DENIED" and "Permission denied" in remote["error"], remote
        rc, _, err = _hwrctl(daemon, "remote", "ls", capsys=capsys)
        assert rc == 1 and err.startswith("hwrctl: REMOTE_DENIED: "), err
    finally:
        finish_daemon(daemon, [])
    (short_tmp / "other").mkdir()
    gone = DaemonProcess(short_tmp / "other" / "store", short_tmp / "other" / "hwrd.sock", "--remote",
                         f"file://{short_tmp / 'no-such-remote'}").start()
    try:
        remote = _remote_status(gone, capsys)
        assert remote["error_code"] == "REMOTE_UNAVAILABLE" and "unreachable" in remote["error"], remote
    finally:
        finish_daemon(gone, [])
