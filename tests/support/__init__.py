"""Test support for mopd-bridge: the torchrun tier's harness and CPU-only megatron patches.

Nothing here is imported by the library.
"""
