"""The per-GPU autotuner.

space (what may be tried) -> gate + objective (checked, then timed, in an isolated process:
isolate) -> study (Optuna, storage) -> profile (YAML per GPU fingerprint) -> activate (the
lookup dispatch calls). standin is a CPU objective for testing the driver without a GPU.
"""
