"""Operations: what runs the workflow on a cluster and keeps it sound, above the stages' library.
The Slurm head job (``submit``), one head per results folder (``head``), grouped Slurm jobs
(``jobgroups``), warm workers (``worker``, ``workerjobs``, ``dispatch``, ``preload``) and the disk
report (``disk``). The job-side services these and the stages call live below, in
``otbflow.runtime``."""
