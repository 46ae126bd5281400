"""The node service: sessions and leases, acquire/release, publications, the read API in front of
the store, capacity, eviction, pins, the lease journal and scrub. Transport-neutral.
"""
