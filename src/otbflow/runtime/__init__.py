"""The runtime: job-side services that models, engines, training, io and the stages call, below
all of them. What a process is (``process``: boot id, /proc stat, start, dying with its parent),
a policy folder's files, digests and checks (``policy_folder``), models and state kept resident in
a warm worker (``resident``), what a run keeps on disk (``retention``) and what a results folder
holds (``usage``), code versions as rerun triggers (``codeversion``) and live curves
(``tracking``).

Nothing here imports an otbflow module above it; what runs the run (workers, dispatch, preload, the
Slurm head, submit) stands above, in ``otbflow.ops``."""
