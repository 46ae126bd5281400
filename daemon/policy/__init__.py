"""Pure decisions over plain values (no I/O): admission, capacity, eviction order, LRU, pages.
"""
