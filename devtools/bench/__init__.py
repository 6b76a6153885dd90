"""The parts of ``python -m devtools bench``: comparison loops, measurement, report."""
