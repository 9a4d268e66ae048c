"""Models and their inputs: the architectures and tokenizers the bootstrap builds
(``architectures``), those policies and how any policy is loaded (``policy``), the per-token
statistics of response logits (``logits``), learned reward models (``reward_model``) and the prompt
sources (``tasks``). The generation backends, and sampling scored groups of responses with them,
are the package ``otbflow.engines``."""
