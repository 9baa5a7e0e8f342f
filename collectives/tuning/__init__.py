"""Tuning: what "auto" chooses by, and the alpha-beta cost model.

The candidates are timed at the grid sizes around the sizes a program uses
(``sweep``, ``table``), tuned online on the first calls of a size band
(``online``), and kept between processes (``cache``); ``selector`` puts them
together for one communicator, ``settings`` holds the switches. The model
(``costmodel``) is a pure function of parameters and layout, measured by
``calibration``; ``auto`` decides by it only where ``MPIDL_COSTMODEL`` asks.
"""
