"""Engram in a Hugging Face model: baseline vs Engram on local text, CPU, no download.

Builds a small Llama from a config (`transformers.LlamaConfig`), trains a byte-level BPE
tokenizer on the interpreter's standard-library source, then trains two copies of the
same initial model on exactly the same batches:

* baseline: the Llama as is;
* engram: the same Llama with `add_engram` at decoder layer 1 (2- and 3-grams).

It prints the validation loss of both at matched steps and saves the curves as a PNG.
Run:  python examples/hf_engram.py [--steps 300] [--out hf-engram-example]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from condmem import EngramConfig
from condmem.integrations.transformers import add_engram, engram_optimizer
from condmem.tokenizer import CompressedTokenizer
from condmem.train.bpe import EOS, PAD, train_bpe
from condmem.train.data import TokenStream, encode_documents, load_corpus, split_corpus


def evaluate(model, batches) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(b.inputs).logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), b.targets.flatten(), reduction="sum").item()
            count += b.targets.numel()
    model.train()
    return total / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps per model")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-windows", type=int, default=64, help="validation windows, spread over the split")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size (stdlib source, sorted by path)")
    p.add_argument("--out", default="hf-engram-example")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus("stdlib", max_bytes=args.max_bytes)
    train_docs, val_docs = split_corpus(corpus, val_fraction=0.05)
    tok = train_bpe((d.text for d in train_docs), vocab_size=2048)
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    train = TokenStream(encode_documents(tok, train_docs, eos), eos)
    val = TokenStream(encode_documents(tok, val_docs, eos), eos)
    val_batches = list(
        val.eval_batches(args.seq_len, max_tokens=args.val_windows * args.seq_len, batch_size=args.batch)
    )

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        pad_token_id=pad,
        bos_token_id=None,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    baseline = LlamaForCausalLM(config)
    engram = copy.deepcopy(baseline)  # the same initial backbone
    ctok = CompressedTokenizer(tok)
    add_engram(
        engram,
        EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=4, head_dim=16, table_size=20_000, pad_id=pad),
        ctok,
    )
    models = {"baseline": baseline, "engram": engram}
    optimizers = {
        "baseline": torch.optim.AdamW(baseline.parameters(), lr=args.lr, weight_decay=0.0),
        "engram": engram_optimizer(engram, lr=args.lr, max_grad_norm=1.0),  # tables: SparseAdam at 5x lr
    }
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    print(
        f"corpus {sum(len(d.text) for d in corpus.documents) / 1e6:.1f} MB, train {len(train):,} tokens, "
        f"val {sum(b.targets.numel() for b in val_batches):,} tokens scored; V={tok.get_vocab_size()} -> "
        f"V'={ctok.vocab_size}; params {params}"
    )

    curves = {k: [] for k in models}
    start = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            row = {k: evaluate(m, val_batches) for k, m in models.items()}
            for k in models:
                curves[k].append((step, row[k]))
            print(
                f"step {step:5d}  val loss  baseline {row['baseline']:.4f}  engram {row['engram']:.4f}  "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        if step == args.steps:
            break
        batch = train.batch(step, args.batch, args.seq_len)  # the same batch for both models
        for k, model in models.items():
            logits = model(batch.inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten())
            optimizers[k].zero_grad()
            loss.backward()
            if k == "baseline":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizers[k].step()

    base, eng = curves["baseline"][-1][1], curves["engram"][-1][1]
    table = "| steps | baseline val loss | Engram val loss | gap |\n| ---: | ---: | ---: | ---: |\n" + "".join(
        f"| {s} | {b:.4f} | {e:.4f} | {100 * (e - b) / b:+.2f} % |\n"
        for (s, b), (_, e) in zip(curves["baseline"], curves["engram"])
    )
    print(table)
    (out / "summary.json").write_text(
        json.dumps(
            {"curves": curves, "params": params, "args": vars(args), "final": {"baseline": base, "engram": eng}},
            indent=1,
        )
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for k, c in curves.items():
            ax.plot(*np.array(c).T, label=k, marker="o")
        ax.set(xlabel="step", ylabel="validation loss (nats/token)", title="LlamaForCausalLM, with and without Engram")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=120)
        print(f"wrote {out / 'loss.png'}")
    except ImportError:
        print("matplotlib not installed: no PNG (pip install condmem[plot])")


if __name__ == "__main__":
    main()
