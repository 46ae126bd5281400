"""One line of help for each configuration key: what ``hwrd --help`` says of its flag.

``HELP`` covers every field of ``hwr.daemon.system.config.DaemonConfig`` that has no hand-made
flag in ``hwr.daemon.app.main`` (a test checks that each key has its line, so a new key cannot
reach ``--help`` without one). The flag's environment variable and its default are added by the
parser; sizes are bytes, durations seconds, ``0`` means off or unlimited where a line says so.
"""

from __future__ import annotations

__all__ = ["HELP"]

HELP: dict[str, str] = {
    "max_leases_per_session": "leases one client session may hold at once",
    "max_leases_per_uid": "leases all sessions of one uid may hold at once",
    "max_sessions_per_uid": "open sessions (peer connections) per uid; one more gets a typed refusal",
    "max_inflight_fds_per_connection": "descriptors sent to one connection and not received yet; "
                                       "replies past it wait until the client reads",
    "max_inflight_fds_per_uid": "descriptors sent to one uid's connections and not received yet",
    "peer_buffer_budget_bytes": "bytes of partial request frames buffered over all connections",
    "peer_frame_timeout_s": "a request frame not complete this long after its first byte ends the session",
    "max_grpc_connections_per_uid": "gRPC connections per uid (a client holds one, hwrctl one per command)",
    "grpc_first_bytes_timeout_s": "a gRPC connection whose client sends no byte this long after it was accepted "
                                  "is closed",
    "publication_wait_timeout_s": "how long a publication or prewarm waits for another publisher of the same "
                                  "artifact or for room in the store",
    "shutdown_grace_s": "on SIGTERM, how long calls in flight may finish before hwrd stops",
    "producer_timeout_s": "wall-clock limit of one prewarm producer process",
    "producer_throttle_s": "test only: a pause after each block a producer writes",
    "publication_stall_timeout_s": "a client publication whose staging shows no progress this long gives its room back "
                                   "and fails (0 off; hwrd's own prewarm builds and pulls are exempt)",
    "fleet_peer_serve": "serve this node's committed artifacts to the fleet's other nodes over NIXL (true/false)",
    "fleet_peer_fetch": "pull an artifact from peers that hold it before (and beside) the remote (true/false)",
    "fleet_peer_listen": "HOST:PORT of the peer tier's control connections when serving",
    "fleet_peer_advertise": "HOST:PORT the other nodes use to reach this one ('' fleet-peer-listen)",
    "fleet_peer_secret_file": "the fleet's shared secret (a file readable by hwrd's user only): membership proofs",
    "fleet_peer_node_id": "this node's name in the remote's holder records ('' the host name)",
    "fleet_peer_serve_max_bytes_per_s": "cap on the bytes per second served to peers, all together (0 no cap)",
    "fleet_peer_holder_ttl_s": "a holder record expires this long after its last refresh",
    "fleet_peer_max_sources": "peers one pull reads from at once",
    "fleet_peer_python": "the interpreter of the peer tier's transfer process, one with nixl-cu12 ('' hwrd's own)",
    "fleet_peer_ucx_tls": "UCX_TLS for the transfer process, e.g. tcp ('' UCX's own choice)",
    "fleet_peer_networks": "networks (CIDR, comma-separated) the fleet's nodes are on: peers elsewhere are refused "
                           "and not asked; install-service's IPAddressAllow= (empty: not restricted)",
    "producer_python": "the interpreter prewarm producers run in, one with torch and hwr[worker] (and vLLM-Omni for "
                       "--producer vllm-omni), e.g. the serving venv's python ('' hwrd's own)",
    "metrics_listen": "serve Prometheus metrics on 127.0.0.1:PORT or unix:/PATH ('' off)",
    "store_limit_bytes": "the most bytes the store holds; least recently used artifacts are evicted (0 unlimited)",
    "artifact_limit_bytes": "the largest artifact a publication may make (0 unlimited)",
    "min_free_bytes": "bytes kept free on the store's filesystem; eviction makes room for them (0 none)",
    "mlock_budget_bytes": "bytes of pinned artifacts kept resident with mlock (0 none)",
    "publication_deadline_s": "a publication not committed this long after it began is cancelled",
    "serialized_admission": "admit one publication at a time into the store (true/false)",
    "scrub_bandwidth_mib_s": "re-verify stored artifacts in the background at this many MiB/s (0 off)",
    "scrub_interval_s": "seconds between two background verification passes",
    "housekeeping_interval_s": "seconds between housekeeping rounds (dead holders, overdue publications)",
    "commit_threads": "threads that stage and commit publications",
    "adopt": "adopt a root written by vLLM-Omni 0.30's in-process store (true/false)",
    "publish_uids": "users (uids or names) that may also publish; with publish-gids empty, everyone allowed "
                    "to connect may",
    "publish_gids": "groups (gids or names) whose members may also publish",
    "operator_uids": "users (uids or names) that may also run operator commands (checkpoints, prewarm, deny, pin, "
                     "evict, gc, verify, pull, push)",
    "operator_gids": "groups (gids or names) whose members may also run operator commands",
    "memfd_staging_max_bytes": "client publications up to this many bytes stage in sealed memfds, larger ones "
                               "in files (0 always files)",
    "remote": "the fleet tier's remote: s3://BUCKET/PREFIX or file:///PATH ('' off); S3 credentials come from "
              "the standard AWS chain, never from here",
    "remote_endpoint_url": "the S3 endpoint of an S3-compatible service ('' AWS)",
    "remote_region": "the S3 region ('' the chain's default)",
    "remote_push": "upload local publications to the remote (true/false)",
    "remote_stall_timeout_s": "a pull that receives nothing from the remote for this long is stopped",
}
