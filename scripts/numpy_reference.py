"""An independent float64 reference of the llama/qwen2 forward pass, in numpy, reading
the GGUF with llama.cpp's own `gguf` package (its dequantization, not ours).

usage: numpy_reference.py MODEL.gguf < request.json > logprobs.json
request: {"prompt": [ids], "continuation": [ids]}; answer: log p of each continuation
token given the prompt and the tokens before it (teacher forcing).
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main() -> None:
    reader = GGUFReader(sys.argv[1])
    request = json.load(sys.stdin)

    def field(name):
        f = reader.fields[name]
        value = f.parts[f.data[0]]
        return value.tobytes().decode() if value.dtype == np.uint8 else value[0].item()

    arch = field("general.architecture")
    n_layer = field(f"{arch}.block_count")
    n_head = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv")
    eps = field(f"{arch}.attention.layer_norm_rms_epsilon")
    theta = field(f"{arch}.rope.freq_base")
    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        return dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)

    def unpermute(w, heads):
        # llama.cpp's interleaved rope rows back to rotate_half rows.
        rows, cols = w.shape
        return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

    tokens = request["prompt"] + request["continuation"]
    embed = weight("token_embd.weight")
    x = embed[tokens]
    T, C = x.shape
    hd = C // n_head
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    angles = np.outer(np.arange(T), inv_freq)
    cos, sin = np.cos(angles), np.sin(angles)

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def rope(v):  # (T, heads, hd)
        h = hd // 2
        a, b = v[..., :h], v[..., h:]
        return np.concatenate([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], -1)

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rms(x, weight(p + "attn_norm.weight"))
        wq, wk = weight(p + "attn_q.weight"), weight(p + "attn_k.weight")
        if arch == "llama":
            wq, wk = unpermute(wq, n_head), unpermute(wk, n_kv)
        q, k, v = h @ wq.T, h @ wk.T, h @ weight(p + "attn_v.weight").T
        if p + "attn_q.bias" in tensors:
            q += weight(p + "attn_q.bias")
            k += weight(p + "attn_k.bias")
            v += weight(p + "attn_v.bias")
        q = rope(q.reshape(T, n_head, hd))
        k = rope(k.reshape(T, n_kv, hd))
        v = v.reshape(T, n_kv, hd)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", scores, v).reshape(T, C)
        x = x + out @ weight(p + "attn_output.weight").T
        h = rms(x, weight(p + "ffn_norm.weight"))
        g, u = h @ weight(p + "ffn_gate.weight").T, h @ weight(p + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ weight(p + "ffn_down.weight").T
    h = rms(x, weight("output_norm.weight"))
    head = weight("output.weight") if "output.weight" in tensors else embed
    n_prompt = len(request["prompt"])
    logprobs = []
    for i, token in enumerate(request["continuation"]):
        z = h[n_prompt - 1 + i] @ head.T
        z = z - z.max()
        logprobs.append(float(z[token] - np.log(np.exp(z).sum())))
    json.dump(logprobs, sys.stdout)


if __name__ == "__main__":
    main()
