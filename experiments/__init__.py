"""Experiments and analyses that regenerate the published tables (docs/results/): run as
`python -m experiments.X`.

They use SlimWise's public API and nothing in `slimwise/` imports them (tests/test_architecture.py checks it).
"""
