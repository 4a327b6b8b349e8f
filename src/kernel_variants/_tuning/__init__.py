"""Tuning: timing, the one verify, qualification, calibration and its distributed form."""
