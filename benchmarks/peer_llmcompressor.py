"""The llm-compressor side of `make bench-peers`. Runs in its own virtual environment (.venv-peers) and never
imports ptq: it reads the model directory and the calibration token windows that benchmarks.bench_peers prepared,
runs llm-compressor's FP8 static per-tensor scheme, writes its compressed-tensors checkpoint, and leaves
its timings in timing.json next to it.

    .venv-peers/bin/python benchmarks/peer_llmcompressor.py MODEL_DIR WINDOWS.safetensors OUT_DIR [--batch-size 4]

Timed: `oneshot` (calibration and quantization in memory), then `save_pretrained(save_compressed=True)`
(writing the checkpoint). Not timed: loading the model and building the dataset object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("windows", help="safetensors file with input_ids [n_windows, seq_len]")
    parser.add_argument("out_dir")
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    out = Path(args.out_dir)

    start = time.perf_counter()
    # float32, like ptq: the same arithmetic on both sides, and scales computed (and stored) in float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    load_s = time.perf_counter() - start
    ids = load_file(args.windows)["input_ids"]
    # Already tokenized: llm-compressor uses an input_ids column as it is (no tokenization, no truncation
    # below max_seq_length); every window has the same length, so batches need no padding.
    dataset = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )

    # The "FP8" preset: E4M3 weights with a static per-tensor scale, E4M3 inputs with a static per-tensor
    # scale from a running min/max over the calibration data ("static_minmax"); lm_head left out, as in ptq.
    recipe = QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"])
    start = time.perf_counter()
    oneshot(
        model=model,
        processor=tokenizer,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        batch_size=args.batch_size,
    )
    quantize_s = time.perf_counter() - start

    start = time.perf_counter()
    model.save_pretrained(out / "checkpoint", save_compressed=True)
    save_s = time.perf_counter() - start

    versions = {
        name: importlib.metadata.version(name)
        for name in ("llmcompressor", "compressed-tensors", "transformers", "torch")
    }
    timing = {
        "load_s": load_s,
        "quantize_s": quantize_s,
        "save_s": save_s,
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "versions": versions,
    }
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")


if __name__ == "__main__":
    main()
