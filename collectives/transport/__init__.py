"""Transport: how the collectives' data lives and moves.

Buffers of every kind as flat arrays, reduction ops, point-to-point transfers
with their byte counts and the stall watchdog, scratch, device staging, service
threads, the rank-prefixed form of diagnostics, surviving a dead peer (ULFM).
"""
