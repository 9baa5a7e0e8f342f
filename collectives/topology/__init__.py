"""Topology: where the ranks are.

Which ranks share a node (the layout), and the node, leader and grid
sub-communicators built from it.
"""
