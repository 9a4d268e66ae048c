"""Models and their inputs: the policies the bootstrap builds and how any policy is loaded
(``policy``), the per-token statistics of response logits (``logits``), sampling scored groups of
responses (``sampling``), learned reward models (``reward_model``) and the prompt sources
(``tasks``). The generation backends are the package ``otbflow.engines``."""
