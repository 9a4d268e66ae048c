"""What a step's throughput is measured against: the dense bf16 tensor-core peak of a GPU, by the
name torch gives it (``PEAKS``, each with its source: NVIDIA's datasheets give the figure with 2:4
sparsity, twice the dense one), and the model FLOPs utilisation of a train step (``mfu``)."""

from __future__ import annotations

H100 = "https://www.nvidia.com/en-us/data-center/h100/ (BF16 Tensor Core, with sparsity)"
H200 = "https://www.nvidia.com/en-us/data-center/h200/ (BF16 Tensor Core, with sparsity)"
A100 = "https://www.nvidia.com/en-us/data-center/a100/ (BF16 Tensor Core, dense)"
PEAKS = (
    # (part of torch.cuda.get_device_name, dense bf16 TFLOP/s, source): the first match wins
    ("H100 PCIe", 756.0, f"H100 PCIe: 1,513 / 2; {H100}"),
    ("H100 NVL", 835.0, f"H100 NVL: 1,671 / 2; {H100}"),
    ("H100", 989.0, f"H100 SXM ('NVIDIA H100 80GB HBM3'): 1,979 / 2; {H100}"),
    ("H200 NVL", 835.0, f"H200 NVL: 1,671 / 2; {H200}"),
    ("H200", 989.0, f"H200 SXM: 1,979 / 2; {H200}"),
    ("A100", 312.0, f"A100 SXM and PCIe: 312; {A100}"),
)


def peak_for(device_name: str | None) -> tuple[float | None, str]:
    """(dense bf16 TFLOP/s, its source) of the GPU called ``device_name``; (None, why) for a GPU
    not in ``PEAKS`` or a CPU (``device_name`` None)."""
    for part, tflops, source in PEAKS:
        if device_name and part in device_name:
            return tflops, source
    return None, f"no dense bf16 peak known for {device_name or 'a CPU'} (otbflow.training.hardware.PEAKS)"


def device_peak(device) -> float | None:
    """The dense bf16 TFLOP/s of a torch device (None: a CPU or an unknown GPU)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device))[0]


def mfu(parameters: int, tokens: int, seconds: float, peak_tflops: float | None, devices: int = 1) -> float:
    """Model FLOPs utilisation: 6 x parameters x non-pad tokens / seconds / (the peak x devices).
    6 x parameters counts each token's forward and backward matrix products once (attention's
    products over the sequence left out); NaN without a peak."""
    if not peak_tflops or seconds <= 0:
        return float("nan")
    return 6.0 * parameters * tokens / seconds / (peak_tflops * 1e12 * devices)


def parameter_count(model) -> int:
    """The parameters of a causal LM that take part in a token's matrix products: all of them,
    each counted once (a tied output head is the embedding's matrix), less an untied input
    embedding (a lookup); a ZeRO-3 partitioned parameter by its whole size (``ds_numel``)."""
    size = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    total = sum(size(p) for p in model.parameters())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding is not None and head is not None and embedding.weight is not head.weight:
        total -= size(embedding.weight)
    return total
