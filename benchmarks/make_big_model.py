"""A randomly initialised Llama of several billion parameters, written straight to disk as sharded bf16
safetensors without ever building the model in memory (one shard of random tensors at a time), for the
out-of-memory demonstration in docs/performance.md.

    python benchmarks/make_big_model.py OUT [--hidden 4096 --intermediate 11008 --layers 32 --vocab 32000]

The default shape is Llama-2-7B's (6.7B parameters: 13.5 GB in bf16, 27 GB in float32). The weights are
N(0, 0.02) like transformers' initialisation and the norms are ones; the tokenizer is a small byte-level BPE
trained on the offline default text (its ids are a subset of the model's vocabulary).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import safetensors.torch
import torch


def tensor_shapes(
    hidden: int, intermediate: int, layers: int, vocab: int, heads: int, kv_heads: int
) -> list[tuple[str, tuple]]:
    """Every tensor of LlamaForCausalLM (untied embeddings), in the order save_pretrained writes them."""
    head_dim = hidden // heads
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (hidden, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"{p}.mlp.gate_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.up_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, intermediate)),
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
        ]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def make_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ptq.evaluation.data import load_corpus

    text = "\n".join(load_corpus(None, role="calibration").documents)[:2_000_000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab, 4096),
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-gb", type=float, default=2.0, help="Largest shard, in GB.")
    args = ap.parse_args()

    from transformers import GenerationConfig, LlamaConfig

    out = args.out
    out.mkdir(parents=True, exist_ok=False)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=0, eos_token_id=1).save_pretrained(out)
    make_tokenizer(out, args.vocab)

    shapes = tensor_shapes(
        args.hidden, args.intermediate, args.layers, args.vocab, args.heads, args.kv_heads
    )
    total = sum(torch.Size(s).numel() for _, s in shapes)
    limit = int(args.shard_gb * 1e9)
    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = torch.Size(shape).numel() * 2
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    start = time.perf_counter()
    for i, group in enumerate(groups, 1):
        filename = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(
                    0.0, 0.02, generator=gen
                )
            weight_map[name] = filename
        safetensors.torch.save_file(tensors, str(out / filename), metadata={"format": "pt"})
        del tensors
        print(
            f"wrote {filename} ({i}/{len(groups)}, {time.perf_counter() - start:.0f} s)", flush=True
        )
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(
        f"{out}: {total:,} parameters, {total * 2 / 1e9:.1f} GB in bf16 ({total * 4 / 2**30:.1f} GiB in float32), "
        f"{len(groups)} shards, {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
