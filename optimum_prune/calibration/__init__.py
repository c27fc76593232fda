"""Calibration data (seeded token windows from text sources) and the layer-wise calibration runner."""
