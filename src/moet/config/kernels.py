"""KernelConfig: how an engine step runs on the GPU: CUDA graphs, the shared experts' second
stream, kernels compiled at start-up, the attention merge, programmatic dependent launch. None of
them changes what is computed beyond the last bits of some outputs (each knob's doc says which).
`EngineConfig.kernels`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moet.config.knobs import Section, knob


@dataclass(frozen=True)
class KernelConfig(Section):
    title: ClassVar[str] = "kernels (how steps run on the GPU: CUDA graphs, streams, launches)"
    about: ClassVar[str] = ("Change these to debug or profile; the defaults are the fast path. From Python: "
                            "`EngineConfig.kernels` (`KernelConfig`).")

    enforce_eager: bool = knob(
        False, "no CUDA graphs (slower; for debugging)", common=True,
        doc="Decode steps normally replay CUDA graphs captured at start-up. Eager mode starts faster and is "
            "easier to profile and debug, and decodes slower.")
    overlap_shared_experts: bool = knob(
        True, "run shared experts on a second CUDA stream",
        doc="On CUDA the shared experts run on a second stream while the routed experts run, CUDA graphs "
            "included. Outputs are bit-identical either way; turn it off to profile the two parts apart.")
    compile_warmup: bool = knob(
        True, "compile kernels before the first request",
        doc="On CUDA, before serving: prefills at token counts 1, 2, 3, 4, 5, 8, 9, ... up to "
            "max_num_batched_tokens and groups of concurrent requests up to max_num_seqs, so Triton compiles "
            "every kernel specialization a step can pick at start-up, not while running streams wait. Costs "
            "start-up time (less with Triton's on-disk cache). Not with the expert store, whose hot set would "
            "learn the warm-up's random prompts. Turn it off for faster start-up in development.")
    attention_fused_merge: bool = knob(
        False, "merge split attention partials in one launch",
        doc="GQA paged decode on CUDA: each sequence's split partials are merged by the split kernel's last "
            "program instead of a second launch. Off by default because it is slower on the GPUs measured "
            "(docs/perf.md); it applies to the whole process once set and may move the last bits of outputs.")
    small_kernel_pdl: bool = knob(
        True, "overlap small kernels' launches (sm_90+)",
        doc="On sm_90 and newer GPUs the small Triton kernels of a step (norms, rotary, KV store, attention "
            "decode and merge, router) launch with programmatic dependent launch: each one's launch overlaps "
            "the kernel before it. Same results, faster decode (docs/perf.md); applies to the whole process "
            "once set. Turn it off to profile kernels one at a time.")
