"""The client's rules for trusting a daemon (``hwr.client.daemon_trust.problem``), case by case
over plain values, and ``walk`` over a real directory tree with symlinks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hwr.client.daemon_trust import Node, Walk, opted_in_uids, problem, walk
from hwr.client.errors import UntrustedDaemon

ME, OTHER, DAEMON = 1000, 1001, 990
DIR, SOCK, LINK = stat.S_IFDIR, stat.S_IFSOCK, stat.S_IFLNK


def d(path: str, uid: int, mode: int) -> Node:
    return Node(path, uid, DIR | mode)


def way(*dirs: Node, sock_uid: int = ME, links: tuple[Node, ...] = ()) -> Walk:
    return Walk(links, dirs, Node(f"{dirs[-1].path}/hwrd.sock", sock_uid, SOCK | 0o660))


ROOT = d("/", 0, 0o755)
TMP = d("/tmp", 0, 0o1777)
RUN = d("/run", 0, 0o755)


@pytest.mark.parametrize(("case", "walk_", "peer", "refused"), [
    ("own daemon in /tmp/hwrd-$UID", way(ROOT, TMP, d("/tmp/hwrd-1000", ME, 0o755)), ME, None),
    ("own daemon in XDG_RUNTIME_DIR", way(ROOT, RUN, d("/run/user", 0, 0o755), d("/run/user/1000", ME, 0o700)),
     ME, None),
    ("root daemon in /run/hwrd", way(ROOT, RUN, d("/run/hwrd", 0, 0o755), sock_uid=0), 0, None),
    ("the unit's User=hwrd in its /run/hwrd", way(ROOT, RUN, d("/run/hwrd", DAEMON, 0o755), sock_uid=DAEMON),
     DAEMON, None),
    ("socket activation: systemd listens, the sockets are hwrd's", way(ROOT, RUN, d("/run/hwrd", DAEMON, 0o755),
                                                                      sock_uid=DAEMON), 0, None),
    ("another user's own /tmp/hwrd-N, explicitly chosen", way(ROOT, TMP, d("/tmp/hwrd-1001", OTHER, 0o755),
                                                            sock_uid=OTHER), OTHER, "is uid 1001's own"),
    ("another user's own /tmp/hwrd-N\n (not its name)", way(ROOT, TMP, d("/tmp/hwrd-1001\n", OTHER, 0o755),
                                                           sock_uid=OTHER), OTHER, "parent is writable by others"),
    ("another user's XDG_RUNTIME_DIR", way(ROOT, RUN, d("/run/user", 0, 0o755), d("/run/user/1001", OTHER, 0o700),
                                           sock_uid=OTHER), OTHER, "is uid 1001's own"),
    ("own daemon with its socket right in /tmp", way(ROOT, TMP), ME, None),
    ("squatted /tmp/hwrd-$UID", way(ROOT, TMP, d("/tmp/hwrd-1000", OTHER, 0o755), sock_uid=OTHER), OTHER,
     "belongs to uid 1001"),
    ("squatted /tmp/hwrd-$UID, 0777, own daemon inside", way(ROOT, TMP, d("/tmp/hwrd-1000", OTHER, 0o777)), ME,
     "belongs to uid 1001"),
    ("own directory left writable by others", way(ROOT, TMP, d("/tmp/hwrd-1000", ME, 0o777)), ME,
     "writable by group or others"),
    ("group-writable /run/hwrd", way(ROOT, RUN, d("/run/hwrd", DAEMON, 0o775), sock_uid=DAEMON), DAEMON,
     "writable by group or others"),
    ("a third uid's daemon in root's directory", way(ROOT, RUN, d("/run/hwrd", 0, 0o755)), OTHER,
     "runs as uid 1001"),
    ("a third uid's daemon in my directory", way(ROOT, TMP, d("/tmp/hwrd-1000", ME, 0o755)), OTHER,
     "runs as uid 1001"),
    ("another uid's socket in sticky /tmp", way(ROOT, TMP, sock_uid=OTHER), OTHER, "runs as uid 1001"),
    ("another uid's gRPC socket beside my peer socket in /tmp", way(ROOT, TMP, sock_uid=OTHER), ME,
     "/tmp/hwrd.sock belongs to uid 1001"),
    ("an ancestor owned by another uid", way(ROOT, d("/home", 0, 0o755), d("/home/eve", OTHER, 0o755),
                                             d("/home/eve/run", 0, 0o755)), 0, "/home/eve belongs to uid 1001"),
    ("an ancestor writable by others, not sticky", way(ROOT, d("/srv", 0, 0o777), d("/srv/hwrd", 0, 0o755)), 0,
     "/srv is writable"),
    ("a symlink another uid made", way(ROOT, RUN, d("/run/hwrd", 0, 0o755),
                                       links=(Node("/tmp/hwrd-1000", OTHER, LINK | 0o777),)), 0,
     "symlink owned by uid 1001"),
])
def test_rules(case: str, walk_: Walk, peer: int, refused: str | None) -> None:
    verdict = problem(walk_, peer, ME)
    if refused is None:
        assert verdict is None, case
    else:
        assert verdict is not None and refused in verdict, (case, verdict)


def test_another_users_daemon_only_when_my_user_opts_in() -> None:
    theirs = way(ROOT, TMP, d("/tmp/hwrd-1001", OTHER, 0o755), sock_uid=OTHER)
    assert problem(theirs, OTHER, ME, frozenset({OTHER})) is None
    assert "is uid 1001's own" in (problem(theirs, OTHER, ME, frozenset({1002})) or "")
    runtime = way(ROOT, RUN, d("/run/user", 0, 0o755), d("/run/user/1001", OTHER, 0o700), sock_uid=OTHER)
    assert problem(runtime, OTHER, ME, frozenset({OTHER})) is None
    # opting in to a uid does not accept a daemon of a third one in that uid's directory
    assert "runs as uid 1002" in (problem(theirs, 1002, ME, frozenset({OTHER})) or "")


@pytest.mark.parametrize(("value", "uids"), [("", frozenset()), (" 1001, 1002 ", frozenset({1001, 1002})),
                                             ("1001,", frozenset({1001}))])
def test_the_opt_in_variable(value: str, uids: frozenset[int]) -> None:
    assert opted_in_uids({"HWR_TRUSTED_UIDS": value}) == uids


@pytest.mark.parametrize("value", ["eve", "1001;1002", "-1", "1001\n2", "99999999999"])
def test_a_malformed_opt_in_is_refused_not_ignored(value: str) -> None:
    with pytest.raises(UntrustedDaemon):
        opted_in_uids({"HWR_TRUSTED_UIDS": value})


def test_root_as_a_client_is_judged_by_the_same_rules() -> None:
    squatted = way(ROOT, TMP, d("/tmp/hwrd-1000", OTHER, 0o755), sock_uid=OTHER)
    assert problem(squatted, OTHER, 0) is not None
    assert problem(way(ROOT, RUN, d("/run/hwrd", DAEMON, 0o755), sock_uid=DAEMON), DAEMON, 0) is None


def test_walk_follows_symlinks_and_records_them(tmp_path: Path) -> None:
    real = tmp_path / "real" / "run"
    real.mkdir(parents=True)
    (real / "hwrd.sock").write_bytes(b"")
    (tmp_path / "alias").symlink_to("real")
    found = walk(tmp_path / "alias" / "run" / ".." / "run" / "hwrd.sock")
    assert [n.path for n in found.links] == [str(tmp_path / "alias")]
    assert found.dirs[-1].path == str(real) and found.dirs[0].path == "/"
    assert found.leaf is not None and found.leaf.path == str(real / "hwrd.sock")
    assert walk(real / "missing.sock").leaf is None
    with pytest.raises(NotADirectoryError):
        walk(real / "hwrd.sock" / "x")
    os.symlink("loop", tmp_path / "loop")
    with pytest.raises(OSError):
        walk(tmp_path / "loop" / "x")
