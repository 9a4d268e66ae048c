"""Methods otbflow adds to vLLM's workers (``worker_extension_cls`` of the engine, so that they are
called by name through ``LLM.collective_rpc``: no code is pickled), imported only inside vLLM's
worker processes."""

from __future__ import annotations


class ReloadExtension:
    """``reload_policy(path)``: the weights of the HF folder ``path`` loaded into the running engine
    in place (vLLM's ``reload_weights``), then the output head's CPU kernel handle made anew. On
    CPU, vLLM packs each linear layer's weight into a oneDNN/SGL handle after loading; its in-place
    reload processes every layer it loads again, but a head tied to the embedding is not loaded (the
    embedding is) and kept computing with the old weights' packed copy. On a GPU there is no such
    handle and this is vLLM's reload alone."""

    def reload_policy(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        if head is not None and hasattr(head, "cpu_linear"):
            head.quant_method.process_weights_after_loading(head)
