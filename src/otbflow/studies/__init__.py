"""Studies over runs: the offline variance study, the length-scaling fit, experiment files and
the small-sample statistics of their reports."""
