"""The CUDA backend: fp16 (and bf16 from Ampere on), TF32 for matmul and cuDNN, allocator stats.

Every call goes through torch.cuda, so on a machine without a GPU the backend simply
reports itself unavailable.

Example:
    >>> from mpnb.precision.backends.cuda import CudaBackend
    >>> CudaBackend().type
    'cuda'
"""

from __future__ import annotations

import torch

from mpnb.precision.backends.base import Backend, MemorySnapshot
from mpnb.precision.fp32math import fine_grained, probe_reduced_math, set_fine_grained
from mpnb.precision.names import Fp32Math

__all__: list[str] = []

_AMPERE = (8, 0)
#: fp8 tensor cores (torch._scaled_mm): Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x).
_ADA = (8, 9)


def _uses_tf32(legacy_flag, path: str) -> bool:
    try:
        return bool(legacy_flag())
    except RuntimeError:  # the user mixed in fine-grained settings: read those instead
        return fine_grained(path) == "tf32"


class CudaBackend(Backend):
    """NVIDIA GPUs through torch.cuda."""

    type = "cuda"
    label = "CUDA GPU"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.cuda is None:
            return "no CUDA GPU: this torch is a CPU-only build"
        return "no CUDA GPU visible to torch"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_available() else 0

    def autocast_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return ()
        return (
            (torch.bfloat16, torch.float16) if torch.cuda.is_bf16_supported() else (torch.float16,)
        )

    def dtype_warnings(self, dtype: torch.dtype) -> list[str]:
        if (
            dtype == torch.bfloat16
            and self.is_available()
            and torch.cuda.get_device_capability() < _AMPERE
        ):
            return ["bf16 on a pre-Ampere GPU runs without bf16 tensor cores: expect no speed-up."]
        return []

    def memory(self, index: int | None = None) -> MemorySnapshot:
        if not self.is_available():
            return super().memory(index)
        return MemorySnapshot(
            source="torch.cuda caching allocator",
            used=torch.cuda.memory_allocated(index),
            peak=torch.cuda.max_memory_allocated(index),
            reserved=torch.cuda.memory_reserved(index),
            limit=torch.cuda.get_device_properties(index or 0).total_memory,
        )

    def reset_peak_memory(self, index: int | None = None) -> bool:
        if not self.is_available():
            return False
        torch.cuda.reset_peak_memory_stats(index)
        return True

    def release_cached_memory(self) -> None:
        if self.is_available():
            torch.cuda.empty_cache()

    def capabilities(self) -> dict[str, object]:
        if not self.is_available():
            return {}
        major, minor = torch.cuda.get_device_capability()
        return {
            "name": torch.cuda.get_device_name(),
            "count": torch.cuda.device_count(),
            "compute_capability": f"{major}.{minor}",
            "bf16": torch.cuda.is_bf16_supported(),
            "tf32": (major, minor) >= _AMPERE,
            "fp8": (major, minor) >= _ADA,
        }

    def has_fast_fp32_math(self) -> bool:
        """Ampere or newer, and TF32 measurably changes a matmul on the current GPU."""
        if not self.is_available() or torch.cuda.get_device_capability() < _AMPERE:
            return False
        return probe_reduced_math(
            self, torch.device("cuda", torch.cuda.current_device())
        ).has_effect

    def apply_fp32_math(self, level: Fp32Math, legacy: bool = True) -> None:
        reduced = level is Fp32Math.REDUCED
        if legacy:
            # Not matmul.allow_tf32: that setter leaves CUDA and oneDNN disagreeing, after
            # which torch.get_float32_matmul_precision() raises.
            torch.set_float32_matmul_precision("high" if reduced else "highest")
        else:
            set_fine_grained({"cuda.matmul": "tf32" if reduced else "ieee"})
        # The cuDNN flag stays legacy in both cases: a fine-grained conv value that differs
        # from the rnn one makes cudnn.allow_tf32 raise.
        torch.backends.cudnn.allow_tf32 = reduced

    def describe_fp32_math(self) -> str:
        matmul = (
            "TF32"
            if _uses_tf32(lambda: torch.backends.cuda.matmul.allow_tf32, "cuda.matmul")
            else "exact fp32"
        )
        conv = (
            "TF32"
            if _uses_tf32(lambda: torch.backends.cudnn.allow_tf32, "cudnn.conv")
            else "exact fp32"
        )
        text = f"matmuls: {matmul}; cuDNN convolutions: {conv}."
        if (
            (matmul == "TF32" or conv == "TF32")
            and self.is_available()
            and not self.has_fast_fp32_math()
        ):
            text += " This GPU predates Ampere and has no TF32 units, so it computes in full fp32 anyway."
        elif conv == "TF32" and matmul != "TF32":
            text += " (torch allows TF32 convolutions by default.)"
        return text
