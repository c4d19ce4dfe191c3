"""Metrics while training: ``autopp.metrics.log_metrics(step)`` wraps a step and logs one line per step.

``step 3 | loss 5.5432 | 41.2 ms | 24.8k tok/s | 0.31 TFLOP/s/dev | mfu - | mem 12.3 MiB``
"""

from autopp._metrics import MetricsLogger, StepMetrics, known_peak_flops, log_metrics, tokens_in

__all__ = ["MetricsLogger", "StepMetrics", "known_peak_flops", "log_metrics", "tokens_in"]
