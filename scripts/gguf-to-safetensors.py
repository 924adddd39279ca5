"""Writes a GGUF model as a Hugging Face folder (config, tokenizer, safetensors) that vLLM
loads: the weights are dequantized to float32 by transformers' GGUF reader. Used for the
proxy's test against a real vLLM, so that both engines serve the same SmolLM2.

usage: gguf-to-safetensors.py MODEL.gguf OUT_DIR   (OUT_DIR is replaced only when complete)
"""
import os
import shutil
import sys
import tempfile

from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf, out = sys.argv[1], sys.argv[2]
    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = model.config
    # The weights are written dequantized: the GGUF quantization no longer applies.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    staging = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(os.path.abspath(out)))
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    tied = getattr(config, "tie_word_embeddings", False)
    weights = {
        k: v.detach().contiguous().clone()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(weights, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.rename(staging, out)
    print(f"wrote {out}: {len(weights)} tensors")


if __name__ == "__main__":
    main()
