"""The research lab around SlimWise: what is used to study and build it, not to prune or serve a model.

Performance modelling and measurement studies (`lab.perf`) and the training, evaluation and model cards of the
testbed backbones (`lab.testbed`). It imports the product (`slimwise`); the product never imports it, and the
wheel does not ship it (tests/test_architecture.py, tests/test_wheel.py). Run its entry points from a source
checkout's root: `python -m lab.perf.cli ...`, `python -m lab.testbed.train ...`.
"""
