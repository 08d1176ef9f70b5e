"""Launch configurations of the Triton grouped MoE kernels (moet.kernels.moe_triton), read from
a table in the repository (moe_configs.json beside this file) keyed by device name, expert
format and shape, and by the number of (token, expert) pairs; written by
benchmarks/kernels/tune_moe.py. Shapes or devices the table lacks get the defaults
below (the tuned H200 values of the nearest regime), so every shape runs, tuned or not.

Table layout:
  {"version": 1,
   "devices": {"NVIDIA H200": {"w2 H7168 I2048": {"8": {<MoEConfig>}, "256": {...}, ...}}}}
A lookup for P pairs takes the smallest tuned bucket >= P (the largest if P exceeds them all).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moet.errors import ConfigError
from moet.kernels.launch_tables import read_table

TABLE_PATH = Path(__file__).with_name("moe_configs.json")
# Up to this many pairs the slot alignment is one Triton program (O(P^2) compares, no host
# sync, one launch); above it, the sort-based moe_align_block_size in torch.
SMALL_ALIGN_MAX_PAIRS = 512
# Keys of launch tables written before the token-major and one-launch decodes were deleted (no shipped
# table selected them; docs/kernels.md, MoE): false is what every config means now, true is refused
DELETED_KEYS = ("token_major", "fused")


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """One grouped GEMM launch: BN output rows x BM pairs per program, BKH 16-bit code units
    per K step (8 W2 / 4 FP4 weights each), K split over SPLIT_K programs (fixed-order sum)."""
    BN: int = 64
    BKH: int = 32
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # the K loop unrolled this many times (moe_gemm's UNROLL: one step's activation loads in
    # flight during another's dots); 1 = not unrolled
    unroll: int = 1
    # independent MMA accumulator chains a K step (moe_gemm's CHAINS): 1, or 2 = gate/up: the gate
    # and up dots alternate (the same bits); down: even and odd slots in two accumulators summed
    # after the K loop (other bits)
    chains: int = 1
    # the scale bytes behind an always-taken branch, so Triton packs the MMA operands' K by 2
    # (kWidth 2: activations by ldmatrix, no register moves) instead of the 4 its heuristic takes from
    # the 8-bit scale load (moe_tiles._scale_values); other fp32 sum order. Fewer instructions a K step,
    # but more registers and one shared-memory load per scale byte: a win on some tiles only.
    kwidth2: bool = False

    def __post_init__(self):
        if self.chains not in (1, 2):
            raise ValueError(f"GemmConfig.chains is 1 or 2, got {self.chains}")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    BM: int                 # pairs per tile (tokens padded to this; one slot per tile)
    gate_up: GemmConfig
    down: GemmConfig
    # programmatic dependent launch between the layer's kernels (sm_90+): each kernel's launch
    # overlaps the one before; pays off where the kernels are short (small models at T = 1)
    pdl: bool = False
    # the tiled path with a split gate/up (gate_up.SPLIT_K > 1): its last program per (tile, row
    # block) does the SwiGLU finish, so the layer has one launch fewer (moe_gemm's FUSED_FINISH)
    fused_finish: bool = False
    # decode regime: the top-k combine in the down GEMM's last program per (token, row block), so
    # the layer has one launch fewer (moe_gemm's FUSED_COMBINE)
    fused_combine: bool = False
    # under PDL (pdl=True, the tiled path): each down program prefetches its weight slab into L2
    # before it waits for the gate/up kernel, so the down's DRAM reads overlap gate/up's tail
    # (moe_gemm's PREFETCH); the same bits
    down_prefetch: bool = False
    # with down_prefetch: only the first this many K steps of each down program's slab (0 = all of it)
    down_prefetch_steps: int = 0

    def __post_init__(self):
        if self.down_prefetch_steps < 0:       # (without down_prefetch it is unused)
            raise ValueError(f"MoEConfig.down_prefetch_steps is >= 0 (0: the whole slab), got {self.down_prefetch_steps}")
        if self.down_prefetch and not self.pdl:
            raise ValueError("MoEConfig.down_prefetch prefetches before the PDL wait: it needs pdl=True")

    def to_json(self) -> dict:
        d = {"BM": self.BM, "gate_up": asdict(self.gate_up), "down": asdict(self.down)}
        if self.pdl:
            d["pdl"] = True
        if self.fused_finish:
            d["fused_finish"] = True
        if self.fused_combine:
            d["fused_combine"] = True
        if self.down_prefetch:
            d["down_prefetch"] = True
        if self.down_prefetch_steps:
            d["down_prefetch_steps"] = self.down_prefetch_steps
        return d

    @staticmethod
    def from_json(d: dict) -> "MoEConfig":
        gone = [k for k in DELETED_KEYS if d.get(k)]
        if gone:
            raise ConfigError(f"MoE launch table entry {d} asks for MoEConfig.{gone[0]}, a decode path moet no longer "
                              "has (docs/kernels.md, MoE); re-tune the table or drop the key")
        return MoEConfig(int(d["BM"]), GemmConfig(**d["gate_up"]), GemmConfig(**d["down"]), bool(d.get("pdl", False)),
                         bool(d.get("fused_finish", False)), bool(d.get("fused_combine", False)),
                         bool(d.get("down_prefetch", False)), int(d.get("down_prefetch_steps", 0)))


def default_config(num_pairs: int) -> MoEConfig:
    """The H200 tuning's winners (benchmarks/kernels/tune_moe.py; docs/kernels.md, MoE): decode one-pair tiles,
    gate/up split in two (the best or close to it across the three model shapes and both formats
    at T = 1), prefill the prefill sweep's winner."""
    if num_pairs <= SMALL_ALIGN_MAX_PAIRS:     # decode: few tokens per expert, stream the weights
        return MoEConfig(1, GemmConfig(32, 32, 2, 2, 4), GemmConfig(32, 32, 1, 2, 4))
    return MoEConfig(64, GemmConfig(64, 16, 1, 4, 3), GemmConfig(128, 32, 1, 8, 3))


def shape_key(fmt: str, hidden: int, inter: int) -> str:
    return f"{fmt} H{hidden} I{inter}"


def load_table(path: str = str(TABLE_PATH)) -> dict:
    return read_table(path)


def lookup(fmt: str, hidden: int, inter: int, num_pairs: int, device_name: str) -> MoEConfig:
    buckets = load_table()["devices"].get(device_name, {}).get(shape_key(fmt, hidden, inter))
    if not buckets:
        return default_config(num_pairs)
    sizes = sorted(int(b) for b in buckets)
    pick = next((b for b in sizes if b >= num_pairs), sizes[-1])
    # a table entry tuned for the other alignment regime would mis-size tiles: keep regimes apart
    if (pick <= SMALL_ALIGN_MAX_PAIRS) != (num_pairs <= SMALL_ALIGN_MAX_PAIRS):
        same = [b for b in sizes if (b <= SMALL_ALIGN_MAX_PAIRS) == (num_pairs <= SMALL_ALIGN_MAX_PAIRS)]
        if not same:
            return default_config(num_pairs)
        pick = next((b for b in same if b >= num_pairs), same[-1])
    return MoEConfig.from_json(buckets[str(pick)])
