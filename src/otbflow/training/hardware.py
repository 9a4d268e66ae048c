"""What a step's throughput is measured against: the dense bf16 tensor-core peak of a GPU, by the
name torch gives it (``PEAKS``, each with its source: NVIDIA's datasheets give the figure with 2:4
sparsity, twice the dense one), the model FLOPs of a train step (``matmul_parameters``,
``step_flops``) and its model FLOPs utilisation (``mfu``)."""

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


def matmul_parameters(model) -> tuple[int, int]:
    """(body, head): the parameters of a causal LM that a token's forward multiplies, in the
    transformer body and in the output head. The head is the output embeddings' weight and bias (a
    tied head is the input embedding's matrix: counted here, once); the body is every other
    parameter but the embedding lookups (every ``torch.nn.Embedding``: the input embedding where
    untied, learned position embeddings). A norm's or a bias's parameters count as weights (a
    fraction of a percent). A ZeRO-3 partitioned parameter counts by its whole size (``ds_numel``)."""
    import torch

    size = lambda p: getattr(p, "ds_numel", p.numel())  # noqa: E731
    head_module = model.get_output_embeddings()
    head = {id(p): p for p in head_module.parameters()}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - set(head)
    body = sum(size(p) for p in model.parameters() if id(p) not in head and id(p) not in lookups)
    return body, sum(size(p) for p in head.values())


def step_flops(
    policy: tuple[int, int], tokens: int, response_tokens: int, reference: tuple[int, int] | None = None
) -> float:
    """Model FLOPs of one train step over ``tokens`` non-pad tokens (prompts and responses), of
    which ``response_tokens`` are response tokens, for a policy of ``policy`` = (body, head)
    parameters (``matmul_parameters``) and, with a KL term (``train.kl_coef`` > 0), a reference of
    ``reference`` = (body, head):

    - the policy's forward and backward, 2 + 4 FLOPs per multiplied parameter: the body on every
      token, the head on the response tokens alone (the prompt tokens' logits are never computed);
      6 (body x tokens + head x response tokens);
    - the reference's forward, without gradients: 2 (body x tokens + head x response tokens).

    So 8 per parameter and token with a reference, 6 without, the head on response tokens only.
    Left out: attention's products over the sequence (4 x layers x context x width per token and
    forward: ~1% at a context of 100 tokens at the 0.5B shape), elementwise work (softmax, norms'
    arithmetic, the loss), and the head's forward recomputed in the backward (activation
    checkpointing, ``response_token_stats``): model FLOPs count what the model needs once, not
    what the hardware does again (that is hardware FLOPs utilisation)."""
    body, head = policy
    flops = 6.0 * (body * tokens + head * response_tokens)
    if reference is not None:
        flops += 2.0 * (reference[0] * tokens + reference[1] * response_tokens)
    return flops


def mfu(flops: float, seconds: float, peak_tflops: float | None, devices: int = 1) -> float:
    """Model FLOPs utilisation: a step's model FLOPs (``step_flops``) / seconds / (the peak x
    devices); NaN without a peak."""
    if not peak_tflops or seconds <= 0:
        return float("nan")
    return flops / seconds / (peak_tflops * 1e12 * devices)
