"""Kernels: the all-reduce algorithms, one module each, and their plans.

Every module opens with its phases and cost; :mod:`.plans` binds each
algorithm to the communicators it runs on.
"""
