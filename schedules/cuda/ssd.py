"""CUDA rule for the SSD kernels, and the CUDA strategy (compute/ssd/strategy.py) it lays templates out with.

Every SSD kernel has one template for every target (tvm_mamba/compute/ssd/): chunk_cumsum(_bwd),
state_passing(_bwd), head_sum, bmm_chunk, chunk_state, chunk_scan, chunk_scan_bwd_dstates, chunk_scan_bwd and
chunk_state_varlen are laid out here by ``Gpu``: blockIdx.x x threadIdx.x of ``threads``, a thread per task and
per lane (dstate element), scratch in registers, CUDA-native exp / log1p. The chunk matmuls (bmm_chunk,
chunk_state, chunk_scan, chunk_scan_bwd_dstates: the strategy's ``scaled_matmul``, ``matmul_rows`` and
``causal_matmul``) are shared-memory tiled blocks with register-blocked outputs (_tiled.py; with 16-bit
operands on tensor cores, _tiled_tc.py). ssd_chunk_scan_bwd takes its non-vector form: a launch per piece,
several launches inside one PrimFunc where a later one reads what an earlier one wrote (launches run in order on
the stream: the backward's cross-position sums without atomics), its products tiled (``product``: _tiled.py
``tiled_product``; the per-position dots as row dots of dx's and dC's tiles), its d dt / d dA_step pass a
block per (batch, chunk, head) (``crossing_pass``: _crossing.py). docs/ssd.md.
Selected by capability (``"gpu" in target.keys``). Knobs: ``threads`` per block (64 / 128 / 256) and, for the
tiled kernels, ``tile`` (the largest output tile side, ``TILE_CAP``); defaults in ``TILED``.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...compute import ssd as compute
from ...compute.ssd.strategy import ChunkStrategy, causal_end
from ..rule import Decisions, schedule_of
from ._crossing import band_within, crossing_pass
from ._strategy import CUDA_SHARED_BYTES, GpuCaps, GpuLoops
from ._tiled import K_SLICE, TILE_CAP, Tiling, product_floats, tiled_causal, tiled_matmul, tiled_product
from ._tc_product import tc_product
from ._tiled_tc import TC, TcTiling, tc_causal, tc_matmul


# the tiled kernels' default (threads, tile): the largest tile whose register block stays well below ptxas's
# 255 (chunk_scan's carry / weight address math takes ~60 registers more than a plain product: at tile 128 it
# reached 255)
TILED = {"bmm_chunk": (256, 128), "chunk_state": (128, 128), "chunk_scan_bwd_dstates": (128, 128),
         "chunk_scan": (256, 64), "chunk_scan_bwd": (256, 128)}
# the chunk products, on tensor cores when their operands are 16-bit (``tensor_core_dtype``)
TENSOR_CORES = ("bmm_chunk", "chunk_state", "chunk_scan_bwd_dstates", "chunk_scan", "chunk_scan_bwd")


class Gpu(GpuLoops, ChunkStrategy):
    """blockIdx.x x threadIdx.x of ``threads``, a task per lane, scratch in registers, native math; a block's
    staged operands within ``shared_bytes`` (the products' k-slices, the crossing pass's bands)."""

    def __init__(self, threads: int = 128, tile: int = 64, tensor_cores: str | None = None, libm: bool = True,
                 shared_bytes: int = CUDA_SHARED_BYTES):
        super().__init__(native_math=True, threads=threads, scope="local", libm=libm)
        self.tile, self.tc, self.shared_bytes = tile, tensor_cores, shared_bytes

    def scaled_matmul(self, M: int, W: int, K: int):
        """A block per output tile, operands staged in shared memory (_tiled.py); on tensor cores with
        ``tensor_cores`` (the 16-bit dtype of the operands) where the sides are multiples of 16."""
        if self.tc and TcTiling.fits(M, W, K):
            return tc_matmul(TcTiling.of(M, W, K, self.threads, self.tile, self.tc), False, False, scaled=True)
        return tiled_matmul(Tiling.of(M, W, K, self.threads, self.tile), k_fast=False, scaled=True)

    def matmul_rows(self, M: int, W: int, K: int, lower: bool = False):
        """As ``scaled_matmul``, both operands copied along k (rows of C and B); ``lower``: the tiles wholly
        above the diagonal skip their product and store 0."""
        if self.tc and TcTiling.fits(M, W, K):
            return tc_matmul(TcTiling.of(M, W, K, self.threads, self.tile, self.tc), True, True, scaled=False,
                             lower=lower)
        return tiled_matmul(Tiling.of(M, W, K, self.threads, self.tile), k_fast=True, scaled=False, lower=lower)

    def visits_lhs(self, M: int, W: int, K: int) -> bool:
        """Yes (strategy.py): the tiles' copies load each lhs element once per tile, the visit runs in a task's
        first column tile (_tiled.py ``operand_at``), on the FMA tiles and on tensor cores alike."""
        return True

    def folds_diagonal(self, M: int, W: int, K: int, strict: bool = False, group: int = 1) -> bool:
        """On the FMA tiles, not strict or grouped (strategy.py): D x then reads no x per output. Not on tensor
        cores, whose weights are rounded to the 16-bit dtype (D would be too)."""
        return not strict and group == 1 and not (self.tc and TcTiling.fits(M, W, K))

    def causal_matmul(self, M: int, W: int, K: int, strict: bool = False, group: int = 1):
        """A block per output tile: the carried product and the causal sum staged slice by slice (_tiled.py)."""
        if self.tc and TcTiling.fits(M, W, K) and not strict and group == 1:  # (Mamba-3's: on the FMA tiles)
            return tc_causal(TcTiling.of(M, W, K, self.threads, self.tile, self.tc), causal_end(strict, group))
        return tiled_causal(Tiling.of(M, W, K, self.threads, self.tile), causal_end(strict, group))

    def product(self, M: int, W: int, units: tuple, dots: bool = False):
        """A block per output tile, each segment staged slice by slice (_tiled.py ``tiled_product``); with row
        ``dots`` a tile spans the whole width (its block sums each row's dot), its slices as deep as
        ``shared_bytes`` allows (``_product_tiling``)."""
        if self.tc and TcTiling.fits(M, W, TC) and all(u % TC == 0 for u in units):
            return tc_product(TcTiling.of(M, W, min(units), self.threads, self.tile, self.tc, full_width=dots), units)
        return tiled_product(self._product_tiling(M, W, units, dots), units)

    def _product_tiling(self, M: int, W: int, units: tuple, dots: bool) -> Tiling:
        """The product's tiling with the deepest k-slice (K_SLICE, K_SLICE / 2, ...) that fits ``shared_bytes``:
        a full-width tile stages KT x W floats of the right operand (dC at dstate 256: 32 x 256 = 32 KB, over
        WebGPU's 16 KB; 8-deep slices take 8 KB), the same products in more rounds (the sums' order unchanged)."""
        slices = [K_SLICE >> i for i in range(K_SLICE.bit_length())]
        tilings = [Tiling.of(M, W, min(units), self.threads, self.tile, full_width=dots, k_slice=ks) for ks in slices]
        return next((tl for tl in tilings if 4 * product_floats(tl, units) <= self.shared_bytes), tilings[-1])

    def crossing_pass(self, Q: int, P: int, start):
        """A block per task, a thread per column of the chunk, bands of rows that fit ``shared_bytes``
        (_crossing.py)."""
        return crossing_pass(Q, P, start, band_within(Q, P, self.shared_bytes))



def tensor_core_dtype(dims) -> str | None:
    """The 16-bit dtype a kernel's chunk-matmul operands come in (x and B / C alike), or None: tensor cores
    take them rounded to it (the forward's products in that dtype, as upstream's kernels)."""
    dtypes = {getattr(dims, f) for f in ("x_dtype", "bc_dtype") if hasattr(dims, f)}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {"bfloat16", "float16"} else None


def template(direction: str, dims, threads: int = 128, serial: bool = False, tile: int = 64,
             tensor_cores: bool = True, libm: bool = True, shared_bytes: int = CUDA_SHARED_BYTES):
    """The CUDA layout of kernel ``ssd_<direction>`` (serial=True: thread loops made serial, CUDA's math: for CPU
    tests); a block's shared memory within ``shared_bytes``."""
    tc = tensor_core_dtype(dims) if tensor_cores and direction in TENSOR_CORES else None
    strategy = ChunkStrategy(native_math=True) if serial else Gpu(threads, tile, tc, libm, shared_bytes)
    return compute.TEMPLATES[direction](dims, strategy)


# the tile cap a small shared-memory budget takes: two staged 32-deep operand slices of a 32-wide tile,
# 8.4 KB (a 64 tile's 16.6 KB is over WebGPU's default 16 KB of workgroup memory)
SMALL_TILE = 32


def lay_out(direction: str, dims, target, decisions: Decisions):
    """The GPU layout of an SSD kernel, or None for another kernel or target. Chosen by the target's
    capabilities (GpuCaps): tiles that fit its shared memory (a small budget also thins the backward's
    full-width k-slices and crossing bands: ``Gpu``), tensor cores where it has them, WGSL's math where it has
    no libm."""
    if "gpu" not in target.keys or direction not in compute.TEMPLATES:
        return None
    caps = GpuCaps.of(target)
    dims = caps.storable(dims)  # 32-bit buffers where the target has no others (WebGPU)
    threads, tile = TILED.get(direction, (128, 64))
    threads = decisions.pick("threads", (64, 128, 256), min(threads, caps.max_threads))
    if caps.shared_bytes < CUDA_SHARED_BYTES:
        tile = min(tile, SMALL_TILE)
    tile = decisions.pick("tile", TILE_CAP, tile) if direction in TILED else tile
    tc = bool(decisions.pick("tensor_cores", (0, 1), 1)) if direction in TENSOR_CORES and caps.tensor_cores else False
    return schedule_of(template(direction, dims, threads, tile=tile, tensor_cores=tc, libm=caps.libm,
                                shared_bytes=caps.shared_bytes),
                       f"ssd_{direction}")
