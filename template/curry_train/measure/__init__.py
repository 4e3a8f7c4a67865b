"""Measurement on this machine: step benchmark, exact memory accounting, hardware probe, launch services."""
