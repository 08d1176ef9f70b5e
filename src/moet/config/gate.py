"""GateConfig: the FP4 repair tier and the confidence gate (engine/confidence_gate.py). W2 experts
compute every step; an FP4 copy of the routed experts repairs the steps where the model is unsure,
by recomputing the sequence's recent positions with FP4 experts (their KV included) and taking the
token from the repaired logits. `EngineConfig.gate`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moet.config.knobs import Section, knob
from moet.errors import ConfigError


@dataclass(frozen=True)
class GateConfig(Section):
    title: ClassVar[str] = "FP4 repair tier and confidence gate (W2 size, FP4 answers)"
    about: ClassVar[str] = ("With W2 experts, an FP4 copy of the routed experts repairs the decode steps whose "
                            "confidence is low (docs/quality.md has the measured trade-off). From Python: "
                            "`EngineConfig.gate` (`GateConfig`).")

    fp4_gate: bool = knob(
        True, "repair unsure W2 steps with FP4 experts", common=True,
        doc="On (the default) with --expert-format w2: an FP4 pool of the routed "
            "experts is loaded beside the W2 one, prompts run with FP4 experts (--fp4-prefill), and a decode "
            "step whose top token probability is below --gate-tau is recomputed with FP4 experts over its last "
            "--gate-reach positions (their KV rewritten), the token taken from the repaired logits. Bare W2 "
            "answers fluently and wrongly far more often (docs/quality.md). It is off, with one log line saying "
            "why, where it does not apply: fp4 or bf16 experts (nothing to repair), or no room for even a top-k "
            "of FP4 experts per layer. With the expert store the FP4 rows come from a pack of their own "
            "(--fp4-pool-gb). --no-fp4-gate serves bare W2.")
    gate_tau: float = knob(
        0.96, "repair steps whose top probability is below P", metavar="P",
        doc="The confidence threshold, in [0, 1]: a step fires when the W2 logits' largest softmax probability "
            "(at temperature 1, whatever the request samples with) is below it. Higher fires more often and "
            "repairs more; 0 never fires, 1 always does. docs/quality.md shows accuracy against fire rate.")
    gate_reach: int = knob(
        32, "earlier positions a repair recomputes", metavar="N",
        doc="A repair recomputes the fired position and up to N generated positions before it with FP4 experts "
            "and rewrites their KV: a wrong step comes from KV that drifted over the tokens the model wrote "
            "itself, so repairing the fired token alone does not recover multi-step answers (arithmetic). The "
            "prompt's KV stays W2. 0 repairs the fired position only.")
    gate_refresh: int = knob(
        16, "also repair after N unrepaired generated tokens", metavar="N",
        doc="A step also fires when N generated positions have passed since the sequence's KV was last FP4's "
            "(its prompt with --fp4-prefill, or its last repair), however confident: a repair then recomputes "
            "those positions, so W2 drift over a long answer (a scratchpad) is bounded even where every step "
            "looks sure. Short answers never reach it. 0: off. The default and --gate-tau's are the measured "
            "choice that recovers at least 90% of the W2 -> FP4 gap on moet-tiny's arithmetic and facts while "
            "firing on at most 30% of decode steps (docs/quality.md).")
    fp4_prefill: bool = knob(
        True, "compute prompts with the FP4 experts",
        doc="With the gate on, prompt tokens (prefill, chunked or not) run with FP4 experts, so the prompt's KV "
            "is FP4's; generated tokens run W2 and the gate repairs them. A W2 prompt caps what decode repairs "
            "can recover on questions answered from the prompt (docs/quality.md); a prefill reads each expert "
            "once per chunk, so FP4 there costs little beside decode. --no-fp4-prefill keeps prompts W2.")
    fp4_pool_gb: str = knob(
        "auto", "FP4 repair pool in GiB (0: off)", metavar="GIB",
        doc="auto: the FP4 copy of every routed expert when it fits in what the weights leave free, else as many "
            "FP4 slots per MoE layer as fit. A number: that much GPU memory for FP4 slots. With fewer slots than "
            "experts, every expert's FP4 rows wait in host memory and the experts repairs route to most move in "
            "(a bounded number per repair), the others repair with their W2 rows; the FP4 pool hit rate in the "
            "engine stats says how often a repaired pair found its FP4 row. With the expert store (W2 experts "
            "paged from their pack) the FP4 rows have a pack of their own beside it and move disk -> host arena "
            "-> GPU like the W2 rows; auto then gives the FP4 pool a quarter of the room the dense weights leave, "
            "the W2 cache the rest. A size that holds fewer experts per layer than a token routes to, or more "
            "than fits, is refused. 0 turns the tier off, like --no-fp4-gate.")

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.gate_tau, (int, float)) or isinstance(self.gate_tau, bool) \
                or not 0.0 <= self.gate_tau <= 1.0:
            raise ConfigError(f"gate_tau={self.gate_tau!r} must be a probability in [0, 1] (--gate-tau)")
        for name in ("gate_reach", "gate_refresh"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{name}={v!r} must be an integer >= 0 (--{name.replace('_', '-')})")
        self.fp4_pool_bytes        # parses fp4_pool_gb

    @property
    def fp4_pool_bytes(self) -> int | None:
        """fp4_pool_gb in bytes; None for auto."""
        text = str(self.fp4_pool_gb).strip().lower()
        if text == "auto":
            return None
        try:
            gb = float(text)
        except ValueError:
            gb = -1.0
        if not gb >= 0 or gb == float("inf"):
            raise ConfigError(f"fp4_pool_gb={self.fp4_pool_gb!r} must be auto, 0 (off) or a size in GiB "
                              "(--fp4-pool-gb)")
        return int(gb * (1 << 30))

    @property
    def wants_tier(self) -> bool:
        """The gate is asked for: on, and a pool size other than 0."""
        return self.fp4_gate and self.fp4_pool_bytes != 0
