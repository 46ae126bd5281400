"""The fleet tier: a remote object store used as a cache of committed artifacts (pull on miss, push
after publish).
"""
