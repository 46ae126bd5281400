"""hwrd, the node daemon, in rooms: sub-packages that depend only downwards.

Each room is a sub-package of ``hwr.daemon``. A module may import from its own room, from the
rooms listed before its own below, and from ``hwr.client`` / ``hwr.protos`` (the contract
packages); never from a room after its own, and never from a sibling room on the same line.
``tests/daemon/test_rooms.py`` checks every import in the tree, lazy ones and ``TYPE_CHECKING``
ones included, against :data:`ROOMS`.

From the bottom up:

``policy``       pure decisions over plain values: capacity, the publication deadline, eviction
                 order, recency (LRU order), pages
``system``       the OS boundary and process plumbing: sockets, peer credentials, socket
                 activation, sd_notify, filesystem guards, /proc scans, config, logs, metric
                 instruments
``store``        the on-disk artifact store of one root: staging (files or sealed memfds),
                 validation, atomic commit, deny/quarantine, retirement, usage accounting
``checkpoints``  the registry of canonical checkpoints, opened with the caller's rights
``service``      the node service: sessions and leases, acquire/release, publications, channels,
                 the read API in front of the store, capacity, eviction, pins, the lease journal,
                 scrub
``producers``    transforms from a checkpoint to final-layout artifacts, in isolated processes,
                 published through the service's publications (prewarm); only that process
                 (``producers.worker``, ``producers.blocks``) imports torch, hwrd never does
``fleet``        the remote tier: pull on miss, push after publish
``peer`` ``rpc`` the two transports (Unix-socket peer socket with descriptor passing; gRPC),
                 siblings that never import each other
``app``          wiring: builds every object with its collaborators, starts and stops them (hwrd)
``ctl``          hwrctl, a client application of the daemon (imports only the client library)

A warm acquire crosses them once, top-down, three module boundaries each way and none a pure
forward: ``peer.server`` (or ``rpc.servicer``: parse, encode the grant) -> ``service.leasing``
(``Leasing.grant``: lookup, lease, manifest, descriptors, journal flush, rollback) ->
``service.catalog`` (the eviction marks, the read API's record and payload opens) ->
``store.records`` (the cached record, the ``fstat``-checked opens), and back with descriptors.
The transports never import ``store``; only ``service.catalog`` reads its records.

The ``service`` room has floors of its own (:data:`SERVICE_FLOORS`), checked the same way: a
service module imports from its own floor and the floors below, never above, and the service
room's modules import each other in no circle (type-only imports count).
"""

#: The rooms from the bottom up; rooms in one tuple are siblings (neither imports the other).
ROOMS: tuple[tuple[str, ...], ...] = (
    ("policy",),
    ("system",),
    ("store",),
    ("checkpoints",),
    ("service",),
    ("producers",),
    ("fleet",),
    ("peer", "rpc"),
    ("app",),
    ("ctl",),
)

#: The ``service`` room's inner floors from the bottom up: (floor, its modules). From the bottom:
#: ``who`` (the session and lease table, the roles, the running settings); ``reader`` (the read
#: API in front of the store and the eviction marks it waits on); ``holds`` (what holds a key and
#: what a grant touches: the lease journal, the mapping scan, recency, pins, weight channels,
#: scrub, and ``Leasing``, which grants, journals and releases every lease); ``capacity``
#: (eviction, purging retired bytes, admission and reservations); ``publishing`` (publications,
#: their handover and checks, and housekeeping, which expires them).
SERVICE_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("who", ("sessions", "roles", "settings")),
    ("reader", ("eviction_marks", "catalog")),
    ("holds", ("lease_journal", "mapping_scan", "recency", "pinning", "channels", "scrubber", "leasing")),
    ("capacity", ("purger", "evictor", "capacity")),
    ("publishing", ("handover", "publication_checks", "publishing", "housekeeping")),
)
