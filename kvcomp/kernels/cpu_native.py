"""A fused C kernel for quantized decode attention on the CPU, compiled on first use.

Torch on a CPU runs a decode step's attention as a series of passes over memory (unpack, convert, scale,
matmul); over a quantized cache that costs more than plain attention over the float cache, which is why
KIVI-style implementations are often *slower* than no compression on CPUs. This kernel does what the Triton
kernel does on a GPU: one pass over the packed codes per (row, KV head), dequantizing in registers, the
query group sharing every byte read (logits of all query rows, one softmax, then values).

It is compiled with the system C compiler (``$CC``, default ``cc``) into ``$KVCOMP_CACHE/kernels`` the first
time it is needed (about a second) and loaded with ctypes. Float32 CPU tensors only; anything else, no
compiler, or ``KVCOMP_NATIVE=0`` falls back to :func:`kvcomp.kernels.quant_cpu.quant_attention`. Same
signature and result as :func:`kvcomp.kernels.quant_ref.quant_attention`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* One token's codes as floats in plane-major order: column p * W + j holds channel j * P + p (code p of byte
   j), so every loop is contiguous and vectorises. */
static inline void unpack_planes(const uint8_t* src, int64_t w, int bits, float* dst) {
    const int per_byte = 8 / bits, mask = (1 << bits) - 1;
    for (int p = 0; p < per_byte; p++) {
        const int shift = p * bits;
        float* o = dst + p * w;
        for (int64_t j = 0; j < w; j++) o[j] = (float)((src[j] >> shift) & mask);
    }
}

static inline float dot(const float* a, const float* b, int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* q [BH, M, D] (row m is query m % n); qpos [B, n]; kc, vc [BH, L, W]; ks, kz [BH, L / G, D]; vs, vz [BH, L, J];
   pos [BH, L]; rk, rv [BH, R, D]; rpos [BH, R]; out [BH, M, D]; logits [BH, M, L + R]; work [BH, 2 * M * D + D].
   Needs D % P == 0 and (D / J) % P == 0 (P = 8 / bits codes per byte). */
void quant_attention_f32(const float* q, const int64_t* qpos, const uint8_t* kc, const float* ks, const float* kz,
                         const uint8_t* vc, const float* vs, const float* vz, const int32_t* pos,
                         const float* rk, const float* rv, const int32_t* rpos, float* out, float* logits,
                         float* work, int64_t B, int64_t H, int64_t M, int64_t n, int64_t L, int64_t G,
                         int64_t R, int64_t D, int64_t J, int64_t W, int bits, float scaling, int threads) {
    const int64_t BH = B * H, T = L + R, P = 8 / bits, run = D / J / P;  /* run: columns of one channel group per plane */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < BH; bh++) {
        const int64_t b = bh / H;
        const float* qb = q + bh * M * D;
        const int64_t* qp = qpos + b * n;
        const int32_t* pb = pos + bh * L;
        const int32_t* rpb = rpos + bh * R;
        float* lg = logits + bh * M * T;
        float* scaled_q = work + bh * (2 * M * D + D);  /* [M, D] plane-major: q * key scale of the group */
        float* acc = scaled_q + M * D;                   /* [M, D] plane-major value accumulator */
        float* codes = acc + M * D;                      /* [D] one token's codes */
        int64_t first = INT64_MAX;
        for (int64_t t = 0; t < L; t++) if (pb[t] < first) first = pb[t];
        for (int64_t t = 0; t < R; t++) if (rpb[t] < first) first = rpb[t];

        /* Keys: logit = sum_d (q_d * s_d) * c_d + sum_d q_d * z_d, with s, z shared by a group of G tokens. */
        for (int64_t g0 = 0; g0 < L; g0 += G) {
            const float* s = ks + (bh * (L / G) + g0 / G) * D;
            const float* z = kz + (bh * (L / G) + g0 / G) * D;
            float bias[M > 0 ? M : 1];
            for (int64_t m = 0; m < M; m++) {
                for (int64_t c = 0; c < D; c++) {
                    const int64_t ch = (c % W) * P + c / W;
                    scaled_q[m * D + c] = qb[m * D + ch] * s[ch];
                }
                bias[m] = dot(qb + m * D, z, D);
            }
            for (int64_t t = g0; t < g0 + G; t++) {
                unpack_planes(kc + (bh * L + t) * W, W, bits, codes);
                for (int64_t m = 0; m < M; m++) {
                    const int64_t qpm = qp[m % n];
                    const int visible = pb[t] <= qpm || first > qpm;
                    lg[m * T + t] = visible ? (dot(scaled_q + m * D, codes, D) + bias[m]) * scaling : -INFINITY;
                }
            }
        }
        for (int64_t t = 0; t < R; t++) {
            const float* k = rk + (bh * R + t) * D;
            for (int64_t m = 0; m < M; m++) {
                const int64_t qpm = qp[m % n];
                const int visible = rpb[t] <= qpm || first > qpm;
                lg[m * T + L + t] = visible ? dot(qb + m * D, k, D) * scaling : -INFINITY;
            }
        }
        /* Softmax per query row (every row sees at least one slot). */
        for (int64_t m = 0; m < M; m++) {
            float* row = lg + m * T;
            float top = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < T; t++) top = row[t] > top ? row[t] : top;
            for (int64_t t = 0; t < T; t++) { row[t] = expf(row[t] - top); sum += row[t]; }
            const float inv = 1.0f / sum;
            for (int64_t t = 0; t < T; t++) row[t] *= inv;
        }
        /* Values: acc_c += (p * s_j) * c_c + p * z_j, j the channel group of column c. */
        memset(acc, 0, sizeof(float) * M * D);
        for (int64_t t = 0; t < L; t++) {
            unpack_planes(vc + (bh * L + t) * W, W, bits, codes);
            const float* s = vs + (bh * L + t) * J;
            const float* z = vz + (bh * L + t) * J;
            for (int64_t m = 0; m < M; m++) {
                const float p = lg[m * T + t];
                if (p == 0.0f) continue;
                float* o = acc + m * D;
                for (int64_t plane = 0; plane < P; plane++)
                    for (int64_t j = 0; j < J; j++) {
                        const float a = p * s[j], c0 = p * z[j];
                        const int64_t base = plane * W + j * run;
                        for (int64_t i = base; i < base + run; i++) o[i] += a * codes[i] + c0;
                    }
            }
        }
        float* ob = out + bh * M * D;
        for (int64_t m = 0; m < M; m++)
            for (int64_t c = 0; c < D; c++) ob[m * D + (c % W) * P + c / W] = acc[m * D + c];
        for (int64_t t = 0; t < R; t++) {
            const float* v = rv + (bh * R + t) * D;
            for (int64_t m = 0; m < M; m++) {
                const float p = lg[m * T + L + t];
                float* o = ob + m * D;
                for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
            }
        }
    }
}
"""

