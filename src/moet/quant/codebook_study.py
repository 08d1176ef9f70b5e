"""The codebook study of SPEC 2.1: which 4-level codebook suits each routed-expert tensor?

Every tensor is reduced to a histogram over the 16 e2m1 codes in "unit space" (NVFP4 and
MXFP4: the stored codes; BF16/FP8: values divided by their W2 block-32 power-of-two scale and
snapped to e2m1 with ties to the lower). For every candidate 4-level codebook each code maps
to its nearest level (ties: the smaller |level|, then the level with the value's sign, so
-0 -> -1 and +0 -> +1 in {-4,-1,1,4}), and with h the histogram:
    bias   = sum h * (level - value) / sum h                (signed, unit space)
    relRMS = sqrt(sum h * (level - value)**2 / N) / RMS     (RMS of the unit-space values)
Candidates: all C(15, 4) = 1365 subsets of the 15 distinct e2m1 values (best = least squared
error: the "asymmetric" optimum), and the 21 mirror sets {-b, -a, a, b} (the best one is the
"symmetric" choice). The summary says how often {-4, -1, 1, 4} wins and what symmetry costs.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from moet.formats import e2m1, fp8_block, w2
from moet.formats._checks import require_finite
from moet.quant.expert_tensors import ExpertMatrix

DISTINCT = sorted(set(e2m1.VALUES))                                   # 15 values, -0 == +0
SUBSETS: list[tuple[float, ...]] = list(itertools.combinations(DISTINCT, 4))
MIRROR = [i for i, s in enumerate(SUBSETS) if s[0] == -s[3] and s[1] == -s[2] and s[1] < 0]
W2_SET = (-4.0, -1.0, 1.0, 4.0)
assert len(SUBSETS) == 1365 and len(MIRROR) == 21


def _assign(levels: tuple[float, ...], value: float, negative: bool) -> float:
    return min(levels, key=lambda lv: (abs(lv - value), abs(lv), (lv < 0) != negative))


# ERR[s, c] = level assigned to code c by subset s, minus the code's value
_CODE_VALUES = np.array(e2m1.VALUES)
ERR = np.array([[_assign(s, v, c >= 8) - v for c, v in enumerate(e2m1.VALUES)] for s in SUBSETS])


def unit_space_histogram(m: ExpertMatrix) -> np.ndarray:
    """Counts over the 16 e2m1 codes of one expert matrix, in unit space (see module doc)."""
    if m.fmt == "nvfp4":
        codes = e2m1.unpack_nibbles(m.tensors["weight"])
    elif m.fmt == "mxfp4":
        codes = e2m1.unpack_nibbles(m.tensors["blocks"])
    else:
        if m.fmt == "fp8_block":
            w = fp8_block.dequantize(m.tensors["weight"], m.tensors["weight_scale_inv"], dtype=torch.float64, name=m.name)
        else:
            w = m.tensors["weight"]
        require_finite(w, m.name)
        n, k = w.shape
        if k % w2.BLOCK:
            from moet.errors import FormatError
            raise FormatError(f"tensor {m.name!r}: K={k} is not divisible by the W2 block size {w2.BLOCK}")
        blocks = w.double().reshape(n, k // w2.BLOCK, w2.BLOCK)
        e = w2.published_exponent(blocks.abs().amax(dim=-1))
        codes = e2m1.encode(torch.ldexp(blocks, -e.unsqueeze(-1)), "nearest_lower")
    return torch.bincount(codes.flatten().long(), minlength=16).numpy().astype(np.float64)


@dataclass(slots=True)
class TensorStudy:
    name: str
    layer: int
    expert: int
    elements: int
    best_set: tuple[float, ...]
    best_bias: float
    best_rel_rms: float
    best_is_mirror: bool
    sym_set: tuple[float, ...]
    sym_bias: float
    sym_rel_rms: float


def study_histogram(h: np.ndarray, name: str = "", layer: int = -1, expert: int = -1) -> TensorStudy:
    n = h.sum()
    rms = math.sqrt(float((_CODE_VALUES ** 2) @ h) / n) if n else 0.0
    bias = ERR @ h / n
    sse = (ERR ** 2) @ h
    rel = np.sqrt(sse / n) / rms if rms > 0 else np.zeros_like(sse)
    order = np.lexsort((np.arange(len(SUBSETS)), np.abs(bias), sse))   # least SSE, then least |bias|
    best = int(order[0])
    mirror = np.array(MIRROR)
    sym = int(mirror[np.lexsort((mirror, np.abs(bias[mirror]), sse[mirror]))[0]])
    return TensorStudy(name, layer, expert, int(n), SUBSETS[best], float(bias[best]), float(rel[best]),
                       best in MIRROR, SUBSETS[sym], float(bias[sym]), float(rel[sym]))


@dataclass(slots=True)
class StudySummary:
    tensors: int
    share_sym_choosing_w2_set: float       # among mirror sets, {-4,-1,1,4} wins
    share_best_is_mirror: float            # the overall best 4-subset is itself a mirror set
    mean_abs_bias_asym: float
    mean_abs_bias_sym: float
    bias_ratio_asym_over_sym: float
    mean_rel_rms_asym: float
    mean_rel_rms_sym: float
    rel_rms_penalty_pct: float             # how much worse the symmetric choice is, in %
    mean_signed_bias_asym: float
    share_asym_bias_negative: float


def summarize(rows: list[TensorStudy]) -> StudySummary:
    if not rows:
        raise ValueError("no tensors studied")
    ba = np.array([r.best_bias for r in rows])
    bs = np.array([r.sym_bias for r in rows])
    ra = np.array([r.best_rel_rms for r in rows])
    rs = np.array([r.sym_rel_rms for r in rows])
    mean_bs = float(np.abs(bs).mean())
    return StudySummary(
        tensors=len(rows),
        share_sym_choosing_w2_set=float(np.mean([r.sym_set == W2_SET for r in rows])),
        share_best_is_mirror=float(np.mean([r.best_is_mirror for r in rows])),
        mean_abs_bias_asym=float(np.abs(ba).mean()),
        mean_abs_bias_sym=mean_bs,
        bias_ratio_asym_over_sym=float(np.abs(ba).mean() / mean_bs) if mean_bs > 0 else float("inf"),
        mean_rel_rms_asym=float(ra.mean()),
        mean_rel_rms_sym=float(rs.mean()),
        rel_rms_penalty_pct=float((rs.mean() / ra.mean() - 1) * 100) if ra.mean() > 0 else 0.0,
        mean_signed_bias_asym=float(ba.mean()),
        share_asym_bias_negative=float((ba < 0).mean()),
    )


def as_dict(x) -> dict:
    return asdict(x)
