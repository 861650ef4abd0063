"""K-quant files without llama.cpp: a numpy quantizer to Q4_K and Q6_K, and a GGUF rewriter that
gives a file Q4_K_M's choice of types, for the int8 path's divergence and speed on K-quants where
this host has no `llama-quantize` (bench/micro/scale_1b_checkpoint.py needs one).

The blocks are GGML's own layouts (gguf-py dequantizes them; main checks that it gives back what was
quantized), but the scales are simpler than llama.cpp's: each sub-block's range (Q4_K: min and max
over 32, Q6_K: largest |w| over 16), not its error-minimizing search, so a weight's error is up to
half a step where llama.cpp's is smaller on average. Both paths of a comparison read the same file,
which is what the divergence measures.

Q4_K_M's choice (llama.cpp's, for a Llama): Q6_K for the output matrix (the tied token_embd when
there is no output.weight) and for attn_v and ffn_down of the layers i < n/8, i >= 7n/8 and every third
between; Q4_K elsewhere. A matrix whose columns are not a multiple of 256 cannot hold a K-quant: it
keeps the source's own type and blocks (llama.cpp would requantize it to Q5_0 or Q8_0). So the
default model (576 columns but ffn_down's 1,536) gets K-quants in ffn_down alone; the 1B-shaped F16
file gets them everywhere.

    python -m bench.micro.scale_1b_kquants SRC.gguf DST.gguf
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import numpy as np

Q4K_BYTES, Q6K_BYTES = 144, 210


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols] (cols % 256 == 0) -> uint8 [rows, cols / 256 * 144]: d, dmin (fp16), 12 bytes of
    6-bit scales and minimums, 128 bytes of nibbles; w ~ d sc_j q - dmin m_j, q in 0..15."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale, mins = (x.max(axis=-1) - lo) / 15.0, -lo
    d, dmin = _f16(scale.max(axis=-1) / 63.0), _f16(mins.max(axis=-1) / 63.0)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.rint((x + (dmin[..., None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.where(step[..., None] > 0, np.clip(q, 0, 15), 0).astype(np.uint8).reshape(rows, -1, 4, 2, 32)
    out = np.zeros((rows, cols // 256, Q4K_BYTES), np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = dmin.astype(np.float16)[..., None].view(np.uint8)
    # scales[j], [j + 4]: sub-block j's scale and minimum (6 bits), their top 2 bits those of j + 4's;
    # scales[j + 8]: j + 4's low 4 bits of each (GGML's get_scale_min_k4)
    out[..., 4:8] = sc[..., :4] | (sc[..., 4:] >> 4) << 6
    out[..., 8:12] = mn[..., :4] | (mn[..., 4:] >> 4) << 6
    out[..., 12:16] = (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4
    out[..., 16:] = (q[..., 0, :] | q[..., 1, :] << 4).reshape(rows, -1, 128)  # 64 weights: 32 bytes
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, cols / 256 * 210]: ql[128], qh[64], int8 scales[16], d (fp16);
    w ~ d sc_i (q - 32), q in 0..63, a scale per 16."""
    rows, cols = w.shape
    x = w.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    scale = np.abs(x).max(axis=-1) / 31.0
    d = _f16(scale.max(axis=-1) / 127.0)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    step = d[..., None] * sc
    q = np.rint(x / np.where(step > 0, step, 1)[..., None])
    q = (np.where(step[..., None] > 0, np.clip(q, -32, 31), 0) + 32).astype(np.uint8)
    q = q.reshape(rows, -1, 2, 4, 32)  # [.., half of 128, quarter, l]: weight 128 h + 32 k + l
    out = np.zeros((rows, cols // 256, Q6K_BYTES), np.uint8)
    ql = np.stack([(q[..., 0, :] & 15) | (q[..., 2, :] & 15) << 4, (q[..., 1, :] & 15) | (q[..., 3, :] & 15) << 4], -2)
    qh = (q[..., 0, :] >> 4) | (q[..., 1, :] >> 4) << 2 | (q[..., 2, :] >> 4) << 4 | (q[..., 3, :] >> 4) << 6
    out[..., :128] = ql.reshape(rows, -1, 128)
    out[..., 128:192] = qh.reshape(rows, -1, 64)
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = d.astype(np.float16)[..., None].view(np.uint8)
    return out.reshape(rows, -1)


def q4_k_m_type(name: str, n_layers: int, has_output: bool) -> str:
    """Q4_K_M's type for a matrix of a Llama: "q6_k" or "q4_k"."""
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return "q6_k"
    m = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$", name)
    if m:
        i = int(m.group(1))
        if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2:
            return "q6_k"
    return "q4_k"


def requantize(src: Path, dst: Path) -> dict:
    """dst: src's fields and tensors, its matrices of whole super-blocks as Q4_K_M would type them,
    written tensor by tensor; {type name: count} of what was written."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    writer = gguf.GGUFWriter(str(dst.with_suffix(".part")), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    plan, counts = [], {}
    for t in reader.tensors:
        cols = int(t.shape[0])
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        kind = q4_k_m_type(t.name, n_layers, has_output) if len(t.shape) == 2 and cols % 256 == 0 else None
        if kind:
            nbytes = rows * cols // 256 * (Q6K_BYTES if kind == "q6_k" else Q4K_BYTES)
            qt = gguf.GGMLQuantizationType[kind.upper()]
            writer.add_tensor_info(t.name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, qt)
        else:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        plan.append((t, kind, rows, cols))
        name = kind or t.tensor_type.name.lower()
        counts[name] = counts.get(name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, kind, rows, cols in plan:
        if kind is None:
            writer.write_tensor_data(np.asarray(t.data))
            continue
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(rows, cols)
        raw = (quantize_q6_k if kind == "q6_k" else quantize_q4_k)(w)
        back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.upper()]).reshape(rows, cols)
        # a weight is within a step of its sub-block (a step: its range / 15 or |max| / 31, scales rounded)
        tol = (np.ptp(w, axis=1, keepdims=True) / 15 if kind == "q4_k" else np.abs(w).max(axis=1, keepdims=True) / 31)
        if not (np.abs(back - w) <= 1.01 * tol + 1e-6).all():
            raise SystemExit(f"{t.name}: the {kind} blocks do not give back the weights")
        writer.write_tensor_data(raw)
    writer.close()
    dst.with_suffix(".part").rename(dst)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args()
    t = time.perf_counter()
    counts = requantize(args.src, args.dst)
    print(f"wrote {args.dst} ({args.dst.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.0f}s: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
