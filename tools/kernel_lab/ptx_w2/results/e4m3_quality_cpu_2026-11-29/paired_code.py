"""Paired per-token comparison on the code probe's tokens: W2 experts, bf16 vs e4m3 activations."""
import json, math, sys, time
import torch, torch.nn.functional as F
from moet.probe import code_data
from moet.probe.loader import default_checkpoint, load, read_tensors
from moet.probe.activations import apply_expert_activations

N_TOK, SEQ, B = int(sys.argv[1]), 512, 4
ck = default_checkpoint(); t = read_tensors(ck)
m = load(ck, "w2", "cpu", tensors=t)
tok = m.tokenizer
ids = []
for _, text in code_data.heldout_texts():
    ids += tok.encode(text, add_special_tokens=True) + [tok.eos_token_id]
    if len(ids) >= N_TOK + SEQ: break
n = min(len(ids), N_TOK) // SEQ
x = torch.tensor(ids[: n * SEQ]).view(n, SEQ)
res = {}
with torch.no_grad():
    for act in ("bf16", "e4m3"):
        apply_expert_activations([m.model, m.mtp], act)
        nll, am, lps = [], [], []
        t0 = time.time()
        for b in range(0, n, B):
            xb = x[b:b+B]
            lg = m.model.lm_head(m.model.model(xb).last_hidden_state)[:, :-1].float()
            lp = lg.log_softmax(-1)
            nll.append(-lp.gather(-1, xb[:, 1:, None])[..., 0].flatten())
            am.append(lg.argmax(-1).flatten()); lps.append(lp.flatten(0, 1).to(torch.bfloat16))
        res[act] = (torch.cat(nll), torch.cat(am), torch.cat(lps))
        print(act, "seconds", round(time.time() - t0, 1), flush=True)
(n0, a0, l0), (n1, a1, l1) = res["bf16"], res["e4m3"]
tgt = x[:, 1:].flatten()
d = (n1 - n0).double()
kl = (l0.float().exp() * (l0.float() - l1.float())).sum(-1)
out = {"tokens": int(d.numel()), "loss_bf16act": round(float(n0.mean()), 4), "loss_e4m3act": round(float(n1.mean()), 4),
       "loss_diff": round(float(d.mean()), 5), "loss_diff_se_naive": round(float(d.std() / math.sqrt(d.numel())), 5),
       "loss_diff_se_by_seq": round(float(d.view(n, -1).mean(1).std() / math.sqrt(n)), 5),
       "top1_bf16act": round(float((a0 == tgt).float().mean()), 4), "top1_e4m3act": round(float((a1 == tgt).float().mean()), 4),
       "argmax_agreement": round(float((a0 == a1).float().mean()), 4), "mean_kl_bf16_to_e4m3": round(float(kl.mean()), 5)}
print(json.dumps(out)); json.dump(out, open("/tmp/e4m3q/paired_code.json", "w"), indent=2)
