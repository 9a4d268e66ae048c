"""Studies over runs: the offline variance study, the length-scaling fit, experiment files, the
statistics of their reports (experiment_stats) and the small-sample intervals they use (stats)."""