# Reductions vectorise with reassociation; -ffinite-math-only (part of -ffast-math) would break -inf masking.
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"]
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def enabled() -> bool:
    return os.environ.get("KVCOMP_NATIVE", "1") != "0"


def _build_dir() -> Path:
    from kvcomp.models import cache_dir

    return cache_dir() / "kernels"


def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (with one warning) when it cannot be built."""
    global _lib
    if _lib is None:
        _lib = _compile() or False
    return _lib or None


def _compile() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS) + compiler + sys.platform).encode()).hexdigest()[:16]
    target = _build_dir() / f"quant_attention_{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "quant_attention.c"
                src.write_text(SOURCE)
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, str(src), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent processes never load a half-written file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        warnings.warn(f"kvcomp: the native CPU kernel is unavailable ({err} {detail.decode()[:300]}); "
                      "using the torch implementation.", stacklevel=3)
        return None
    fn = lib.quant_attention_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 15 + [ctypes.c_int64] * 10 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    return lib


def supports(q: torch.Tensor, value_scale: torch.Tensor, bits: int, *tensors: torch.Tensor) -> bool:
    """Whether :func:`quant_attention` runs these inputs: float32 CPU tensors, and value channel groups made of
    whole bit planes (``(D / J) % (8 / bits) == 0``)."""
    d, per_byte = q.shape[-1], 8 // bits
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32
            and all(t.dtype == torch.float32 for t in (value_scale, *tensors))
            and d % value_scale.shape[-1] == 0 and (d // value_scale.shape[-1]) % per_byte == 0
            and load() is not None)


def quant_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    positions: torch.Tensor,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    residual_positions: torch.Tensor,
    bits: int,
    scaling: float,
    block_tokens: int = 1024,
    sentinel: int = 2**30,
) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.quant_attention` (float32 CPU tensors; ``block_tokens`` unused:
    the kernel holds one token's codes at a time)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernel is unavailable; use kvcomp.kernels.quant_cpu.quant_attention")
    b, hq, n, d = q.shape
    h, n_groups, group = positions.shape[1], positions.shape[2], positions.shape[3]
    r = residual_positions.shape[-1]
    rows = hq // h * n
    length = n_groups * group
    tensors = [
        q.reshape(b, h, rows, d).contiguous(), q_pos.to(torch.int64).contiguous(),
        key_codes.contiguous(), key_scale.contiguous(), key_zero.contiguous(),
        value_codes.contiguous(), value_scale.contiguous(), value_zero.contiguous(),
        positions.to(torch.int32).contiguous(),
        residual_keys.contiguous(), residual_values.contiguous(), residual_positions.to(torch.int32).contiguous(),
    ]
    out = torch.empty(b, h, rows, d, dtype=torch.float32)
    logits = torch.empty(b * h, rows, length + r, dtype=torch.float32)
    work = torch.empty(b * h, 2 * rows * d + d, dtype=torch.float32)
    lib.quant_attention_f32(
        *[t.data_ptr() for t in tensors], out.data_ptr(), logits.data_ptr(), work.data_ptr(),
        b, h, rows, n, length, group, r, d, value_scale.shape[-1], key_codes.shape[-1], bits, float(scaling),
        max(1, min(torch.get_num_threads(), b * h)),
    )
    return out.reshape(b, hq, n, d)
