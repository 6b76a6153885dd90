"""The parts of ``python -m worker bench``: comparison loops, measurement, report."""
