"""Tools around the recipe: benchmarks, the study, the scaling model and its calibration, the GPU check."""
