"""Partial averaging: among some ranks rather than all.

Neighbour averaging over a graph (D-PSGD), and P-Reduce in groups handed out
by the group generator lock service (Prague).
"""
