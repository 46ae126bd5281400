"""Configuration: errors name the key and the TOML line (exit status 2), every option is also a
flag and a variable, and ``hwrd --check-config`` prints the effective configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hwr.client.errors import ConfigError
from hwr.daemon.system.config import (
    DaemonConfig,
    describe,
    env_name,
    field_names,
    flag_name,
    load_config_with_sources,
    parse_text,
)

HWRD = [sys.executable, "-m", "hwr.daemon.app.main"]


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HWRD, *args, "--check-config"], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


@pytest.mark.parametrize(("body", "key", "line"), [
    ('log_level = "info"\n\n# comment\nmax_leases_per_session = "many"\n', "max_leases_per_session", 4),
    ('socket_mode = 0o660\nallow_uids = [1000, "bob"]\n', "allow_uids", 2),
    ('\n\n\nsocket_mode = 0o7777\n', "socket_mode", 4),
    ('log_level = "info"\nlog_levle = "debug"\n', "log_levle", 2),
    ('metrics_listen = "0.0.0.0:9464"\n', "metrics_listen", 1),
    ('\ncommit_threads = 0\n', "commit_threads", 2),
    ('shutdown_grace_s = 1.0\n[extra]\nx = 1\n', "extra", 2),
])
def test_bad_config_file_names_key_and_line_and_exits_2(short_tmp: Path, body: str, key: str, line: int) -> None:
    config = short_tmp / "hwrd.toml"
    config.write_text(body)
    result = _check("--config", str(config), "--root", str(short_tmp / "store"))
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err  # one line, no traceback
    assert f"{config}:{line}:" in err and f"'{key}'" in err
    with pytest.raises(ConfigError) as info:
        load_config_with_sources(config, env={})
    assert (info.value.details["key"], info.value.details["line"]) == (key, line)


def test_toml_syntax_error_exits_2_with_position(short_tmp: Path) -> None:
    config = short_tmp / "hwrd.toml"
    config.write_text('log_level = "info"\nsocket_mode = \n')
    result = _check("--config", str(config))
    assert result.returncode == 2
    assert str(config) in result.stderr and "line 2" in result.stderr


def test_bad_variable_and_flag_name_their_source(short_tmp: Path) -> None:
    result = _check("--root", str(short_tmp), env={"HWR_MAX_LEASES_PER_SESSION": "lots"})
    assert result.returncode == 2
    assert "env HWR_MAX_LEASES_PER_SESSION" in result.stderr and "'max_leases_per_session'" in result.stderr
    result = _check("--root", str(short_tmp), "--shutdown-grace-s", "soon")
    assert result.returncode == 2 and "flag --shutdown-grace-s" in result.stderr


def test_check_config_prints_effective_values_with_sources(short_tmp: Path) -> None:
    config = short_tmp / "hwrd.toml"
    config.write_text('socket_mode = 0o640\nlog_level = "debug"\nallow_gids = [5, 6]\n')
    result = _check("--config", str(config), "--root", str(short_tmp / "r"), "--log-level", "warning",
                    env={"HWR_ALLOW_UIDS": "1000,1001", "HWR_SOCKET": str(short_tmp / "s.sock")})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"socket_mode = 0o640  # {config}:1" in out
    assert "log_level = \"warning\"  # flag --log-level" in out  # flags win over the file
    assert "allow_uids = [1000, 1001]  # env HWR_ALLOW_UIDS" in out
    assert f"allow_gids = [5, 6]  # {config}:3" in out
    assert f'socket = "{short_tmp / "s.sock"}"  # env HWR_SOCKET' in out
    # The printed configuration is itself a valid config file that yields the same struct.
    again = short_tmp / "again.toml"
    again.write_text(out)
    first, _ = load_config_with_sources(config, env={"HWR_ALLOW_UIDS": "1000,1001",
                                                     "HWR_SOCKET": str(short_tmp / "s.sock")},
                                        overrides={"root": str(short_tmp / "r"), "log_level": "warning"})
    second, _ = load_config_with_sources(again, env={})
    assert first == second


def test_every_option_has_a_flag_and_a_variable() -> None:
    from hwr.daemon.app.main import _parser

    dests = {a.dest for a in _parser()._actions}
    help_text = subprocess.run([*HWRD, "--help"], capture_output=True, text=True, timeout=120).stdout
    for key in field_names():
        assert key in dests or f"opt_{key}" in dests, key
        if f"opt_{key}" in dests:
            assert flag_name(key) in help_text and env_name(key) in help_text, key
        # The variable is read: a bad value is reported against it, and a string option takes
        # the text itself (so a variable that were never read fails either way).
        text = f"/from-{env_name(key).lower()}"
        env = {"HWR_ROOT": "/r", "HWR_SOCKET": "/s", env_name(key): text}
        try:
            cfg, sources = load_config_with_sources(None, env=env)
        except ConfigError as exc:
            assert exc.details.get("source") == f"env {env_name(key)}", (key, str(exc))
            continue
        assert str(getattr(cfg, key)) == text, (key, getattr(cfg, key))
        assert sources.by_key.get(key) == f"env {env_name(key)}", (key, sources.by_key.get(key))


def test_later_sources_win(short_tmp: Path) -> None:
    config = short_tmp / "hwrd.toml"
    config.write_text("max_leases_per_session = 10\nshutdown_grace_s = 3.0\n")
    cfg, sources = load_config_with_sources(
        config, env={"HWR_MAX_LEASES_PER_SESSION": "20", "HWR_ROOT": "/r", "HWR_SOCKET": "/s"},
        flag_text={"shutdown_grace_s": "4.5"})
    assert (cfg.max_leases_per_session, cfg.shutdown_grace_s) == (20, 4.5)
    assert sources.by_key["max_leases_per_session"] == "env HWR_MAX_LEASES_PER_SESSION"
    assert "shutdown_grace_s = 4.5  # flag --shutdown-grace-s" in describe(cfg, sources)


@given(st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=5),
       st.sampled_from(["debug", "info", "warning", "error"]), st.integers(min_value=0, max_value=0o777))
def test_variable_text_round_trips(uids: list[int], level: str, mode: int) -> None:
    env = {"HWR_ALLOW_UIDS": ",".join(map(str, uids)), "HWR_LOG_LEVEL": level,
           "HWR_SOCKET_MODE": f"{mode:o}", "HWR_ROOT": "/r", "HWR_SOCKET": "/s"}
    cfg, _ = load_config_with_sources(None, env=env) if not Path("/etc/hwrd/hwrd.toml").exists() else (None, None)
    if cfg is None:
        return
    assert isinstance(cfg, DaemonConfig)
    assert cfg.allow_uids == tuple(uids) or not uids
    assert (cfg.log_level, cfg.socket_mode) == (level, mode)
    assert parse_text("socket_mode", f"0o{mode:o}") == mode


def test_commit_threads_sizes_the_publication_pool(tmp_path: Path) -> None:
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.eviction_marks import EvictionMarks
    from hwr.daemon.service.publishing import COMMIT_THREADS, Publishing
    from hwr.daemon.store.root import Store

    if Path("/etc/hwrd/hwrd.toml").exists():
        pytest.skip("a system config file would set the values under test")

    cfg, _ = load_config_with_sources(None, env={"HWR_ROOT": "/r", "HWR_SOCKET": "/s"}, flag_text={})
    assert cfg.commit_threads == COMMIT_THREADS == 8  # the measured default (daemon/system/config.py)
    cfg, sources = load_config_with_sources(None, env={"HWR_ROOT": "/r", "HWR_SOCKET": "/s",
                                                       "HWR_COMMIT_THREADS": "3"})
    assert cfg.commit_threads == 3 and sources.by_key["commit_threads"] == "env HWR_COMMIT_THREADS"
    with pytest.raises(ConfigError):
        load_config_with_sources(None, env={"HWR_ROOT": "/r", "HWR_SOCKET": "/s", "HWR_COMMIT_THREADS": "65"})
    with Store.open(tmp_path / "root") as store:
        publications = Publishing(store, Catalog(store, EvictionMarks()), commit_threads=cfg.commit_threads)
        try:
            assert publications._commit_pool._max_workers == 3
        finally:
            publications._commit_pool.shutdown()
