"""SIGHUP: re-read the configuration and apply what can change while serving.

``plan_reload(old, new, can_apply)`` is the pure decision: each changed key is either applied or
refused (kept at its old value and reported). ``Reloader.reload()`` is the adapter: it parses
the same sources again (the same file path, the environment hwrd started with, the same flags),
applies the plan to the running daemon and logs one line per refused key.

=============================================  ==============================================
key                                            on SIGHUP
=============================================  ==============================================
``allow_uids``, ``allow_gids``                 swapped atomically; new connections are judged
                                               by the new list, existing sessions and their
                                               leases are kept
roles (``publish_uids``, ``publish_gids``,      swapped atomically; judged at each call, so
``operator_uids``, ``operator_gids``)           existing sessions get the new roles at once
``log_level``                                  applied to every hwrd logger
``max_leases_per_session``,                    applied to later Acquires (leases held above a
``max_leases_per_uid``                         lowered limit are kept)
capacity (``store_limit_bytes``,               applied when the daemon has a capacity policy
``artifact_limit_bytes``, ``min_free_bytes``)  (``Daemon.set_capacity``), else refused
``publication_wait_timeout_s``,                applied: read at each use
``shutdown_grace_s``
anything else (``root``, ``socket``,           refused: needs a restart (``systemctl restart
``socket_mode``, ``metrics_listen``, ...)      hwrd``); the old value stays in effect
=============================================  ==============================================

Contract: a reload that fails to parse changes nothing and leaves the daemon serving with the
old configuration (the error is logged and sent as sd_notify ``STATUS=``). Limits: the
environment is the one hwrd was started with (a process cannot see its manager's new
environment); a changed ``--config`` path needs a restart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from hwr.client.errors import ConfigError
from hwr.daemon.system import logs
from hwr.daemon.system.config import DaemonConfig, field_names, load_config_with_sources

if TYPE_CHECKING:
    from hwr.daemon.app.server import Daemon
    from hwr.daemon.system.sdnotify import Notifier

__all__ = ["ALWAYS_RELOADABLE", "CAPACITY_KEYS", "ReloadPlan", "Reloader", "plan_reload"]

log = logging.getLogger("hwrd.reload")
ALWAYS_RELOADABLE = frozenset({"allow_uids", "allow_gids", "log_level", "max_leases_per_session",
                               "max_leases_per_uid", "publication_wait_timeout_s", "shutdown_grace_s"})
ROLE_KEYS = frozenset({"publish_uids", "publish_gids", "operator_uids", "operator_gids"})
CAPACITY_KEYS = frozenset({"store_limit_bytes", "artifact_limit_bytes", "min_free_bytes"})


@dataclass(frozen=True)
class ReloadPlan:
    config: DaemonConfig  # the configuration to run with: new values for applied keys, old for the rest
    applied: tuple[str, ...]
    refused: tuple[str, ...]


def plan_reload(old: DaemonConfig, new: DaemonConfig, can_apply: Callable[[str], bool]) -> ReloadPlan:
    changed = [k for k in field_names() if getattr(old, k) != getattr(new, k)]
    applied = tuple(k for k in changed if can_apply(k))
    refused = tuple(k for k in changed if k not in applied)
    merged = msgspec.structs.replace(old, **{k: getattr(new, k) for k in applied})
    return ReloadPlan(merged, applied, refused)


class Reloader:
    def __init__(
        self, daemon: Daemon, *, config_file: Path | None, overrides: Mapping[str, Any],
        flag_text: Mapping[str, str], notifier: Notifier, env: Mapping[str, str] | None = None,
    ) -> None:
        self.daemon = daemon
        self.config_file = config_file
        self.overrides = dict(overrides)
        self.flag_text = dict(flag_text)
        self.notifier = notifier
        self.env = dict(os.environ if env is None else env)

    def can_apply(self, key: str) -> bool:
        if key in ALWAYS_RELOADABLE or key in ROLE_KEYS:
            return True
        return key in CAPACITY_KEYS and callable(getattr(self.daemon, "set_capacity", None))

    def reload(self) -> ReloadPlan | None:
        """Re-read and apply; returns the plan, or ``None`` when the new configuration is invalid."""
        self.notifier.reloading()
        try:
            new, _sources = load_config_with_sources(
                self.config_file, overrides=self.overrides, env=self.env, flag_text=self.flag_text)
        except ConfigError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc,
                      extra=logs.fields(key=exc.details.get("key", "-")))
            self.notifier.send(READY=1, STATUS=f"reload failed: {exc}")
            return None
        plan = plan_reload(self.daemon.settings.config, new, self.can_apply)
        self._apply(plan)
        for key in plan.refused:
            log.warning("cannot reload %s without a restart; keeping the running value", key,
                        extra=logs.fields(key=key, running=getattr(plan.config, key), wanted=getattr(new, key)))
        log.info("configuration reloaded", extra=logs.fields(
            applied=",".join(plan.applied) or "-", refused=",".join(plan.refused) or "-"))
        self.notifier.send(READY=1, STATUS=self.daemon.status_line())
        return plan

    def _apply(self, plan: ReloadPlan) -> None:
        config, daemon = plan.config, self.daemon
        daemon.settings.config = config
        if {"allow_uids", "allow_gids"} & set(plan.applied):
            daemon.set_allow_list(config.allow_uids, config.allow_gids)
        if {"max_leases_per_session", "max_leases_per_uid"} & set(plan.applied):
            daemon.set_lease_limits(config)
        if ROLE_KEYS & set(plan.applied):
            from hwr.daemon.service.roles import roles_from

            daemon.settings.roles = roles_from(config)
        if "log_level" in plan.applied:
            logs.set_level(config.log_level)
        if CAPACITY_KEYS & set(plan.applied):
            daemon.set_capacity(config)  # type: ignore[attr-defined]
