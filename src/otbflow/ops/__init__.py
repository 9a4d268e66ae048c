"""Operations: running the workflow on a cluster and keeping it sound. The Slurm head job
(``submit``), one head per results folder (``head``), grouped Slurm jobs (``jobgroups``), warm
workers (``worker``, ``workerjobs``, ``dispatch``, ``resident``), what a run keeps on disk
(``retention``, ``disk``), code versions as rerun triggers (``codeversion``) and live curves
(``tracking``)."""
