"""SchedulerConfig: which requests the engine admits and how it batches them into steps: the
longest sequence, the sequences and tokens of one step, chunked prefill, asynchronous steps, the
seed of requests that bring none. `EngineConfig.scheduler`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moet.config.knobs import Section, knob
from moet.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig(Section):
    title: ClassVar[str] = "scheduling"
    about: ClassVar[str] = ("Which requests run, how many at once and how they share an engine step. From Python: "
                            "`EngineConfig.scheduler` (`SchedulerConfig`).")

    max_model_len: int | None = knob(
        None, "longest prompt + output (default: the model's context)", common=True,
        doc="The longest sequence (prompt and output together) the engine accepts. Default: the checkpoint's "
            "max_position_embeddings. Lower it to start on a smaller GPU or when requests are short (the KV "
            "cache must hold at least one sequence of this length); going past the checkpoint's context needs "
            "--allow-long-max-model-len.")
    allow_long_max_model_len: bool = knob(
        False, "allow --max-model-len past the trained context",
        doc="Outputs past the context the checkpoint was trained for (max_position_embeddings) may be wrong. "
            "Set it only for a model whose position encoding is known to extend further.")
    max_num_seqs: int = knob(
        64, "most sequences running at once", common=True,
        doc="The decode batch size limit; CUDA graphs are captured for decode batches of 1, 2, 4, ... up to it. "
            "Raise it for throughput with many clients, lower it to save memory and start-up time.")
    max_num_batched_tokens: int = knob(
        8192, "most tokens one engine step computes", common=True,
        doc="Prefill chunks plus one token per decoding sequence. Larger: faster prefill of long prompts, more "
            "activation memory and longer steps for the streams that wait. With chunked prefill off it must be "
            "at least max_model_len.")
    enable_chunked_prefill: bool = knob(
        True, "split long prompts across engine steps",
        doc="A long prompt is prefilled in chunks that share steps with running decodes, which bounds the "
            "inter-token latency of the other streams. Off: a prompt is prefilled in one step, which then "
            "needs max_num_batched_tokens >= max_model_len.")
    async_scheduling: bool = knob(
        True, "overlap host scheduling with GPU decode",
        doc="Pure decode steps launch before the previous step's tokens reach the host: the sampled ids feed "
            "the next step on the device while the host processes the last one, so the GPU does not wait for "
            "scheduling and output processing. The same tokens as synchronous steps, except that a sequence "
            "stopping on a stop token or string is computed once more and dropped, which can move the last bits "
            "of other rows in batch-variant kernels. Sequences with repetition, frequency or presence penalties, "
            "and the expert store, run synchronously. Turn it off for bit-exact comparisons across batch "
            "compositions.")
    speculative_config: str | None = knob(
        None, "MTP drafts per step, e.g. {\"num_speculative_tokens\": 2}",
        metavar="JSON",
        doc="vLLM's spelling. method mtp: the checkpoint's own multi-token-prediction layer drafts K tokens (1 to "
            "4, chained: each draft feeds the next) after every decode step, and the next step verifies them "
            "in one forward over K + 1 positions per sequence: a draft is kept while the token the request's "
            "own sampling picks at its position equals it, so outputs follow the same distribution as without "
            "speculation (greedy: the same tokens) and each step yields the kept drafts plus one token. Needs "
            "a checkpoint with MTP layers (num_nextn_predict_layers) and --load-mtp; asking for it elsewhere is "
            "an error. From Python a dict works too. Off by default.")
    seed: int = knob(
        0, "sampling seed of requests that give none",
        doc="A request with a seed of its own is reproducible whatever this is. Change it to draw different "
            "samples from one run to the next.")

    @property
    def speculative(self) -> dict | None:
        """The parsed --speculative-config ({"method": "mtp", "num_speculative_tokens": K}), or None."""
        return parse_speculative_config(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per sequence and step (0: no speculative decoding)."""
        spec = self.speculative
        return int(spec["num_speculative_tokens"]) if spec else 0

    def validate(self) -> None:
        super().validate()
        self.speculative
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len={self.max_model_len!r} must be a positive integer or None")
        self._positive_int("max_num_seqs", "max_num_batched_tokens")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                              f"{self.max_num_seqs} (every running sequence decodes one token per step)")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(f"without chunked prefill max_num_batched_tokens={self.max_num_batched_tokens} must be "
                              f">= max_model_len={self.max_model_len}; raise it or enable chunked prefill")


SPECULATIVE_METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 4


def parse_speculative_config(value) -> dict | None:
    """--speculative-config (a JSON object, or a dict from Python) -> {"method", "num_speculative_tokens"},
    None when unset; a ConfigError naming the flag otherwise."""
    import json
    from collections.abc import Mapping

    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"--speculative-config {value!r} is not JSON ({exc}); e.g. "
                              '\'{"method": "mtp", "num_speculative_tokens": 2}\'') from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"--speculative-config must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ConfigError(f"--speculative-config: unknown key {unknown[0]!r} (moet reads method and "
                          "num_speculative_tokens)")
    method = value.get("method", "mtp")
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative-config: method {method!r} is not supported; moet drafts with the "
                          f"checkpoint's own MTP layers: {', '.join(SPECULATIVE_METHODS)}")
    k = value.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"--speculative-config: num_speculative_tokens={k!r} must be an integer in "
                          f"[1, {MAX_SPECULATIVE_TOKENS}]")
    return {"method": method, "num_speculative_tokens": k}
