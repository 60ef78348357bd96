"""
lmdx native core (C++/Eigen); use the lmdx package, not this module
"""

from __future__ import annotations

import collections.abc
import typing

import numpy
import numpy.typing

__all__: list[str] = [
    "SINGULAR_PIVOT",
    "Moments",
    "NotPositiveDefiniteError",
    "RegMeanInfo",
    "SolveInfo",
    "bf16_dot_available",
    "compiler",
    "cpu_features",
    "eigen_simd",
    "eigen_version",
    "fisher_average",
    "gram_product",
    "gram_tile",
    "has_openmp",
    "isa",
    "max_threads",
    "measure_bf16_peak_gflops",
    "measure_peak_gflops",
    "profiled",
    "regmean_low_rank_solve",
    "regmean_merge_layer",
    "release_scratch",
    "scratch_bytes",
    "spd_solve",
    "sum_squared_products",
    "weighted_average",
]

class Moments:
    """
    Streaming count, sum and Gram (sum of outer products) in float64.
    """
    @staticmethod
    def from_state(
        *,
        count: typing.SupportsFloat | typing.SupportsIndex,
        sum: numpy.ndarray,
        gram: numpy.ndarray,
        chunk_rows: typing.SupportsInt | typing.SupportsIndex,
    ) -> Moments:
        """
        Rebuild from a saved count, sum (d,) and Gram (d, d), all float64.
        """
    def __init__(
        self,
        *,
        dim: typing.SupportsInt | typing.SupportsIndex,
        chunk_rows: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        An empty accumulator of rows of length dim; chunk_rows rows are packed per block.
        """
    def gram(self) -> numpy.typing.NDArray[numpy.float64]:
        """
        The full symmetric Gram matrix (a new float64 array).
        """
    def merge(self, *, other: Moments) -> None:
        """
        Add another accumulator's statistics (disjoint data): count, sum and Gram add.
        """
    def update(
        self,
        *,
        x: numpy.ndarray,
        weights: numpy.ndarray | None,
        n_threads: typing.SupportsInt | typing.SupportsIndex,
        bfloat16: bool,
        bf16_dot: bool = False,
    ) -> None:
        """
        Add the rows of x (rows, dim) with optional float64 weights (rows,).
        bfloat16: x holds bfloat16 values as their uint16 bit patterns.
        bf16_dot: multiply them with the CPU's bf16 dot product (bf16_dot_available()).
        """
    @property
    def chunk_rows(self) -> int: ...
    @property
    def count(self) -> float: ...
    @property
    def dim(self) -> int: ...
    @property
    def sum(self) -> numpy.typing.NDArray[numpy.float64]: ...

class NotPositiveDefiniteError(ValueError):
    pass

class SolveInfo:
    """
    What the regularized Cholesky solver did.
    """
    def __repr__(self) -> str: ...
    @property
    def attempts(self) -> int:
        """
        Factorizations tried.
        """
    @property
    def escalated(self) -> bool:
        """
        Whether the ridge was raised above the requested one.
        """
    @property
    def max_pivot(self) -> float:
        """
        Largest diagonal entry of L.
        """
    @property
    def mean_diagonal(self) -> float:
        """
        mean(diag(a)).
        """
    @property
    def min_pivot(self) -> float:
        """
        Smallest diagonal entry of L.
        """
    @property
    def rcond_estimate(self) -> float:
        """
        (min_pivot / max_pivot)^2, a rough bound on 1 / cond(a).
        """
    @property
    def ridge(self) -> float:
        """
        Relative ridge finally used.
        """
    @property
    def ridge_absolute(self) -> float:
        """
        ridge * mean(diag(a)).
        """

class RegMeanInfo(SolveInfo):
    """
    What the solver did for one RegMean layer, and in which precision.
    """
    def __repr__(self) -> str: ...
    @property
    def condition_estimate(self) -> float:
        """
        1-norm condition estimate of the system (0: nothing solved).
        """
    @property
    def output_error_estimate(self) -> float:
        """
        Certified relative output error ||W - W_float64||_S / ||W_float64||_S
        of a float32 merge (0: float64 or identical).
        """
    @property
    def phases(self) -> list[str]:
        """
        The phases of the merge in the order first entered: the path it took.
        """
    @property
    def precision(self) -> str:
        """
        'float64', 'float32' (factorization, products and solve) or
        'identical' (equal weights in every model, returned without a solve).
        """
    @property
    def relative_spread(self) -> float:
        """
        max_i max |W_i - mean| / max |mean|.
        """
    @property
    def timings(self) -> dict[str, float]:
        """
        Wall time per phase of the merge in seconds (a benchmark's breakdown), in a
        build with LMDX_PROFILE=ON only (lmdx.config()['profiled']); empty otherwise.
        """
    @property
    def unseen_directions(self) -> int:
        """
        Eigendirections below the statistics' noise floor, kept at the average.
        """

def bf16_dot_available() -> bool:
    """
    Whether this module has the bf16 dot-product Gram kernel and this CPU runs it.
    """

def compiler() -> str:
    """
    The compiler that built this module.
    """

def cpu_features() -> dict[str, bool]:
    """
    CPU features detected at run time (x86-64; all False elsewhere).
    """

def eigen_simd() -> str:
    """
    SIMD instruction sets Eigen was compiled with.
    """

def eigen_version() -> str:
    """
    Version of the Eigen headers compiled in.
    """

def fisher_average(
    *,
    params: collections.abc.Sequence[numpy.ndarray],
    fishers: collections.abc.Sequence[numpy.ndarray],
    coefficients: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None,
    eps: typing.SupportsFloat | typing.SupportsIndex,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
) -> numpy.typing.NDArray[numpy.float64]:
    """
    sum_i c_i (F_i + eps) x_i / sum_i c_i (F_i + eps), element-wise, in float64.
    """

def gram_product(
    *, gram: numpy.ndarray, y: numpy.ndarray, n_threads: typing.SupportsInt | typing.SupportsIndex
) -> numpy.typing.NDArray[numpy.float64]:
    """
    G Y (d, p): G a float64 Gram, full or packed upper (d (d + 1) / 2,).
    """

def gram_tile() -> dict[str, tuple[int, int]]:
    """
    Register tile (rows, columns) of this variant's Gram kernel per precision.
    """

def has_openmp() -> bool:
    """
    Whether the core was built with OpenMP.
    """

def isa() -> str:
    """
    Instruction-set level this module was compiled for.
    """

def max_threads() -> int:
    """
    Threads available to OpenMP (1 without it); every n_threads must be >= 1.
    """

def measure_bf16_peak_gflops(
    *,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
    seconds: typing.SupportsFloat | typing.SupportsIndex,
) -> float:
    """
    GFLOP/s of a register-resident bf16 dot-product loop (0 without the bf16 kernel).
    """

def measure_peak_gflops(
    *,
    double_precision: bool,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
    seconds: typing.SupportsFloat | typing.SupportsIndex,
) -> float:
    """
    GFLOP/s of a register-resident FMA loop on this machine.
    """

def profiled() -> bool:
    """
    Whether the core was built with LMDX_PROFILE (RegMeanInfo.timings filled).
    """

def regmean_low_rank_solve(
    *,
    grams: collections.abc.Sequence[numpy.ndarray],
    factors: collections.abc.Sequence[numpy.ndarray],
    counts: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex],
    alpha: typing.SupportsFloat | typing.SupportsIndex,
    coefficients: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None,
    ridge: typing.SupportsFloat | typing.SupportsIndex,
    allow_regularization: bool,
    name: str,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
) -> tuple[numpy.typing.NDArray[numpy.float64], SolveInfo]:
    """
    RegMean solve of K low-rank updates A_i (r_i, d_in) of one base: returns
    (F float64 (d_in, R), SolveInfo), the merged update being [B_1 .. B_K] F^T.
    """

def regmean_merge_layer(
    *,
    grams: collections.abc.Sequence[numpy.ndarray],
    weights: collections.abc.Sequence[numpy.ndarray],
    counts: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex],
    alpha: typing.SupportsFloat | typing.SupportsIndex,
    coefficients: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None,
    layout: str,
    precision: str,
    noise_floor: typing.SupportsFloat | typing.SupportsIndex,
    ridge: typing.SupportsFloat | typing.SupportsIndex,
    allow_regularization: bool,
    name: str,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
) -> tuple[numpy.typing.NDArray[numpy.float64], RegMeanInfo]:
    """
    RegMean merge of one linear layer; grams full (d, d) or packed upper triangles.
    Returns (merged float64 weight in the layout of the inputs, RegMeanInfo).
    """

def release_scratch() -> None:
    """
    Free the kernels' pooled scratch buffers.
    """

def scratch_bytes() -> int:
    """
    Bytes held by the kernels' scratch pool.
    """

def spd_solve(
    *,
    a: numpy.ndarray,
    b: numpy.ndarray,
    alpha: typing.SupportsFloat | typing.SupportsIndex,
    ridge: typing.SupportsFloat | typing.SupportsIndex,
    allow_regularization: bool,
    name: str,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
) -> tuple[numpy.typing.NDArray[numpy.float64], SolveInfo]:
    """
    Solve (alpha-reduced a + ridge * mean(diag(a)) I) x = b by Cholesky.
    Returns (x of b's shape, SolveInfo).
    """

def sum_squared_products(
    *,
    a: numpy.ndarray,
    b: numpy.ndarray,
    out: numpy.ndarray | None = None,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
) -> numpy.ndarray:
    """
    sum over e of (a_e^T b_e)^2: a (n, t, p), b (n, t, q) -> (p, q), added into out if given.
    """

def weighted_average(
    *,
    tensors: collections.abc.Sequence[numpy.ndarray],
    coefficients: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None,
    n_threads: typing.SupportsInt | typing.SupportsIndex,
    dtype: str = "float64",
) -> numpy.ndarray:
    """
    sum_i c_i x_i / sum_i c_i, element-wise, in float64 (dtype float32: rounded once).
    """

SINGULAR_PIVOT: float = 1e-13
__version__: str = "0.1.0"
