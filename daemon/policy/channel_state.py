"""Channel state and its transitions (pure): a change, what is protected, what a restart keeps.

A channel points to one artifact key. Each change takes the next generation of one node-wide
counter and is recorded in a bounded history (newest last). A change is *durable* when the key
it points to is a durable artifact; a channel remembers its last durable key and generation,
which is all that a restart keeps of its state (its history is kept whole, see below)::

    persisted document of a channel        what a restart makes of it
    ---------------------------------      ------------------------------------------------
    durable state, volatile_generation 0   the same state
    durable state, volatile_generation g   the last durable key, at a NEW generation (the
                                           fallback is a change; history entry "fallback")
    no durable key, volatile_generation g  nothing: the channel is gone

The history (the last ``HISTORY`` changes) is persisted whole, non-durable entries included
(``durable`` false): after a restart it still says which revisions ran, though a non-durable
one's artifact is gone. Non-durable changes are written without fsync, so a host crash (not a
restart of hwrd) may lose the newest of them.

Protected keys (never evicted): each channel's current key and its last durable key (what a
restart falls back to). Superseded keys are not protected: they become evictable once no lease
holds them.

Each history entry records the uid that made the change (``uid``), and a channel a publisher
created records its ``owner`` (``channel_rights`` says who may repoint it); both are optional
in the file, so a file written before they were recorded still loads (no uid, no owner).

Everything here is a function of plain values; ``hwr.daemon.service.channels`` does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hwr.client.channels import valid_channel_name
from hwr.client.identity import is_key

__all__ = [
    "HISTORY",
    "ChannelState",
    "HistoryEntry",
    "Restored",
    "document",
    "moved",
    "protected_keys",
    "restored",
]

#: History entries kept per channel (newest last).
HISTORY = 16
#: Who made a change: an operator's set, a publication's commit, a restart's fallback.
SET_BY = ("operator", "publication", "fallback")


@dataclass(frozen=True)
class HistoryEntry:
    key: str
    generation: int
    set_at: float
    set_by: str
    durable: bool
    uid: int | None = None  # who made the change; None: hwrd itself, or recorded before uids were


@dataclass(frozen=True)
class ChannelState:
    name: str
    key: str
    generation: int
    durable: bool
    durable_key: str  # "" when the channel never pointed to a durable artifact
    durable_generation: int
    switches: int
    created_at: float
    updated_at: float
    history: tuple[HistoryEntry, ...]
    # The publisher uid that created it and may repoint it (``channel_rights``); None: an operator's.
    owner: int | None = None


def moved(current: ChannelState | None, name: str, key: str, generation: int, now: float, set_by: str,
          durable: bool, *, uid: int | None = None, owner: int | None = None) -> ChannelState:
    """The state after ``uid`` pointed ``name`` (``current``: its state, None when new, then owned
    by ``owner``) at ``key``; an existing channel keeps its owner."""
    entry = HistoryEntry(key, generation, now, set_by, durable, uid)
    if current is None:
        return ChannelState(name, key, generation, durable, key if durable else "", generation if durable else 0,
                            1, now, now, (entry,), owner)
    return replace(
        current, key=key, generation=generation, durable=durable,
        durable_key=key if durable else current.durable_key,
        durable_generation=generation if durable else current.durable_generation,
        switches=current.switches + 1, updated_at=now, history=(*current.history, entry)[-HISTORY:])


def protected_keys(states: Iterable[ChannelState]) -> set[str]:
    """Keys that must not be evicted: every current key and every last durable key."""
    keys: set[str] = set()
    for state in states:
        keys.add(state.key)
        if state.durable_key:
            keys.add(state.durable_key)
    return keys


def _entry_doc(entry: HistoryEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"key": entry.key, "generation": entry.generation, "set_at": entry.set_at,
                           "set_by": entry.set_by, "durable": entry.durable}
    if entry.uid is not None:
        doc["uid"] = entry.uid
    return doc


def document(states: Iterable[ChannelState], counter: int) -> dict[str, Any]:
    """The persisted form: per channel only its durable part (its last durable key, generation
    and its whole history) plus ``volatile_generation``, the generation of a
    non-durable current state (0 when the current state is durable)."""
    channels = {}
    for s in sorted(states, key=lambda s: s.name):
        channels[s.name] = {
            "key": s.durable_key, "generation": s.durable_generation, "switches": s.switches,
            "created_at": s.created_at, "updated_at": s.updated_at,
            "volatile_generation": 0 if s.durable else s.generation,
            "history": [_entry_doc(e) for e in s.history],
        }
        if s.owner is not None:
            channels[s.name]["owner"] = s.owner
    return {"schema_version": 1, "generation": counter, "channels": channels}


def _number(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool) and value >= 0  # type: ignore[operator]


def _optional_uid(value: object) -> bool:
    """A uid field of the file: absent (a file written before uids were recorded) or a uid."""
    return value is None or (_number(value, int) and value < 1 << 32)  # type: ignore[operator]


def _history(items: object) -> tuple[HistoryEntry, ...]:
    if not isinstance(items, list):
        raise ValueError("history is not a list")
    out = []
    for item in items[-HISTORY:]:
        if not isinstance(item, Mapping) or not is_key(item.get("key")) or not _number(item.get("generation"), int) \
                or not isinstance(item.get("set_at"), (int, float)) or item.get("set_by") not in SET_BY \
                or not _optional_uid(item.get("uid")) or not isinstance(item.get("durable", True), bool):
            raise ValueError("a history entry is malformed")
        # Documents written before entries said so hold durable entries only.
        out.append(HistoryEntry(item["key"], item["generation"], float(item["set_at"]), item["set_by"],
                                item.get("durable", True), item.get("uid")))
    return tuple(out)


@dataclass(frozen=True)
class Restored:
    """What ``restored`` makes of a persisted document (see the module docstring)."""

    states: dict[str, ChannelState]
    counter: int
    fell_back: list[str]  # pointed to a non-durable revision: back on their last durable key
    vanished: list[str]  # never pointed to a durable artifact: gone
    malformed: list[str]  # entries that are not a channel: dropped


def restored(doc: object, now: float) -> Restored:
    """The channels a persisted ``document`` describes after a restart. Raises ``ValueError``
    for a document that is not one (the caller keeps it aside); a malformed channel entry is
    dropped and named."""
    if not isinstance(doc, Mapping) or doc.get("schema_version") != 1 or not _number(doc.get("generation"), int) \
            or not isinstance(doc.get("channels"), Mapping):
        raise ValueError("not a schema 1 channels document")
    counter: int = doc["generation"]
    states: dict[str, ChannelState] = {}
    fell_back: list[str] = []
    vanished: list[str] = []
    malformed: list[str] = []
    for name, item in sorted(doc["channels"].items()):
        try:
            if not valid_channel_name(name) or not isinstance(item, Mapping):
                raise ValueError("bad name")
            key, generation, volatile = item.get("key"), item.get("generation"), item.get("volatile_generation", 0)
            if not _number(generation, int) or not _number(volatile, int) or not _number(item.get("switches"), int):
                raise ValueError("bad numbers")
            if not isinstance(item.get("created_at"), (int, float)) or not isinstance(item.get("updated_at"),
                                                                                      (int, float)):
                raise ValueError("bad times")
            history = _history(item.get("history"))
            if not _optional_uid(item.get("owner")):
                raise ValueError("bad owner")
        except ValueError:
            malformed.append(str(name)[:64])
            continue
        counter = max(counter, generation, volatile)
        if not is_key(key):  # it never pointed to a durable artifact: nothing survives a restart
            vanished.append(name)
            continue
        state = ChannelState(name, key, generation, True, key, generation, item["switches"],
                             float(item["created_at"]), float(item["updated_at"]), history, item.get("owner"))
        if volatile > generation:  # it pointed to a non-durable revision, which a restart removed
            counter += 1
            state = moved(state, name, key, counter, now, "fallback", True)
            fell_back.append(name)
        states[name] = state
    return Restored(states, counter, fell_back, vanished, malformed)
