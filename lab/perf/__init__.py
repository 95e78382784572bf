"""Performance studies: the roofline's sensitivity analysis, expert-parallel predictions, the calibration
pass's cost and the load-aware policy's quality (`python -m lab.perf.cli`). The decode-step model itself
(slimwise.perf.roofline) stays in the product: `slimwise bench` compares its measurements with it."""
