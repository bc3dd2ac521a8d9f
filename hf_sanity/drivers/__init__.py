"""The drivers: they ask the catalog for the detectors of their kind, feed them, and collect a report."""
