"""Count, sum and Gram of rows accumulated with torch on the rows' own device (a GPU).

The collector's accumulator where the model runs on another torch device than the CPU
(``lmdx stats --device cuda``, ``collect_regmean_stats(..., device=)``), or on the CPU
with ``backend="torch"``: the same statistics as :class:`lmdx.Moments`, computed where the
activations are, so they never cross to the host during the forward passes.

Arithmetic (the statistics file's ``extra["accumulation"]``, :data:`TORCH_ACCUMULATIONS`):

* ``"torch-float32"``: the kept rows, widened to float32 (exact for bfloat16/float16;
  float64 rows are multiplied in float64, as by the core), are
  multiplied by a torch matmul in blocks of :data:`BLOCK_ROWS` rows with every
  reduced-precision mode off (``torch.set_float32_matmul_precision("highest")``: no TF32),
  so each entry of a block is a float32 sum over at most that many rows in the device
  library's order; the blocks are added in float64 on the device.
* ``"float64"``: rows widened to float64 and multiplied in float64.

Sums are float64 sums of the exact values; the count is the number of kept rows. Rows are
kept by a 0/1 mask (padding left out), as in the core. Non-finite values are refused when
the statistics are taken (:meth:`TorchGram.moments`), naming the input group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..moments import Moments

__all__ = ["BLOCK_ROWS", "TORCH_ACCUMULATIONS", "TorchGram", "exact_float32_matmul"]

#: Rows per float32 matmul block before its product is added into the float64 Gram: a
#: float32 sum over at most this many rows (a sequential one, as a device library may
#: compute it, stays within ~5e-7 of float64 at 256 rows; 1,024 rows reached 5e-6).
BLOCK_ROWS = 256

#: The statistics file's accumulation label for each requested accumulation.
TORCH_ACCUMULATIONS = {"mixed": "torch-float32", "float64": "float64"}


@contextlib.contextmanager
def exact_float32_matmul() -> Iterator[None]:
    """torch's float32 matmuls in full float32 (no TF32 or bfloat16 passes) while inside."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class TorchGram:
    """Streaming count, sum and Gram of rows of length ``dim`` on ``device``, in float64.

    Parameters
    ----------
    dim
        Length of each row.
    device
        The torch device the rows arrive on (and the float64 accumulators live on).
    float64
        Multiply in float64 (``accumulation="float64"``) instead of float32 blocks.
    """

    def __init__(self, dim: int, device: Any, *, float64: bool = False) -> None:
        import torch

        self.dim = int(dim)
        self.device = torch.device(device)
        self.float64 = float64
        self._compute = torch.float64 if float64 else torch.float32
        self._gram = torch.zeros(self.dim, self.dim, dtype=torch.float64, device=self.device)
        self._sum = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        self._count = 0

    def update(self, x: Any, keep: Any = None) -> None:
        """Add the rows of ``x`` (a tensor of shape (..., dim) on this device); ``keep``: a
        boolean tensor of one value per row on this device (None: every row)."""
        import torch

        rows = x.detach().reshape(-1, self.dim)
        if keep is not None:
            rows = rows[keep]
        compute = torch.float64 if rows.dtype == torch.float64 else self._compute
        for block in torch.split(rows, BLOCK_ROWS):
            wide = block.to(compute)
            product = wide.T @ wide
            self._gram += product.to(torch.float64)
            self._sum += torch.sum(block, dim=0, dtype=torch.float64)
        self._count += int(rows.shape[0])

    @property
    def count(self) -> float:
        return float(self._count)

    @property
    def sum(self) -> NDArray[np.float64]:
        return np.asarray(self._sum.cpu().numpy(), dtype=np.float64)

    def gram(self) -> NDArray[np.float64]:
        """The symmetric Gram on the host (lower triangle mirrored: the matmul's two
        triangles may differ in the last bit)."""
        import torch

        lower = torch.tril(self._gram)
        return np.asarray((lower + torch.tril(lower, -1).T).cpu().numpy(), dtype=np.float64)

    def check_finite(self, what: str) -> None:
        """Refuse statistics of rows that held NaN or Inf (or overflowed float32)."""
        import torch

        if not bool(torch.isfinite(self._sum).all()) or not bool(
            torch.isfinite(torch.diagonal(self._gram)).all()
        ):
            raise ValueError(
                f"{what}: its input held NaN or Inf (or values whose squares overflow "
                f"{'float64' if self.float64 else 'float32'}); check the model and the data"
            )

    def moments(self, what: str) -> Moments:
        """These statistics as a host :class:`lmdx.Moments` (after :meth:`check_finite`)."""
        self.check_finite(what)
        return Moments.from_state(self.count, self.sum, self.gram())
