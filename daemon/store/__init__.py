"""The on-disk artifact store of one root: staging (files, or sealed memfds for small ones),
validation, atomic commit, deny/quarantine, retirement and usage accounting. Knows nothing of
sessions, leases or transports.
"""
