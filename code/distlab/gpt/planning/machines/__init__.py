"""The machines the step-time model knows, one JSON file each (``planning/hardware.py`` reads them)."""
