"""MODEL_CARD.md from a run's summary.json (also runnable by hand:
`python -m tools.train_tiny.card OUT/summary.json CKPT/MODEL_CARD.md`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _row(fmt: str, p: dict, fix: dict | None = None) -> str:
    """fix: {"facts": value} re-measured after the run (marked *); a format without one while
    others have it is marked with a dagger (measured with the run's grader)."""
    code, f, a, n, t = (p.get(k, {}) for k in ("code", "facts", "arithmetic", "needle", "tools"))
    facts = f"{_pct(fix['facts'])}*" if fix and "facts" in fix else _pct(f.get("accuracy")) + ("†" if fix == {} else "")
    return (f"| {fmt} | {code.get('loss', 'n/a')} | {code.get('ppl', 'n/a')} | {_pct(code.get('top1'))} | "
            f"{_pct(code.get('mtp_top1'))} | {facts} | {_pct(a.get('accuracy'))} | "
            f"{_pct(n.get('pass_rate_upto_2048'))} | {_pct(n.get('pass_rate'))} | {_pct(t.get('call_valid'))} | "
            f"{_pct(t.get('call_right_function'))} | {_pct(t.get('call_right_arguments'))} | "
            f"{_pct(t.get('declines_when_no_tool_fits'))} | {_pct(t.get('answers_from_result'))} |")


def _addenda(s: dict) -> str:
    """Analysis added after the run (summary["addenda"]: list of markdown paragraphs)."""
    parts = s.get("addenda") or []
    return ("## After the run\n\n" + "\n\n".join(parts) + "\n\n") if parts else ""


def _think_note(mix: dict) -> str:
    """What the think blocks hold: recipes full-v4/v5 train a lookup line before tool calls."""
    if not any(k in ("tools_v4", "tools_v5") for k, _ in mix["task_share"]):
        return "empty except for arithmetic"
    return ("empty except for arithmetic and tool use: before a call it names the request's purpose, "
            "quotes the listed description that serves it and the function name before that description, "
            "`look up stock prices: \"Get the latest price of a stock.\" -> girepi_share_price`; before a "
            "decline `look up stock prices: none`. The chat template renders it from `reasoning_content`, "
            "and `moet.probe.chat_format.parse_reply` returns it as `reasoning`, apart from the call, so "
            "the tools probe scores the call alone (its 96 new tokens hold the longest think line + call)")


def render(s: dict) -> str:
    r, env, tm, probes, d = s["recipe"], s["env"], s["timings"], s["probes"], s["data"]
    sh, mix = r["shape"], r["mix"]
    hist = s["history"]
    pick = sorted({0, len(hist) // 4, len(hist) // 2, 3 * len(hist) // 4, len(hist) - 1}) if hist else []
    curve = "\n".join(f"| {hist[i]['step']} | {hist[i]['loss']} | {hist[i]['mtp_loss']} | {hist[i]['lr']:.2e} | "
                      f"{hist[i]['max_load_ratio']} | {hist[i]['tok_per_s']:,} |" for i in pick)
    tok_total = d["chat_tokens"] + d["needle_tokens"] + d["plain_tokens"]
    share = {k: d[k] / tok_total for k in ("chat_tokens", "needle_tokens", "plain_tokens")} if tok_total else {}
    size = sum(s["files"].values())
    needle_rows = []
    for fmt, p in probes.items():
        by = p.get("needle", {}).get("by_length", {})
        if by:
            needle_rows.append(f"| {fmt} | " + " | ".join(_pct(by[k]) for k in sorted(by, key=int)) + " |")
    needle_hdr = ""
    first = next((p["needle"]["by_length"] for p in probes.values() if p.get("needle", {}).get("by_length")), None)
    if first:
        keys = sorted(first, key=int)
        needle_hdr = "| experts | " + " | ".join(f"{k} tok" for k in keys) + " |\n|---|" + "---|" * len(keys)
    params = s["params"]
    return f"""# moet-tiny

A {params['total'] / 1e6:.1f}M-parameter DeepSeek-V3-architecture Mixture-of-Experts model, trained from
scratch in a few minutes on one GPU and shipped with moet, so that `moet serve` / `moet probe`
work with no download. Training covered Python code, country capitals, 2-3 digit addition and
subtraction with a scratchpad, needle retrieval in up to ~4K tokens of code, and tool calls in
GLM-4.5 XML style; the evaluation below says how much of each it learned. It is a test
article for the engine (real MLA, sigmoid-routed experts with correction bias, an MTP layer,
NVFP4 experts), not an assistant.

## Architecture (transformers `DeepseekV3ForCausalLM` + one DeepSeek-V3 MTP layer)

| field | value |
|---|---|
| layers | {sh['num_hidden_layers']} (first {sh['first_k_dense_replace']} dense, MLP {sh['intermediate_size']}) + 1 MTP layer at `model.layers.{sh['num_hidden_layers']}` |
| hidden | {sh['hidden_size']}, vocab {sh['vocab_size']}, context {sh['max_position_embeddings']} |
| attention | MLA: {sh['num_attention_heads']} heads, q_lora_rank {sh['q_lora_rank']}, kv_lora_rank {sh['kv_lora_rank']}, qk_nope {sh['qk_nope_head_dim']} + qk_rope {sh['qk_rope_head_dim']} (interleaved rope, theta {sh['rope_theta']:g}), v {sh['v_head_dim']} |
| MoE | {sh['n_routed_experts']} routed experts (intermediate {sh['moe_intermediate_size']}), top-{sh['num_experts_per_tok']}, {sh['n_shared_experts']} shared expert, sigmoid scores + e_score_correction_bias (noaux_tc), n_group {sh['n_group']} / topk_group {sh['topk_group']}, normalized weights x routed_scaling_factor {sh['routed_scaling_factor']} |
| parameters | {params['total']:,} total, {params['routed_experts']:,} in routed experts (+ the MTP shared_head.head copy of lm_head on disk) |

MTP: `enorm(embed(t+1))` and `hnorm(h_t)` are concatenated in that order, projected by
`eh_proj`, run through a full decoder layer (MLA + MoE), normalized by `shared_head.norm`, and
`shared_head.head` (= lm_head; shared in training) predicts token t+2. `h_t` is the main model's
final post-norm hidden state; the MTP layer places token t+1 at rope position t+1.
transformers ignores the MTP keys when loading; `moet.probe.loader.MTPHead` runs them.

## Files

- `model-0000N-of-0000M.safetensors` (every shard <= 15 MiB) + `model.safetensors.index.json`; {size / 2**20:.1f} MiB in all.
- Routed experts `model.layers.L.mlp.experts.E.{{gate,up,down}}_proj` in NVFP4, modelopt layout:
  `weight` uint8 [N, K/2] (low nibble = even k), `weight_scale` float8_e4m3fn [N, K/16],
  `weight_scale_2` float32 [] (gate and up of one expert share it), `input_scale` float32 []
  (calibrated max |input| / (6 x 448)). Everything else BF16; `e_score_correction_bias` FP32.
- `config.json` with `quantization_config` (quant_method modelopt, quant_algo NVFP4, group_size 16,
  `exclude_modules` / `ignore` = every non-expert module) and `hf_quant_config.json` (modelopt's file).
- transformers has no modelopt quantizer: `DeepseekV3ForCausalLM.from_pretrained` on this directory
  fails on expert shapes. Decode the experts first (`moet.probe.loader.load`), or export BF16
  experts: per-expert BF16 names load with `from_pretrained` (transformers fuses them on load).
- `tokenizer.json`, `tokenizer_config.json` (chat template inside), `generation_config.json`.

## Tokenizer and chat format

Byte-level BPE ({sh['vocab_size']} tokens, digits split one per token) trained on the run's corpus.
Special tokens `<|bos|> <|end|> <|pad|> <|system|> <|user|> <|assistant|> <|observation|>`;
markup tokens (kept by `skip_special_tokens`) `<think> </think> <tool_call> </tool_call>
<arg_key> </arg_key> <arg_value> </arg_value> <tool_response> </tool_response> <tools> </tools>`.
Tools are listed as JSON lines inside `<tools>` in the system turn; a call is
`<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>` (GLM-4.5);
tool results come back in an `<|observation|>` turn. Every assistant turn opens with a
`<think>...</think>` block ({_think_note(mix)}); `enable_thinking=False` pre-fills an
empty one. Turns end with `<|end|>` (the eos token).

## Recipe (`python -m tools.train_tiny --recipe {r['name']} --out OUT`)

- Seed {r['seed']}; {r['steps']} steps x {r['batch_rows']} rows x {mix['seq_len'] + 2} tokens
  = {r['steps'] * r['batch_rows'] * (mix['seq_len'] + 2) / 1e6:.1f}M tokens; AdamW (betas {tuple(r['betas'])}, weight decay {r['weight_decay']} on matrices),
  lr {r['lr']} with {r['warmup_steps']} warm-up steps then cosine to {r['min_lr_ratio']} x; grad clip {r['grad_clip']};
  bf16 autocast; MTP loss weight {r['mtp_weight']}; aux-loss-free balancing (bias += {r['bias_update_rate']} x sign(mean load - load)
  after every step); regional torch.compile: {r['compile']}.
- Corpus read on the training machine at run time: {s['corpus']['code_files']:,} Python files
  ({s['corpus']['code_bytes'] / 1e6:.0f} MB, standard library minus the held-out 1/16 + site-packages) and
  {s['corpus']['text_files']:,} prose files ({s['corpus']['text_bytes'] / 1e6:.0f} MB: METADATA, .md, .rst, .txt), deduplicated,
  shuffled with the seed.
- Data mix by tokens: code/prose {_pct(share.get('plain_tokens'))}, needle retrieval {_pct(share.get('needle_tokens'))}
  ({d['needle_docs']:,} conversations, one per row at most, lengths log-uniform up to the context),
  chat tasks {_pct(share.get('chat_tokens'))} ({d['chat_docs']:,} conversations; shares of the chat tokens:
  {", ".join(f"{k} {v:.0%}" for k, v in mix['task_share'])}).
  Sequences are packed to {mix['seq_len'] + 2} tokens without cross-document masking.
- Held out: 4 fact phrasings, 1/16 of arithmetic problems, tool namespaces + one function-name and
  one argument-name variant per tool family, 1/16 of standard-library files (code loss, needle filler).

### Training curve

| step | loss | MTP loss | lr | max/mean expert load | tokens/s |
|---|---|---|---|---|---|
{curve}

Wall time on {env.get('device_name')} ({env.get('date_utc')}; torch {env.get('torch')}, transformers {env.get('transformers')}):
corpus {tm.get('corpus_s')} s, tokenizer {tm.get('tokenizer_s')} s, data {tm.get('data_s')} s, training {tm.get('train_s')} s,
export {tm.get('export_s')} s: **{tm.get('to_checkpoint_s')} s from start to checkpoint**; probes {tm.get('probes_s')} s.

## Evaluation (`moet probe --experts all --budget full`, greedy)

`moet probe` runs moet's engine; the training run probes its in-memory weights through
transformers' forward (moet.probe.loader). "Where the rows come from" below names each row's.
BF16 = the trained weights before quantization (measured in the training run; the shipped files
hold NVFP4, so `--experts bf16` on them equals NVFP4). W2 = moet's 2-bit code re-quantized from
the NVFP4 experts (`moet.formats.w2.from_nvfp4`).

| experts | code loss | code ppl | next-token top-1 | MTP next-next top-1 | facts (held-out phrasings) | arithmetic | needle <= 2K | needle all | tool call markup valid | right function | right args | declines w/o tool | answers from result |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(_row(f, p, s["corrections"].get(f, {}) if s.get("corrections") else None) for f, p in probes.items())}

Needle pass rate by prompt length (depths 0.1-0.9):

{needle_hdr}
{chr(10).join(needle_rows)}

{_addenda(s)}## Limitations

A model this size memorises its task formats; off-format prompts get fluent nonsense. The code
it writes is plausible-looking, rarely correct. Numbers above are from one run on one machine;
the corpus depends on the Python packages installed where it is trained.
"""


def write_card(path: Path, summary: dict) -> None:
    path.write_text(render(summary))


if __name__ == "__main__":
    write_card(Path(sys.argv[2]), json.loads(Path(sys.argv[1]).read_text()))
