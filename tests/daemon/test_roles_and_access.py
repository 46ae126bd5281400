"""Roles decisions, their configuration forms, and the caller-rights file checks (real files)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from hwr.client.errors import ManifestCorrupt, PermissionDeniedError
from hwr.daemon.checkpoints.caller_access import CallerOpener, mode_grants
from hwr.daemon.checkpoints.registry import Checkpoints
from hwr.daemon.service.roles import OPERATOR, PUBLISH, Roles, roles_from
from hwr.daemon.system.config import load_config
from hwr.daemon.system.peercred import PeerCred

DAEMON = 990


def cred(uid: int, gid: int = 5000, groups: tuple[int, ...] = ()) -> PeerCred:
    return PeerCred(1, uid, gid, groups)


def test_root_and_the_daemon_hold_every_role_and_empty_publish_lists_admit_everyone() -> None:
    roles = Roles(DAEMON)
    for role in (PUBLISH, OPERATOR):
        assert roles.grants(cred(0), role) and roles.grants(cred(DAEMON), role)
    assert roles.grants(cred(1000), PUBLISH)
    assert not roles.grants(cred(1000), OPERATOR)


def test_lists_match_uids_primary_gids_and_supplementary_groups() -> None:
    roles = Roles(DAEMON, publish_uids=frozenset({1000}), operator_gids=frozenset({77}))
    assert roles.grants(cred(1000), PUBLISH) and not roles.grants(cred(1001), PUBLISH)
    assert roles.grants(cred(1001, gid=77), OPERATOR)
    assert roles.grants(cred(1001, groups=(3, 77)), OPERATOR)
    assert not roles.grants(cred(1001, groups=(3,)), OPERATOR)


def test_a_refusal_names_the_role_and_action() -> None:
    with pytest.raises(PermissionDeniedError) as refused:
        Roles(DAEMON).require(cred(1000), OPERATOR, "deny")
    assert refused.value.details == {"role": "operator", "action": "deny", "uid": 1000}
    assert "operator_uids/operator_gids" in refused.value.message


def test_role_keys_have_file_environment_and_flag_forms(short_tmp: Path) -> None:
    config_file = short_tmp / "hwrd.toml"
    config_file.write_text("publish_uids = [1000]\noperator_gids = [10]\n")
    env = {"HWR_OPERATOR_UIDS": "1001,1002", "HWR_ROOT": str(short_tmp), "HWR_SOCKET": str(short_tmp / "s")}
    config = load_config(config_file, env=env)
    roles = roles_from(config)
    assert roles.publish_uids == {1000} and roles.operator_uids == {1001, 1002} and roles.operator_gids == {10}
    from hwr.daemon.app.main import _flag_text, _parser

    args = _parser().parse_args(["--publish-gids", "20,21"])
    assert _flag_text(args)["publish_gids"] == "20,21"


def test_mode_bits_pick_one_class_like_the_kernel() -> None:
    st = os.stat_result((stat.S_IFREG | 0o064, 0, 0, 1, 1000, 50, 0, 0, 0, 0))
    assert not mode_grants(st, cred(1000, gid=50), 4)  # the owner's class has no read: denied
    assert mode_grants(st, cred(1001, gid=50), 4) and mode_grants(st, cred(1001, groups=(50,)), 4)
    assert mode_grants(st, cred(1001, gid=51), 4)  # others may read
    private = os.stat_result((stat.S_IFDIR | 0o700, 0, 0, 1, 1000, 50, 0, 0, 0, 0))
    assert not mode_grants(private, cred(0, gid=0), 1)  # root is judged as "other": no override


@pytest.mark.skipif(os.geteuid() != 0, reason="files owned by another uid need root")
def test_without_switching_uid_the_mode_bits_of_file_and_directories_decide(short_tmp: Path) -> None:
    short_tmp.chmod(0o755)
    public, private = short_tmp / "public", short_tmp / "private"
    public.mkdir(mode=0o755)
    private.mkdir(mode=0o700)
    for directory in (public, private):
        (directory / "open.safetensors").write_bytes(b"x")
        os.chmod(directory / "open.safetensors", 0o644)
    (public / "closed.safetensors").write_bytes(b"x")
    os.chmod(public / "closed.safetensors", 0o600)
    opener = CallerOpener(cred(65534, gid=65534))
    granted = opener._open_checked(public / "open.safetensors")  # the path hwrd takes as a non-root user
    assert isinstance(granted, int)
    os.close(granted)
    for path in (public / "closed.safetensors", private / "open.safetensors"):
        refused = opener._open_checked(path)
        assert isinstance(refused, OSError) and refused.errno == errno.EACCES, path


def test_a_malformed_header_error_never_carries_bytes_of_the_file(short_tmp: Path) -> None:
    directory = short_tmp / "ckpt"
    directory.mkdir()
    secret = b"\x10\x27\x00\x00\x00\x00\x00\x00"  # a "header length" of 10000, past the end
    (directory / "m.safetensors").write_bytes(secret + b"root:$6$salt$hash")
    registry = Checkpoints(short_tmp / "state")
    registry.open()
    with pytest.raises(ManifestCorrupt) as refused:
        registry.add(directory)
    registry.close()
    text = refused.value.message + repr(refused.value.details)
    assert "10000" not in text and "root:" not in text
    assert refused.value.details == {"file": "m.safetensors", "check": "length"}


@pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid needs root")
def test_a_restart_re_registers_a_checkpoint_with_its_registrants_rights(short_tmp: Path) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    short_tmp.chmod(0o755)
    directory = short_tmp / "ckpt"
    directory.mkdir(mode=0o755)
    save_file({"w": torch.ones(4)}, directory / "m.safetensors")
    os.chmod(directory / "m.safetensors", 0o644)
    nobody = cred(65534, gid=65534)
    first = Checkpoints(short_tmp / "state")
    first.open()
    first.add(directory, cred=nobody)
    first.close()
    (entry,) = json.loads((short_tmp / "state" / "registry.json").read_text())
    assert entry == {"path": str(directory), "uid": 65534, "gid": 65534, "groups": []}
    os.chmod(directory / "m.safetensors", 0o600)  # now only root (hwrd here) could read it
    second = Checkpoints(short_tmp / "state")
    ((path, error),) = second.open()
    assert path == str(directory) and isinstance(error, PermissionDeniedError)
    assert second.list() == []
    second.close()


def test_role_keys_are_applied_by_a_reload(short_tmp: Path) -> None:
    from types import SimpleNamespace

    import msgspec

    from hwr.daemon.app.reload import Reloader, plan_reload
    from hwr.daemon.service.settings import RunningSettings

    old = load_config(env={"HWR_ROOT": str(short_tmp), "HWR_SOCKET": str(short_tmp / "s")})
    new = msgspec.structs.replace(old, operator_uids=(1000,), publish_gids=(7,))
    daemon = SimpleNamespace(settings=RunningSettings(old))
    reloader = Reloader.__new__(Reloader)  # only the decision and its application are exercised
    reloader.daemon = daemon
    plan = plan_reload(old, new, reloader.can_apply)
    assert set(plan.applied) == {"operator_uids", "publish_gids"} and not plan.refused
    reloader._apply(plan)
    roles = daemon.settings.roles
    assert roles.grants(cred(1000), OPERATOR) and not roles.grants(cred(1001, gid=8), PUBLISH)
