"""torch tensors <-> RawTensor wire frames, without copies where the memory layout allows."""

import torch

from shared.wire import RawTensor, WireError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
WIRE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def to_raw(tensor: torch.Tensor) -> RawTensor:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in WIRE_NAMES:
        raise WireError(f"tensor dtype {tensor.dtype} cannot travel")
    data = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
    return RawTensor(WIRE_NAMES[tensor.dtype], tuple(tensor.shape), memoryview(data).cast("B") if len(data) else b"")


def from_raw(raw: RawTensor) -> torch.Tensor:
    dtype = TORCH_DTYPES[raw.dtype]
    buffer = memoryview(raw.data).cast("B")
    if len(buffer) == 0:
        return torch.zeros(raw.shape, dtype=dtype)
    return torch.frombuffer(bytearray(buffer) if buffer.readonly else buffer, dtype=dtype).view(raw.shape)
