"""benchmark/probes/: see benchmark/README.md, "Scripts"."""
