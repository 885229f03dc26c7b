"""benchmark/faults/: see benchmark/README.md, "Scripts"."""
