"""Calibration: observers, the calibration run that records every amax, and the calibration file."""
