"""Helpers every stage may use: devices, memory resources, the host allocator, distributed ranks."""
