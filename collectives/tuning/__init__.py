"""Tuning: the cost model and its calibration.

The model is a pure function of parameters and layout; the calibration
measures the parameters on the running job.
"""
