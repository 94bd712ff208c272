"""Storage tiers of a daemon: space allocation and eviction policies."""
from .allocator import ExtentAllocator
from .eviction import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy

__all__ = ["POLICIES", "EvictionPolicy", "ExtentAllocator", "LFUPolicy", "LRUPolicy", "make_policy"]
