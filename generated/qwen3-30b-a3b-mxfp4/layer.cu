// moegen 0.1.0: qwen3-30b-a3b-mxfp4 (Qwen/Qwen3-30B-A3B), sm_90a. Generated; do not edit.
// spec sha256 60bd91231f7f88e2dfb922bb7abf9788e028ed6d0de0e2527158a7450f6d6ef8
//
// E=128 routed experts, top-8, H=2048, I=768.
// Routing: softmax over 128 experts (fp32 logits) -> top-8 -> renormalize.
// Weights: bf16 packed into m16n8k16 fragment order; per expert 9437184 bytes.
// Kernels per call: one token: single (router, route, gate/up, down + sum) -> more tokens: router (+ route) -> route -> gate_up -> down + combine -> from 512 tokens: router, permute (FP8 activations: quantize) beside it, route -> count -> scan -> place -> gate/up GEMM -> down GEMM -> combine; launch geometry per token bucket is
// in the launcher and manifest.
// ---- common: raw bf16 bits, tensor-core fragments, streaming loads, launch dependencies ----
// No CUDA headers: the file compiles with NVRTC alone, which keeps a cold build fast.
typedef unsigned short bf16_t;
typedef unsigned int u32;
#define MOE_DEVICE __device__ __forceinline__
#define MOE_NEG_INF (-__int_as_float(0x7f800000))

MOE_DEVICE float bf16_to_f32(bf16_t h) { return __uint_as_float(((u32)h) << 16); }
MOE_DEVICE bf16_t f32_to_bf16(float f) {
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
MOE_DEVICE u32 pack_bf16x2(float lo, float hi) {  // (one instruction: the two roundings as f32_to_bf16's)
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// Programmatic dependent launch: wait for the previous kernel's results, then let the next
// kernel's blocks start early. Both are no-ops when the launch does not ask for it.
MOE_DEVICE void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
MOE_DEVICE void grid_dep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// D = A(16x16, row) * B(16x8, col) + D, bf16 inputs, fp32 accumulate.
MOE_DEVICE void mma_bf16(float (&d)[4], const uint4& a, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, "
      "{ %0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// Unsigned key ordered as the floats are (for warp-wide max with redux.sync).
MOE_DEVICE u32 order_key(float f) {
  const u32 b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// Inverse of order_key.
MOE_DEVICE float key_value(u32 k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }
#define MOE_SCORE_SOFTMAX 0
#define MOE_SCORE_SIGMOID 1
#define MOE_SCORE_SQRT_SOFTPLUS 2
#define MOE_SCORE_SPARSEMIXER 3
#define MOE_ACT_SILU 0
#define MOE_ACT_GELU 1
#define MOE_ACT_SWIGLU_CLAMPED 2
MOE_DEVICE float softplus(float v) { return fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v))); }
MOE_DEVICE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
MOE_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A streaming 16-byte load whose L2 fill from memory is the whole aligned 64 bytes around it:
// where a warp reads every other 32-byte sector and another block the ones between (the one-token
// kernel's down columns of two neighbouring tiles), the first read brings both sectors into L2
// (H200, 2026-12-01: Qwen3-30B-A3B N = 1 25.30 -> 24.93 us, Qwen3-Next-80B-A3B 25.53 -> 24.86;
// 128-byte fills 24.98 / 24.99, 256-byte 25.14 / 25.11).
MOE_DEVICE uint4 ld_stream_fill64(const uint4* p) {
  uint4 r;
  asm("ld.global.cs.L2::64B.v4.u32 { %0, %1, %2, %3 }, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// A byte through the read-only path whose L2 fill from memory is the aligned 128 bytes around it:
// the one-token kernel's FP4 tile scales, whose 32-byte chunks the warps read one by one, each
// chunk's sector otherwise its own trip to memory (H200, 2026-12-01: Qwen3-30B-A3B-MXFP4 N = 1
// 20.23 -> 19.96 us, -NVFP4 19.73 -> 19.50; 256-byte fills 19.97 / 19.60).
MOE_DEVICE u32 ldg_u8_fill128(const unsigned char* p) {
  unsigned short r;
  asm("ld.global.nc.L2::128B.u8 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

MOE_DEVICE void cp_async16(void* smem, const void* gmem, bool valid) {
  const u32 dst = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
// 4 bytes through L1 (an FP8 block scale; neighbouring chunks share it).
MOE_DEVICE void cp_async4(void* smem, const void* gmem) {
  const u32 dst = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(gmem) : "memory");
}
// Scales from shared memory by explicit ld.shared (plain loads here made ptxas spill in the FP8
// and MXFP4 down kernels).
MOE_DEVICE float lds_f32(u32 addr) {
  float f;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(f) : "r"(addr));
  return f;
}
MOE_DEVICE u32 lds_u8(u32 addr) {
  u32 b;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(b) : "r"(addr));
  return b;
}
// Ask L2 for `bytes` (a multiple of 16) from p (16-byte aligned), without waiting for them.
MOE_DEVICE void prefetch_l2(const void* p, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// 4 bytes through L1, or zeros (valid false: nothing is read).
MOE_DEVICE void cp_async4_zfill(void* smem, const void* gmem, bool valid) {
  const u32 dst = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
}
// mbarriers (shared memory, CTA scope): init with an arrival count; wait for the phase of a parity.
MOE_DEVICE void mbar_init(u32 addr, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(count) : "memory");
}
// One arrival (release: this thread's writes before it are seen by the waiters).
MOE_DEVICE void mbar_arrive(u32 addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr) : "memory");
}
// The barrier's phase of this parity has completed (a spin on try_wait, which suspends a while).
MOE_DEVICE void mbar_wait(u32 addr, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(addr), "r"(parity) : "memory");
}
// A 1-D bulk copy global -> shared, completing `bytes` of the mbarrier's transaction count.
MOE_DEVICE void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
MOE_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
MOE_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// One 16-row tile of MATS packed weight matrices times up to 8*NT token vectors.
//
// Packed layout (moegen.weights.pack_tiles): [tile][K/32 chunk][MATS][2 k-steps][32 lanes][8 bf16].
// Each lane's 16 bytes are its whole m16n8k16 A fragment, so a warp reads 512 contiguous bytes
// per fragment. K is permuted inside each 32-wide chunk so that the B fragment of a token is 16
// contiguous bytes of its activation row as stored (K is summed over, so the same permutation
// on both operands leaves the product unchanged).
//
// Warps split K (chunks warp, warp+WARPS, ...). Each lane copies its own 16-byte fragments
// into a DEPTH-deep shared-memory ring with cp.async and reads back only what it copied, so
// DEPTH-1 chunks per warp stay in flight without any block barrier. The scales of a quantized
// chunk travel in the same ring, DEPTH-1 chunks ahead like the codes (a load at use would put
// one memory latency on every chunk): a few lanes copy them, and the warp reads them after a
// __syncwarp (and another before the slot is refilled). Each warp's partial sums go to
// shared memory and are added in warp order: the result depends neither on timing nor on the
// other tokens.
// Weight formats of the packed tiles: bf16 (2 fragments of 16 bytes per lane and chunk) or FP8
// e4m3 with one fp32 scale per 128x128 block (1 fragment: both k-steps' 16 codes).
// MXFP4 (OCP MX: e2m1 codes, one E8M0 scale per row and 32-wide K block): 8 bytes per lane,
// matrix and chunk, so one 16-byte fragment carries a pair of matrices.
// NVFP4 (ModelOpt): e2m1 codes in the same layout, one e4m3 scale per row and 16 along K, times
// the matrix's fp32 scale_2.
#define MOE_W_BF16 0
#define MOE_W_FP8_BLOCK 1
#define MOE_W_MXFP4 2
#define MOE_W_NVFP4 3
// FP8 per-tensor (ModelOpt FP8): e4m3 codes as FP8 block's, one fp32 weight scale per matrix and a
// static input scale: the activations are quantized, e4m3(x / input_scale) saturating, and the
// products of codes summed in fp32 are multiplied by input_scale * weight_scale. TileGemv takes
// its B rows already quantized (bf16 holding the e4m3 values: moe_tensor_quant for x, gate/up's
// epilogue for the activations), once per row rather than once per weight tile.
#define MOE_W_FP8_TENSOR 4
// FP8 block weights times FP8 activations (DeepSeek's recipe, MODELS.md format a): the B rows are
// e4m3 codes (as bf16) of activations quantized per token and 128 channels, with their fp32
// scales [row][K/128]; each chunk's code sums get the weight block scale times the token's scale.
#define MOE_W_FP8_BLOCK_A8 5

// Eight e2m1 codes (nibble i = element i of an A fragment's k-step, low nibble first) as the four
// bf16x2 registers of that fragment, exactly: every e2m1 value is a bf16 value. Byte tables
// through prmt: the high and the low byte of the bf16 of each magnitude code 0-7 (0, .5, 1, 1.5,
// 2, 3, 4, 6), then the sign bit of each nibble into bit 15 of its half.
MOE_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
MOE_DEVICE uint4 e2m1x8_to_bf16x8(u32 w) {
  constexpr u32 HI0 = 0x3F3F3F00u, HI1 = 0x40404040u, LO0 = 0xC0800000u, LO1 = 0xC0804000u;
  const u32 sel0 = w & 0x7777u, sel1 = (w >> 16) & 0x7777u;  // magnitudes of elements 0-3, 4-7
  const u32 hb0 = prmt(HI0, HI1, sel0), lb0 = prmt(LO0, LO1, sel0);
  const u32 hb1 = prmt(HI0, HI1, sel1), lb1 = prmt(LO0, LO1, sel1);
  const u32 w4 = w << 4;  // byte k's top bit: the sign of nibble 2k (w4) and of nibble 2k+1 (w)
  uint4 r;
  r.x = prmt(lb0, hb0, 0x5140u) | (prmt(w4, w, 0xCC88u) & 0x80008000u);
  r.y = prmt(lb0, hb0, 0x7362u) | (prmt(w4, w, 0xDD99u) & 0x80008000u);
  r.z = prmt(lb1, hb1, 0x5140u) | (prmt(w4, w, 0xEEAAu) & 0x80008000u);
  r.w = prmt(lb1, hb1, 0x7362u) | (prmt(w4, w, 0xFFBBu) & 0x80008000u);
  return r;
}
MOE_DEVICE u32 mul_bf16x2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// One e4m3 code (the low byte) as fp32, exactly.
MOE_DEVICE float e4m3_to_f32(u32 b) {
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)(b & 0xffu)));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h & 0xffffu)));
  return f;
}
// E8M0 scale byte: 2^(b - 127); 0 is 2^-127 (an fp32 subnormal), 255 is NaN.
MOE_DEVICE float e8m0_to_f32(u32 b) {
  return __uint_as_float(b == 0 ? 0x00400000u : (b == 255 ? 0x7fc00000u : b << 23));
}

// One 16-row matrix's FP4 chunk times a token's B fragment b (its two k-steps' codes q0, q1: 8
// e2m1 each), into acc (rows g: 0, 1; g + 8: 2, 3). MXFP4: exact bf16 codes through the tensor
// cores, the rows' E8M0 scales (e_lo, e_hi: bytes) on the fp32 products. NVFP4: the codes times the
// rows' e4m3 scales in bf16 (sc: row g's in the low half, row g + 8's in the high), exactly (e2m1 x
// e4m3 has at most 6 significant bits), then the tensor cores; scale_2 multiplies the finished sums.
MOE_DEVICE void mx_mma(float (&acc)[4], u32 q0, u32 q1, const uint4& b, u32 e_lo, u32 e_hi) {
  const uint4 k0 = e2m1x8_to_bf16x8(q0), k1 = e2m1x8_to_bf16x8(q1);
  float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_bf16(tmp, k0, b.x, b.y);
  mma_bf16(tmp, k1, b.z, b.w);
  const float s_lo = e8m0_to_f32(e_lo), s_hi = e8m0_to_f32(e_hi);
  acc[0] = fmaf(s_lo, tmp[0], acc[0]);
  acc[1] = fmaf(s_lo, tmp[1], acc[1]);
  acc[2] = fmaf(s_hi, tmp[2], acc[2]);
  acc[3] = fmaf(s_hi, tmp[3], acc[3]);
}
MOE_DEVICE void nv_mma(float (&acc)[4], u32 q0, u32 q1, const uint4& b, u32 sc) {
  const u32 lo = prmt(sc, 0u, 0x1010u), hi = prmt(sc, 0u, 0x3232u);  // each row's scale in both halves
  uint4 k0 = e2m1x8_to_bf16x8(q0), k1 = e2m1x8_to_bf16x8(q1);
  k0 = make_uint4(mul_bf16x2(k0.x, lo), mul_bf16x2(k0.y, hi), mul_bf16x2(k0.z, lo), mul_bf16x2(k0.w, hi));
  k1 = make_uint4(mul_bf16x2(k1.x, lo), mul_bf16x2(k1.y, hi), mul_bf16x2(k1.z, lo), mul_bf16x2(k1.w, hi));
  mma_bf16(acc, k0, b.x, b.y);
  mma_bf16(acc, k1, b.z, b.w);
}

// Two e4m3 codes (low byte first) as two bf16 in one register, exactly: every e4m3 value is a
// bf16 value. cvt.rn.f16x2.e4m3x2 puts the low byte's value in the low half.
MOE_DEVICE u32 e4m3x2_to_bf16x2(u32 two) {
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)(two & 0xffffu)));
  float lo, hi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h & 0xffffu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h >> 16)));
  return pack_bf16x2(lo, hi);
}

// Four e4m3 weight codes as the two bf16x2 registers (e0, e1) and (e2, e3) of an A fragment,
// exactly, with integer operations and one bf16 multiply per register (no conversion unit: its
// quarter rate made the FP8 GEMV conversion-bound). The packer stores a word's bytes as e0, e2,
// e1, e3, so bytes 0 and 2 make the first register and bytes 1 and 3 the second. A code's bits
// moved into a bf16 (sign to bit 15, exponent and mantissa to bits 10..4) read as its value
// times 2^-120: e4m3's bias is 7, bf16's 127, and e4m3's subnormals land on bf16's. The multiply
// by 2^120 (bf16 0x7B80) is exact, subnormal inputs included. The NaN codes (0x7F, 0xFF) are
// refused when the codes are packed.
MOE_DEVICE uint2 e4m3x4_to_bf16x4(u32 q) {
  constexpr u32 SIGN = 0x80008000u, BITS = 0x07F007F0u, TWO_120 = 0x7B807B80u;
  const u32 lo = ((q << 8) & SIGN) | ((q << 4) & BITS);  // bytes 0 and 2: e0, e1
  const u32 hi = (q & SIGN) | ((q >> 4) & BITS);         // bytes 1 and 3: e2, e3
  return make_uint2(mul_bf16x2(lo, TWO_120), mul_bf16x2(hi, TWO_120));
}
// The 16 codes of a lane's FP8 fragment (two k-steps) as the 8 registers of its two A fragments.
MOE_DEVICE void e4m3x16_to_bf16(uint4 q, uint4& k0, uint4& k1) {
  const uint2 a = e4m3x4_to_bf16x4(q.x), b = e4m3x4_to_bf16x4(q.y);
  const uint2 c = e4m3x4_to_bf16x4(q.z), d = e4m3x4_to_bf16x4(q.w);
  k0 = make_uint4(a.x, a.y, b.x, b.y);
  k1 = make_uint4(c.x, c.y, d.x, d.y);
}

// The e4m3 A fragment of a lane (ldmatrix.x4 of the core-matrix layout: rows g, g + 8 at K
// positions 4t .. 4t + 3, then 16 + 4t ..) as the bf16 A fragments of its two m16n8k16 k-steps:
// e4m3x4_to_bf16x4 pairs bytes 0, 2 and 1, 3 of a row's word, which A8_ORDER gives columns 8t, 8t + 1
// and 8t + 2, 8t + 3 (k-step 1: 8t + 4 ..), as pack_fp8's fragments hold them: X' the same.
MOE_DEVICE void a8_frags(uint4 q, uint4& k0, uint4& k1) {
  const uint2 a = e4m3x4_to_bf16x4(q.x), b = e4m3x4_to_bf16x4(q.y);
  const uint2 c = e4m3x4_to_bf16x4(q.z), d = e4m3x4_to_bf16x4(q.w);
  k0 = make_uint4(a.x, b.x, a.y, b.y);
  k1 = make_uint4(c.x, d.x, c.y, d.y);
}

// Two bf16 activations (low half first) quantized by a scale: e4m3(x / s) with round-to-nearest-
// even, saturating at +-448, as two code bytes (the low half's in the low byte), or (quant_e4m3x2)
// as two bf16 holding their e4m3 values exactly.
MOE_DEVICE u32 e4m3x2_codes(u32 two, float s) {
  const float lo = __fdiv_rn(bf16_to_f32((bf16_t)(two & 0xffffu)), s);
  const float hi = __fdiv_rn(bf16_to_f32((bf16_t)(two >> 16)), s);
  unsigned short q;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(q) : "f"(hi), "f"(lo));  // hi -> upper byte
  return q;
}
// The scale of a 128-channel group of activations held by a warp, 4 bf16 a lane (v):
// max(amax, 1e-4) / 448 in fp32 (MODELS.md format a, DeepSeek's act_quant).
MOE_DEVICE float group_scale_e4m3(uint2 v) {
  const float a = fmaxf(fmaxf(fabsf(bf16_to_f32((bf16_t)(v.x & 0xffffu))), fabsf(bf16_to_f32((bf16_t)(v.x >> 16)))),
                        fmaxf(fabsf(bf16_to_f32((bf16_t)(v.y & 0xffffu))), fabsf(bf16_to_f32((bf16_t)(v.y >> 16)))));
  return __fdiv_rn(fmaxf(warp_max(a), 1e-4f), 448.0f);
}
MOE_DEVICE u32 quant_e4m3x2(u32 two, float s) { return e4m3x2_to_bf16x2((unsigned short)e4m3x2_codes(two, s)); }
MOE_DEVICE bf16_t quant_e4m3(bf16_t v, float s) { return (bf16_t)(quant_e4m3x2(v, s) & 0xffffu); }

// The FP4 row scales of packed tile `tile` as TileGemv takes them. MXFP4: [KC][MATS][16] E8M0
// bytes per tile. NVFP4: [KC][MATS][2][16] e4m3 bytes per tile, then the MATS fp32 scale_2 of
// the tile's matrices (16 bytes): nv_scale2 points at them.
MOE_DEVICE const float* mx_scales(const float* base, size_t tile, int kc, int mats) {
  return reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(base) + tile * kc * mats * 16);
}
MOE_DEVICE const float* nv_scales(const float* base, size_t tile, int kc, int mats) {
  return reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(base) + tile * (kc * mats * 32 + 16));
}
MOE_DEVICE const float* nv_scale2(const float* tile_scales, int kc, int mats) {
  return reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(tile_scales) + kc * mats * 32);
}

// MSTRIDE (BF16 only): 0, a chunk's fragments of the MATS matrices side by side (gate/up); else the
// matrices are MSTRIDE uint4 apart, each with its own chunks in order (the router's consecutive
// 16-row tiles as MATS matrices, sharing the block's activation rows).
template <int KC, int MATS, int NT, int WARPS, int DEPTH, int FMT = MOE_W_BF16, int MSTRIDE = 0>
struct TileGemv {
  static_assert(MSTRIDE == 0 || FMT == MOE_W_BF16, "matrices apart: BF16 tiles only");
  static constexpr bool FP8B = FMT == MOE_W_FP8_BLOCK || FMT == MOE_W_FP8_BLOCK_A8;  // block-scaled e4m3 weights
  static constexpr bool A8 = FMT == MOE_W_FP8_BLOCK_A8;
  static constexpr int AF = FMT == MOE_W_BF16 ? 2 : 1;  // 16-byte A fragments per matrix and chunk (FP8, BF16)
  // 16-byte A fragments per lane and chunk, all matrices: MXFP4 packs two matrices in one.
  static constexpr bool FP4 = FMT == MOE_W_MXFP4 || FMT == MOE_W_NVFP4;
  static constexpr int AU = FP4 ? MATS / 2 : MATS * AF;
  static_assert(!FP4 || MATS % 2 == 0, "FP4 tiles pair their matrices");
  static constexpr int XSU = A8 ? (NT + 1) / 2 : 0;  // A8: 16-byte units of this lane's token scales (2 per group)
  static constexpr int FRAGS = AU + NT + XSU;  // 16-byte fragments per lane per chunk
  // 16-byte units of scales per chunk (the warp's, not a lane's): MXFP4 MATS x 16 E8M0 bytes,
  // NVFP4 MATS x 2 x 16 e4m3 bytes, FP8 one fp32 per matrix.
  static constexpr int SCU = FMT == MOE_W_MXFP4 ? MATS : FMT == MOE_W_NVFP4 ? 2 * MATS
                             : FP8B ? (MATS * 4 + 15) / 16 : 0;
  static_assert(SCU <= 32 && (!FP8B || MATS <= 32), "a chunk's scales: one copy per lane at most");
  static constexpr int RING_U4 = WARPS * DEPTH * (FRAGS * 32 + SCU);
  static constexpr int RED_FLOATS = WARPS * NT * MATS * 128;
  static constexpr int SMEM_BYTES = (RING_U4 * 16 > RED_FLOATS * 4) ? RING_U4 * 16 : RED_FLOATS * 4;

  // a: this tile's packed weights; x: activation rows (stride x_stride elements); tok: row index
  // of each token (nullptr: rows are 0..m-1); tokens n0 .. n0+8*NT-1 of m are computed.
  // FP8: scale[mt * scale_stride + c / 4] is the scale of matrix mt's 128-wide K block of chunk c.
  // FP8 per-tensor: scale[mt * scale_stride] and [.. + 1] are matrix mt's weight and input scales;
  // the rows of x are already quantized by the input scale (equal for all MATS matrices).
  // MXFP4: scale (bytes) [KC][MATS][16] holds this tile's E8M0 row scales, one per chunk.
  // NVFP4: scale (bytes) [KC][MATS][2 blocks of 16 along K][16] its e4m3 row scales; scale2[mt]
  // each matrix's scale_2.
  // smem: SMEM_BYTES, 16-byte aligned; on return it holds the per-warp partial sums.
  static MOE_DEVICE void run(const uint4* __restrict__ a, const bf16_t* __restrict__ x, int x_stride,
                             const int* __restrict__ tok, int n0, int m, uint4* smem,
                             const float* __restrict__ scale = nullptr, int scale_stride = 0,
                             const float* __restrict__ scale2 = nullptr, const float* __restrict__ xscale = nullptr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const bf16_t* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int n = n0 + j * 8 + g;
      xr[j] = (n < m) ? x + (size_t)(tok ? tok[n] : n) * x_stride + t * 8 : x;
    }
    bool live[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) live[j] = n0 + j * 8 + g < m;
    float acc[NT][MATS][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int mt = 0; mt < MATS; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][mt][i] = 0.0f;

    int xrow[NT][2];  // A8: the activation rows of the lane's output columns, and whether they exist
    bool xlive[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int n = n0 + j * 8 + 2 * t + b;
        xlive[j][b] = A8 && n < m;
        xrow[j][b] = xlive[j][b] ? (tok ? tok[n] : n) : 0;
      }
    float s_out[MATS];  // FP8 per-tensor: each matrix's input scale times its weight scale
    if constexpr (FMT == MOE_W_FP8_TENSOR) {
#pragma unroll
      for (int mt = 0; mt < MATS; ++mt) s_out[mt] = __ldg(scale + mt * scale_stride + 1) * __ldg(scale + mt * scale_stride);
    }
    uint4* ring = smem + warp * DEPTH * FRAGS * 32 + lane;
    uint4* sring = smem + WARPS * DEPTH * FRAGS * 32 + warp * DEPTH * SCU;  // the warp's scales
    const int mine = (KC - warp + WARPS - 1) / WARPS;  // chunks warp, warp + WARPS, ...
    auto issue = [&](int i) {
      if (i < mine) {
        const int c = warp + i * WARPS;
        uint4* st = ring + (i % DEPTH) * FRAGS * 32;
#pragma unroll
        for (int f = 0; f < AU; ++f)
          cp_async16(st + f * 32, MSTRIDE ? a + (size_t)(f / AF) * MSTRIDE + ((size_t)c * AF + f % AF) * 32 + lane
                                          : a + ((size_t)c * AU + f) * 32 + lane, true);
#pragma unroll
        for (int j = 0; j < NT; ++j) cp_async16(st + (AU + j) * 32, xr[j] + c * 32, live[j]);
        uint4* ss = sring + (i % DEPTH) * SCU;
        if constexpr (A8) {  // the scales of the lane's two output columns (tokens 2t, 2t+1 of each group)
          float* xs = reinterpret_cast<float*>(st + (AU + NT) * 32);
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int b = 0; b < 2; ++b)
              cp_async4_zfill(xs + ((j * 2 + b) / 4) * 128 + (j * 2 + b) % 4,
                              xscale + (size_t)xrow[j][b] * (KC / 4) + c / 4, xlive[j][b]);
        }
        if constexpr (FP8B) {  // matrix mt's 128-wide K block of chunk c
          if (lane < MATS) cp_async4(reinterpret_cast<float*>(ss) + lane, scale + lane * scale_stride + c / 4);
        } else if constexpr (SCU > 0) {  // FP4: the chunk's scale bytes are contiguous, SCU x 16 of them
          if (lane < SCU) cp_async16(ss + lane, reinterpret_cast<const uint4*>(scale) + (size_t)c * SCU + lane, true);
        }
      }
      cp_async_commit();  // an empty group past the end keeps the wait count uniform
    };
#pragma unroll
    for (int i = 0; i < DEPTH - 1; ++i) issue(i);
    for (int i = 0; i < mine; ++i) {
      if constexpr (SCU > 0) __syncwarp();  // every lane has read the scales of the slot about to be refilled
      issue(i + DEPTH - 1);
      cp_async_wait<DEPTH - 1>();
      if constexpr (SCU > 0) __syncwarp();  // the scales other lanes copied are visible
      const uint4* st = ring + (i % DEPTH) * FRAGS * 32;
      const u32 sb = (u32)__cvta_generic_to_shared(sring + (i % DEPTH) * SCU);  // this chunk's scales
      uint4 av[AU], bv[NT];
#pragma unroll
      for (int f = 0; f < AU; ++f) {
        // A8 (moegen.weights.pack_fp8_core): the lane's 16 bytes are row lane % 8 of the chunk's core
        // matrix lane / 8, so ldmatrix.x4 at the lane's own slot gives the e4m3 A fragment: rows g,
        // g + 8 at K positions 4t .. 4t + 3, then 16 + 4t .. (columns 8t + 0, 2, 1, 3 and 8t + 4 +
        // those: A8_ORDER), which a8_frags turns into the two bf16 A fragments
        if constexpr (A8) {
          u32 q[4];
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];"
                       : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3])
                       : "r"((u32)__cvta_generic_to_shared(st + f * 32)) : "memory");
          av[f] = make_uint4(q[0], q[1], q[2], q[3]);
        } else {
          av[f] = st[f * 32];
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) bv[j] = st[(AU + j) * 32];
      if constexpr (FMT == MOE_W_BF16) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int mt = 0; mt < MATS; ++mt) {
            mma_bf16(acc[j][mt], av[mt * AF], bv[j].x, bv[j].y);
            mma_bf16(acc[j][mt], av[mt * AF + AF - 1], bv[j].z, bv[j].w);
          }
      } else if constexpr (FMT == MOE_W_MXFP4) {  // exact bf16 codes through the tensor cores, the row scale in fp32
#pragma unroll
        for (int mt = 0; mt < MATS; ++mt) {
          const uint4 q = av[mt / 2];  // matrix 2p: k-steps in x, y; matrix 2p+1: in z, w
          const uint4 k0 = e2m1x8_to_bf16x8(mt & 1 ? q.z : q.x), k1 = e2m1x8_to_bf16x8(mt & 1 ? q.w : q.y);
          const float s_lo = e8m0_to_f32(lds_u8(sb + mt * 16 + g)), s_hi = e8m0_to_f32(lds_u8(sb + mt * 16 + g + 8));
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_bf16(tmp, k0, bv[j].x, bv[j].y);
            mma_bf16(tmp, k1, bv[j].z, bv[j].w);
            acc[j][mt][0] = fmaf(s_lo, tmp[0], acc[j][mt][0]);  // rows g (0, 1) and g + 8 (2, 3)
            acc[j][mt][1] = fmaf(s_lo, tmp[1], acc[j][mt][1]);
            acc[j][mt][2] = fmaf(s_hi, tmp[2], acc[j][mt][2]);
            acc[j][mt][3] = fmaf(s_hi, tmp[3], acc[j][mt][3]);
          }
        }
      } else if constexpr (FMT == MOE_W_NVFP4) {
        // A lane's four columns of a k-step lie in one 16-wide block (block 2c + t/2, K permuted as
        // the module comment says), so each code is scaled by its row's e4m3 scale before the
        // tensor cores, in bf16, exactly: e2m1 x e4m3 has at most 6 significant bits. scale_2
        // multiplies the finished sums.
#pragma unroll
        for (int mt = 0; mt < MATS; ++mt) {
          const uint4 q = av[mt / 2];
          uint4 k0 = e2m1x8_to_bf16x8(mt & 1 ? q.z : q.x), k1 = e2m1x8_to_bf16x8(mt & 1 ? q.w : q.y);
          const float f_lo = e4m3_to_f32(lds_u8(sb + mt * 32 + (t >> 1) * 16 + g));
          const float f_hi = e4m3_to_f32(lds_u8(sb + mt * 32 + (t >> 1) * 16 + g + 8));
          const u32 s_lo = pack_bf16x2(f_lo, f_lo), s_hi = pack_bf16x2(f_hi, f_hi);
          k0 = make_uint4(mul_bf16x2(k0.x, s_lo), mul_bf16x2(k0.y, s_hi), mul_bf16x2(k0.z, s_lo), mul_bf16x2(k0.w, s_hi));
          k1 = make_uint4(mul_bf16x2(k1.x, s_lo), mul_bf16x2(k1.y, s_hi), mul_bf16x2(k1.z, s_lo), mul_bf16x2(k1.w, s_hi));
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            mma_bf16(acc[j][mt], k0, bv[j].x, bv[j].y);
            mma_bf16(acc[j][mt], k1, bv[j].z, bv[j].w);
          }
        }
      } else if constexpr (FMT == MOE_W_FP8_TENSOR) {  // codes times the quantized rows, exactly, summed in fp32
#pragma unroll
        for (int mt = 0; mt < MATS; ++mt) {
          uint4 k0, k1;
          e4m3x16_to_bf16(av[mt], k0, k1);
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            mma_bf16(acc[j][mt], k0, bv[j].x, bv[j].y);
            mma_bf16(acc[j][mt], k1, bv[j].z, bv[j].w);
          }
        }
      } else {  // FP8 block: exact bf16 codes through the tensor cores, the block scale in fp32
        float xsc[NT][2];  // A8: the output columns' activation scales for this chunk
        if constexpr (A8) {
          const float* xs = reinterpret_cast<const float*>(st + (AU + NT) * 32);
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int b = 0; b < 2; ++b) xsc[j][b] = xs[((j * 2 + b) / 4) * 128 + (j * 2 + b) % 4];
        }
#pragma unroll
        for (int mt = 0; mt < MATS; ++mt) {
          uint4 k0, k1;
          if constexpr (A8) {
            a8_frags(av[mt], k0, k1);
          } else {
            e4m3x16_to_bf16(av[mt], k0, k1);
          }
          const float sc = lds_f32(sb + 4 * mt);
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_bf16(tmp, k0, bv[j].x, bv[j].y);
            mma_bf16(tmp, k1, bv[j].z, bv[j].w);
            if constexpr (A8) {  // columns 2t (r = 0, 2) and 2t + 1 (r = 1, 3)
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[j][mt][r] = fmaf(sc * xsc[j][r & 1], tmp[r], acc[j][mt][r]);
            } else {
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[j][mt][r] = fmaf(sc, tmp[r], acc[j][mt][r]);
            }
          }
        }
      }
    }
    if constexpr (FMT == MOE_W_FP8_TENSOR) {  // input_scale * weight_scale, once
#pragma unroll
      for (int mt = 0; mt < MATS; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[j][mt][r] *= s_out[mt];
    }
    if constexpr (FMT == MOE_W_NVFP4) {  // each matrix's scale_2, once
#pragma unroll
      for (int mt = 0; mt < MATS; ++mt) {
        const float s2 = __ldg(scale2 + mt);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[j][mt][r] *= s2;
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the partial sums reuse the ring
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int mt = 0; mt < MATS; ++mt)
        *reinterpret_cast<float4*>(red + ((warp * NT + j) * MATS + mt) * 128 + lane * 4) =
            make_float4(acc[j][mt][0], acc[j][mt][1], acc[j][mt][2], acc[j][mt][3]);
    __syncthreads();
  }

  // Result for tile row r (0..15) and token column col (0..7) of token group j, summed over
  // warps in a fixed order.
  static MOE_DEVICE float result(const uint4* smem, int j, int mt, int r, int col) {
    const float* red = reinterpret_cast<const float*>(smem);
    const int e = (((r & 7) * 4 + (col >> 1)) * 4) + (r >> 3) * 2 + (col & 1);
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[((w * NT + j) * MATS + mt) * 128 + e];
    return s;
  }
};

// ---- the routing rule of this layer ----
struct RouteRule {
  static constexpr int SCORE = MOE_SCORE_SOFTMAX;
  static constexpr int E_REAL = 128;
  static constexpr int ZERO = 0;
  static constexpr bool WEIGHT_ON_INPUT = false;
  static constexpr bool HASH = false;
  static constexpr int VOCAB = 0;
  static constexpr bool EP = false;
  static constexpr int EP_LO = 0;
  static constexpr int EP_N = 128;
  static constexpr bool EP_RANK0 = true;
  static constexpr float SPARSEMIXER_EPS = 0.01f;
  static constexpr bool SELECT_LOGITS = false;
  static constexpr bool CORR_BIAS = false;
  static constexpr bool ROUTER_BIAS = false;
  static constexpr int NGROUP = 1;
  static constexpr int TOPK_GROUP = 1;
  static constexpr bool RENORM = true;
  static constexpr float SCALE = 1.0f;
  static constexpr bool LOGITS_BF16 = false;
};

// ---- the RMSNorm epsilons of this layer (used only where it has the norms) ----
struct NormRule {
  static constexpr float ROUTER_EPS = 1e-06f;
  static constexpr float EXPERT_EPS = 1e-06f;
};

// ---- the expert activation of this layer ----
struct ActRule {
  static constexpr int KIND = MOE_ACT_SILU;
  static constexpr float LIMIT = 0.0f;
  static constexpr float ALPHA = 1.0f;
  static constexpr bool SHARED_LIMIT = false;
  static constexpr bool EXPERT_BIAS = false;
};
// The logistic function 1 / (1 + 2^(-z log2 e)) with the multifunction unit's ex2.approx and
// rcp.approx (relative errors about 2^-22 and 2^-23, far under the bf16 rounding that follows;
// z below -87: 2^(...) = inf, its reciprocal 0). With expf and the IEEE division each of the prefill
// gate/up epilogue's 64 sites was 16 instructions instead of 7: on the H200 (2026-12-02, one process,
// the same weights) that version's layers took 0.7-1% longer at N = 8192 (Qwen3-30B-A3B 1455.9 against
// 1446.0 us, Mixtral-8x7B 10133.7 / 10051.9, Qwen3-30B-A3B-FP8-a8 1308.0 / 1294.4), and NVRTC 0.2-0.4 s
// longer to compile a layer on a 2-core machine. The tier (every bucket against the float64 reference)
// passed with it for ten catalog layers, BF16, FP8, FP8-a8, NVFP4, SwiGLU and the clamped ones.
MOE_DEVICE float sigmoid(float z) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return r;
}
// The gated activation; CLAMP applies the layer's limit (gate from above, up both ways).
template <bool CLAMP>
MOE_DEVICE float activate(float g, float u) {
  if (CLAMP && ActRule::LIMIT > 0.0f) {
    g = fminf(g, ActRule::LIMIT);
    u = fminf(fmaxf(u, -ActRule::LIMIT), ActRule::LIMIT);
  }
  if constexpr (ActRule::KIND == MOE_ACT_GELU) return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f)) * u;
  if constexpr (ActRule::KIND == MOE_ACT_SWIGLU_CLAMPED) return g * sigmoid(ActRule::ALPHA * g) * (u + 1.0f);
  return g * sigmoid(g) * u;
}

// ---- route family: scores, top-k, weights, and the grouping of tokens by expert ----

// The choices' weights, by one warp, from their scores (pick, in choice order): route_one's and
// route_block's rules. all: (LOGIT_ORDER without RENORM) the sum over every expert of exp(l - the
// largest l).
template <int K, class R>
MOE_DEVICE void route_weights(const float* pick, float all, float* w_out) {
  constexpr bool LOGIT_ORDER = !R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX && !R::CORR_BIAS;
  const int lane = threadIdx.x & 31;
  const float my_v = lane < K ? pick[lane] : 0.0f;
  float w = my_v;
  if constexpr (LOGIT_ORDER) {  // exp(l_j - max) over the sum of the k (RENORM) or of all experts
    const float top = __shfl_sync(0xffffffffu, my_v, 0);  // the first choice: the largest logit
    w = lane < K ? expf(my_v - top) : 0.0f;
    w = w / (R::RENORM ? warp_sum(w) : all);
  } else if constexpr (R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX) {  // softmax over the k chosen logits
    const float top = __shfl_sync(0xffffffffu, my_v, 0);
    w = lane < K ? expf(my_v - top) : 0.0f;
    w = w / warp_sum(w);
  } else if constexpr (R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SIGMOID) {
    w = 1.0f / (1.0f + expf(-my_v));
  }
  if constexpr (R::RENORM && !LOGIT_ORDER) w = w / warp_sum(lane < K ? w : 0.0f);
  w *= R::SCALE;
  if (lane < K) w_out[lane] = w;
}

// One expert's logit as the rule sees it (its router bias added, rounded to bf16 where the rule's
// logits are), and its score where the score is a function of the logit alone (sigmoid,
// sqrt-softplus; the logit itself otherwise: softmax scores need every expert).
template <class R>
MOE_DEVICE float route_logit(float s, const float* __restrict__ router_bias, int e) {
  if constexpr (R::ROUTER_BIAS) s += router_bias[e];
  return R::LOGITS_BF16 ? bf16_to_f32(f32_to_bf16(s)) : s;
}
template <class R>
MOE_DEVICE float route_score(float s) {
  if constexpr (!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SIGMOID) return 1.0f / (1.0f + expf(-s));
  if constexpr (!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SQRT_SOFTPLUS) return sqrtf(softplus(s));
  return s;
}

// The route of one token by one warp (the one-token kernel's warp 0, route_body's warp a token),
// for the rules without expert groups, hash tables, identity experts or SparseMixer: the k
// largest selection values, equal values the lower expert (route_body's rounds for the others).
// Lane l holds experts l * EPL .. l * EPL + EPL - 1 (a lower lane holds lower experts), sorted by selection value;
// each round takes the warp's largest key and the lowest lane holding it (one reduction and one
// ballot), and only that lane moves on in its list. The partial logits: part p at logits +
// p * PSTRIDE, in global memory (read from L2) or (SMEM) in shared memory. The choices, their weights and the shared-expert gate go to
// ids, w, gate (shared memory); s_cand and s_cscore: 32 candidates' room (shared memory, this warp's).
// OVERLAP: once every choice is in ids, the warp calls after(), then every lane arrives on the
// mbarrier `chosen` (the other warps, waiting on it, start streaming; each lane's arrival releases
// its own writes of choices); the weights are left to route_weights (the choices' scores in pick;
// LOGIT_ORDER without RENORM: the sum over every expert in *all). Otherwise the weights go to
// w_out before it returns.
template <int E, int K, int KSPLIT, size_t PSTRIDE, bool SMEM, bool SHARED_GATE, class R, bool OVERLAP, class After,
          int BOUND_MIN = 8>
MOE_DEVICE void route_one(const float* logits, const float* __restrict__ corr_bias,
                          const float* __restrict__ router_bias, int* ids, float* s_pick, float* w_out, float* gate,
                          float* all_out, u32 chosen, After after, unsigned long long* s_cand, float* s_cscore) {
  constexpr int EPL = (E + 31) / 32;
  constexpr int P2 = EPL <= 1 ? 1 : EPL <= 2 ? 2 : EPL <= 4 ? 4 : EPL <= 8 ? 8 : 16;
  static_assert(EPL <= 16, "route_one: at most 512 experts");
  constexpr bool BOUND = P2 >= BOUND_MIN;  // (below)
  // Lane l's experts: l * EPL .. l * EPL + EPL - 1 (a lower lane holds lower experts, as the
  // rounds below need for equal values), or (ILV: the bound, whose keys carry their expert, and
  // E a multiple of 128) 4 l .. 4 l + 3 of every 128, so that a warp's 16-byte loads of the
  // logits are 512 contiguous bytes (no bank conflicts; contiguous runs of EPL were 4-way)
  constexpr bool ILV = BOUND && E % 128 == 0;
  const int lane = threadIdx.x & 31;
  auto expert = [&](int i) { return ILV ? (i / 4) * 128 + 4 * lane + i % 4 : lane * EPL + i; };
  float v[EPL], sel[EPL];
  float gl = 0.0f;  // the shared-expert gate's logit, asked for with the others
#pragma unroll
  for (int i = 0; i < EPL; ++i) v[i] = 0.0f;
#pragma unroll
  for (int p = 0; p < KSPLIT; ++p) {
    const float* row = logits + (size_t)p * PSTRIDE + (ILV ? 4 * lane : lane * EPL);
    if constexpr (E % 128 == 0) {  // 16-byte loads: a lane's experts come 4 at a time
#pragma unroll
      for (int i = 0; i < EPL; i += 4) {
        const float* r4 = row + (ILV ? (i / 4) * 128 : i);
        const float4 q = SMEM ? *reinterpret_cast<const float4*>(r4) : __ldcg(reinterpret_cast<const float4*>(r4));
        v[i] += q.x;
        v[i + 1] += q.y;
        v[i + 2] += q.z;
        v[i + 3] += q.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (lane * EPL + i < E) v[i] += SMEM ? row[i] : __ldcg(row + i);
    }
    if (SHARED_GATE && lane == 0) gl += SMEM ? logits[p * PSTRIDE + E] : __ldcg(logits + (size_t)p * PSTRIDE + E);
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = expert(i);
    v[i] = e < E ? route_logit<R>(v[i], router_bias, e) : MOE_NEG_INF;
  }
  // Softmax over all experts, then the k largest (no correction bias): the order of the scores is
  // the logits' order (equal logits: equal scores, the lower expert first), so the route picks
  // the k largest logits and computes the k weights alone (LOGIT_ORDER), with no pass over the
  // experts' scores.
  constexpr bool LOGIT_ORDER = !R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX && !R::CORR_BIAS;
  if constexpr (LOGIT_ORDER) {
  } else if constexpr (!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX) {  // softmax over all experts
    float mx = MOE_NEG_INF;
#pragma unroll
    for (int i = 0; i < EPL; ++i) mx = fmaxf(mx, v[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      v[i] = expert(i) < E ? expf(v[i] - mx) : 0.0f;
      sum += v[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < EPL; ++i) v[i] = v[i] / sum;
  } else {
#pragma unroll
    for (int i = 0; i < EPL; ++i) v[i] = route_score<R>(v[i]);
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = expert(i);
    sel[i] = e < E ? v[i] + (R::CORR_BIAS ? corr_bias[e] : 0.0f) : MOE_NEG_INF;
  }
  // Where a lane holds BOUND_MIN (8; 16 in the router's last block, where 8 spilled beside the
  // router's registers) or more experts (BOUND), the k largest as one 64-bit order per expert (the
  // key above the inverted expert index: a larger value first, equal values the lower expert; every
  // entry distinct). T, the k-th largest of the lanes' largest entries, bounds the k-th largest
  // entry from below (k lanes each hold one >= T), so the choices are the k largest of the entries
  // >= T, which only the k lanes whose largest entry is >= T hold (at most k * EPL; about k for
  // logits at random): those are gathered into shared memory and each ranked among the others, a
  // few dependent steps where k rounds of a warp reduction took k, and no lane sorts its experts.
  // Past 32 of them (ties or skewed logits), k rounds, each lane's largest remaining entry found
  // by a pass over its experts. With fewer experts a lane (a round's work is short: the rounds
  // measured as fast), each lane's experts as (key, slot) pairs, sorted once (a bitonic network
  // over the next power of two, the slots past EPL keyed below every expert); each round the warp
  // takes the largest first key (the lowest lane among equal ones) and only that lane shifts its
  // list: one reduction, one ballot and a shift a round.
  if constexpr (BOUND) {
    // T, the k-th largest lane maximum, by 32-bit order keys (equal values equal keys): each
    // lane counts the lanes whose maximum is larger, and T is the smallest maximum with fewer
    // than k larger (one min-reduction)
    u32 k32[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) k32[i] = order_key(sel[i]);
    u32 head = k32[0];
#pragma unroll
    for (int i = 1; i < EPL; ++i) head = max(head, k32[i]);
    int above[4] = {0, 0, 0, 0};  // (four sums: short dependency chains)
#pragma unroll
    for (int m = 0; m < 32; ++m) above[m & 3] += __shfl_sync(0xffffffffu, head, m) > head ? 1 : 0;
    const u32 bound = __reduce_min_sync(0xffffffffu, above[0] + above[1] + above[2] + above[3] < K ? head : 0xffffffffu);
    int cnt = 0;  // this lane's entries >= T
#pragma unroll
    for (int i = 0; i < EPL; ++i) cnt += k32[i] >= bound ? 1 : 0;
    int off = cnt;  // inclusive scan over the lanes
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int o = __shfl_up_sync(0xffffffffu, off, d);
      if (lane >= d) off += o;
    }
    const int total = __shfl_sync(0xffffffffu, off, 31);
    off -= cnt;
    // each candidate's exact key: its order key above the inverted expert (a larger value first,
    // equal values the lower expert; every key distinct and above 0, the empty slots' value)
    auto full_key = [&](int i) { return (unsigned long long)k32[i] << 32 | (0xffffffffu - (u32)expert(i)); };
    if (total <= 32) {
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (k32[i] >= bound) {
          s_cand[off] = full_key(i);
          if constexpr (R::CORR_BIAS) s_cscore[off] = v[i];
          ++off;
        }
      if (lane >= total) s_cand[lane] = 0ull;
      __syncwarp();
      if (lane < total) {
        const unsigned long long me = s_cand[lane];
        int r = 0;
#pragma unroll
        for (int j = 0; j < 32; j += 2) {
          const ulonglong2 o = *reinterpret_cast<const ulonglong2*>(s_cand + j);
          r += (o.x > me ? 1 : 0) + (o.y > me ? 1 : 0);
        }
        if (r < K) {
          ids[r] = (int)(0xffffffffu - (u32)me);
          s_pick[r] = R::CORR_BIAS ? s_cscore[lane] : key_value((u32)(me >> 32));
        }
      }
    } else {
      unsigned long long ent[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) ent[i] = full_key(i);
      auto lane_max = [&]() {  // this lane's largest entry (a tree over its experts)
        unsigned long long m[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) m[i] = ent[i];
#pragma unroll
        for (int s = 1; s < EPL; s *= 2)
#pragma unroll
          for (int i = 0; i + s < EPL; i += 2 * s) m[i] = m[i + s] > m[i] ? m[i + s] : m[i];
        return m[0];
      };
#pragma unroll 1
      for (int j = 0; j < K; ++j) {
        const unsigned long long mine = lane_max();  // (a chosen entry is 0: below every expert's)
        const u32 khi = __reduce_max_sync(0xffffffffu, (u32)(mine >> 32));
        const u32 klo = __reduce_max_sync(0xffffffffu, (u32)(mine >> 32) == khi ? (u32)mine : 0u);
        const unsigned long long best = (unsigned long long)khi << 32 | klo;
        const int e = (int)(0xffffffffu - klo);
        if (lane == (ILV ? (e & 127) >> 2 : e / EPL)) {
#pragma unroll
          for (int i = 0; i < EPL; ++i)
            if (ent[i] == best) {
              ids[j] = e;
              s_pick[j] = R::CORR_BIAS ? v[i] : key_value(khi);  // (without a bias the value is the score)
              ent[i] = 0ull;
            }
        }
      }
    }
  } else {
    u32 ck[P2];
    int ci[P2];
    float cs[R::CORR_BIAS ? P2 : 1];  // the scores, where the selection values are not (a correction bias)
#pragma unroll
    for (int i = 0; i < P2; ++i) {
      ck[i] = i < EPL ? order_key(sel[i]) : 0u;
      ci[i] = i;
      if constexpr (R::CORR_BIAS) cs[i] = i < EPL ? v[i] : 0.0f;
    }
#pragma unroll
    for (int size = 2; size <= P2; size *= 2)
#pragma unroll
      for (int stride = size / 2; stride > 0; stride /= 2)
#pragma unroll
        for (int i = 0; i < P2; ++i) {
          const int o = i ^ stride;
          if (o > i) {  // i's pair: descending where i & size is 0, ascending elsewhere (selects, no branches)
            const bool o_first = ck[o] > ck[i] || (ck[o] == ck[i] && ci[o] < ci[i]);
            const bool sw = o_first == ((i & size) == 0);
            const u32 ki = ck[i], ko = ck[o];
            const int si = ci[i], so = ci[o];
            ck[i] = sw ? ko : ki;
            ck[o] = sw ? ki : ko;
            ci[i] = sw ? so : si;
            ci[o] = sw ? si : so;
            if constexpr (R::CORR_BIAS) {
              const float fi = cs[i], fo = cs[o];
              cs[i] = sw ? fo : fi;
              cs[o] = sw ? fi : fo;
            }
          }
        }
#pragma unroll 1
    for (int j = 0; j < K; ++j) {
      const u32 kmax = __reduce_max_sync(0xffffffffu, ck[0]);
      const int owner = __ffs(__ballot_sync(0xffffffffu, ck[0] == kmax)) - 1;
      if (lane == owner) {
        ids[j] = lane * EPL + ci[0];
        s_pick[j] = R::CORR_BIAS ? cs[0] : key_value(ck[0]);  // (without a bias the value is the score)
#pragma unroll
        for (int i = 0; i + 1 < P2; ++i) {
          ck[i] = ck[i + 1];
          ci[i] = ci[i + 1];
          if constexpr (R::CORR_BIAS) cs[i] = cs[i + 1];
        }
        ck[P2 - 1] = 0u;
      }
    }
  }
  __syncwarp();
  if constexpr (OVERLAP) {  // every choice written: after() (before the others' loads fill the memory
    after();      // pipeline, where its shared-memory accesses and copies would queue), then the others
    __syncwarp();
    mbar_arrive(chosen);
  }
  float all = 0.0f;  // LOGIT_ORDER without RENORM: the sum over every expert of exp(l - the largest l)
  if constexpr (LOGIT_ORDER && !R::RENORM) {
    const float top = s_pick[0];  // the first choice: the largest logit
#pragma unroll
    for (int i = 0; i < EPL; ++i) all += expert(i) < E ? expf(v[i] - top) : 0.0f;
    all = warp_sum(all);
  }
  if constexpr (OVERLAP) {
    if (lane == 0) *all_out = all;
  } else {
    route_weights<K, R>(s_pick, all, w_out);
  }
  if (SHARED_GATE && lane == 0) *gate = 1.0f / (1.0f + expf(-gl));
}

// Each warp routes tokens (lane j keeps the j-th choice); then the hit experts are numbered in
// ascending expert order (slots) and each (token, choice) pair gets a row in its expert's
// contiguous segment. The order of tokens inside a segment is whatever the counters give, which
// changes no result: each token's row is computed independently.
// One block does it all (the last block of the router), or (MULTI, the route kernel) every block
// routes its share of the tokens and adds its per-expert counts into gcnt; the last block to
// finish (integer counter `done`) numbers the slots and places the pairs, and clears gcnt.
// R is the layer's RouteRule (see the top of the file): scoring, selection, bias, groups, scaling.
// group false (the prefill buckets, which group the tokens themselves): only the choices and
// their weights (and the shared-expert gate) are written.
template <int E, int ROWS_PAD, int K, int KSPLIT, int NMAX, bool SHARED_GATE, int THREADS, class R,
          bool MULTI = false>
MOE_DEVICE void route_body(const float* logits, const float* __restrict__ corr_bias,
                           const float* __restrict__ router_bias, int* __restrict__ topk_ids,
                           float* __restrict__ topk_w, int* __restrict__ pair_pos,
                           float* __restrict__ gate_s, int* __restrict__ num_slots,
                           int* __restrict__ slot_expert, int* __restrict__ slot_begin,
                           int* __restrict__ slot_token, int n, float* __restrict__ slot_w = nullptr,
                           const int* __restrict__ token_ids = nullptr, const int* __restrict__ tid2eid = nullptr,
                           int* gcnt = nullptr, int* done = nullptr, bool group = true) {
  // ES experts are scored; the R::ZERO past E are identity experts, which get no slot.
  constexpr int ES = E + R::ZERO;
  constexpr int EPL = (ES + 31) / 32;
  __shared__ int cnt[E];
  __shared__ int cursor[E];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // route_one's rules: each warp's token routed by route_one (the k largest by a bound where a lane
  // holds 8 or more experts, 16 here in the router's last block; the weights from the k choices
  // alone where the order of the scores is the logits'), as the one-token kernel routes; its
  // choices, weights and gate in this warp's room
  constexpr bool ONE = !R::HASH && R::NGROUP == 1 && R::SCORE != MOE_SCORE_SPARSEMIXER && R::ZERO == 0;
  constexpr int OW = ONE ? THREADS / 32 : 1;
  __shared__ __align__(16) unsigned long long one_cand[OW][32];
  __shared__ float one_cscore[ONE && R::CORR_BIAS ? OW : 1][32];
  __shared__ int one_ids[OW][K];
  __shared__ float one_pick[OW][K], one_w[OW][K], one_gate[OW];
  for (int e = threadIdx.x; e < E; e += THREADS) cnt[e] = 0;
  __syncthreads();
  const int first = MULTI ? blockIdx.x * (THREADS / 32) + warp : warp;
  const int step = MULTI ? gridDim.x * (THREADS / 32) : THREADS / 32;
  for (int tk = first; tk < n; tk += step) {
    if constexpr (ONE) {
      route_one<E, K, KSPLIT, (size_t)NMAX * ROWS_PAD, false, SHARED_GATE, R, false, void (*)(), MULTI ? 8 : 16>(
          logits + (size_t)tk * ROWS_PAD, corr_bias, router_bias, one_ids[warp], one_pick[warp], one_w[warp],
          &one_gate[warp], nullptr, 0u, [] {}, one_cand[warp], one_cscore[R::CORR_BIAS ? warp : 0]);
      __syncwarp();
      if (lane < K) {
        const int e = one_ids[warp][lane];
        topk_ids[tk * K + lane] = e;
        topk_w[tk * K + lane] = one_w[warp][lane];
        if (!R::EP || (e >= R::EP_LO && e < R::EP_LO + R::EP_N)) atomicAdd(&cnt[e], 1);  // this rank's experts get slots
      }
      if (SHARED_GATE && lane == 0) gate_s[tk] = one_gate[warp];
      __syncwarp();  // (this warp's room read before its next token)
      continue;
    }
    // v: logits, then scores (what the weights come from); sel: what top-k ranks.
    float v[EPL], sel[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = lane + 32 * i;
      float s = MOE_NEG_INF;
      if (e < ES) {
        s = 0.0f;
#pragma unroll
        for (int p = 0; p < KSPLIT; ++p) s += __ldcg(logits + ((size_t)p * NMAX + tk) * ROWS_PAD + e);
        if constexpr (R::ROUTER_BIAS) s += router_bias[e];
        if constexpr (R::LOGITS_BF16) s = bf16_to_f32(f32_to_bf16(s));
      }
      v[i] = s;
    }
    if constexpr (!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX) {  // softmax over all experts
      float mx = MOE_NEG_INF;
#pragma unroll
      for (int i = 0; i < EPL; ++i) mx = fmaxf(mx, v[i]);
      mx = warp_max(mx);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        v[i] = (lane + 32 * i < ES) ? expf(v[i] - mx) : 0.0f;
        sum += v[i];
      }
      sum = warp_sum(sum);
#pragma unroll
      for (int i = 0; i < EPL; ++i) v[i] = v[i] / sum;
    } else if constexpr (!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SIGMOID) {
#pragma unroll
      for (int i = 0; i < EPL; ++i) v[i] = 1.0f / (1.0f + expf(-v[i]));
    } else if constexpr (!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SQRT_SOFTPLUS) {
#pragma unroll
      for (int i = 0; i < EPL; ++i) v[i] = sqrtf(softplus(v[i]));
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = lane + 32 * i;
      sel[i] = e < ES ? v[i] + (R::CORR_BIAS ? corr_bias[e] : 0.0f) : MOE_NEG_INF;
    }
    if constexpr (R::NGROUP > 1) {  // keep the TOPK_GROUP groups with the largest sum of their top-2 selection values
      constexpr int G = ES / R::NGROUP;
      float gs[R::NGROUP];
#pragma unroll
      for (int gr = 0; gr < R::NGROUP; ++gr) {
        float b1 = MOE_NEG_INF;
        int i1 = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if ((lane + 32 * i) / G == gr && sel[i] > b1) { b1 = sel[i]; i1 = lane + 32 * i; }
        const u32 k1 = __reduce_max_sync(0xffffffffu, order_key(b1));
        i1 = (int)__reduce_min_sync(0xffffffffu, order_key(b1) == k1 ? (u32)i1 : 0x7fffffffu);
        float b2 = MOE_NEG_INF;
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          if ((lane + 32 * i) / G == gr && lane + 32 * i != i1 && sel[i] > b2) b2 = sel[i];
        const u32 k2 = __reduce_max_sync(0xffffffffu, order_key(b2));
        gs[gr] = key_value(k1) + key_value(k2);
      }
      bool keep[R::NGROUP];
#pragma unroll
      for (int gr = 0; gr < R::NGROUP; ++gr) keep[gr] = false;
#pragma unroll
      for (int r = 0; r < R::TOPK_GROUP; ++r) {  // equal group scores: the lower group wins
        int best = -1;
        float best_v = MOE_NEG_INF;
#pragma unroll
        for (int gr = 0; gr < R::NGROUP; ++gr)
          if (!keep[gr] && (best < 0 || gs[gr] > best_v)) { best = gr; best_v = gs[gr]; }
#pragma unroll
        for (int gr = 0; gr < R::NGROUP; ++gr)
          if (gr == best) keep[gr] = true;
      }
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        bool k = false;
#pragma unroll
        for (int gr = 0; gr < R::NGROUP; ++gr)
          if ((lane + 32 * i) / G == gr) k = keep[gr];
        if (!k) sel[i] = MOE_NEG_INF;
      }
    }
    // k rounds of arg-max: warp-wide max of an order-preserving integer key, then the lowest
    // expert index holding it (equal values: the lower expert index wins). my_v: the score (or
    // logit) of this lane's choice, not its biased selection value.
    float my_v = 0.0f;
    int my_e = 0;
    if constexpr (R::HASH) {  // hash layer: the token's row of the table picks the experts; their scores weigh them
      // ids outside [0, VOCAB) read the nearest row (clamped): never a read past the table
      if (lane < K) my_e = tid2eid[(size_t)min(max(token_ids[tk], 0), R::VOCAB - 1) * K + lane];
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        const float cand = __shfl_sync(0xffffffffu, v[i], my_e & 31);
        if (i == (my_e >> 5)) my_v = cand;
      }
    }
    for (int j = 0; j < (R::HASH ? 0 : K); ++j) {
      float bv = MOE_NEG_INF, bs = 0.0f;
      int be = 0x7fffffff;
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (sel[i] > bv) { bv = sel[i]; bs = v[i]; be = lane + 32 * i; }
      const u32 key = order_key(bv);
      const u32 kmax = __reduce_max_sync(0xffffffffu, key);
      be = (int)__reduce_min_sync(0xffffffffu, key == kmax ? (u32)be : 0x7fffffffu);
      bs = __shfl_sync(0xffffffffu, bs, be & 31);
      if (lane == j) { my_v = bs; my_e = be; }
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        if (lane + 32 * i == be) sel[i] = MOE_NEG_INF;
    }
    float w = my_v;
    if constexpr (R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX) {  // softmax over the k chosen logits
      const float top = __shfl_sync(0xffffffffu, my_v, 0);
      w = lane < K ? expf(my_v - top) : 0.0f;
      w = w / warp_sum(w);
    } else if constexpr (R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SIGMOID) {
      w = 1.0f / (1.0f + expf(-my_v));
    } else if constexpr (R::SCORE == MOE_SCORE_SPARSEMIXER) {
      // Phi-3.5: round j's pick is the largest remaining logit; the softmax runs over the remaining
      // logits l with (top - l) / max(|l|, top) <= 2 eps, so the pick's weight is 1 / sum.
      for (int j = 0; j < K; ++j) {
        const float top = __shfl_sync(0xffffffffu, my_v, j);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
          const int e = lane + 32 * i;
          bool gone = e >= ES;
          for (int jj = 0; jj < j; ++jj) gone |= e == __shfl_sync(0xffffffffu, my_e, jj);
          const bool drop = (top - v[i]) / fmaxf(fabsf(v[i]), top) > 2.0f * R::SPARSEMIXER_EPS;
          sum += (gone || drop) ? 0.0f : expf(v[i] - top);
        }
        sum = warp_sum(sum);
        if (lane == j) w = 1.0f / sum;
      }
    }
    if constexpr (R::RENORM) w = w / warp_sum(lane < K ? w : 0.0f);
    w *= R::SCALE;
    if (lane < K) {
      topk_ids[tk * K + lane] = my_e;
      topk_w[tk * K + lane] = w;
      // Only this rank's experts (expert parallelism) and no identity expert get a slot.
      if ((R::ZERO == 0 || my_e < E) && (!R::EP || (my_e >= R::EP_LO && my_e < R::EP_LO + R::EP_N)))
        atomicAdd(&cnt[my_e], 1);
    }
    if (SHARED_GATE && lane == 0) {
      float s = 0.0f;
#pragma unroll
      for (int p = 0; p < KSPLIT; ++p) s += __ldcg(logits + ((size_t)p * NMAX + tk) * ROWS_PAD + ES);
      gate_s[tk] = 1.0f / (1.0f + expf(-s));
    }
  }
  if (!group) return;
  __syncthreads();
  if constexpr (MULTI) {  // this block's counts into the global ones; the last block goes on with all of them
    __shared__ int is_last;
    for (int e = threadIdx.x; e < E; e += THREADS)
      if (cnt[e]) atomicAdd(gcnt + e, cnt[e]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      is_last = atomicAdd(done, 1) == (int)gridDim.x - 1;
      if (is_last) *done = 0;  // every block has counted: ready for the next call
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < E; e += THREADS) {
      cnt[e] = __ldcg(gcnt + e);
      gcnt[e] = 0;  // cleared for the next call
    }
    __syncthreads();
  }
  {  // number the hit experts in ascending order (slots); segment starts by a block-wide prefix
    // sum over the experts: thread t takes EPT consecutive ones (one pass over E; a pass of
    // THREADS experts at a time took E / THREADS passes, each two block barriers)
    constexpr int EPT = (E + THREADS - 1) / THREADS;
    __shared__ int warp_c[THREADS / 32], warp_f[THREADS / 32];
    int c[EPT], ci = 0, fi = 0;
#pragma unroll
    for (int i = 0; i < EPT; ++i) {
      const int e = threadIdx.x * EPT + i;
      c[i] = e < E ? cnt[e] : 0;
      ci += c[i];
      fi += c[i] > 0;
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int co = __shfl_up_sync(0xffffffffu, ci, o), fo = __shfl_up_sync(0xffffffffu, fi, o);
      if (lane >= o) { ci += co; fi += fo; }
    }
    if (lane == 31) { warp_c[warp] = ci; warp_f[warp] = fi; }
    __syncthreads();
    if (warp == 0) {
      int wc = lane < THREADS / 32 ? warp_c[lane] : 0, wf = lane < THREADS / 32 ? warp_f[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int co = __shfl_up_sync(0xffffffffu, wc, o), fo = __shfl_up_sync(0xffffffffu, wf, o);
        if (lane >= o) { wc += co; wf += fo; }
      }
      if (lane < THREADS / 32) { warp_c[lane] = wc; warp_f[lane] = wf; }
    }
    __syncthreads();
    if (warp > 0) { ci += warp_c[warp - 1]; fi += warp_f[warp - 1]; }
    int b = ci, f = fi;  // past this thread's experts: walk them back
#pragma unroll
    for (int i = EPT - 1; i >= 0; --i) {
      b -= c[i];
      if (c[i] > 0) {
        const int e = threadIdx.x * EPT + i;
        slot_expert[f - 1] = e - R::EP_LO;  // the expert's index among this rank's weights
        slot_begin[f - 1] = b;
        cursor[e] = b;
        --f;
      }
    }
    if (threadIdx.x == 0) {
      *num_slots = warp_f[THREADS / 32 - 1];
      slot_begin[warp_f[THREADS / 32 - 1]] = warp_c[THREADS / 32 - 1];
    }
  }
  __syncthreads();
  // Four pairs a thread at a time: their choices read together, one round trip for four.
  for (int p0 = threadIdx.x; p0 < n * K; p0 += 4 * THREADS) {
    int ids[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int p = min(p0 + u * THREADS, n * K - 1);
      ids[u] = MULTI ? __ldcg(topk_ids + p) : topk_ids[p];  // MULTI: other blocks wrote them
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int p = p0 + u * THREADS, e = ids[u];
      if (p >= n * K) break;
      if ((R::ZERO > 0 && e >= E) || (R::EP && (e < R::EP_LO || e >= R::EP_LO + R::EP_N))) {
        pair_pos[p] = -1;  // an identity expert (w * x in the combine) or another rank's expert
        continue;
      }
      const int pos = atomicAdd(&cursor[e], 1);
      pair_pos[p] = pos;
      slot_token[pos] = p / K;
      if constexpr (R::WEIGHT_ON_INPUT) slot_w[pos] = MULTI ? __ldcg(topk_w + p) : topk_w[p];
    }
  }
}


// The route as its own kernel (token buckets too large for the fused form): one token per warp,
// as many blocks as the bucket needs; the last block groups the tokens by expert, up to GROUP_MAX
// tokens (the decode buckets; 0: every N), not past it (the prefill buckets group them themselves).
template <int E, int ROWS_PAD, int K, int KSPLIT, int NMAX, bool SHARED_GATE, int THREADS, int GROUP_MAX = 0>
MOE_DEVICE void route_kernel_body(const float* __restrict__ logits, int* route_cnt, int* route_done,
                                  const float* __restrict__ corr_bias,
                                  const float* __restrict__ router_bias, int* __restrict__ topk_ids,
                                  float* __restrict__ topk_w, int* __restrict__ pair_pos,
                                  float* __restrict__ gate_s, int* __restrict__ num_slots,
                                  int* __restrict__ slot_expert, int* __restrict__ slot_begin,
                                  int* __restrict__ slot_token, int n, float* __restrict__ slot_w = nullptr,
                           const int* __restrict__ token_ids = nullptr, const int* __restrict__ tid2eid = nullptr) {
  grid_dep_wait();
  grid_dep_launch();
  route_body<E, ROWS_PAD, K, KSPLIT, NMAX, SHARED_GATE, THREADS, RouteRule, true>(
      logits, corr_bias, router_bias, topk_ids, topk_w, pair_pos, gate_s, num_slots, slot_expert, slot_begin,
      slot_token, n, slot_w, token_ids, tid2eid, route_cnt, route_done, GROUP_MAX == 0 || n <= GROUP_MAX);
}

// ---- expert GEMV family: router logits, fused gate/up + activation, down projection ----
// Every block streams one 16-row weight tile once and applies it to all tokens that need it.

// Router logits (and the shared-expert gate logit as row E): rows of the packed router matrix
// times every token. K is split over KSPLIT blocks per tile, whose partial sums are added in a
// fixed order (no floating-point atomics). With ROUTE, the last block to finish (an integer
// counter) routes the tokens itself, adding the partials as it reads them: one launch fewer on
// the small-batch path. Without it, the last block of each tile adds the tile's partials into
// partial 0, so that the route kernel (one block) reads one partial per logit, not KSPLIT.
// route_done: [0] the route's counter, [1 + tile] the tiles' counters.
// RT > 1 (the prefill buckets: no K split, no route): a block takes RT consecutive 16-row tiles as
// RT matrices over the same activation rows, so that each token's row is read once per RT tiles.
template <int KC, int NT, int WARPS, int DEPTH, int KSPLIT, int ROWS_PAD, int NMAX, bool ROUTE, int E, int K,
          bool SHARED_GATE, int RT = 1>
MOE_DEVICE void router_logits_body(const uint4* __restrict__ wr, const bf16_t* __restrict__ x,
                                   float* logits, int* route_done, const float* __restrict__ corr_bias,
                                   const float* __restrict__ router_bias, int* __restrict__ topk_ids,
                                   float* __restrict__ topk_w, int* __restrict__ pair_pos,
                                   float* __restrict__ gate_s, int* __restrict__ num_slots,
                                   int* __restrict__ slot_expert, int* __restrict__ slot_begin,
                                   int* __restrict__ slot_token, int n, float* __restrict__ slot_w = nullptr,
                                   const int* __restrict__ token_ids = nullptr,
                                   const int* __restrict__ tid2eid = nullptr) {
  constexpr int KC_PART = KC / KSPLIT;
  static_assert(RT == 1 || (KSPLIT == 1 && !ROUTE), "row tiles a block: without a K split or the route");
  using G = TileGemv<KC_PART, RT, NT, WARPS, DEPTH, MOE_W_BF16, (RT > 1 ? KC * 64 : 0)>;
  __shared__ uint4 red[G::SMEM_BYTES / 16];
  const int tile = blockIdx.x / KSPLIT, part = blockIdx.x % KSPLIT;
  const uint4* a = wr + ((size_t)tile * RT * KC + part * KC_PART) * 64;
  const bf16_t* xs = x + part * KC_PART * 32;
  grid_dep_wait();
  grid_dep_launch();
  // The grid's y splits the tokens (prefill buckets: one pass of 8 * NT tokens a block).
  for (int n0 = blockIdx.y * 8 * NT; n0 < n; n0 += gridDim.y * 8 * NT) {
    G::run(a, xs, KC * 32, nullptr, n0, n, red);
    for (int i = threadIdx.x; i < RT * NT * 128; i += WARPS * 32) {
      const int mt = i / (NT * 128), j = (i >> 7) % NT, col = (i >> 4) & 7, r = i & 15, tk = n0 + j * 8 + col;
      if (tk < n)
        logits[((size_t)part * NMAX + tk) * ROWS_PAD + (tile * RT + mt) * 16 + r] = G::result(red, j, mt, r, col);
    }
    __syncthreads();
  }
  if constexpr (ROUTE) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      is_last = atomicAdd(route_done, 1) == (int)gridDim.x - 1;
      if (is_last) *route_done = 0;  // all blocks have counted: ready for the next call
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    route_body<E, ROWS_PAD, K, KSPLIT, NMAX, SHARED_GATE, WARPS * 32, RouteRule>(
        logits, corr_bias, router_bias, topk_ids, topk_w, pair_pos, gate_s, num_slots, slot_expert, slot_begin,
        slot_token, n, slot_w, token_ids, tid2eid);
  } else if constexpr (KSPLIT > 1) {
    // One counter per (tile, y): the last of a tile's K parts adds the partials of the tokens its
    // y covers, so that no block adds all of them (the grid's y splits the tokens from 32 on).
    __shared__ int tile_last;
    int* done = route_done + 1 + tile * gridDim.y + blockIdx.y;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      tile_last = atomicAdd(done, 1) == KSPLIT - 1;
      if (tile_last) *done = 0;  // every part of this tile has counted
    }
    __syncthreads();
    if (!tile_last) return;
    __threadfence();
    for (int n0 = blockIdx.y * 8 * NT; n0 < n; n0 += gridDim.y * 8 * NT) {
      for (int i = threadIdx.x; i < 8 * NT * 16; i += WARPS * 32) {  // 0 + p0 + p1 + ...: the route's order
        if (n0 + (i >> 4) >= n) break;
        float* p0 = logits + (size_t)(n0 + (i >> 4)) * ROWS_PAD + tile * 16 + (i & 15);
        float s = 0.0f;
#pragma unroll
        for (int p = 0; p < KSPLIT; ++p) s += __ldcg(p0 + (size_t)p * NMAX * ROWS_PAD);
        *p0 = s;
      }
    }
  }
}

// A routed expert's activation of one gate/up row for one token, in bf16: the expert's biases
// (row = e * I + i), the routing weight on the input where the rule puts it there (w * (x . g)),
// the clamped activation.
MOE_DEVICE bf16_t routed_act(float gv, float uv, const float* __restrict__ b_gate, const float* __restrict__ b_up,
                             size_t row, const float* __restrict__ slot_w, int pair) {
  if constexpr (ActRule::EXPERT_BIAS) {
    gv += b_gate[row];
    uv += b_up[row];
  }
  if constexpr (RouteRule::WEIGHT_ON_INPUT) {
    const float w = slot_w[pair];
    gv *= w;
    uv *= w;
  }
  return f32_to_bf16(activate<true>(gv, uv));
}

// Gate/up projections of one 16-column tile of one expert's FFN, then the activation:
// act[p, i] = bf16(silu(x_p . g_i) * (x_p . u_i)) for every token p routed to the expert.
// Blocks past the routed slots compute the shared expert over all tokens.
// FP8: s13 holds the gate then the up scales [2][E][I/128][H/128] (ss13: [2][IS/128][H/128]).
// FP8 per-tensor: s13 [E][gate, up][weight scale, input scale] (ss13 likewise, without E).
// MXFP4: s13 holds E8M0 bytes [E][tile][chunk][gate, up][16 rows] (ss13 likewise, without E).
// NVFP4: s13 holds per tile e4m3 bytes [chunk][gate, up][2 blocks of 16][16 rows], then the two scale_2.
template <int KC, int NT, int NTS, int WARPS, int DEPTH, int DEPTHS, int TI, int TIS, int I, int IS, int FMT, int FMTS,
          int E>
MOE_DEVICE void gate_up_body(const uint4* __restrict__ w13, const uint4* __restrict__ ws13,
                             const float* __restrict__ s13, const float* __restrict__ ss13,
                             const bf16_t* __restrict__ x, const int* __restrict__ num_slots,
                             const int* __restrict__ slot_expert, const int* __restrict__ slot_begin,
                             const int* __restrict__ slot_token, bf16_t* __restrict__ act,
                             bf16_t* __restrict__ act_s, int n, const float* __restrict__ slot_w = nullptr,
                             const float* __restrict__ b_gate = nullptr, const float* __restrict__ b_up = nullptr,
                             const bf16_t* __restrict__ xq = nullptr, const float* __restrict__ sx = nullptr,
                             const bf16_t* __restrict__ xt = nullptr, const bf16_t* __restrict__ xt_s = nullptr,
                             const float* __restrict__ s2 = nullptr, const float* __restrict__ ss2 = nullptr) {
  using GR = TileGemv<KC, 2, NT, WARPS, DEPTH, FMT>;
  using GS = TileGemv<KC, 2, NTS, WARPS, DEPTHS, FMTS>;  // the shared expert's ring: its own format's depth
  // (a layer without a shared expert reserves nothing for it: 5 BF16-sized rings a multiprocessor,
  // not 2, for the FP4 layers)
  constexpr int SMEM = TIS > 0 && GS::SMEM_BYTES > GR::SMEM_BYTES ? GS::SMEM_BYTES : GR::SMEM_BYTES;
  __shared__ uint4 red[SMEM / 16];
  constexpr int KB = KC / 4;  // 128-wide K blocks (FP8 scales)
  // The grid is TIS shared-expert tiles, then (expert slots of the bucket) x TI routed tiles: the
  // shared expert's blocks, which need not wait for the routing, are scheduled first, beside the
  // router's last blocks, and stream while the route runs.
  if ((int)blockIdx.x >= TIS) {
    const int slot = (blockIdx.x - TIS) / TI, tile = (blockIdx.x - TIS) % TI;
    grid_dep_wait();  // routing must be complete
    grid_dep_launch();
    if (slot >= *num_slots) return;
    const int e = slot_expert[slot], begin = slot_begin[slot], m = slot_begin[slot + 1] - begin;
    const uint4* a = w13 + ((size_t)e * TI + tile) * KC * GR::AU * 32;
    const float* sc = FMT == MOE_W_MXFP4 ? mx_scales(s13, (size_t)e * TI + tile, KC, 2)
                      : FMT == MOE_W_NVFP4 ? nv_scales(s13, (size_t)e * TI + tile, KC, 2)
                      : FMT == MOE_W_FP8_TENSOR ? s13 + (size_t)e * 4
                      : FMT == MOE_W_BF16 ? nullptr : s13 + ((size_t)e * (I / 128) + tile / 8) * KB;
    const int sc_stride = FMT == MOE_W_FP8_TENSOR ? 2 : E * (I / 128) * KB;
    // FP8 per-tensor: the pairs' rows of x as moe_tensor_quant wrote them (in slot order), and the
    // activations quantized here by down's input scale, once
    constexpr bool T8 = FMT == MOE_W_FP8_TENSOR;
    const float s_down = T8 ? __ldg(s2 + (size_t)e * 2 + 1) : 0.0f;
    for (int n0 = 0; n0 < m; n0 += 8 * NT) {
      GR::run(a, FMT == MOE_W_FP8_BLOCK_A8 ? xq : T8 ? xt + (size_t)begin * KC * 32 : x, KC * 32,
              T8 ? nullptr : slot_token + begin, n0, m, red, sc, sc_stride, nv_scale2(sc, KC, 2), sx);
      for (int i = threadIdx.x; i < NT * 128; i += WARPS * 32) {
        const int j = i >> 7, col = (i >> 4) & 7, r = i & 15, tk = n0 + j * 8 + col;
        if (tk < m) {
          const bf16_t v = routed_act(GR::result(red, j, 0, r, col), GR::result(red, j, 1, r, col), b_gate, b_up,
                                      (size_t)e * I + tile * 16 + r, slot_w, begin + tk);
          act[(size_t)(begin + tk) * I + tile * 16 + r] = T8 ? quant_e4m3(v, s_down) : v;
        }
      }
      __syncthreads();
    }
  } else if constexpr (TIS > 0) {
    // The shared expert reads only x and its weights: it need not wait for the routing (with FP8
    // activations, or FP8 per-tensor weights, it reads x's codes, which the kernel before it writes).
    constexpr bool T8S = FMTS == MOE_W_FP8_TENSOR;
    if constexpr (FMTS == MOE_W_FP8_BLOCK_A8 || T8S) grid_dep_wait();
    grid_dep_launch();
    const int tile = blockIdx.x;
    const uint4* a = ws13 + (size_t)tile * KC * GS::AU * 32;
    const float* sc = FMTS == MOE_W_MXFP4 ? mx_scales(ss13, tile, KC, 2)
                      : FMTS == MOE_W_NVFP4 ? nv_scales(ss13, tile, KC, 2)
                      : FMTS == MOE_W_FP8_TENSOR ? ss13
                      : FMTS == MOE_W_BF16 ? nullptr : ss13 + (size_t)(tile / 8) * KB;
    const float s_down = T8S ? __ldg(ss2 + 1) : 0.0f;
    for (int n0 = 0; n0 < n; n0 += 8 * NTS) {
      GS::run(a, FMTS == MOE_W_FP8_BLOCK_A8 ? xq : T8S ? xt_s : x, KC * 32, nullptr, n0, n, red, sc,
              T8S ? 2 : (IS / 128) * KB, nv_scale2(sc, KC, 2), sx);
      for (int i = threadIdx.x; i < NTS * 128; i += WARPS * 32) {
        const int j = i >> 7, col = (i >> 4) & 7, r = i & 15, tk = n0 + j * 8 + col;
        if (tk < n) {
          const float gv = GS::result(red, j, 0, r, col), uv = GS::result(red, j, 1, r, col);
          const bf16_t v = f32_to_bf16(activate<ActRule::SHARED_LIMIT>(gv, uv));
          act_s[(size_t)tk * IS + tile * 16 + r] = T8S ? quant_e4m3(v, s_down) : v;
        }
      }
      __syncthreads();
    }
  }
}

// The weighted sum of a token's choices at output columns h .. h + V - 1: acc[v] = sum_j w[t, j] *
// y(j)[v] in choice order, y(j, yv) the choice's expert output; a zero (identity) expert
// contributes w * x (on one rank), and with expert parallelism another rank's expert nothing.
// Llama-4 weighted the input instead (w = 1).
template <int K, int H, int V, class Y>
MOE_DEVICE void weighted_choices(float (&acc)[V], int tk, int h, const float* __restrict__ topk_w,
                                 const int* __restrict__ topk_ids, const int* __restrict__ pair_pos,
                                 const bf16_t* __restrict__ x, Y y) {
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.0f;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const float w = RouteRule::WEIGHT_ON_INPUT ? 1.0f : topk_w[tk * K + j];
    if (RouteRule::ZERO > 0 && topk_ids[tk * K + j] >= RouteRule::E_REAL) {
      if constexpr (RouteRule::EP_RANK0) {  // added on one rank
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] = fmaf(w, bf16_to_f32(x[(size_t)tk * H + h + v]), acc[v]);
      }
    } else if (!RouteRule::EP || pair_pos[tk * K + j] >= 0) {
      float yv[V];
      y(j, yv);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = fmaf(w, yv[v], acc[v]);
    }
  }
}

// Down projection of TPB 16-row tiles of the hidden dimension (one block: TPB*16 rows, packed
// as TPB matrices per chunk) for one expert's tokens: y[p, h] = act[p, :] . d_h in fp32. Blocks
// past the routed slots do the shared expert. The last block to finish a row group (a counter
// per group, integer atomics only) writes that part of the output:
// out[t, h] = sum_j w[t, j] * y[pair(t, j), h] (+ gate[t] * ys[t, h]), choices in order, so the
// sum does not depend on which block came last.
// FP8: s2 [E][H/128][I/128], ss2 [H/128][IS/128]; a block's TPB tiles share one 128-row block.
// FP8 per-tensor: s2 [E][weight scale, input scale] (ss2 without E); the TPB tiles share them.
// MXFP4: s2 E8M0 bytes [E][row group][chunk][TPB tiles][16 rows] (ss2 likewise, without E).
// NVFP4: s2 per row group e4m3 bytes [chunk][TPB tiles][2 blocks of 16][16 rows], then TPB scale_2.
template <int KC, int KCS, int NT, int NTS, int WARPS, int DEPTH, int DEPTHS, int TPB, int TH, int H, int K,
          bool SHARED_GATE, int FMT, int FMTS, int E_LOCAL, bool PREFETCH>
MOE_DEVICE void down_body(const uint4* __restrict__ w2, const uint4* __restrict__ ws2,
                          const float* __restrict__ s2, const float* __restrict__ ss2,
                          const bf16_t* __restrict__ act, const bf16_t* __restrict__ act_s,
                          const int* __restrict__ num_slots, const int* __restrict__ slot_expert,
                          const int* __restrict__ slot_begin, float* y, float* ys,
                          const float* __restrict__ topk_w, const int* __restrict__ pair_pos,
                          const float* __restrict__ gate_s, int* tile_done, bf16_t* __restrict__ out, int n,
                          const float* __restrict__ b_down = nullptr, const bf16_t* __restrict__ x = nullptr,
                          const int* __restrict__ topk_ids = nullptr, const bf16_t* __restrict__ actq = nullptr,
                          const float* __restrict__ sa = nullptr, const bf16_t* __restrict__ actq_s = nullptr,
                          const float* __restrict__ sas = nullptr) {
  constexpr int ROWS = 16 * TPB;  // rows of one block; TH = H / ROWS row groups
  using GR = TileGemv<KC, TPB, NT, WARPS, DEPTH, FMT>;
  using GS = TileGemv<(KCS > 0 ? KCS : 1), TPB, NTS, WARPS, DEPTHS, FMTS>;
  static_assert(128 % ROWS == 0, "a block's rows lie in one 128-row scale block");
  constexpr int SMEM = KCS > 0 && GS::SMEM_BYTES > GR::SMEM_BYTES ? GS::SMEM_BYTES : GR::SMEM_BYTES;
  __shared__ uint4 red[SMEM / 16];
  __shared__ int is_last;
  // Blocks in row-group order: a group's routed slots, then its shared-expert block, so that the
  // groups complete (and are summed by their last block) one after another while the rest stream.
  const int per_group = gridDim.x / TH, routed_slots = per_group - (KCS > 0 ? 1 : 0);
  const int group = blockIdx.x / per_group, slot = blockIdx.x % per_group;
  const bool routed = slot < routed_slots;
  if (PREFETCH && routed && threadIdx.x == 0) {
    // Before the wait, while gate/up may still run: this block's weight tile into L2. The routing
    // is complete here (gate/up's routed blocks let this grid start only after their own wait on
    // it); read past L1 all the same. A hint only: results never depend on it, and the expert
    // index is clamped so that the address stays inside the weights whatever was read.
    if (slot < __ldcg(num_slots)) {
      const int e = min(max(__ldcg(slot_expert + slot), 0), E_LOCAL - 1);
      prefetch_l2(w2 + ((size_t)e * TH + group) * KC * GR::AU * 32, KC * GR::AU * 512);
    }
  } else if (PREFETCH && KCS > 0 && threadIdx.x == 0) {  // the shared expert's tile needs no routing
    prefetch_l2(ws2 + (size_t)group * KCS * GS::AU * 32, KCS * GS::AU * 512);
  }
  grid_dep_wait();
  grid_dep_launch();
  if (routed) {
    if (slot >= *num_slots) return;
    const int e = slot_expert[slot], begin = slot_begin[slot], m = slot_begin[slot + 1] - begin;
    const uint4* a = w2 + ((size_t)e * TH + group) * KC * GR::AU * 32;
    const float* sc = FMT == MOE_W_MXFP4 ? mx_scales(s2, (size_t)e * TH + group, KC, TPB)
                      : FMT == MOE_W_NVFP4 ? nv_scales(s2, (size_t)e * TH + group, KC, TPB)
                      : FMT == MOE_W_FP8_TENSOR ? s2 + (size_t)e * 2
                      : FMT == MOE_W_BF16 ? nullptr : s2 + ((size_t)e * (H / 128) + group * ROWS / 128) * (KC / 4);
    const bf16_t* xa = (FMT == MOE_W_FP8_BLOCK_A8 ? actq : act) + (size_t)begin * KC * 32;
    const float* xs = FMT == MOE_W_FP8_BLOCK_A8 ? sa + (size_t)begin * (KC / 4) : nullptr;
    for (int n0 = 0; n0 < m; n0 += 8 * NT) {
      GR::run(a, xa, KC * 32, nullptr, n0, m, red, sc, 0, nv_scale2(sc, KC, TPB), xs);
      for (int i = threadIdx.x; i < NT * 128 * TPB; i += WARPS * 32) {
        const int mt = i / (NT * 128), j = (i >> 7) % NT, col = (i >> 4) & 7, r = i & 15, tk = n0 + j * 8 + col;
        if (tk < m) {
          float v = GR::result(red, j, mt, r, col);
          if constexpr (ActRule::EXPERT_BIAS) v += b_down[(size_t)e * H + group * ROWS + mt * 16 + r];
          y[(size_t)(begin + tk) * H + group * ROWS + mt * 16 + r] = v;
        }
      }
      __syncthreads();
    }
  } else {
    const uint4* a = ws2 + (size_t)group * KCS * GS::AU * 32;
    const float* sc = FMTS == MOE_W_MXFP4 ? mx_scales(ss2, group, KCS, TPB)
                      : FMTS == MOE_W_NVFP4 ? nv_scales(ss2, group, KCS, TPB)
                      : FMTS == MOE_W_FP8_TENSOR ? ss2
                      : FMTS == MOE_W_BF16 ? nullptr : ss2 + (size_t)(group * ROWS / 128) * (KCS / 4);
    for (int n0 = 0; n0 < n; n0 += 8 * NTS) {
      GS::run(a, FMTS == MOE_W_FP8_BLOCK_A8 ? actq_s : act_s, KCS * 32, nullptr, n0, n, red, sc, 0,
              nv_scale2(sc, KCS, TPB), sas);
      for (int i = threadIdx.x; i < NTS * 128 * TPB; i += WARPS * 32) {
        const int mt = i / (NTS * 128), j = (i >> 7) % NTS, col = (i >> 4) & 7, r = i & 15, tk = n0 + j * 8 + col;
        if (tk < n) ys[(size_t)tk * H + group * ROWS + mt * 16 + r] = GS::result(red, j, mt, r, col);
      }
      __syncthreads();
    }
  }
  // Publish this block's rows, then count it; the block that completes the group combines it.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int expect = *num_slots + (KCS > 0 ? 1 : 0);  // read again: not held across the GEMV
    is_last = atomicAdd(&tile_done[group], 1) == expect - 1;
    if (is_last) tile_done[group] = 0;  // every block of this group has counted: ready for the next call
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Four rows of one token a thread (float4 reads of its choices' rows), two such in flight: the
  // sums of a group take a few round trips to L2 at any N, not one per 4 tokens.
  constexpr int R4 = ROWS / 4, THREADS = WARPS * 32;
  for (int i0 = threadIdx.x; i0 < n * R4; i0 += 2 * THREADS) {
    float acc[2][4];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = min(i0 + u * THREADS, n * R4 - 1), tk = i / R4, h = group * ROWS + (i % R4) * 4;
      weighted_choices<K, H>(acc[u], tk, h, topk_w, topk_ids, pair_pos, x, [&](int j, float (&v)[4]) {
        const float4 q = __ldcg(reinterpret_cast<const float4*>(y + (size_t)pair_pos[tk * K + j] * H + h));
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
      });
      if constexpr (KCS > 0) {
        const float gs = SHARED_GATE ? gate_s[tk] : 1.0f;
        const float4 q = __ldcg(reinterpret_cast<const float4*>(ys + (size_t)tk * H + h));
        acc[u][0] = fmaf(gs, q.x, acc[u][0]), acc[u][1] = fmaf(gs, q.y, acc[u][1]);
        acc[u][2] = fmaf(gs, q.z, acc[u][2]), acc[u][3] = fmaf(gs, q.w, acc[u][3]);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = i0 + u * THREADS, tk = i / R4, h = group * ROWS + (i % R4) * 4;
      if (i < n * R4)
        *reinterpret_cast<uint2*>(out + (size_t)tk * H + h) =
            make_uint2(pack_bf16x2(acc[u][0], acc[u][1]), pack_bf16x2(acc[u][2], acc[u][3]));
    }
  }
}

// ---- FP8 per-tensor weights: x quantized by the experts' static input scales ----
// FP8 per-tensor weights (ModelOpt FP8): the rows gate/up's GEMV reads, quantized once rather than
// in every weight tile, e4m3(x / s) saturating and held in bf16 exactly. ROUTED: a row per routed
// (token, choice) pair in slot order (the rows of act), by its expert's static input scale (gate's,
// equal to up's: the loader checks it), into xt; SHARED: a row per token by the shared expert's,
// into xt_s. A warp per 256 columns of a row, grid-strided.
template <int H, bool ROUTED, bool SHARED>
MOE_DEVICE void tensor_quant_body(const bf16_t* __restrict__ x, const float* __restrict__ s13,
                                  const float* __restrict__ ss13, const int* __restrict__ num_slots,
                                  const int* __restrict__ slot_expert, const int* __restrict__ slot_begin,
                                  const int* __restrict__ slot_token, bf16_t* __restrict__ xt,
                                  bf16_t* __restrict__ xt_s, int n) {
  static_assert(H % 8 == 0, "whole 16-byte pieces");
  constexpr int PIECES = (H + 255) / 256;
  grid_dep_wait();  // the routing is complete, and the last call's readers of xt are done
  grid_dep_launch();
  const int slots = ROUTED ? *num_slots : 0, pairs = ROUTED ? slot_begin[slots] : 0;
  const int rows = pairs + (SHARED ? n : 0), lane = threadIdx.x & 31, warps = gridDim.x * (blockDim.x >> 5);
  for (int w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < rows * PIECES; w += warps) {
    const int r = w / PIECES, c = (w % PIECES) * 256 + lane * 8;
    if (c >= H) continue;
    const bf16_t* src;
    bf16_t* dst;
    float s;
    if (r < pairs) {  // the slot holding row r: slot_begin[lo] <= r < slot_begin[lo + 1]
      int lo = 0, hi = slots - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (slot_begin[mid] <= r) lo = mid; else hi = mid - 1;
      }
      s = __ldg(s13 + (size_t)slot_expert[lo] * 4 + 1);
      src = x + (size_t)slot_token[r] * H;
      dst = xt + (size_t)r * H;
    } else {
      s = __ldg(ss13 + 1);
      src = x + (size_t)(r - pairs) * H;
      dst = xt_s + (size_t)(r - pairs) * H;
    }
    const uint4 v = *reinterpret_cast<const uint4*>(src + c);
    *reinterpret_cast<uint4*>(dst + c) =
        make_uint4(quant_e4m3x2(v.x, s), quant_e4m3x2(v.y, s), quant_e4m3x2(v.z, s), quant_e4m3x2(v.w, s));
  }
}

// ---- FP8 activations (MODELS.md format a): per token and 128 channels ----
// s = max(amax, 1e-4) / 448 in fp32; the codes e4m3(v / s) are kept as their bf16 values (exact),
// which the FP8 GEMMs multiply on the tensor cores, scaling each chunk's sums by s. A warp per
// (row, 128 channels), grid-strided.
MOE_DEVICE void quant_rows(const bf16_t* __restrict__ src, bf16_t* __restrict__ q, float* __restrict__ s, int k,
                           int rows, int first_warp, int warps) {
  const int lane = threadIdx.x & 31, kb_count = k / 128;
  for (int w = first_warp; w < rows * kb_count; w += warps) {
    const int row = w / kb_count, kb = w % kb_count;
    const size_t at = (size_t)row * k + kb * 128 + lane * 4;
    const uint2 v = *reinterpret_cast<const uint2*>(src + at);
    const float sc = group_scale_e4m3(v);
    *reinterpret_cast<uint2*>(q + at) = make_uint2(quant_e4m3x2(v.x, sc), quant_e4m3x2(v.y, sc));
    if (lane == 0) s[(size_t)row * kb_count + kb] = sc;
  }
}

template <int K, int THREADS>
MOE_DEVICE void act_quant_body(const bf16_t* __restrict__ src, bf16_t* __restrict__ q, float* __restrict__ s, int n) {
  grid_dep_wait();  // the previous kernels (and the last call's readers of q) are done
  grid_dep_launch();
  quant_rows(src, q, s, K, n, blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), gridDim.x * (THREADS / 32));
}

// The routed activations (n * KR rows of I) and the shared expert's (n rows of IS, where KS).
template <int I, int KR, int IS, int KS, int THREADS>
MOE_DEVICE void act_quant2_body(const bf16_t* __restrict__ act, bf16_t* __restrict__ actq, float* __restrict__ sa,
                                const bf16_t* __restrict__ act_s, bf16_t* __restrict__ actq_s,
                                float* __restrict__ sas, int n) {
  grid_dep_wait();
  grid_dep_launch();
  const int first = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), warps = gridDim.x * (THREADS / 32);
  if constexpr (KR > 0) quant_rows(act, actq, sa, I, n * KR, first, warps);
  if constexpr (KS > 0) quant_rows(act_s, actq_s, sas, IS, n, first, warps);
}

// ---- small batches: the whole expert in one kernel, down split over K ----
// Thread-block clusters of two: the blocks of one pair compute the gate/up + activation of the
// two 16-row tiles 2c and 2c+1 of one expert, exchange them through distributed shared memory
// (the 32 activations of down's K chunk c), and each then multiplies its half of down's row groups
// by that chunk. The result is down's partial sum over chunk c, written per (chunk, token row)
// to `part` without atomics; moe_combine adds the chunks in order and weighs the experts. The
// ring carries gate/up's chunks and then down's row groups, so the down weights are in flight
// while gate/up finishes: one stream per block, no kernel boundary between gate/up and down.
MOE_DEVICE u32 cluster_map(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
MOE_DEVICE uint4 ld_cluster_u4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 { %0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
MOE_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// part: [I/32 chunks][NF*K token rows][H] fp32 (rows as the route numbers the pairs); part_s:
// [IS/32][NF][H] for the shared expert. KCD = I/32, KCDS = IS/32; GB = this block's row groups.
template <int KC, int KCD, int KCDS, int WARPS, int DEPTH, int TI, int TIS, int I, int TPB, int TH, int H, int NF,
          int K>
MOE_DEVICE void expert_fused_body(const uint4* __restrict__ w13, const uint4* __restrict__ ws13,
                                  const uint4* __restrict__ w2, const uint4* __restrict__ ws2,
                                  const bf16_t* __restrict__ x, const int* __restrict__ num_slots,
                                  const int* __restrict__ slot_expert, const int* __restrict__ slot_begin,
                                  const int* __restrict__ slot_token, float* __restrict__ part,
                                  float* __restrict__ part_s, int n, const float* __restrict__ slot_w = nullptr,
                                  const float* __restrict__ b_gate = nullptr, const float* __restrict__ b_up = nullptr) {
  constexpr int AUA = 4, AUB = 2 * TPB;  // 16-byte fragments per lane: gate/up chunk, down row group
  constexpr int SLOT = AUA + 1 > AUB ? AUA + 1 : AUB;
  constexpr int GB = TH / 2;
  static_assert(TI % 2 == 0 && TH % 2 == 0, "tiles in pairs, row groups in halves");
  __shared__ uint4 ring[WARPS * DEPTH * SLOT * 32];
  using GA = TileGemv<KC, 2, 1, WARPS, DEPTH>;  // gate/up's partial sums laid out as GA::result reads them
  __shared__ uint4 red[WARPS * 2 * 128 / 4];
  __shared__ __align__(16) bf16_t actb[8 * 16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int routed_blocks = gridDim.x - TIS;
  const bool shared = (int)blockIdx.x >= routed_blocks;
  const int tile = shared ? blockIdx.x - routed_blocks : blockIdx.x % TI;
  const u32 rank = tile & 1;  // the cluster rank: a pair is blocks 2q, 2q+1 (routed_blocks is even)
  int m = n, begin = 0, e = 0;
  if (!shared) {
    grid_dep_wait();  // routing must be complete
    grid_dep_launch();
    const int slot = blockIdx.x / TI;
    if (slot >= *num_slots) return;  // both blocks of the pair
    e = slot_expert[slot];
    begin = slot_begin[slot];
    m = slot_begin[slot + 1] - begin;
  } else {
    grid_dep_launch();  // the shared expert reads x only
  }
  const int c = tile >> 1;
  const int kcd = shared ? KCDS : KCD;
  const uint4* a = shared ? ws13 + (size_t)tile * KC * AUA * 32 : w13 + ((size_t)e * TI + tile) * KC * AUA * 32;
  const uint4* d = (shared ? ws2 : w2 + (size_t)e * TH * KCD * AUB * 32) + (size_t)c * AUB * 32;
  const int tok = g < m ? (shared ? g : slot_token[begin + g]) : 0;
  const bf16_t* xr = x + (size_t)tok * H + t * 8;
  uint4* lring = ring + warp * DEPTH * SLOT * 32 + lane;
  const int mine_a = (KC - warp + WARPS - 1) / WARPS, mine_b = (GB - warp + WARPS - 1) / WARPS;
  auto issue = [&](int i) {
    uint4* st = lring + (i % DEPTH) * SLOT * 32;
    if (i < mine_a) {
      const int ck = warp + i * WARPS;
#pragma unroll
      for (int f = 0; f < AUA; ++f) cp_async16(st + f * 32, a + ((size_t)ck * AUA + f) * 32 + lane, true);
      cp_async16(st + AUA * 32, xr + ck * 32, g < m);
    } else if (i < mine_a + mine_b) {
      const int gr = rank * GB + warp + (i - mine_a) * WARPS;
      const uint4* src = d + (size_t)gr * kcd * AUB * 32 + lane;
#pragma unroll
      for (int f = 0; f < AUB; ++f) cp_async16(st + f * 32, src + f * 32, true);
    }
    cp_async_commit();
  };
  float acc[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[mt][r] = 0.0f;
#pragma unroll
  for (int i = 0; i < DEPTH - 1; ++i) issue(i);
  for (int i = 0; i < mine_a; ++i) {
    issue(i + DEPTH - 1);
    cp_async_wait<DEPTH - 1>();
    const uint4* st = lring + (i % DEPTH) * SLOT * 32;
    const uint4 bv = st[AUA * 32];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_bf16(acc[mt], st[(2 * mt) * 32], bv.x, bv.y);
      mma_bf16(acc[mt], st[(2 * mt + 1) * 32], bv.z, bv.w);
    }
  }
  // gate/up sums over warps in warp order (GA::result), the activation, in bf16
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) red[(warp * 2 + mt) * 32 + lane] = make_uint4(
      __float_as_uint(acc[mt][0]), __float_as_uint(acc[mt][1]), __float_as_uint(acc[mt][2]), __float_as_uint(acc[mt][3]));
  __syncthreads();
  if (threadIdx.x < 128) {
    const int r = threadIdx.x & 15, col = threadIdx.x >> 4;
    const float gv = GA::result(red, 0, 0, r, col), uv = GA::result(red, 0, 1, r, col);
    actb[col * 16 + r] = col >= m ? (bf16_t)0
                         : shared ? f32_to_bf16(activate<ActRule::SHARED_LIMIT>(gv, uv))
                                  : routed_act(gv, uv, b_gate, b_up, (size_t)e * I + tile * 16 + r, slot_w, begin + col);
  }
  cluster_sync();  // both tiles' activations are in place
  // down's B fragment: token g's activations 8t .. 8t+7 of the 32-wide chunk (tile 2c: 0-15)
  const uint4 b = ld_cluster_u4(cluster_map((u32)__cvta_generic_to_shared(actb + g * 16 + (t & 1) * 8), t >> 1));
  float* dst = shared ? part_s + (size_t)c * NF * H : part + ((size_t)c * NF * K + begin) * H;
  for (int i = mine_a; i < mine_a + mine_b; ++i) {
    issue(i + DEPTH - 1);
    cp_async_wait<DEPTH - 1>();
    const uint4* st = lring + (i % DEPTH) * SLOT * 32;
    const int gr = rank * GB + warp + (i - mine_a) * WARPS;
#pragma unroll
    for (int mt = 0; mt < TPB; ++mt) {
      float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_bf16(o, st[(2 * mt) * 32], b.x, b.y);
      mma_bf16(o, st[(2 * mt + 1) * 32], b.z, b.w);
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // rows g (r = 0, 1) and g + 8, token columns 2t, 2t + 1
        const int col = 2 * t + (r & 1);
        if (col < m) dst[(size_t)col * H + gr * 16 * TPB + mt * 16 + g + (r >> 1) * 8] = o[r];
      }
    }
  }
  cp_async_wait<0>();
  cluster_sync();  // the other block has read this block's activations
}

// The weighted sum of the fused kernel's partials: out[t, h] = sum_j w[t, j] * (sum_c part[c, pair(t, j), h]
// (+ down bias)) (+ gate[t] * sum_c part_s[c, t, h]). Block (t, 32 columns h): warp q adds the q-th
// eighth of every choice's chunks in chunk order, then one warp adds the eighths in order and
// the choices in order (a fixed order: no atomics). The shared expert is choice K.
template <int KCD, int KCDS, int H, int K, int NF, bool SHARED, bool SHARED_GATE>
MOE_DEVICE void combine_body(const float* __restrict__ part, const float* __restrict__ part_s,
                             const float* __restrict__ topk_w, const int* __restrict__ pair_pos,
                             const float* __restrict__ gate_s, bf16_t* __restrict__ out, int n,
                             const float* __restrict__ b_down = nullptr, const bf16_t* __restrict__ x = nullptr,
                             const int* __restrict__ topk_ids = nullptr) {
  constexpr int TERMS = K + (SHARED ? 1 : 0);
  __shared__ float v[TERMS][8][32];
  grid_dep_wait();
  grid_dep_launch();
  const int tk = blockIdx.x, hh = threadIdx.x & 31, q = threadIdx.x >> 5, h = blockIdx.y * 32 + hh;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int pos = pair_pos[tk * K + j];
    float s = 0.0f;
    if (pos >= 0) {  // an identity expert or another rank's has no partials
      const float* src = part + (size_t)pos * H + h;
#pragma unroll
      for (int c = q * KCD / 8; c < (q + 1) * KCD / 8; ++c) s += __ldcg(src + (size_t)c * NF * K * H);
    }
    v[j][q][hh] = s;
  }
  if constexpr (SHARED) {
    const float* src = part_s + (size_t)tk * H + h;
    float s = 0.0f;
#pragma unroll
    for (int c = q * KCDS / 8; c < (q + 1) * KCDS / 8; ++c) s += __ldcg(src + (size_t)c * NF * H);
    v[TERMS - 1][q][hh] = s;
  }
  __syncthreads();
  if (q != 0) return;
  auto eighths = [&](int j) {  // a choice's sum over its chunks, its eighths in order
    float y = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; ++r) y += v[j][r][hh];
    return y;
  };
  float acc[1];
  weighted_choices<K, H>(acc, tk, h, topk_w, topk_ids, pair_pos, x, [&](int j, float (&v)[1]) {
    const float y = eighths(j);
    v[0] = ActRule::EXPERT_BIAS ? y + b_down[(size_t)(topk_ids[tk * K + j] - RouteRule::EP_LO) * H + h] : y;
  });
  if constexpr (SHARED) acc[0] = fmaf(SHARED_GATE ? gate_s[tk] : 1.0f, eighths(K), acc[0]);
  out[(size_t)tk * H + h] = f32_to_bf16(acc[0]);
}

// ---- one token, one launch: router, route, gate/up and down + weighted sum in a single grid ----
// At N = 1 a fine-grained layer reads tens of MB in a few microseconds, and the dependent-launch
// chain (router -> gate/up -> down) costs about as much as the bytes: each kernel's start, its
// first memory round trip and its drain are exposed. This kernel runs the whole layer in one
// grid of one block per multiprocessor, all resident (a cooperative launch). With down by
// columns it also takes two tokens (NTOK, the N = 2 bucket: each token's units as at one token):
//
//   1. router logits: (16-row tile, K part) units over the blocks, partial sums to global; the
//      shared expert's weights asked for into L2 meanwhile, or (warp 0's route) while warp 0
//      routes (they do not depend on the route; not with down by columns);
//   -- every block waits for all of them --
//   2. every block routes the token itself (into its shared memory; with route_one's rules the
//      whole block at once, route_block), then asks the copy engine for its whole share of the
//      down weights (its 16 output rows of every chosen expert, and of the shared expert: one
//      tensor copy per operand, or one bulk copy per piece or per operand), which stream into
//      shared memory while it computes gate/up: the memory is never idle between gate/up and
//      down;
//   3. gate/up + activation: (expert, 16-row tile) units over the blocks, each warp keeping P
//      chunks of weights in flight in registers; activations to global;
//   -- every block waits for all of them --
//   4. down: the block's rows of every expert from shared memory, the activations from L2, all
//      of a warp's products issued together; the partial sums added in warp order, then the
//      choices in choice order: out, in bf16.
//
// The two waits are grid barriers (one word, ws.gbar, whose top bit flips at each barrier), or
// with TAGS none: each partial logit and each activation is written with the call's epoch in
// the same word (a 64-bit logit: value, epoch; a 32-bit activation: bf16, low 16 bits of the
// epoch), and the readers load them until every epoch is this call's. A barrier costs the last
// arrival's round trip to L2, the pollers' round trip and then the data's; a tagged read only
// the data's. The epoch (ws.epoch[0]) is read by every block at its start (each counts itself in
// ws.epoch[1]); block 0 advances it at its end, once every block has read it. The call before
// has finished when a block starts reading (griddepcontrol.wait), so its words carry an older
// epoch, and the workspace starts zeroed (epoch 0, never a call's).
//
// No floating-point atomics; every sum has a fixed order (the result is the same run to run).
// BF16, FP8 block or per-tensor, MXFP4 or NVFP4 weights (the shared expert in the routed experts' format), no
// expert parallelism, biases or identity experts: the plan (moegen.single.single_layout) gives
// this kernel only such layers, and the shapes it fits.

// Grid-wide barrier of a fully resident grid, on one word: every block adds 1, block 0 adds
// 2^31 - (blocks - 1), so the word's top bit flips when the last block arrives, whichever it
// is. The word is never reset. Each block reads the top bit once, before its first arrival (the
// bit cannot flip before every block has arrived), so that its arrivals need no reply: a
// release reduction, then polls until the bit differs from the one it had before (`phase`,
// which each barrier flips).
MOE_DEVICE void grid_barrier(unsigned* bar, unsigned& phase) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    __threadfence();  // this block's writes, before its arrival
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(bar), "r"(add) : "memory");
    unsigned now;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
    } while ((now & 0x80000000u) == phase);
    phase ^= 0x80000000u;
  }
  __syncthreads();
}

// A tensor copy global -> shared of one box of a tensor map (in global memory, 128 bytes), at
// coordinates c (innermost first), completing its bytes on the mbarrier.
MOE_DEVICE void tensor_copy(u32 dst, const void* map, int c0, int c1, int c2, int c3, int c4, u32 bar) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5, %6 }], [%7];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}
MOE_DEVICE void tensor_copy(u32 dst, const void* map, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5 }], [%6];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
MOE_DEVICE void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Tagged words (TAGS): relaxed gpu-scope accesses, each single-copy atomic (value and epoch together).
MOE_DEVICE void st_tagged(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MOE_DEVICE unsigned long long ld_tagged(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MOE_DEVICE ulonglong2 ld_tagged2(const unsigned long long* p) {  // two tagged logits (16-byte aligned)
  ulonglong2 v;
  asm volatile("ld.relaxed.gpu.global.v2.b64 { %0, %1 }, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}
MOE_DEVICE void st_tagged(u32* p, u32 v) { asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }
MOE_DEVICE uint4 ld_tagged4(const u32* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.b32 { %0, %1, %2, %3 }, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Whether route_block takes a rule: every expert's selection value a function of its own logit
// (not a softmax over all experts ahead of a correction bias), one expert per thread, at most 16
// choices.
template <int E, int K, class R, int THREADS>
struct RouteBlockFits {
  static constexpr bool value = !(!R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX && R::CORR_BIAS) && E <= THREADS &&
                                K <= 16 && E >= K;
};

// route_one's bound (its 32-lane rank of the lanes' largest keys) from 2 experts a lane, where the
// routers' kernels take it from 8: measured on the H200 (2026-12-01, N = 1, one process, 6-8
// interleaved rounds, the same bits) against the k rounds of a warp reduction: GLM-4.5-Air 89.96
// -> 88.88 us, OLMoE 30.53 -> 30.16, Qwen3-30B-A3B 25.06 -> 25.05, DeepSeek-V2-Lite 39.12 -> 39.18,
// Qwen1.5-MoE 39.81 -> 39.89
constexpr int SINGLE_BOUND_MIN = 2;

// The route of the one token by the whole block (route_one's rules where RouteBlockFits): the
// same choices, in the same order, into ids; their scores into pick, every expert's score (for
// a softmax over all experts) into v_all and the shared gate's logit into gl, for
// route_block_weights, which runs later, off the path to the first expert byte. Expert e's
// selection value becomes one 64-bit key, its order key above ~e (a larger value first; equal
// values: the lower expert), and its choice slot is its rank: the keys above it, counted.
//  - E <= THREADS / 4: every rank counted directly, RG threads an expert, each comparing a strided
//    E / RG of the keys (one barrier between the keys and the ranks);
//  - else NG <= 32 groups of G experts (G the smallest power of two that makes so few; NG >= K)
//    take their largest key; the K-th largest group maximum T bounds the K-th largest key from
//    below (K groups each hold a key >= T), so the choices are among the keys >= T, about K of
//    them: those are gathered (in any order) and ranked among themselves (two barriers).
// The partial logits: part p at logits + p * PSTRIDE (shared memory).
template <int E, int K, int KSPLIT, int PSTRIDE, bool SHARED_GATE, class R, int THREADS>
MOE_DEVICE void route_block(const float* logits, const float* __restrict__ corr_bias,
                            const float* __restrict__ router_bias, int* ids, float* pick, float* v_all, float* gl) {
  static_assert(RouteBlockFits<E, K, R, THREADS>::value, "route_block's rules");
  constexpr bool DIRECT = 4 * E <= THREADS;
  constexpr int RG = THREADS / E >= 32 ? 32 : THREADS / E >= 16 ? 16 : THREADS / E >= 8 ? 8 : 4;  // DIRECT: threads an expert
  constexpr int G = E <= 32 ? 1 : E <= 64 ? 2 : E <= 128 ? 4 : E <= 256 ? 8 : 16;
  constexpr int NG = (E + G - 1) / G;
  static_assert(DIRECT || (NG >= K && NG <= 32), "route_block's groups");
  __shared__ __align__(16) u32 s_gmax[(NG + 3) / 4 * 4];
  __shared__ int s_cnt;
  __shared__ unsigned long long s_ck[E];  // the keys (DIRECT: expert e's at e; else the candidates')
  __shared__ float s_cv[E];               // their scores
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float v = MOE_NEG_INF;
  u32 key = 0;  // below every expert's
  if (tid < E) {
    float s = 0.0f;
#pragma unroll
    for (int p = 0; p < KSPLIT; ++p) s += logits[p * PSTRIDE + tid];
    s = route_score<R>(route_logit<R>(s, router_bias, tid));
    v = s;
    v_all[tid] = s;
    key = order_key(s + (R::CORR_BIAS ? corr_bias[tid] : 0.0f));
  }
  if (SHARED_GATE && tid == 0) {
    float s = 0.0f;
#pragma unroll
    for (int p = 0; p < KSPLIT; ++p) s += logits[p * PSTRIDE + E];
    *gl = s;
  }
  if constexpr (DIRECT) {
    if (tid < E) {
      s_ck[tid] = (unsigned long long)key << 32 | (u32)~tid;
      s_cv[tid] = v;
    }
    __syncthreads();
    const int e = tid / RG, q = tid % RG;  // expert e's rank, part q: keys q, q + RG, ... (no bank conflicts)
    int rank = 0;
    if (e < E) {
      const unsigned long long my = s_ck[e];
#pragma unroll
      for (int j = q; j < E; j += RG) rank += s_ck[j] > my;
    }
#pragma unroll
    for (int o = 1; o < RG; o *= 2) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    if (e < E && q == 0 && rank < K) {
      ids[rank] = e;
      pick[rank] = s_cv[e];
    }
  } else {
    u32 gm = key;
#pragma unroll
    for (int o = 1; o < G; o *= 2) gm = max(gm, __shfl_xor_sync(0xffffffffu, gm, o));
    if (tid % G == 0 && tid / G < NG) s_gmax[tid / G] = gm;
    if (tid == 0) s_cnt = 0;
    __syncthreads();
    // every warp holding experts: T, the group maximum with K - 1 before it (lane l ranks group
    // l, the maxima read 4 at a time)
    u32 thr = 0;
    if (warp * 32 < E) {
      const u32 m = lane < NG ? s_gmax[lane] : 0u;
      int rank = 0;
#pragma unroll
      for (int w4 = 0; w4 < NG; w4 += 4) {
        const uint4 q = *reinterpret_cast<const uint4*>(s_gmax + w4);
        const u32 o[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int w = w4; w < w4 + 4 && w < NG; ++w) rank += o[w - w4] > m || (o[w - w4] == m && w < lane);
      }
      thr = __shfl_sync(0xffffffffu, m, __ffs(__ballot_sync(0xffffffffu, lane < NG && rank == K - 1)) - 1);
    }
    if (tid < E && key >= thr) {
      const int i = atomicAdd(&s_cnt, 1);
      s_ck[i] = (unsigned long long)key << 32 | (u32)~tid;
      s_cv[i] = v;
    }
    __syncthreads();
    const int C = s_cnt;
    for (int i = tid; i < C; i += THREADS) {
      const unsigned long long ki = s_ck[i];
      int rank = 0;
#pragma unroll 4
      for (int j = 0; j < C; ++j) rank += s_ck[j] > ki;
      if (rank < K) {
        ids[rank] = (int)~(u32)ki;
        pick[rank] = s_cv[i];
      }
    }
  }
}

// route_block's weights (warp 0): the choices' from their scores (a softmax over all experts:
// exp(v - the largest v) summed over v_all, in lane order), the shared-expert gate.
template <int E, int K, bool SHARED_GATE, class R>
MOE_DEVICE void route_block_weights(const float* pick, const float* v_all, const float* gl, float* w_out, float* gate) {
  constexpr bool LOGIT_ORDER = !R::SELECT_LOGITS && R::SCORE == MOE_SCORE_SOFTMAX && !R::CORR_BIAS;
  float sum = 0.0f;
  if constexpr (LOGIT_ORDER && !R::RENORM) {
    const float top = pick[0];  // the first choice: the largest logit
    for (int e = threadIdx.x & 31; e < E; e += 32) sum += expf(v_all[e] - top);
    sum = warp_sum(sum);
  }
  route_weights<K, R>(pick, sum, w_out);
  if (SHARED_GATE && threadIdx.x == 0) *gate = 1.0f / (1.0f + expf(-*gl));
}

// KC = H/32, KCD = I/32, KCDS = IS/32 chunks; TI, TIS gate/up tiles; TPB down tiles per packed
// row group (w2's layout); KSPLIT router K parts; UR gate/up units a block takes per round
// (reduction space); WARPS warps; P chunks in flight per warp; TAGS: tagged words instead of
// grid barriers (see the top; with route_one's rules); OVERLAP (with TAGS): warp 0 routes alone
// and asks for this block's down rows; the other warps wait for the choices only (an mbarrier,
// route_mem), not for the weights (computed in the down phase). Their loads are not in flight
// meanwhile: with them in flight (the first unit's, as each block's expert was chosen) the route
// took three times as long (its shared-memory accesses queued behind them), and so did the copies
// asked for after it. (Asking for each expert's rows as it was chosen measured 0.1-0.3 us
// slower: the copies' issue slowed the rounds.) LATE: the block's down rows asked for as warp 0
// starts its last round of gate/up loads instead (moegen.single.single_late_down), the memory
// streaming the gate/up weights first and the down rows behind them, during the activations'
// exchange.
// Without TAGS: logits, act, act_s, gbar;
// with: tl (KSPLIT x ROWS_PAD tagged logits), tact (K x I + IS tagged activations), epoch.
template <int KC, int KCD, int KCDS, int TI, int TIS, int I, int IS, int H, int E, int K, int ROWS_PAD, int KSPLIT,
          int NMAX, int TPB, bool SHARED_GATE, int WARPS, int UR, int P, bool TAGS, int FMT, bool OVERLAP, bool TMAP,
          bool LATE, int VB, int NTOK, bool BROUTE>
MOE_DEVICE void single_body(const uint4* __restrict__ wr, const uint4* __restrict__ w13,
                            const uint4* __restrict__ ws13, const uint4* __restrict__ w2,
                            const uint4* __restrict__ ws2, const float* __restrict__ s13,
                            const float* __restrict__ ss13, const float* __restrict__ s2,
                            const float* __restrict__ ss2, const bf16_t* __restrict__ xr_in,
                            const bf16_t* __restrict__ x, float* logits, unsigned* gbar,
                            const float* __restrict__ corr_bias, const float* __restrict__ router_bias,
                            int* __restrict__ topk_ids, float* __restrict__ topk_w, bf16_t* act, bf16_t* act_s,
                            bf16_t* __restrict__ out, unsigned long long* tl, u32* tact, u32* epoch,
                            unsigned long long* spart, const void* tmaps) {
  constexpr int THREADS = WARPS * 32;
  constexpr int DSLOTS = K + (KCDS > 0 ? 1 : 0);  // down's operands: the chosen experts, the shared one
  constexpr int PIECES = K * KCD + KCDS;          // pieces: a block's 16 down rows x 32 K of one chunk (BF16 1 KB,
                                                  // FP8 512 bytes; FP4 512 bytes: its row group's 32 rows)
  constexpr int CPU = KC / WARPS;                 // chunks of a gate/up unit per warp
  constexpr int RC = (KC / KSPLIT + WARPS - 1) / WARPS;  // router chunks per warp and unit
  constexpr int RTILES = ROWS_PAD / 16;
  // FMT: BF16, or FP8 block (e4m3 codes, one 16-byte fragment per lane for two k-steps, exact
  // bf16 through the tensor cores, each 128 x 128 block's scale in fp32; the shared expert's too)
  // MXFP4 / NVFP4: e2m1 codes, 8 bytes per lane, matrix and chunk (a 16-byte fragment holds a pair
  // of matrices: gate and up, or down's two tiles of a row group), row scales per 32 (E8M0) or 16
  // (e4m3, times each matrix's fp32 scale_2) along K. A block asks for its row group's whole run
  // of each operand (both tiles: 8-byte halves of each lane's fragments, which no copy separates)
  // and its scales, and multiplies its own tile; the two blocks of a group ask at the same time,
  // so the second finds the bytes in L2 (or on their way there).
  // PT8: FP8 per-tensor (ModelOpt FP8: e4m3 codes as FP8 block's, a weight scale and a static input
  // scale per matrix, s13 [E][gate, up][weight, input], s2 [E][weight, input], ss13 and ss2 without
  // E). x is quantized by each unit's input scale once a round, into shared memory (s_xq, bf16
  // holding the e4m3 values exactly), as moe_tensor_quant does for the GEMV path (e4m3(x / s), an
  // IEEE division per element: in the loop, per chunk, it would bound the kernel on its ALUs); the
  // codes times those rows are summed in fp32 over all of K and times weight_scale * input_scale
  // once; the activations are quantized by down's input scale as they are made, and down's sums
  // times its weight_scale * input_scale once (s_dsc, one per operand).
  constexpr bool FP8 = FMT == MOE_W_FP8_BLOCK, PT8 = FMT == MOE_W_FP8_TENSOR, C8 = FP8 || PT8;
  constexpr bool MX = FMT == MOE_W_MXFP4, NV = FMT == MOE_W_NVFP4, FP4 = MX || NV;
  static_assert(FMT == MOE_W_BF16 || C8 || FP4, "the one-token kernel: BF16, FP8 block or per-tensor, MXFP4 or NVFP4 weights");
  static_assert(!FP4 || (TPB == 2 && !TMAP), "FP4: a row group of two tiles, one bulk copy");
  constexpr int AF = C8 ? 1 : 2;          // 16-byte A fragments per lane, matrix and chunk (BF16, FP8)
  constexpr int GU = FP4 ? 1 : 2 * AF;    // 16-byte fragments per lane of a gate/up chunk, both matrices
  constexpr int GCU = GU * 32;            // uint4 of a gate/up tile's chunk
  constexpr int PU4 = FP4 ? 32 : AF * 32;  // uint4 of a piece: 16 rows (FP4: the row group's 32) x 32 K
  constexpr int P16 = FP4 ? 16 : PU4;      // uint4 of 16 rows x 32 K
  // FP4: bytes of one operand's down scales in shared memory (a chunk's: MX TPB x 16 E8M0, NV TPB x 2
  // x 16 e4m3; NV then the tiles' scale_2, 16 bytes), and of a gate/up tile's
  constexpr int SCC = MX ? 32 : 64, KCM = KCD > KCDS ? KCD : KCDS;
  constexpr int SCB = FP4 ? KCM * SCC + (NV ? 16 : 0) : 16;
  constexpr u32 SCT = (u32)KC * SCC + (NV ? 16 : 0);
  constexpr int AUD = AF * TPB;           // 16-byte fragments per lane and chunk of a packed down row group
  constexpr int KB = KC / 4;              // 128-wide K blocks of gate/up (FP8 scales)
  constexpr int UNITS = K * TI + TIS;  // gate/up units: 16 rows of one expert
  // route_one's rules (no expert groups, hash tables, SparseMixer, identity experts or expert
  // parallelism); the route by the whole block where it fits (route_block; its weights computed
  // in the down phase)
  constexpr bool ONE_RULES = !RouteRule::HASH && RouteRule::NGROUP == 1 && RouteRule::SCORE != MOE_SCORE_SPARSEMIXER &&
                             RouteRule::ZERO == 0 && !RouteRule::EP;
  constexpr bool BLOCK_ROUTE = TAGS && !OVERLAP && ONE_RULES && RouteBlockFits<E, K, RouteRule, THREADS>::value;
  constexpr int NACT = K * I + IS;  // activations of the call (TAGS: staged in shared memory for down)
  // COLS (VB unit groups, moegen.single.single_cols): down by columns. Group v (block v, or in
  // rounds where the grid has fewer blocks) takes the gate/up units v, v + VB, ... (nu <= UR). Each
  // warp's stream holds, besides its chunks of the units' gate/up weights, its row tiles' fragments
  // of the units' columns of down (a unit's 16 K of every output row): G0, G1, C0, G2, C1, ...,
  // C(nu - 1), so that unit k's columns arrive once every warp has added its part of unit k's
  // gate/up (an mbarrier a unit), and are multiplied by its activations (each warp computes them
  // from the warps' sums) while the next unit streams. A warp's row tiles' sums over the units go
  // to shared memory, then to the group's partial sum of every output row (tagged words, spart
  // [VB][NTOK][H]); each block then adds its rows' VB partials in group order.
  constexpr bool COLS = VB > 0;
  // SFIRST (COLS with a shared expert): a group's units in the order of the shared expert's TIS
  // tiles first, then the chosen experts' (slot, tile); a group whose first unit is the shared
  // expert's issues that unit's first loads before the choices are made (its warps 1.. wait for
  // warp 0's route only then), so the memory streams while the block routes. H200, 2026-12-01,
  // N = 1, one process, 10 rounds, the same weights: Qwen3-Next-80B-A3B 25.02 -> 24.34 us,
  // DeepSeek-V2-Lite 40.00 -> 39.18, Qwen1.5-MoE-A2.7B 39.78 -> 39.50, GLM-4.5-Air 84.35 -> 82.43.
  // The order alone, every group waiting for the route, was slower (Next 25.17 -> 25.22, V2-Lite
  // 40.01 -> 40.52), and the shared weights asked for into L2 during the route no faster.
  constexpr bool SFIRST = COLS && TIS > 0;
  // BROUTE (COLS, one token, moegen.single.single_block_route): the route by the whole block
  // (route_block), no warp waiting for another's choices
  static_assert(!BROUTE || (COLS && NTOK == 1 && ONE_RULES && RouteBlockFits<E, K, RouteRule, THREADS>::value),
                "the block's route: down by columns, one token, where route_block takes the rule");
  // NTOK tokens (COLS): each token's units as at one token. Group v takes units v, v + VB, ... of
  // every token, as (unit, token) pairs kk = k * NTOK + n in its stream, and keeps each token's sums
  // apart: a token's sums have the same order whatever the other token and its own index. The
  // router's products take the tokens as the MMA's columns; warp n routes token n.
  static_assert(NTOK == 1 || (COLS && NTOK <= 2), "more than one token: down by columns, two at most");
  constexpr int URT = UR * NTOK;  // (unit, token) pairs a group takes at most
  constexpr int RT = H / 16, RTW = RT / WARPS, CC = RTW / 4;  // row tiles, a warp's, its column chunks a unit
  static_assert(!COLS || (FMT == MOE_W_BF16 && TAGS && OVERLAP && !LATE && RTW % 4 == 0),
                "down by columns: BF16, tagged words, the overlapped route, whole column chunks a warp");
  static_assert(KC % WARPS == 0, "gate/up chunks split evenly over the warps");
  // P chunks in flight per warp: a divisor of a unit's (every round of P one unit's or several
  // whole units'), or (FP4's 512-byte chunks, more of them in flight) any, the rounds past the
  // last chunk skipped
  constexpr bool PART = CPU % P != 0;
  static_assert(K <= 32 && (THREADS / 32) <= 32, "route: one choice per lane");
  static_assert(DSLOTS <= 32, "one lane per operand's mbarrier (and bulk copy, TPB 1)");
  static_assert(DSLOTS * 16 <= THREADS, "a thread per operand row in the down sums");
  static_assert(NACT % 4 == 0, "tagged activations staged 4 at a time");
  extern __shared__ __align__(128) uint4 dyn[];
  uint4* pieces = dyn;                              // PIECES x PU4 uint4, in slot (choice) order
  float* red = reinterpret_cast<float*>(dyn + (COLS ? 0 : PIECES * PU4));
  __shared__ __align__(8) unsigned long long bar_mem[DSLOTS];  // an mbarrier per operand's pieces
  // OVERLAP: the route's mbarrier (every choice made), the routing warps' lanes arriving (warp n: token n)
  __shared__ __align__(8) unsigned long long route_mem[1];
  // TAGS: the partial logits (route), then the activations (down), staged here
  constexpr int NLOG = NTOK * KSPLIT * ROWS_PAD, STAGE = TAGS && (COLS || 4 * NLOG > 2 * NACT) ? 4 * NLOG : 2 * NACT;
  __shared__ __align__(16) unsigned char s_stage[STAGE];
  // FP8: the block scales of this block's down rows, [operand][128-wide K block]
  constexpr int KBD = ((KCD > KCDS ? KCD : KCDS) + 3) / 4;
  // (PT8: each operand's weight_scale * input_scale)
  __shared__ float s_dsc[FP8 ? DSLOTS * KBD : PT8 ? DSLOTS : 1];
  // PT8: x quantized by the input scale of each unit of this round (unit k's at k * H)
  __shared__ __align__(16) bf16_t s_xq[PT8 ? URT * H : 8];
  // FP4: each operand's down scales (bytes, SCB each), as the packed weights hold them
  __shared__ __align__(16) unsigned char s_dsc4[FP4 ? DSLOTS * SCB : 16];
  bf16_t* s_act = reinterpret_cast<bf16_t*>(s_stage);
  float* s_log = reinterpret_cast<float*>(s_stage);
  __shared__ int s_ids[K * NTOK];
  __shared__ float s_cpart[COLS ? NTOK * H : 1];  // COLS: the group's sums of every output row (each warp its row tiles')
  __shared__ __align__(8) unsigned long long ubar_mem[COLS ? URT : 1];  // COLS: unit k's gate/up summed by every warp
  __shared__ float s_w[K * NTOK], s_gate[NTOK];
  // route_block and OVERLAP: the choices' scores; route_block: every expert's score, the shared
  // gate's logit; OVERLAP: the sum over every expert that route_weights may need
  __shared__ float s_pick[K * NTOK], s_vall[BLOCK_ROUTE || BROUTE ? E : 1], s_gl, s_all[NTOK];
  __shared__ u32 s_ep;
  __shared__ __align__(16) unsigned long long s_cand[32 * NTOK];  // route_one's candidates (its bound: 2+ experts a lane)
  __shared__ float s_cscore[RouteRule::CORR_BIAS ? 32 * NTOK : 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const u32 bar = (u32)__cvta_generic_to_shared(bar_mem);  // operand s's: bar + 8 * s
  const u32 rbar = (u32)__cvta_generic_to_shared(route_mem);  // OVERLAP: every choice made
  const u32 ubar = (u32)__cvta_generic_to_shared(ubar_mem);  // COLS: unit k's: ubar + 8 * k
  if (threadIdx.x == 0) {
    for (int s = 0; s < DSLOTS; ++s) mbar_init(bar + 8 * s, 1);
    if constexpr (COLS)
      for (int k = 0; k < URT; ++k) mbar_init(ubar + 8 * k, THREADS);
    if constexpr (OVERLAP) mbar_init(rbar, 32 * NTOK);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // this block's 16 output rows rb of down: request every piece (slot order, then chunks); with
  // one tile per packed row group (TPB 1) an operand's rows are one contiguous run. With one copy
  // per operand (TMAP, TPB 1) and every choice known to every warp (not OVERLAP), lane 0 of warp s
  // asks for operand s (and lanes of warp s for its FP8 scales): the copies' issue spread over the
  // warps rather than holding warp 0 (and the last operands' copies) back; otherwise warp 0 asks
  // for everything.
  // (FP4: its row group's run of one operand, both tiles: one bulk copy, and one for its scales)
  constexpr bool WHOLE = TPB == 1 || FP4;
  constexpr bool SPREAD = (TMAP || WHOLE) && !OVERLAP && DSLOTS <= WARPS;
  // operand s's pieces of output rows rb: one tensor copy (tile mt of row group `group`) or one bulk copy
  auto one = [&](int rb, int s) {
    const int group = rb / TPB, mt = rb % TPB;  // (the tensor maps fenced after the router)
    const u32 sbytes = FP4 ? (u32)(s < K ? KCD : KCDS) * SCC + (NV ? 16 : 0) : 0;  // FP4: its scales
    mbar_expect(bar + 8 * s, (s < K ? KCD : KCDS) * PU4 * 16 + sbytes);
    const u32 dst = (u32)__cvta_generic_to_shared(pieces + s * KCD * PU4);
    if constexpr (TMAP) {
      if (s < K) tensor_copy(dst, tmaps, 0, mt, 0, group, s_ids[s], bar + 8 * s);
      else tensor_copy(dst, static_cast<const char*>(tmaps) + 128, 0, mt, 0, group, bar + 8 * s);
    } else if (s < K) {
      bulk_copy(dst, w2 + ((size_t)s_ids[s] * (H / (16 * TPB)) + group) * KCD * PU4, KCD * PU4 * 16, bar + 8 * s);
    } else {
      bulk_copy(dst, ws2 + (size_t)group * KCDS * PU4, KCDS * PU4 * 16, bar + 8 * s);
    }
    if constexpr (FP4) {  // MX s2 [E][row group][chunk][tile][16 rows] E8M0; NV per row group [chunk][tile][2][16] e4m3, scale_2
      const size_t run = s < K ? (size_t)s_ids[s] * (H / (16 * TPB)) + group : (size_t)group;
      bulk_copy((u32)__cvta_generic_to_shared(s_dsc4 + s * SCB),
                reinterpret_cast<const unsigned char*>(s < K ? s2 : ss2) + run * sbytes, sbytes, bar + 8 * s);
    }
  };
  // FP8: the rows' block scales, s2 [E][H/128][I/128], ss2 [H/128][IS/128]
  auto scales = [&](int rb, int i) {
    const int s = i / KBD, kb = i % KBD;
    if (s < K ? kb < I / 128 : kb < IS / 128)
      cp_async4(s_dsc + i, s < K ? s2 + ((size_t)s_ids[s] * (H / 128) + rb / 8) * (I / 128) + kb
                                 : ss2 + (size_t)(rb / 8) * (IS / 128) + kb);
  };
  // The shared expert's pieces of this block's first output rows do not depend on the route
  // (EARLY): asked for before it, by the thread that fenced the shared tensor map (or the last
  // warp's lane 1), while the memory is idle; request() then leaves them out of that group.
  constexpr bool EARLY = TAGS && KCDS > 0 && (TMAP || WHOLE) && !LATE && !COLS;
  // this block's output rows rb: every operand
  // PT8: operand s's down scale (weight_scale * input_scale, as the GEMV path multiplies them)
  auto scale2 = [&](int s) {
    const float* p = s < K ? s2 + (size_t)s_ids[s] * 2 : ss2;
    s_dsc[s] = __ldg(p + 1) * __ldg(p);
  };
  auto request = [&](int rb) {
    const int group = rb / TPB, mt = rb % TPB;
    const bool skip = EARLY && rb == (int)blockIdx.x;  // operand K's pieces, asked for already
    if constexpr (SPREAD) {
      if (warp < DSLOTS) {
        if (lane == 0 && !(skip && warp == K)) one(rb, warp);
        if (FP8 && lane < KBD) scales(rb, warp * KBD + lane);
        if (PT8 && lane == 0) scale2(warp);
      }
      if constexpr (FP8) cp_async_commit();
    } else if (warp == 0) {
      if constexpr (TMAP || WHOLE) {
        if (lane < DSLOTS && !(skip && lane == K)) one(rb, lane);
      } else {
        if (lane < DSLOTS) mbar_expect(bar + 8 * lane, (lane < K ? KCD : KCDS) * PU4 * 16);
        __syncwarp();
        for (int p = lane; p < PIECES; p += 32) {  // one bulk copy per piece
          const uint4* src;
          if (p < K * KCD) {
            const int j = p / KCD, c = p % KCD;
            src = w2 + ((((size_t)s_ids[j] * (H / (16 * TPB)) + group) * KCD + c) * AUD + AF * mt) * 32;
          } else {
            const int c = p - K * KCD;
            src = ws2 + (((size_t)group * KCDS + c) * AUD + AF * mt) * 32;
          }
          bulk_copy((u32)__cvta_generic_to_shared(pieces + p * PU4), src, PU4 * 16, bar + 8 * (p < K * KCD ? p / KCD : K));
        }
      }
      if constexpr (FP8) {
        for (int i = lane; i < DSLOTS * KBD; i += 32) scales(rb, i);
        cp_async_commit();
      }
      if (PT8 && lane < DSLOTS) scale2(lane);
    }
  };
  // The shared expert's weights do not depend on the route: every block asks for its share of
  // them (gate/up, down) into L2 while the memory is idle (the asking thread waits while the copy
  // engine takes the request): with warp 0's route (OVERLAP) once the logits are staged, by a
  // thread that does not route; otherwise while the block waits for the logits. (Asked for before
  // the logits were staged, the requests delayed them: Qwen3-Next-80B-A3B N = 1 26.11 -> 25.70 us
  // after them, H200, 2026-11-30, in one process, the same bits.) Not with down by columns, whose
  // groups read the shared expert's units from the memory as they read the chosen experts': the
  // requests, made as the stream starts, only add to it (Qwen3-Next-80B-A3B N = 1 25.76 -> 25.45 us
  // without them, H200, 2026-12-01, one process, 12 rounds, the same bits).
  auto shared_to_l2 = [&]() {
    if (TIS > 0 && threadIdx.x == (WARPS - 2) * 32) {
      // (EARLY: each block copies its own rows of the shared down weights instead, below)
      constexpr size_t N13 = (size_t)TIS * KC * GCU, N2 = EARLY ? 0 : (size_t)(H / 16) * KCDS * P16;  // uint4
      const size_t per = (N13 + N2 + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per, hi = min(lo + per, N13 + N2);
      if (lo < N13) prefetch_l2(ws13 + lo, (u32)(min(hi, N13) - lo) * 16);
      if (hi > N13) prefetch_l2(ws2 + (max(lo, N13) - N13), (u32)(hi - max(lo, N13)) * 16);
    }
  };
  // 1. router logits: unit (tile, part): 16 rows x KC/KSPLIT chunks; warps split the chunks.
  // The first unit's weights are read before the wait: they do not depend on the kernel before.
  uint4 ra[RC][2];
  auto router_weights = [&](int u) {
#pragma unroll
    for (int j = 0; j < RC; ++j) {
      const int c = warp + j * WARPS;
      if (c < KC / KSPLIT) {
        const uint4* a = wr + ((size_t)(u / KSPLIT) * KC + (u % KSPLIT) * (KC / KSPLIT) + c) * 64 + lane;
        ra[j][0] = __ldg(a);
        ra[j][1] = __ldg(a + 32);
      }
    }
  };
  if ((int)blockIdx.x < RTILES * KSPLIT) router_weights(blockIdx.x);
  grid_dep_wait();  // x (and the last call's readers of this workspace) are done
  // thread 0 asks for the barrier word (its top bit: the phase) or the last call's epoch now, and
  // waits for it only where it is used (the router's products wait for x meanwhile)
  unsigned word = 0, phase = 0;
  if (threadIdx.x == 0)
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(word) : "l"(TAGS ? epoch : gbar) : "memory");
  for (int u = blockIdx.x; u < RTILES * KSPLIT; u += gridDim.x) {
    const int tile = u / KSPLIT, part = u % KSPLIT;
    if (u != (int)blockIdx.x) router_weights(u);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < RC; ++j) {
      const int c = warp + j * WARPS;
      if (c < KC / KSPLIT) {
        const int ck = part * (KC / KSPLIT) + c;
        const uint4 b = g < NTOK ? *reinterpret_cast<const uint4*>(xr_in + g * H + ck * 32 + t * 8) : make_uint4(0, 0, 0, 0);
        mma_bf16(acc, ra[j][0], b.x, b.y);
        mma_bf16(acc, ra[j][1], b.z, b.w);
      }
    }
    if (t == 0) {  // token n's logits: column n (lanes t = 0 hold columns 0, 1)
#pragma unroll
      for (int n = 0; n < NTOK; ++n) {
        red[(n * WARPS + warp) * 16 + g] = acc[n];
        red[(n * WARPS + warp) * 16 + g + 8] = acc[2 + n];
      }
    }
    if (TAGS && threadIdx.x == 0) s_ep = word + 1;  // this call's epoch
    __syncthreads();
    if (threadIdx.x < 16 * NTOK) {
      const unsigned n = NTOK > 1 ? threadIdx.x >> 4 : 0u, r = NTOK > 1 ? threadIdx.x & 15 : threadIdx.x;
      float s = 0.0f;
      for (int w = 0; w < WARPS; ++w) s += red[(n * WARPS + w) * 16 + r];
      if constexpr (TAGS) {
        st_tagged(tl + (n * KSPLIT + part) * ROWS_PAD + tile * 16 + r, ((unsigned long long)s_ep << 32) | __float_as_uint(s));
      } else {
        logits[(size_t)part * NMAX * ROWS_PAD + tile * 16 + threadIdx.x] = s;
      }
    }
    __syncthreads();
  }
  if constexpr (!OVERLAP) shared_to_l2();
  // TMAP: the maps (written before the launch) as the tensor copies will see them, fenced by the
  // last warp while the block waits for the logits (the fence waits about a round trip)
  if (TMAP && warp == WARPS - 1 && lane < (KCDS > 0 ? 2 : 1))
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;"
                 ::"l"(static_cast<const char*>(tmaps) + 128 * lane) : "memory");
  if constexpr (TAGS) {
    if (threadIdx.x == 0) s_ep = word + 1;
    __syncthreads();
    // (after the block's barrier: the mbarriers' initialization is seen by the copy's thread)
    if (EARLY && warp == WARPS - 1 && lane == 1 && (int)blockIdx.x < H / 16) one(blockIdx.x, K);
    // this block has read the epoch (the value was used above): count it, for block 0's advance
    if (threadIdx.x == 0) asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(epoch + 1) : "memory");
  } else {
    phase = word & 0x80000000u;
    grid_barrier(gbar, phase);
  }
  const u32 ep = TAGS ? s_ep : 0u;

  // 2. the route, in every block (the same inputs, the same code: the same choices). Slot j of
  // the expert work is choice j (one token: no grouping).
  // every partial logit into shared memory, loaded until each is this call's. Where there are more
  // than threads (PAIRS), two a load, each thread reading again only its pairs that were not:
  // Qwen3-Next-80B-A3B's 2112 (H200, 2026-11-30, N = 1, one process, the same bits: 25.98 -> 25.74
  // us); otherwise one a thread, every one read again (with pairs Qwen3-30B-A3B's 512: no change,
  // its NVFP4 layer 21.19 -> 21.49 us)
  constexpr bool PAIRS = NLOG > THREADS;
  if constexpr (TAGS && PAIRS) {
    static_assert(NLOG % 2 == 0, "tagged logits staged two at a time");
    constexpr int PER = (NLOG / 2 + THREADS - 1) / THREADS;
    bool done[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) done[i] = (int)threadIdx.x + i * THREADS >= NLOG / 2;
    for (;;) {
      bool stale = false;
      ulonglong2 q[PER];
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if (!done[i]) q[i] = ld_tagged2(tl + 2 * ((int)threadIdx.x + i * THREADS));
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        if (!done[i]) {  // every row of every tile is written each call (padding rows too)
          done[i] = (u32)(q[i].x >> 32) == ep && (u32)(q[i].y >> 32) == ep;
          stale |= !done[i];
          *reinterpret_cast<float2*>(s_log + 2 * ((int)threadIdx.x + i * THREADS)) =
              make_float2(__uint_as_float((u32)q[i].x), __uint_as_float((u32)q[i].y));
        }
      }
      if (!__syncthreads_or(stale)) break;
      __nanosleep(64);
    }
  } else if constexpr (TAGS) {
    constexpr int PER = (NLOG + THREADS - 1) / THREADS;
    for (;;) {
      bool stale = false;
      unsigned long long q[PER];
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if ((int)threadIdx.x + i * THREADS < NLOG) q[i] = ld_tagged(tl + threadIdx.x + i * THREADS);
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const int f = (int)threadIdx.x + i * THREADS;
        if (f < NLOG) {  // every row of every tile is written each call (padding rows too)
          stale |= (u32)(q[i] >> 32) != ep;
          s_log[f] = __uint_as_float((u32)q[i]);
        }
      }
      if (!__syncthreads_or(stale)) break;
      __nanosleep(64);
    }
  }
  if constexpr (OVERLAP && !COLS) shared_to_l2();  // (warp 0 routes meanwhile)
  if constexpr (ONE_RULES) {
    if constexpr (BLOCK_ROUTE || BROUTE) {  // the logits staged in shared memory
      route_block<E, K, KSPLIT, ROWS_PAD, SHARED_GATE, RouteRule, THREADS>(s_log, corr_bias, router_bias, s_ids, s_pick,
                                                                           s_vall, &s_gl);
      if constexpr (BROUTE) {  // every choice seen by every warp; warp 0's weights read after a unit's mbarrier
        __syncthreads();
        if (warp == 0) route_block_weights<E, K, SHARED_GATE, RouteRule>(s_pick, s_vall, &s_gl, s_w, s_gate);
      }
    } else if (warp < NTOK) {  // the logits staged in shared memory (TAGS) or in L2; warp n: token n
      const int n = warp;
      auto after = [&]() {  // OVERLAP: this block's down rows asked for once every expert is chosen
        if (!LATE && !COLS && (int)blockIdx.x < H / 16) request(blockIdx.x);
      };
      route_one<E, K, KSPLIT, TAGS ? (size_t)ROWS_PAD : (size_t)NMAX * ROWS_PAD, TAGS, SHARED_GATE, RouteRule,
                OVERLAP, decltype(after), SINGLE_BOUND_MIN>(TAGS ? s_log + n * KSPLIT * ROWS_PAD : logits, corr_bias, router_bias, s_ids + n * K, s_pick + n * K,
                         s_w + n * K, s_gate + n, s_all + n, rbar, after, s_cand + 32 * n,
                         s_cscore + (RouteRule::CORR_BIAS ? 32 * n : 0));
      if constexpr (COLS) {  // the choices' weights, for the columns' products (the other warps read them after a unit's mbarrier)
        __syncwarp();
        route_weights<K, RouteRule>(s_pick + n * K, s_all[n], s_w + n * K);
      }
    }
  } else {
    static_assert(!TAGS && !OVERLAP, "tagged logits: route_one's rules");
    route_body<E, ROWS_PAD, K, KSPLIT, NMAX, SHARED_GATE, THREADS, RouteRule, false>(
        logits, corr_bias, router_bias, s_ids, s_w, nullptr, s_gate, nullptr, nullptr, nullptr, nullptr, 1, nullptr,
        nullptr, nullptr, nullptr, nullptr, false);
  }
  static_assert(!OVERLAP || TAGS, "the overlapped route: with tagged words");
  if constexpr (OVERLAP) {  // warps 1..: every choice is written
    // (SFIRST) a group whose first unit is the shared expert's: after its first loads (below)
    // (NTOK > 1: the routing warps too, for the other token's choices)
    if (!BROUTE && (NTOK > 1 || warp != 0) && !(SFIRST && (int)blockIdx.x < TIS && (int)blockIdx.x < VB)) mbar_wait(rbar, 0);
  } else {
    __syncthreads();
  }
  grid_dep_launch();  // every block is resident: the next kernel may be scheduled
  // the call's routing, for inspection (COLS: at the end, with the weights: block 0's warp 0 may
  // not have waited for the other routing warps' choices here, where the block starts its shared
  // expert's loads first)
  if (!COLS && blockIdx.x == 0 && threadIdx.x < K * NTOK) {
    topk_ids[threadIdx.x] = s_ids[threadIdx.x];
    if constexpr (!BLOCK_ROUTE && !OVERLAP) topk_w[threadIdx.x] = s_w[threadIdx.x];
  }
  // this block's first 16 output rows of down: every piece asked for now (OVERLAP: done)
  if (!OVERLAP && !LATE && (int)blockIdx.x < H / 16) request(blockIdx.x);

  // 3. gate/up: unit u < K*TI is (slot u / TI, tile u % TI), then the shared expert's tiles (their
  // weights asked for into L2 before the route, but by columns: the blocks with one unit fewer of
  // the chosen experts take them)
  // (COLS: round = unit group u0, its units u0 + k * VB)
  const int ustride = COLS ? VB : (int)gridDim.x;
  // (SFIRST) group order: the shared expert's units first, then the chosen experts'
  auto unit_of = [&](int n) { return SFIRST ? (n < TIS ? K * TI + n : n - TIS) : n; };
  u32 cpar = 0;  // COLS: the units' mbarriers' phase
  for (int u0 = blockIdx.x; COLS ? u0 < VB : u0 < UNITS; u0 += COLS ? (int)gridDim.x : UR * (int)gridDim.x) {
    const int nu = min(UR, (UNITS - u0 + ustride - 1) / ustride);  // units this round
    const int nuu = nu * NTOK;  // (unit, token) pairs this round (kk = k * NTOK + n; one token: the units)
    // unit k's weights (ub[k]) and (FP8) its row of gate scales (m = 0; up's follow: s13
    // [2][E][I/128][H/128], ss13 [2][IS/128][H/128]) or (FP4) its tile's scales (bytes: MX s13
    // [E][tile][chunk][gate, up][16 rows]; NV per tile [chunk][gate, up][2][16 rows], then the two
    // scale_2) as an offset (so[k], top bit: the shared expert's), in registers: each load takes
    // its address from them rather than from the choices in shared memory
    const uint4* ub[URT];
    u32 so[URT];
    auto unit_base = [&](int k) {  // (pair k: unit k / NTOK of token k % NTOK)
      const int u = unit_of(u0 + (k / NTOK) * ustride);
      if (u < K * TI) {
        const int e = s_ids[(k % NTOK) * K + u / TI];
        ub[k] = w13 + ((size_t)e * TI + u % TI) * KC * GCU;
        so[k] = FP4 ? ((u32)e * TI + u % TI) * SCT : PT8 ? (u32)e * 4 : ((u32)e * (I / 128) + (u % TI) / 8) * KB;
      } else {
        ub[k] = ws13 + (size_t)(u - K * TI) * KC * GCU;
        so[k] = 0x80000000u | (FP4 ? (u32)(u - K * TI) * SCT : PT8 ? 0u : (u32)((u - K * TI) / 8) * KB);
      }
    };
    auto weights = [&](int k) -> const uint4* {
      const uint4* r = ub[0];
#pragma unroll
      for (int j = 1; j < URT; ++j)
        if (k == j) r = ub[j];
      return r;
    };
    auto unit_so = [&](int k) -> u32 {
      u32 o = so[0];
#pragma unroll
      for (int j = 1; j < URT; ++j)
        if (k == j) o = so[j];
      return o;
    };
    // PT8: unit k's matrix m (0 gate, 1 up) scale j (0 weight, 1 input)
    auto scale_t8 = [&](int k, int m, int j) -> float {
      const u32 o = unit_so(k);
      return __ldg((o >> 31 ? ss13 : s13) + (o & 0x7fffffffu) + 2 * m + j);
    };
    auto scale13 = [&](int k, int m, int c) -> float {
      const u32 o = unit_so(k);
      return __ldg((o >> 31 ? ss13 + (size_t)m * (IS / 128) * KB : s13 + (size_t)m * E * (I / 128) * KB) + (o & 0x7fffffffu) + c / 4);
    };
    // FP4: unit k's tile scales (bytes), and the four of chunk c this lane's rows (g, g + 8) take
    // of gate (m = 0) and up: MX bytes (gate g, gate g+8, up g, up g+8); NV (gate g, up g, gate g+8,
    // up g+8), as e4m3x4_to_bf16x4 pairs them
    auto tile_scales = [&](u32 o) {
      return reinterpret_cast<const unsigned char*>(o >> 31 ? ss13 : s13) + (o & 0x7fffffffu);
    };
    auto scales4 = [&](int k, int c) -> u32 {
      const unsigned char* b = tile_scales(unit_so(k)) + c * SCC;
      if constexpr (MX) return ldg_u8_fill128(b + g) | ldg_u8_fill128(b + g + 8) << 8 | ldg_u8_fill128(b + 16 + g) << 16 | ldg_u8_fill128(b + 24 + g) << 24;
      b += (t >> 1) * 16 + g;
      return ldg_u8_fill128(b) | ldg_u8_fill128(b + 32) << 8 | ldg_u8_fill128(b + 8) << 16 | ldg_u8_fill128(b + 40) << 24;
    };
    unit_base(0);
    if constexpr (COLS) {
      // slot q of this warp's stream: a gate/up chunk (G) or a column chunk (C) of pair k, its i-th
      const int q_end = nuu * (CPU + CC);
      auto slot = [&](int q, int& k, int& i) -> bool {  // true: a column chunk
        if (q < CPU) {
          k = 0;
          i = q;
          return false;
        }
        const int r = q - CPU, blk = r / (CPU + CC), off = r % (CPU + CC);
        if (blk < nuu - 1 && off < CPU) {
          k = blk + 1;
          i = off;
          return false;
        }
        k = blk;
        i = blk < nuu - 1 ? off - CPU : off;
        return true;
      };
      // unit k's column fragment of row tile rt for lane (g, t): the packed down weights' lane (g, 2 h +
      // t / 2) of k-step t & 1 in the unit's chunk c = j / 2 (h = j & 1): an m16n8k16 A fragment over
      // the unit's 16 K in the order 4 t + (0, 1), 4 t + (2, 3), whose B is activations 4 t .. 4 t + 3
      auto col = [&](int k, int rt) -> const uint4* {
        const int u = unit_of(u0 + (k / NTOK) * VB), j = u < K * TI ? u % TI : u - K * TI, h = j & 1, c = j >> 1;
        const int grp = rt / TPB, lo = ((rt % TPB) * 2 + (t & 1)) * 32 + g * 4 + 2 * h + (t >> 1);
        if (u < K * TI)
          return w2 + (((size_t)s_ids[(k % NTOK) * K + u / TI] * (H / (16 * TPB)) + grp) * KCD + c) * AUD * 32 + lo;
        return ws2 + ((size_t)grp * KCDS + c) * AUD * 32 + lo;
      };
      uint4 buf[P][4];
      auto load = [&](int q, uint4 (&b)[4]) {
        if (q < q_end) {
          int k, i;
          if (slot(q, k, i)) {
#pragma unroll
            for (int f = 0; f < 4; ++f) b[f] = ld_stream_fill64(col(k, warp + (i * 4 + f) * WARPS));
          } else {
            const uint4* a = weights(k) + (size_t)(warp + i * WARPS) * GCU + lane;
#pragma unroll
            for (int f = 0; f < 4; ++f) b[f] = __ldcs(a + f * 32);
          }
        }
      };
      static_assert(!SFIRST || P <= CPU, "the first round of loads: the first unit's");
      if (SFIRST && u0 < TIS) {  // the shared expert's unit: its first loads, then the choices
#pragma unroll
        for (int s = 0; s < P; ++s) load(s, buf[s]);
        if (!BROUTE && (NTOK > 1 || warp != 0)) mbar_wait(rbar, 0);
#pragma unroll
        for (int k = 1; k < URT; ++k)
          if (k < nuu) unit_base(k);
      } else {
#pragma unroll
        for (int k = 1; k < URT; ++k)
          if (k < nuu) unit_base(k);
#pragma unroll
        for (int s = 0; s < P; ++s) load(s, buf[s]);
      }
      float acc[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[m][r] = 0.0f;
      uint2 cb = make_uint2(0u, 0u);  // the column unit's activations (lanes g = 0) and weight
      float cw = 0.0f;
      for (int q0 = 0; q0 < q_end; q0 += P) {
#pragma unroll
        for (int s = 0; s < P; ++s) {
          const int q = q0 + s;
          if (q >= q_end) break;
          int k, i;
          const bool is_col = slot(q, k, i);
          if (is_col) {
            if (i == 0) {  // unit k's activations from every warp's sums, in warp order (each warp computes them)
              mbar_wait(ubar + 8 * k, cpar);
              const int u = unit_of(u0 + (k / NTOK) * VB), n = k % NTOK;
              u32 a = 0;
              if (lane < 16) {
                float gv = 0.0f, uv = 0.0f;
                for (int w = 0; w < WARPS; ++w) {
                  gv += red[(k * WARPS + w) * 32 + lane];
                  uv += red[(k * WARPS + w) * 32 + 16 + lane];
                }
                a = (u32)(u < K * TI ? f32_to_bf16(activate<true>(gv, uv)) : f32_to_bf16(activate<ActRule::SHARED_LIMIT>(gv, uv)));
              }
              const u32 a0 = __shfl_sync(0xffffffffu, a, 4 * t), a1 = __shfl_sync(0xffffffffu, a, 4 * t + 1);
              const u32 a2 = __shfl_sync(0xffffffffu, a, 4 * t + 2), a3 = __shfl_sync(0xffffffffu, a, 4 * t + 3);
              cb = g == 0 ? make_uint2(a0 | a1 << 16, a2 | a3 << 16) : make_uint2(0u, 0u);
              cw = u < K * TI ? s_w[n * K + u / TI] : (SHARED_GATE ? s_gate[n] : 1.0f);
            }
#pragma unroll
            for (int f = 0; f < 4; ++f) {
              float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              mma_bf16(tmp, buf[s][f], cb.x, cb.y);
              if (t == 0) {  // rows g, g + 8 of row tile rt: the units in order, each times its weight
                float* y = s_cpart + (k % NTOK) * H + (warp + (i * 4 + f) * WARPS) * 16 + g;
                y[0] = k < NTOK ? cw * tmp[0] : fmaf(cw, tmp[0], y[0]);
                y[8] = k < NTOK ? cw * tmp[2] : fmaf(cw, tmp[2], y[8]);
              }
            }
          } else {
            const int c = warp + i * WARPS;
            const uint4 b = g == 0 ? *reinterpret_cast<const uint4*>(x + (k % NTOK) * H + c * 32 + t * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              mma_bf16(acc[m], buf[s][2 * m], b.x, b.y);
              mma_bf16(acc[m], buf[s][2 * m + 1], b.z, b.w);
            }
          }
          load(q + P, buf[s]);
          if (!is_col && i == CPU - 1) {  // the end of unit k's gate/up: this warp's sums, its arrival
            if (t == 0) {
              float* rk = red + (k * WARPS + warp) * 32;
#pragma unroll
              for (int m = 0; m < 2; ++m) {
                rk[m * 16 + g] = acc[m][0];
                rk[m * 16 + g + 8] = acc[m][2];
              }
            }
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[m][r] = 0.0f;
            mbar_arrive(ubar + 8 * k);
          }
        }
      }
      cpar ^= 1;
      if (t == 0) {  // this group's partial sums of this warp's row tiles (its own writes)
        const unsigned long long tag = (unsigned long long)ep << 32;
#pragma unroll 1
        for (int rt = warp; rt < RT; rt += WARPS)
#pragma unroll
          for (int n = 0; n < NTOK; ++n) {  // spart [VB][NTOK][H]
            unsigned long long* o = spart + ((size_t)u0 * NTOK + n) * H + rt * 16 + g;
            st_tagged(o, tag | __float_as_uint(s_cpart[n * H + rt * 16 + g]));
            st_tagged(o + 8, tag | __float_as_uint(s_cpart[n * H + rt * 16 + g + 8]));
          }
      }
      if (u0 + (int)gridDim.x < VB) __syncthreads();  // (fewer blocks than groups) red and the mbarriers again
      continue;
    }
    // this warp's stream: unit k's chunks warp, warp + WARPS, ... (CPU of them), P in flight (with
    // their FP8 or FP4 scales)
    const int q_end = nu * CPU;
    uint4 buf[P][GU];
    float scl[P][2];
    u32 sq[P];
    auto load = [&](int q, uint4 (&b)[GU], float (&sc)[2], u32& s4) {
      if (q < q_end) {
        const int c = warp + (q % CPU) * WARPS;
        const uint4* a = weights(q / CPU) + (size_t)c * GCU + lane;
#pragma unroll
        for (int f = 0; f < GU; ++f) b[f] = __ldcs(a + f * 32);
        if constexpr (FP8) {
#pragma unroll
          for (int m = 0; m < 2; ++m) sc[m] = scale13(q / CPU, m, c);
        }
        if constexpr (FP4) s4 = scales4(q / CPU, c);
      }
    };
    constexpr int P0 = P < CPU ? P : CPU;  // the first round's loads of the first unit
#pragma unroll
    for (int s = 0; s < P0; ++s) load(s, buf[s], scl[s], sq[s]);
#pragma unroll
    for (int k = 1; k < UR; ++k)
      if (k < nu) unit_base(k);
#pragma unroll
    for (int s = P0; s < P; ++s) load(s, buf[s], scl[s], sq[s]);  // (P past a unit's chunks) the next units'
    if constexpr (PT8) {  // x by each unit's input scale (gate's, equal to up's: the loader checks), its loads in flight
      for (int k = 0; k < nu; ++k) {
        const float s = scale_t8(k, 0, 1);
        for (int i = threadIdx.x; i < H / 8; i += THREADS) {
          const uint4 v = reinterpret_cast<const uint4*>(x)[i];
          reinterpret_cast<uint4*>(s_xq + k * H)[i] =
              make_uint4(quant_e4m3x2(v.x, s), quant_e4m3x2(v.y, s), quant_e4m3x2(v.z, s), quant_e4m3x2(v.w, s));
        }
      }
      __syncthreads();
    }
    float acc[2][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[m][r] = 0.0f;
    const int q_ask = (q_end - 1) / P * P;  // LATE: the last round, whose start asks for the down rows
    for (int q0 = 0; q0 < q_end; q0 += P) {
      if (LATE && q0 == q_ask && u0 == (int)blockIdx.x && (int)blockIdx.x < H / 16) request(blockIdx.x);
#pragma unroll
      for (int s = 0; s < P; ++s) {
        const int q = q0 + s, c = warp + (q % CPU) * WARPS;
        if (PART && q >= q_end) break;
        const uint4 b = g != 0 ? make_uint4(0, 0, 0, 0)
                         : *reinterpret_cast<const uint4*>((PT8 ? s_xq + (q / CPU) * H : x) + c * 32 + t * 8);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          if constexpr (MX) {  // gate's k-steps in x, y; up's in z, w
            mx_mma(acc[m], m ? buf[s][0].z : buf[s][0].x, m ? buf[s][0].w : buf[s][0].y, b, (sq[s] >> (16 * m)) & 0xffu,
                   (sq[s] >> (16 * m + 8)) & 0xffu);
          } else if constexpr (NV) {
            const uint2 sc = e4m3x4_to_bf16x4(sq[s]);  // (gate g, gate g + 8), (up g, up g + 8)
            nv_mma(acc[m], m ? buf[s][0].z : buf[s][0].x, m ? buf[s][0].w : buf[s][0].y, b, m ? sc.y : sc.x);
          } else if constexpr (FP8) {  // exact bf16 codes through the tensor cores, the block scale in fp32
            uint4 k0, k1;
            e4m3x16_to_bf16(buf[s][m], k0, k1);
            float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_bf16(tmp, k0, b.x, b.y);
            mma_bf16(tmp, k1, b.z, b.w);
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[m][r] = fmaf(scl[s][m], tmp[r], acc[m][r]);
          } else if constexpr (PT8) {  // exact bf16 codes times the quantized x, summed over all of K
            uint4 k0, k1;
            e4m3x16_to_bf16(buf[s][m], k0, k1);
            mma_bf16(acc[m], k0, b.x, b.y);
            mma_bf16(acc[m], k1, b.z, b.w);
          } else {
            mma_bf16(acc[m], buf[s][2 * m], b.x, b.y);
            mma_bf16(acc[m], buf[s][2 * m + 1], b.z, b.w);
          }
        }
        load(q + P, buf[s], scl[s], sq[s]);
        if ((q + 1) % CPU == 0) {  // the end of unit q / CPU: this warp's partial sums
          if (t == 0) {
            float* rk = red + ((q / CPU) * WARPS + warp) * 32;
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              rk[m * 16 + g] = acc[m][0];
              rk[m * 16 + g + 8] = acc[m][2];
            }
          }
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[m][r] = 0.0f;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < nu * 16) {  // unit k, row r: the warps' sums in warp order, the activation
      const int k = threadIdx.x >> 4, r = threadIdx.x & 15, u = u0 + k * gridDim.x;
      float gv = 0.0f, uv = 0.0f;
      for (int w = 0; w < WARPS; ++w) {
        gv += red[(k * WARPS + w) * 32 + r];
        uv += red[(k * WARPS + w) * 32 + 16 + r];
      }
      if constexpr (NV) {  // the tile's scale_2 of gate and up (after its scales)
        const float* s2t = reinterpret_cast<const float*>(tile_scales(unit_so(k)) + KC * SCC);
        gv *= __ldg(s2t);
        uv *= __ldg(s2t + 1);
      }
      if constexpr (PT8) {  // input_scale * weight_scale, once
        gv *= scale_t8(k, 0, 1) * scale_t8(k, 0, 0);
        uv *= scale_t8(k, 1, 1) * scale_t8(k, 1, 0);
      }
      bf16_t a = u < K * TI ? f32_to_bf16(activate<true>(gv, uv)) : f32_to_bf16(activate<ActRule::SHARED_LIMIT>(gv, uv));
      if constexpr (PT8) a = quant_e4m3(a, __ldg(u < K * TI ? s2 + (size_t)s_ids[u / TI] * 2 + 1 : ss2 + 1));  // down's input scale
      const int idx = u < K * TI ? (u / TI) * I + (u % TI) * 16 + r : K * I + (u - K * TI) * 16 + r;
      if constexpr (TAGS) {
        st_tagged(tact + idx, (ep << 16) | (u32)a);
      } else if (u < K * TI) {
        act[idx] = a;
      } else {
        act_s[idx - K * I] = a;
      }
    }
    __syncthreads();
  }
  if (LATE && (int)blockIdx.x >= UNITS && (int)blockIdx.x < H / 16) request(blockIdx.x);  // (a block without units)
  if constexpr (!TAGS) grid_barrier(gbar, phase);

  if constexpr (COLS) {
    // 4. (COLS) block b's output rows 16 rb .. 16 rb + 15, rb = b, b + blocks, ...: each row's VB
    // partials loaded until every one is this call's; thread (j0, r) adds groups j0, j0 + JW, ...
    // in order, then row r adds the JW sums in order: a fixed order for every grid.
    // (NTOK: every token's rows alike, spart [VB][NTOK][H], out [NTOK][H])
    if (blockIdx.x == 0 && threadIdx.x < K * NTOK) {  // for inspection (block 0 has a unit: its mbarriers
      topk_ids[threadIdx.x] = s_ids[threadIdx.x];        // ordered every routing warp's writes before these reads)
      topk_w[threadIdx.x] = s_w[threadIdx.x];
    }
    constexpr int JW = THREADS / 16, PV = (VB + JW - 1) / JW;
    const int r = threadIdx.x & 15, j0 = threadIdx.x >> 4;
    for (int rb = blockIdx.x; rb < RT; rb += gridDim.x) {
      float v[NTOK][PV];
      bool done[NTOK][PV];
#pragma unroll
      for (int n = 0; n < NTOK; ++n)
#pragma unroll
        for (int i = 0; i < PV; ++i) {
          done[n][i] = j0 + i * JW >= VB;
          v[n][i] = 0.0f;
        }
      for (;;) {
        bool stale = false;
        unsigned long long q[NTOK][PV];
#pragma unroll
        for (int n = 0; n < NTOK; ++n)
#pragma unroll
          for (int i = 0; i < PV; ++i)
            if (!done[n][i]) q[n][i] = ld_tagged(spart + ((size_t)(j0 + i * JW) * NTOK + n) * H + rb * 16 + r);
#pragma unroll
        for (int n = 0; n < NTOK; ++n)
#pragma unroll
          for (int i = 0; i < PV; ++i) {
            if (!done[n][i]) {
              done[n][i] = (u32)(q[n][i] >> 32) == ep;
              stale |= !done[n][i];
              v[n][i] = __uint_as_float((u32)q[n][i]);
            }
          }
        if (!__syncthreads_or(stale)) break;
        __nanosleep(64);
      }
#pragma unroll
      for (int n = 0; n < NTOK; ++n) {
        float y = 0.0f;
#pragma unroll
        for (int i = 0; i < PV; ++i)
          if (j0 + i * JW < VB) y += v[n][i];
        red[(n * JW + j0) * 16 + r] = y;
      }
      __syncthreads();
      if (threadIdx.x < 16 * NTOK) {
        const unsigned n = NTOK > 1 ? threadIdx.x >> 4 : 0u, rr = NTOK > 1 ? (unsigned)r : threadIdx.x;
        float o = 0.0f;
        for (int j = 0; j < JW; ++j) o += red[(n * JW + j) * 16 + rr];
        out[n * H + rb * 16 + rr] = f32_to_bf16(o);
      }
      __syncthreads();
    }
  } else {

  // 4. down + the weighted sum, 16 output rows at a time. The activations are staged in shared
  // memory by the whole block: (TAGS) loaded until every one carries this call's epoch (each
  // thread reading again only its quads that did not), or copied from L2 (other blocks wrote
  // them, before the barrier).
  if ((int)blockIdx.x < H / 16) {
    if constexpr (FP8) cp_async_wait<0>();  // this thread's copies of the down scales (request)
    if constexpr (TAGS) {
      constexpr int PER = (NACT / 4 + THREADS - 1) / THREADS;  // 4 tagged activations per load and thread
      const u32 want = ep & 0xffffu;
      if (BLOCK_ROUTE && warp == 0) route_block_weights<E, K, SHARED_GATE, RouteRule>(s_pick, s_vall, &s_gl, s_w, s_gate);
      if (OVERLAP && warp == 0) route_weights<K, RouteRule>(s_pick, s_all[0], s_w);
      bool done[PER];  // this thread's quads that carry the epoch (staged): not read again
#pragma unroll
      for (int i = 0; i < PER; ++i) done[i] = (int)threadIdx.x + i * THREADS >= NACT / 4;
      for (;;) {
        bool stale = false;
        uint4 q[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i)
          if (!done[i]) q[i] = ld_tagged4(tact + 4 * ((int)threadIdx.x + i * THREADS));
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          if (!done[i]) {
            done[i] = (q[i].x >> 16) == want && (q[i].y >> 16) == want && (q[i].z >> 16) == want && (q[i].w >> 16) == want;
            stale |= !done[i];
            *reinterpret_cast<uint2*>(s_act + 4 * ((int)threadIdx.x + i * THREADS)) =
                make_uint2((q[i].x & 0xffffu) | (q[i].y << 16), (q[i].z & 0xffffu) | (q[i].w << 16));
          }
        }
        if (!__syncthreads_or(stale)) break;
        __nanosleep(64);
      }
    } else {
      static_assert(I % 8 == 0 && IS % 8 == 0, "activations copied 8 at a time");
      for (int v = threadIdx.x; v < NACT / 8; v += THREADS)
        reinterpret_cast<uint4*>(s_act)[v] = __ldcg(reinterpret_cast<const uint4*>(8 * v < K * I ? act + 8 * v : act_s + (8 * v - K * I)));
      __syncthreads();
    }
    if ((BLOCK_ROUTE || OVERLAP) && blockIdx.x == 0 && threadIdx.x < K) topk_w[threadIdx.x] = s_w[threadIdx.x];  // for inspection
  }
  constexpr int CW = (KCD + WARPS - 1) / WARPS, CWS = (KCDS + WARPS - 1) / WARPS;  // BF16: pieces a warp may get
  constexpr int CWM = CW > CWS ? CW : CWS;
  constexpr bool RUNS = C8 || FP4;  // FP8, FP4: a warp's pieces a run of PPW consecutive ones, NACC in flight
  constexpr int PPW = (PIECES + WARPS - 1) / WARPS, NACC = 4;
  u32 parity = 0;
  for (int rb = blockIdx.x; rb < H / 16; rb += gridDim.x) {
    if (rb != (int)blockIdx.x) {  // a later group (fewer blocks than row groups): request it now
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the reads of the last pieces first
      __syncthreads();
      request(rb);
      if constexpr (FP8) {
        cp_async_wait<0>();
        __syncthreads();
      }
    }
    // BF16: warp w takes the pieces p = w, w + WARPS, ... of each operand's run (p = s * KCD + c),
    // one operand at a time, its own accumulator. Each operand's pieces are waited for just before
    // its loads. Measured on the H200 (2026-11-30, N = 1, in one process, the same bits; with the
    // re-reads of stale activations only, above) against the groups of 4 to 8 operands unrolled
    // before: Qwen3-Next-80B-A3B 26.73 -> 26.10 us, Qwen3-30B-A3B 26.44 -> 26.11.
    // FP8 and FP4 (RUNS): warp w takes the run of PPW consecutive pieces of the flattened list from
    // w * PPW (each operand's pieces in it waited for once: one or two operands where PPW <= KCD), NACC pieces' products in
    // their own accumulators, added in a fixed order at the operand's end: fewer waits and dependent
    // products a warp. On the H200 (2026-11-30, N = 1, one process, 12 interleaved rounds, the same
    // weights; against one operand at a time, FP4 two): Qwen3-30B-A3B-FP8 18.97 -> 18.43 and 19.04 ->
    // 18.89 us, -NVFP4 20.52 -> 20.24 and 20.70 -> 20.35, -MXFP4 20.75 -> 20.20. The same for BF16
    // measured slower (Qwen3-30B-A3B 25.67 -> 25.78, Qwen3-Next-80B-A3B 25.07 -> 25.15 us), and
    // reading a run's first 4-8 pieces into registers before the activations' poll slower still
    // (25.68 -> 26.10-26.80 us).
    const int mt = rb % TPB;  // FP4: this block's tile of the row group
    if constexpr (RUNS) {
      const int p_end = min((warp + 1) * PPW, PIECES);
#pragma unroll 1
      for (int p = warp * PPW; p < p_end;) {  // one operand's pieces of this warp's run
        const int s = p < K * KCD ? p / KCD : K, base = s * KCD;
        const int q_end = min(p_end, s < K ? base + KCD : PIECES);
        mbar_wait(bar + 8 * s, parity);
        float o[NACC][4];
#pragma unroll
        for (int j = 0; j < NACC; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) o[j][r] = 0.0f;
#pragma unroll 1
        for (int q = p; q < q_end; q += NACC) {
#pragma unroll
          for (int j = 0; j < NACC; ++j) {
            if (q + j < q_end) {
              const int c = q + j - base;
              const uint4 b = g == 0 ? *reinterpret_cast<const uint4*>(s_act + s * I + c * 32 + t * 8) : make_uint4(0, 0, 0, 0);
              const uint4 w = pieces[(q + j) * PU4 + lane];
              if constexpr (FP4) {  // tile 0's k-steps in x, y; tile 1's in z, w; the chunk's scales as the packed weights hold them
                const u32 q0 = mt ? w.z : w.x, q1 = mt ? w.w : w.y;
                const unsigned char* sc = s_dsc4 + s * SCB + c * SCC;
                if constexpr (MX) {
                  mx_mma(o[j], q0, q1, b, sc[mt * 16 + g], sc[mt * 16 + g + 8]);
                } else {
                  const unsigned char* r = sc + mt * 32 + (t >> 1) * 16 + g;
                  nv_mma(o[j], q0, q1, b, e4m3x4_to_bf16x4((u32)r[0] | (u32)r[8] << 16).x);
                }
              } else if constexpr (PT8) {  // summed over all of K, scaled once (below)
                uint4 k0, k1;
                e4m3x16_to_bf16(w, k0, k1);
                mma_bf16(o[j], k0, b.x, b.y);
                mma_bf16(o[j], k1, b.z, b.w);
              } else {
                uint4 k0, k1;
                e4m3x16_to_bf16(w, k0, k1);
                float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_bf16(tmp, k0, b.x, b.y);
                mma_bf16(tmp, k1, b.z, b.w);
                const float sc = s_dsc[s * KBD + c / 4];
#pragma unroll
                for (int r = 0; r < 4; ++r) o[j][r] = fmaf(sc, tmp[r], o[j][r]);
              }
            }
          }
        }
        if (t == 0) {
          float y0 = o[0][0], y2 = o[0][2];
#pragma unroll
          for (int j = 1; j < NACC; ++j) {
            y0 += o[j][0];
            y2 += o[j][2];
          }
          red[(warp * DSLOTS + s) * 16 + g] = y0;
          red[(warp * DSLOTS + s) * 16 + g + 8] = y2;
        }
        p = q_end;
      }
    } else {
#pragma unroll 1
      for (int s = 0; s < DSLOTS; ++s) {
        const int base = s * KCD, kcd = s < K ? KCD : KCDS;
        const int c0 = ((warp - base) % WARPS + WARPS) % WARPS;
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mbar_wait(bar + 8 * s, parity);
#pragma unroll
        for (int i = 0; i < CWM; ++i) {
          const int c = c0 + i * WARPS;
          if (c < kcd) {
            const uint4 b = g == 0 ? *reinterpret_cast<const uint4*>(s_act + s * I + c * 32 + t * 8) : make_uint4(0, 0, 0, 0);
            mma_bf16(o, pieces[(base + c) * PU4 + lane], b.x, b.y);
            mma_bf16(o, pieces[(base + c) * PU4 + lane + 32], b.z, b.w);
          }
        }
        if (t == 0) {
          red[(warp * DSLOTS + s) * 16 + g] = o[0];
          red[(warp * DSLOTS + s) * 16 + g + 8] = o[2];
        }
      }
    }
    parity ^= 1;
    __syncthreads();
    float* ys = red + WARPS * DSLOTS * 16;  // each operand's rows: its warps' sums in warp order
    if (threadIdx.x < DSLOTS * 16) {
      const int s = threadIdx.x >> 4, r = threadIdx.x & 15;
      float y = 0.0f;
      if constexpr (RUNS) {  // operand s's pieces b0 .. b1 - 1 lie in the runs of warps b0 / PPW .. (b1 - 1) / PPW
        const int b0 = s * KCD, b1 = s < K ? b0 + KCD : PIECES;
        for (int w = b0 / PPW; w <= (b1 - 1) / PPW; ++w) y += red[(w * DSLOTS + s) * 16 + r];
      } else {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) y += red[(w * DSLOTS + s) * 16 + r];
      }
      if constexpr (NV) y *= reinterpret_cast<const float*>(s_dsc4 + s * SCB + (s < K ? KCD : KCDS) * SCC)[mt];  // the tile's scale_2
      if constexpr (PT8) y *= s_dsc[s];  // weight_scale * input_scale
      ys[s * 16 + r] = y;
    }
    __syncthreads();
    if (threadIdx.x < 16) {  // row r: the choices in order, then the shared expert
      const int r = threadIdx.x;
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) acc = fmaf(s_w[j], ys[j * 16 + r], acc);
      if constexpr (KCDS > 0) acc = fmaf(SHARED_GATE ? s_gate[0] : 1.0f, ys[K * 16 + r], acc);
      out[rb * 16 + r] = f32_to_bf16(acc);
    }
    __syncthreads();
  }
  }  // (not COLS)
  if (TAGS && blockIdx.x == 0 && threadIdx.x == 0) {  // every block has read the epoch: advance it
    u32 n;
    do {
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(epoch + 1) : "memory");
    } while (n < gridDim.x);
    epoch[1] = 0;
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(epoch), "r"(ep) : "memory");
  }
}

// ---- pack family: Hugging Face row-major weights -> the GEMV tile layout, on the device ----
// MATS source tensors [E][R][K] bf16 become [E][R_pad/16][K/32][MATS][2][32][8] (see TileGemv):
// one thread writes one lane's 16-byte fragment. Rows past R are zero. With interleave the MATS
// matrices of a tile group are consecutive 16-row tiles of src0: [E][R_pad/(16*MATS)][K/32][MATS]...
// One kernel for every layout (MATS and interleave are arguments): it runs once, at load.
MOE_DEVICE void pack_body(const bf16_t* __restrict__ src0, const bf16_t* __restrict__ src1,
                          uint4* __restrict__ dst, int experts, int rows, int rows_pad, int k, int MATS,
                          int interleave) {
  const bool INTERLEAVE = interleave != 0;
  const int tiles = rows_pad / (INTERLEAVE ? 16 * MATS : 16), chunks = k / 32;
  const long long total = (long long)experts * tiles * chunks * MATS * 64;
  for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < total;
       u += (long long)gridDim.x * blockDim.x) {
    long long r = u;
    const int lane = (int)(r % 32); r /= 32;
    const int s = (int)(r % 2); r /= 2;
    const int mt = (int)(r % MATS); r /= MATS;
    const int chunk = (int)(r % chunks); r /= chunks;
    const int tile = (int)(r % tiles);
    const int e = (int)(r / tiles);
    const bf16_t* src = (INTERLEAVE || mt == 0 ? src0 : src1) + (size_t)e * rows * k;
    const int row0 = INTERLEAVE ? (tile * MATS + mt) * 16 : tile * 16;
    const int g = lane >> 2, col = chunk * 32 + 8 * (lane & 3) + 4 * s;
    u32 v[4];
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + g + 8 * h;
        v[q * 2 + h] = row < rows ? *reinterpret_cast<const u32*>(src + (size_t)row * k + col + 2 * q) : 0u;
      }
    dst[u] = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

// ---- norm family: RMSNorm of x before the router and/or before the experts ----
// One block per token: the sum of squares in fp32 (a fixed reduction order), then
// bf16(x * rsqrt(mean + eps) * weight) for each norm the layer has.
template <int H, int THREADS, bool ROUTER_NORM, bool EXPERT_NORM>
MOE_DEVICE void rmsnorm_body(const bf16_t* __restrict__ x, const float* __restrict__ w_router,
                             const float* __restrict__ w_expert, bf16_t* __restrict__ xr,
                             bf16_t* __restrict__ xe, int n) {
  __shared__ float part[THREADS / 32];
  grid_dep_wait();
  grid_dep_launch();
  const int tk = blockIdx.x;
  if (tk >= n) return;
  const bf16_t* row = x + (size_t)tk * H;
  float ss = 0.0f;
  for (int h = threadIdx.x; h < H; h += THREADS) {
    const float v = bf16_to_f32(row[h]);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += part[w];
  const float mean = total / H;
  const float rr = 1.0f / sqrtf(mean + NormRule::ROUTER_EPS), re = 1.0f / sqrtf(mean + NormRule::EXPERT_EPS);
  for (int h = threadIdx.x; h < H; h += THREADS) {
    const float v = bf16_to_f32(row[h]);
    if constexpr (ROUTER_NORM) xr[(size_t)tk * H + h] = f32_to_bf16(v * rr * w_router[h]);
    if constexpr (EXPERT_NORM) xe[(size_t)tk * H + h] = f32_to_bf16(v * re * w_expert[h]);
  }
}

// ---- prefill: a grouped GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a) ----
// Y[p, n] = sum_k X[tok[p], k] * W[e, n, k] for the token rows p of expert e, in the permuted
// order (rows grouped by expert). A block computes BM token rows x BN weight rows of one
// expert: A (BM x 64 K, gathered from X through tok) and B (BN x 64 K, from W[e]) are K-major
// in shared memory with the 128-byte swizzle wgmma reads, in a STAGES-deep cp.async ring; each
// warpgroup multiplies its 64 token rows by the block's BN weight rows (wgmma m64nBNk16, fp32
// accumulators in registers). Results in bf16. Each output element is one fixed sequence of
// wgmma k-steps: the same bits whatever the other tokens of the batch.
// tiles: [blocks.y][8] int32, (expert, first permuted row, rows in the tile <= BM, then its group
// (gemm_tile's order): the group's first tile + its tiles << 16, its first row, its last tile's
// rows; 0, 0).
namespace gg {
constexpr int TI = 8;  // int32 a tile table's entry (32 bytes: one sector)
// Byte offset of 16-byte chunk c (0..7) of row r in a [rows][64] bf16 tile, 128-byte swizzle:
// the chunk index XOR the row within its 8-row group.
MOE_DEVICE u32 swz128(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }
// wgmma matrix descriptor of a K-major tile at shared address `addr` (1024-byte aligned tile;
// a k-step adds 32 bytes): 128-byte swizzle, 8-row groups 1024 bytes apart.
MOE_DEVICE unsigned long long smem_desc(u32 addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}
MOE_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
MOE_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MOE_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
MOE_DEVICE void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accumulator reads or writes across wgmma issue and wait.
template <int R>
MOE_DEVICE void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d (64 x 128 fp32, this thread's 64) = A (64 x 16) * B (16 x 128) + (accumulate ? d : 0)
MOE_DEVICE void wgmma_bf16(float (&d)[64], unsigned long long a, unsigned long long b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 { %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 }, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}
}  // namespace gg


// ---- prefill gate/up from the decode path's packed weights (no second copy) ----
// H[p, i] = act(X'[tok[p]] . Wg[e, i], X'[tok[p]] . Wu[e, i]) for the token rows p of expert e.
// The weights are the GEMV tiles (moegen.weights.pack_tiles: a lane's 16 bytes are its m16n8k16
// A fragment) and go to the tensor cores as wgmma's register operand A: warp w of the block
// owns one 16-row tile, its fragments copied into a shared-memory ring and read back by the
// same lane. X' is X with K permuted inside each 32-wide chunk as the tiles permute it
// (moegen.prefill.permute_k), so the tokens' B tiles are plain K-major rows, gathered through
// tok as above. Gate and up of a row are in the same thread: the activation is applied in
// registers and H written in bf16.
namespace gg {
// d += A (this warp's 16 rows x 16 K, registers) * B (16 x 128, desc b)
MOE_DEVICE void wgmma_bf16_ra(float (&d)[64], const uint4& a, unsigned long long b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 { %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 }, { %64, %65, %66, %67 }, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(b), "r"(accumulate));
}
// FP4 (F4) row scales of one chunk as bf16 pairs: (row g's in both halves, row g + 8's in both),
// from their bytes (MX: E8M0 2^(b - 127), 0: 2^-127, a bf16 subnormal; NV: e4m3), exactly
template <int F4>
MOE_DEVICE uint2 fp4_scales(u32 lo, u32 hi) {
  if constexpr (F4 == MOE_W_NVFP4) {
    const u32 two = e4m3x4_to_bf16x4(lo | hi << 16).x;  // (row g, row g + 8)
    return make_uint2(prmt(two, 0u, 0x1010u), prmt(two, 0u, 0x3232u));
  } else {
    auto bits = [](u32 b) -> u32 { return b == 0 ? 0x0040u : b == 255 ? 0x7FC0u : b << 7; };
    return make_uint2(bits(lo) * 0x00010001u, bits(hi) * 0x00010001u);
  }
}
// An A fragment's rows times their scales (x, z: row g; y, w: row g + 8), in bf16, exactly
MOE_DEVICE uint4 scale_rows(uint4 k, uint2 sp) {
  return make_uint4(mul_bf16x2(k.x, sp.x), mul_bf16x2(k.y, sp.y), mul_bf16x2(k.z, sp.x), mul_bf16x2(k.w, sp.y));
}
MOE_DEVICE uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 { %0, %1, %2, %3 }, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// The block's index in its grid and the grid's size, read where they are used: computed once before
// the warpgroups set their register counts, ptxas kept them on the stack (the FP8-activation GEMMs)
MOE_DEVICE int block_index() {
  u32 x, y, nx;
  asm volatile("mov.u32 %0, %%ctaid.x;\n\tmov.u32 %1, %%ctaid.y;\n\tmov.u32 %2, %%nctaid.x;" : "=r"(x), "=r"(y), "=r"(nx));
  return (int)(y * nx + x);
}
MOE_DEVICE int grid_size() {
  u32 nx, ny;
  asm volatile("mov.u32 %0, %%nctaid.x;\n\tmov.u32 %1, %%nctaid.y;" : "=r"(nx), "=r"(ny));
  return (int)(nx * ny);
}
// Block b of the GEMM's rbs x tiles blocks: its weight row block, tile and the tile's (expert, first
// row, rows). Consecutive blocks take one group's tiles (the scan's groups: an expert's tiles, cut
// into equal parts where it has more than two over the average) of one row block, then the same
// tiles of the next row block. An expert's weight rows are then read from DRAM once, by blocks that
// run side by side, and the group's token rows stay in L2 while every row block reads them. Block
// b's group is that of tile b / rbs, whose entry holds all the group's tiles need (a group is one
// expert's consecutive tiles, full but for the expert's last), so that one 32-byte read finds it.
// Only which block computes a tile changes, never how.
// (Before, groups of G consecutive tiles, G the tiles an expert has on average, which straddle
// experts: on the H200, 2026-12-02, the same bits, N = 8192, DeepSeek-V3-FP8-a8 11043.7 -> 10608.6 us,
// Qwen3-30B-A3B 1316.8 -> 1302.4; Qwen3-30B-A3B-FP8-a8 at N = 2048 376.0 -> 383.0 (README). Before
// that, G row blocks of a tile then of the next: Mixtral-8x7B 10027.4 -> 9829.1 us, Qwen3-30B-A3B
// 1432.7 -> 1409.1 us at N = 8192, 2026-12-01.)
struct TileRef {
  int rb, tile, e, row0, rows;
};
MOE_DEVICE TileRef gemm_tile(int b, int rbs, const int* __restrict__ tiles, int bm) {
  const unsigned p = (unsigned)b / (unsigned)rbs;
  const int4 h = *reinterpret_cast<const int4*>(tiles + (size_t)p * TI);
  const int2 g = *reinterpret_cast<const int2*>(tiles + (size_t)p * TI + 4);
  const unsigned f = (unsigned)h.w & 0xFFFFu, size = (unsigned)h.w >> 16;
  const unsigned rem = (unsigned)b - f * rbs, rb = rem / size, i = rem - rb * size;
  return TileRef{ (int)rb, (int)(f + i), h.x, g.x + (int)i * bm, i + 1 < size ? bm : g.y };
}
// Block b's (row block, unit) where a block takes a unit of two tiles (the FP8-activation GEMMs'
// pairs of 64-row tiles, whose two tiles may be two experts'): groups of G consecutive units, G
// about the units an expert has, in the same order (the groups before the scan's).
MOE_DEVICE int2 gemm_block(int b, int rbs, int units, int experts) {
  const unsigned g = max(1, units / experts - 1), grp = (unsigned)b / (g * rbs), first = grp * g;
  const unsigned size = min(g, units - first), rem = (unsigned)b - grp * g * rbs, rb = rem / size;
  return make_int2((int)rb, (int)(first + rem - rb * size));
}
// The first warp unit (16-row tile, or row group) of row block rb of `warps` units: where the
// units are not whole blocks of them, the last block overlaps the one before it (GPT-OSS's 90 row
// groups in blocks of 4), its rows computed twice the same way and the same bits stored twice.
MOE_DEVICE int row_unit(int rb, int warps, int units) {
  return units % warps ? min(rb * warps, units - warps) : rb * warps;
}
}  // namespace gg

// SiLU(g) * u in the gate/up epilogue (or GPT-OSS's clamped SwiGLU), as activate() has it.
template <bool CLAMP>
MOE_DEVICE float silu_mul(float g, float u) {
  static_assert(ActRule::KIND == MOE_ACT_SILU || ActRule::KIND == MOE_ACT_SWIGLU_CLAMPED,
                "the prefill epilogue: SiLU or clamped SwiGLU");
  return activate<CLAMP>(g, u);
}

// A thread's words w0 (columns col, col + 1) and w1 (col + 8, col + 9) of token row `row`, columns in
// their natural order, col = 16 * tile + r (r = 0, 2, 4, 6 by lane / 4, rounded down to even): lanes 8
// apart swap one word, so that each holds four adjacent columns (r = 0, 4: col .. col + 3; r = 2, 6:
// col + 6 .. col + 9), and a warp's 8-byte stores fill each token row's 32 bytes of the tile, one
// sector, where its 4-byte stores wrote half of each of two.
// WIDE false: the two words by 4-byte stores (the kernels without the producer warpgroup, whose
// 128 registers the exchange overflows; MOE_Y_STORE32: every kernel, for an A/B).
#ifdef MOE_Y_STORE32
constexpr bool Y_WIDE = false;  // (an A/B: 4-byte stores)
#else
constexpr bool Y_WIDE = true;
#endif
template <bool WIDE>
MOE_DEVICE void pair_exchange(u32& w0, u32& w1, int lane) {  // w0, w1 become the two words pair_store stores
  if constexpr (WIDE && Y_WIDE) {
    const bool hi = (lane >> 3) & 1;  // r = 2, 6
    const u32 x = __shfl_xor_sync(0xffffffffu, hi ? w0 : w1, 8);
    if (hi) w0 = x; else w1 = x;
  }
}
template <bool WIDE>
MOE_DEVICE void pair_store(bf16_t* row, int col, u32 w0, u32 w1, int lane, bool ok) {
  if constexpr (WIDE && Y_WIDE) {
    if (ok)  // (one 64-bit word: as two u32 fields NVVM split the store in two)
      *reinterpret_cast<unsigned long long*>(row + col + ((lane >> 3) & 1 ? 6 : 0)) =
          (unsigned long long)w1 << 32 | w0;
  } else if (ok) {
    *reinterpret_cast<u32*>(row + col) = w0;
    *reinterpret_cast<u32*>(row + col + 8) = w1;
  }
}
// A warp's accumulators of its 16-row tile to memory. Accumulator j: weight row 16*it + lane/4
// (+8 for odd j/2), token (j/4)*8 + 2*(lane%4) + j%2. GATED: H' bf16 [P][n_out], act(gate, up),
// each column at its permuted place (PERM; otherwise H in column order, for the FP8
// quantization). Otherwise Y bf16 [P][n_out] from accumulator set m. Either way lanes 4 apart (rows
// r, r + 1 of the same tokens n, n + 1) swap one value, so that each writes two adjacent columns of
// one token, one 4-byte word (the even row token n's, the odd row token n + 1's; the permutation
// keeps columns 2c, 2c + 1 adjacent). On the H200 (2026-12-01, one process, the same bits) the
// gate/up epilogue's words instead of each activation's 2 bytes: Qwen3-30B-A3B 346.3 / 486.8 /
// 1482.5 -> 341.6 / 471.6 / 1431.8 us at N = 600 / 2048 / 8192, Mixtral-8x7B 10354.8 -> 10073.1 us
// at 8192, GPT-OSS-20B 1362.2 -> 1322.2 us at 3000, Llama-4-Scout 2369.6 -> 2366.6 us at 2048.
// CLAMP: the activation with the layer's
// limit (the routed experts'; the shared expert's where ActRule::SHARED_LIMIT). WOI (GATED, the
// routed experts' with the routing weight on the input, Llama-4): gate and up of row p times its
// (token, choice)'s weight wrow[p] before the activation, as the GEMV kernels scale them. BIAS (the
// expert's biases, GPT-OSS; b0 and b1 this expert's, by weight row): GATED, gate + b0[i] and up +
// b1[i] before the activation; otherwise Y + b0[i]. WIDE: a thread's two words of a token row (columns
// c and c + 8) as one 8-byte store, side by side in the permuted H' as they are; in column order
// after pair_exchange. (The 4-byte stores wrote 14.4 L2 sectors each, four times their bytes,
// through the L1 data path the shared-memory pipe shares: Nsight Compute, Qwen3-30B-A3B, N = 8192.)
template <bool GATED, int NACC, int BN, bool PERM = true, bool CLAMP = true, bool WOI = false, bool BIAS = false,
          bool WIDE = true>
MOE_DEVICE void prefill_store(const float (&acc)[NACC][BN / 2], int it, int lane, int rows, int row0, int n_out,
                              void* __restrict__ out, int m = 0, const float* __restrict__ wrow = nullptr,
                              const float* __restrict__ b0 = nullptr, const float* __restrict__ b1 = nullptr) {
  if constexpr (GATED) {
    // The word of accumulators j, j + 1 (token n, n + 1 of weight row i): lanes 4 apart (rows i, i + 1
    // of tokens n, n + 1) swap one activation, so that each holds one token's two adjacent columns,
    // adjacent at their permuted places too.
    auto word_of = [&](int j) -> u32 {
      const int i = it * 16 + (lane >> 2) + 8 * ((j >> 1) & 1), n = (j >> 2) * 8 + 2 * (lane & 3);
      float h[2];
      const float bg = BIAS && i < n_out ? b0[i] : 0.0f, bu = BIAS && i < n_out ? b1[i] : 0.0f;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const float wt = WOI && n + t < rows ? wrow[row0 + n + t] : 1.0f;
        const float g = BIAS ? acc[0][j + t] + bg : acc[0][j + t];
        const float u = BIAS ? acc[NACC - 1][j + t] + bu : acc[NACC - 1][j + t];
        h[t] = silu_mul<CLAMP>(WOI ? g * wt : g, WOI ? u * wt : u);
      }
      const bool odd = (lane >> 2) & 1;
      const float v = __shfl_xor_sync(0xffffffffu, odd ? h[0] : h[1], 4);
      return odd ? pack_bf16x2(v, h[1]) : pack_bf16x2(h[0], v);
    };
    const bool odd = (lane >> 2) & 1;
#pragma unroll
    for (int j = 0; j < BN / 2; j += 4) {  // accumulators j, j + 1 and j + 2, j + 3: columns col and col + 8
      const int t = (j >> 2) * 8 + 2 * (lane & 3) + (odd ? 1 : 0), col = it * 16 + (lane >> 2) - (odd ? 1 : 0);
      bf16_t* row = static_cast<bf16_t*>(out) + (size_t)(row0 + t) * n_out;
      const u32 w0 = word_of(j), w1 = word_of(j + 2);
      if constexpr (PERM) {  // columns c and c + 8 (c < 8 mod 16) of a 32-wide chunk lie 2 apart: one 8-byte store
        const int c = col & 31, at = (col & ~31) + 16 * ((c >> 2) & 1) + 8 * ((c >> 1) & 1) + 2 * (c >> 3);
#ifdef MOE_H_STORE32
        constexpr bool wide = false;  // (an A/B: 4-byte stores)
#else
        constexpr bool wide = WIDE;
#endif
        const bool ok = t < rows && col + 8 < n_out;  // (n_out, the layer's I, a multiple of 64: so is col < n_out)
        if constexpr (wide) {
          if (ok) *reinterpret_cast<uint2*>(row + at) = make_uint2(w0, w1);
        } else if (ok) {
          *reinterpret_cast<u32*>(row + at) = w0;
          *reinterpret_cast<u32*>(row + at + 2) = w1;
        }
      } else {  // (n_out a multiple of 64: the tile's 16 columns all in range, or none)
        u32 a = w0, b = w1;
        pair_exchange<WIDE>(a, b, lane);
        pair_store<WIDE>(row, col, a, b, lane, t < rows && col < n_out);
      }
    }
  } else {
    // The word of accumulators j, j + 1 of set m (weight row i, tokens n, n + 1): lanes 4 apart swap
    // one value, so that each holds one token's two adjacent columns.
    auto word_of = [&](int j) -> u32 {
      const int i = it * 16 + (lane >> 2) + 8 * ((j >> 1) & 1);
      const bool odd = (lane >> 2) & 1;
      const float bi = BIAS && i < n_out ? b0[i] : 0.0f;  // (both values are weight row i's)
      const float a0 = BIAS ? acc[m][j] + bi : acc[m][j], a1 = BIAS ? acc[m][j + 1] + bi : acc[m][j + 1];
      const float v = __shfl_xor_sync(0xffffffffu, odd ? a0 : a1, 4);
      return odd ? pack_bf16x2(v, a1) : pack_bf16x2(a0, v);
    };
    const bool odd = (lane >> 2) & 1;
    const int col = it * 16 + (lane >> 2) - (odd ? 1 : 0);
    u32 w[BN / 8][2];  // every exchange first, then the stores (no branch between two exchanges)
#pragma unroll
    for (int j = 0; j < BN / 2; j += 4) {  // accumulators j, j + 1 and j + 2, j + 3: columns col and col + 8
      w[j / 4][0] = word_of(j);
      w[j / 4][1] = word_of(j + 2);
      pair_exchange<WIDE>(w[j / 4][0], w[j / 4][1], lane);
    }
#pragma unroll
    for (int j = 0; j < BN / 2; j += 4) {
      const int t = (j >> 2) * 8 + 2 * (lane & 3) + (odd ? 1 : 0);
      pair_store<WIDE>(static_cast<bf16_t*>(out) + (size_t)(row0 + t) * n_out, col, w[j / 4][0], w[j / 4][1], lane,
                       t < rows && col < n_out);
    }
  }
}

namespace gg {
MOE_DEVICE void mbar_arrive(u32 addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr) : "memory");
}
MOE_DEVICE float2 lds64f(u32 addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 { %0, %1 }, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
// The barrier's phase also waits for `bytes` more of transactions (no arrival).
MOE_DEVICE void mbar_expect_tx(u32 addr, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(bytes) : "memory");
}
// Arrives on the barrier once every cp.async this thread issued before has landed.
MOE_DEVICE void cp_async_mbar_arrive(u32 addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(addr) : "memory");
}
}  // namespace gg

// One block: WARPS consumer warps (two warpgroups, a 16-row weight tile each warp) x BN token
// rows of one expert, and a producer warpgroup that fills an S-stage ring by cp.async, each stage
// announced by a `full` barrier (the producers' copies landed) and released by an `empty` one
// (every consumer thread arrives once its warpgroup's wgmmas on the stage completed, its own
// fragment reads before them; one arrival a warpgroup left racecheck without the order of the
// other threads' reads). The consumer warpgroups run on their own:
// one's wgmma overlaps the other's waits. Registers move from the producers to the consumers
// (setmaxnreg).
// GATED (gate/up): w is [E][row_tiles][K/32][2 (gate, up)][2 k-steps][32 lanes] 16-byte fragments,
// the tile's rows X'[tok[row0 + r]] (GATHER false: X'[row0 + r], the shared expert's);
// out is H' bf16 [P][n_out] (n_out = I), each row's I permuted in 32-wide chunks as permute_k
// does, ready to be the down GEMM's X'. Otherwise (down): w is the interleaved GEMV layout
// [E][row_tiles / MATS][K/32][MATS][2][32]; out is Y bf16 [P][n_out] (n_out = H).
// FP8 (block-scaled e4m3 weights, bf16 activations): w holds one 16-byte fragment per lane, matrix
// and chunk (both k-steps' codes: [..][K/32][MATS][32]), which become the two bf16 A fragments
// exactly in registers (e4m3x16_to_bf16; the same K order as BF16's, so X' is the same); sc are the
// fp32 scales of the 128 x 128 blocks, [matrix][E][n_out/128][K/128]. Each 128-wide K block's
// products go to their own accumulators (two k-tiles), which are then added to the sums times
// the block's scale in fp32, as the reference scales each block: a warpgroup's 64 rows share one.
// (FP8 activations, A8: prefill_gemm_a8 below.)
// PAIR (down, MATS 2): each warp takes a whole row group, its two 16-row tiles as gate/up's two
// matrices (the same layout a chunk), so a block covers 2 x WARPS tiles: twice the products for
// each token row B tile read.
// BULK (gate/up or PAIR): each warp's A run of a k-tile (A_WARP bytes, contiguous in the packed
// layout: BF16 4 KB, FP8 weight-only 2 KB, FP4 1 KB) by one bulk copy of the copy engine,
// instead of A_WARP / 16 cp.async of the producers.
// F4 (MOE_W_MXFP4 or MOE_W_NVFP4; gate/up or PAIR, BULK): e2m1 codes, a lane's 16 bytes of a chunk
// holding both matrices' (moegen.weights.pack_fp4), and per-row scales (MX: E8M0 per 32 K; NV: e4m3
// per 16 K, times each matrix's fp32 scale_2) in sc as the GEMV kernels read them: per 16-row tile
// (PAIR: row group) a record [K/32][2 matrices][MX 16 | NV 2 x 16 rows] bytes, NV then the two
// scale_2 in 16 bytes. Hopper's tensor cores take no FP4: each code times its row's scale becomes
// a bf16 A fragment exactly (e2m1 x E8M0 is a power-of-two multiple, e2m1 x e4m3 has at most 6
// significant bits; MX scales up to 2^125, which the packer checks), and the products run as
// BF16's on the same bf16 X'; NV's scale_2 multiplies the finished sums. The producers copy each
// k-tile's scales of every warp into the stage beside the codes.
template <bool GATED, int MATS, bool GATHER = GATED, bool FP8 = false, bool PAIR = false,
          bool BULK = false, int F4 = 0, bool WOI = false, bool BIAS = false, int BNT = 128, bool PT8 = false,
          bool STY = false>
MOE_DEVICE void prefill_gemm_w(const void* __restrict__ xp, const int* __restrict__ tok, const uint4* __restrict__ w,
                               const int* __restrict__ tiles, void* __restrict__ out, int n_out, int k_dim,
                               int row_tiles, int experts, int n, int topk, int extra,
                               const float* __restrict__ sc = nullptr, const float* __restrict__ xs = nullptr,
                               const float* __restrict__ wrow = nullptr, const float* __restrict__ bias0 = nullptr,
                               const float* __restrict__ bias1 = nullptr) {
  static_assert(!WOI || (GATED && GATHER), "WOI: the routed experts' gate/up GEMM");
  static_assert(!BIAS || (GATHER || !GATED), "BIAS: the routed experts' GEMMs (bias0, bias1: [E][n_out] fp32)");
  static_assert(!PAIR || (!GATED && MATS == 2), "PAIR: the down GEMM on row groups of two tiles");
  static_assert(!BULK || GATED || PAIR, "BULK: runs of two matrices a warp");
  static_assert(F4 == 0 || ((F4 == MOE_W_MXFP4 || F4 == MOE_W_NVFP4) && BULK && !FP8 && !PT8),
                "FP4 weights: MX or NV, runs of two matrices by bulk copies");
  // PT8 (FP8 per-tensor weights, the routed experts'): e4m3 codes as FP8 block's (C8: the same
  // copies and fragments), the products summed as BF16's over all of K and times the matrix's
  // weight_scale * input_scale at the end (sc: [E][MATS][2]; down [E][1][2]); the token rows
  // already quantized by that input scale (prefill_quant_tile_body), read in row order (GATHER false)
  static_assert(!PT8 || (!FP8 && !WOI && !BIAS && !GATHER), "PT8: FP8 per-tensor routed experts, rows in order");
  // STY (PAIR, persistent, two consumer warpgroups): each warpgroup's half of the block's Y tile (BN
  // token rows x its 4 row groups' 128 columns, bf16) staged in shared memory behind the ring, rows YS
  // = 272 bytes apart (the 8 rows of a stmatrix piece then in distinct banks), then each token row's
  // 256 bytes written by one bulk copy of the copy engine, issued by that row's thread of the
  // warpgroup. The two halves share one stage: warpgroup 1 stages its half once warpgroup 0's copies
  // have read theirs, and warpgroup 0 its next block's once warpgroup 1's have (named barriers 2 and
  // 3), so warpgroup 0 runs the next block's k-loop while warpgroup 1 stores, instead of both storing
  // 4-byte words to the token rows while the tensor cores idle. The ring's barriers lie in the stage's
  // row padding (16 bytes of each of the first S rows), so that four stages still fit.
  static_assert(!STY || (PAIR && 256 == 256), "STY: the down GEMM on row-group pairs, two consumer warpgroups");
  constexpr bool C8 = FP8 || PT8;
  // TWO: a warp's weights are two 16-row matrices side by side in every chunk (gate and up; or
  // PAIR, the two tiles of a down row group: the same layout), so the same copies and fragments
  constexpr bool TWO = GATED || PAIR;
  // FINE (BF16 weights, more than 128 tokens a tile): the A fragments a k-step at a time, two sets
  // of NACC registers instead of two k-tiles' (4 NACC), which leaves room for the wider tile's sums
#ifdef MOE_FINE_FRAGS
  constexpr bool FINE = !C8 && !F4;  // (a measurement: the k-step fragments at 128 tokens too)
#else
  constexpr bool FINE = !C8 && !F4 && BNT > 128;
#endif
  // a k-tile: 128 bytes of each token row (64 bf16 K); KBT k-tiles a 128-wide K block
  constexpr int BN = BNT, BK = 64, KBT = 2, S = GATED ? 4 : 4;
  constexpr int CONSUMERS = 256, WARPS = CONSUMERS / 32;
  static_assert(!BULK || WARPS % 4 == 0, "BULK: whole warp runs for each producer warp");
  constexpr int PT = 128;  // producer threads
  // 16-byte fragments per warp and k-tile: (chunk, [gate/up], k-step); FP8 (chunk, [gate/up]),
  // two chunks a k-tile
  constexpr int UNITS = (TWO ? 8 : 4) / (C8 ? 2 : F4 ? 4 : 1);
  // F4: each stage ends with each warp's row scales of the k-tile's two chunks (SCW bytes a warp: MX 2 x 32, NV 2 x 64)
  constexpr int SCC = F4 == MOE_W_NVFP4 ? 64 : 32, SCW = 2 * SCC;
  constexpr int B_BYTES = BN * 128, A_WARP = UNITS * 512, SC_BYTES = F4 ? 1024 : 0;
  static_assert(!F4 || 256 / 32 * SCW <= SC_BYTES, "FP4: every warp's scales in the stage");
  constexpr int STAGE = B_BYTES + WARPS * A_WARP + SC_BYTES;
  constexpr int BJ = BN * 8 / PT, AJ = WARPS * UNITS * 32 / PT, NACC = TWO ? 2 : 1;
  static_assert(BJ * PT == BN * 8 && AJ * PT == WARPS * UNITS * 32 && S >= 2 && (B_BYTES % 1024) == 0 &&
                (STAGE % 1024) == 0 && BN * 4 <= 1024 && (!STY || BN <= PT), "tile shape");
  constexpr size_t ROW_BYTES_PER_K = 2;
  extern __shared__ unsigned char smem_raw[];
  const u32 raw = (u32)__cvta_generic_to_shared(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  unsigned char* sbase = smem_raw + (base - raw);
  // S barriers each, 8 bytes a barrier (STY: in the padding of the staged Y rows 0 .. S - 1, 16-byte
  // aligned after the 1024-aligned ring)
  constexpr u32 YS = 272;  // STY: bytes between staged Y rows (128 columns and 16 of padding)
  const u32 ystage = base + S * STAGE;
  const u32 full = STY ? ystage + 256 : base + S * STAGE, empty = STY ? full + 8 : full + S * 8;
  constexpr u32 BSTEP = STY ? YS : 8;  // bytes from one stage's barrier to the next's
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s * BSTEP, PT);
      mbar_init(empty + s * BSTEP, CONSUMERS);  // every consumer thread, after its own reads of the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int kc = k_dim / 32, ktiles = k_dim / BK;
  const size_t REC = (size_t)kc * SCC + (F4 == MOE_W_NVFP4 ? 16 : 0);  // F4: bytes of a tile's scale record
  // The grid's blocks take the GEMM's blocks (row block, tile) in turn: one each with a grid of
  // them all, several with a persistent grid (one block a multiprocessor), the ring and its
  // barriers running on across them (gk counts this block's k-tiles), so that the producers fill
  // the next block's first stages while the consumers finish and store the last one's.
  // a warp's unit of rows: a 16-row tile, or (PAIR) a row group of two
  const int wtiles = PAIR ? row_tiles / 2 : row_tiles;
  const int rbs = (wtiles + WARPS - 1) / WARPS, n_tiles = (n * topk + BN - 1) / BN + extra, blocks = rbs * n_tiles;
  const int b0 = blockIdx.y * gridDim.x + blockIdx.x, grid = gridDim.x * gridDim.y;

  if (tid >= CONSUMERS) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    const int p = tid - CONSUMERS, pu = p >> 5, pl = p & 31;
    int gk = 0;
    for (int b = b0; b < blocks; b += grid) {
      const gg::TileRef blk = gg::gemm_tile(b, rbs, tiles, BN);
      const int e = blk.e, row0 = blk.row0, rows = blk.rows;
      if (rows <= 0) continue;  // past the routing's tiles
      const unsigned char* bsrc[BJ];  // the X' row of each B chunk this thread copies (rows past the tile: zero-filled)
      bool alive[BJ];
#pragma unroll
      for (int j = 0; j < BJ; ++j) {
        const int r = (p + j * PT) >> 3;
        alive[j] = r < rows;
        bsrc[j] = static_cast<const unsigned char*>(xp) +
                  (size_t)(alive[j] ? (GATHER ? tok[row0 + r] : row0 + r) : 0) * k_dim * ROW_BYTES_PER_K + (p & 7) * 16;
      }
      // A: lane-unit q = p + j * PT of a stage is warp q / (UNITS * 32)'s unit (q / 32) % UNITS,
      // lane q % 32: gated, warp j / 2, unit pu + 4 (j % 2); down, warp j, unit pu. Its source
      // moves by a fixed stride per k-tile, so every address is a base plus constants.
      static_assert(PT == 128 && WARPS % MATS == 0, "the producer's map of lane-units");
      const size_t wstride = TWO ? (size_t)kc * 128 : (size_t)kc * MATS * 64;  // a 16-row tile / row group's run
      const int wu = gg::row_unit(blk.rb, WARPS, wtiles);  // the block's first warp unit
      const uint4* abase = TWO ? w + ((size_t)e * wtiles + wu) * kc * 128 + pu * 32 + pl
                                 : w + ((size_t)e * (row_tiles / MATS) + wu / MATS) * kc * MATS * 64 +
                                       ((pu / 2) * MATS * 2 + pu % 2) * 32 + pl;
      const u32 adst = B_BYTES + pu * 512 + pl * 16;
      // BULK: producer warp pu's first warp run (warp pu's 16-row tile or row group, RUN uint4 over K)
      constexpr int AK = A_WARP / 16;  // uint4 of a warp's run of one k-tile
      const size_t RUN = (size_t)ktiles * AK;
      const uint4* arun = w + ((size_t)e * wtiles + wu + pu) * RUN;
      // F4: producer thread p < WARPS * SCW / 16 copies 16 bytes of warp p / (SCW / 16)'s scales of
      // each k-tile: its tile's (row group's) record, REC bytes, SCW of them a k-tile
      constexpr int SCT = WARPS * SCW / 16;
      const unsigned char* fsrc = reinterpret_cast<const unsigned char*>(sc) +
                                  ((size_t)e * wtiles + wu + p / (SCW / 16)) * REC + (p % (SCW / 16)) * 16;
      // FP8, a chunk's fragments of a tile (gated: 64, gate's lanes then up's) or a row group (MATS
      // x 32), a fragment per lane and matrix. Gated: lane-unit j is warp j, unit pu = (chunk pu / 2,
      // matrix pu % 2); down: warp 2j + pu / 2, chunk pu % 2 (its row group (warp / MATS), tile warp % MATS).
      const uint4* fbase = TWO ? w + ((size_t)e * wtiles + wu) * kc * 64 + (pu / 2) * 64 + (pu % 2) * 32 + pl
                                 : w + ((size_t)e * (row_tiles / MATS) + wu / MATS) * kc * MATS * 32 +
                                       (pu % 2) * MATS * 32 + pl;
      for (int kt = 0; kt < ktiles; ++kt, ++gk) {
        const int s = (int)((u32)gk % S);  // (unsigned: a mask and a shift)
        if (gk >= S) mbar_wait(empty + s * BSTEP, ((u32)gk / S - 1) & 1);
        unsigned char* st = sbase + s * STAGE;
#pragma unroll
        for (int j = 0; j < BJ; ++j)
          cp_async16(st + gg::swz128((p + j * PT) >> 3, p & 7), bsrc[j] + kt * 128, alive[j]);
        if constexpr (BULK) {  // lane 0 of producer warp pu: the runs of warps pu, pu + 4, ...
          if (p == 0) gg::mbar_expect_tx(full + s * BSTEP, WARPS * A_WARP);
          if (pl == 0) {
#pragma unroll
            for (int j = 0; j < WARPS / 4; ++j)
              bulk_copy(base + (u32)(s * STAGE + B_BYTES + (pu + 4 * j) * A_WARP),
                            arun + (size_t)j * 4 * RUN + (size_t)kt * AK, A_WARP, full + s * BSTEP);
          }
          if (F4 && p < SCT) cp_async16(st + B_BYTES + WARPS * A_WARP + p * 16, fsrc + (size_t)kt * SCW, true);
        } else if constexpr (C8) {
#pragma unroll
          for (int j = 0; j < AJ; ++j) {
            const int wq = TWO ? j : 2 * j + (pu >> 1);  // the warp whose fragment this is
            const uint4* a = TWO ? fbase + (size_t)j * kc * 64 + (size_t)kt * 128
                                   : fbase + (size_t)(wq / MATS) * kc * MATS * 32 + (wq % MATS) * 32 + (size_t)kt * MATS * 64;
            cp_async16(st + B_BYTES + wq * A_WARP + (TWO ? pu : (pu & 1)) * 512 + pl * 16, a, true);
          }
        } else {
#pragma unroll
          for (int j = 0; j < AJ; ++j) {
            const uint4* a = TWO ? abase + (j >> 1) * wstride + (j & 1) * 128 + (size_t)kt * 256
                                   : abase + (j / MATS) * wstride + (j % MATS) * 64 + (size_t)kt * MATS * 128;
            cp_async16(st + (TWO ? adst + (j >> 1) * A_WARP + (j & 1) * 2048 : adst + j * A_WARP), a, true);
          }
        }
        gg::cp_async_mbar_arrive(full + s * BSTEP);
      }
    }
    cp_async_wait<0>();
    return;
  }

  // (one consumer warpgroup: 240, the most a thread takes; two: 224, 2 x 128 x 224 + 128 x 56 of
  // the multiprocessor's 64K)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  const int warp = tid >> 5, lane = tid & 31;
  const u32 adst = B_BYTES + warp * A_WARP + lane * 16;
  float acc[NACC][BN / 2];  // each block's first wgmma overwrites them
#pragma unroll
  for (int a = 0; a < NACC; ++a)
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[a][i] = 0.0f;
  // BF16: matrix a's fragment of k-step kk (= 2 * chunk + s) in the stage at st
  auto frag_at = [&](u32 st, int a, int kk) -> uint4 {
    return gg::lds128(st + adst + (TWO ? (((kk >> 1) * 2 + a) * 2 + (kk & 1)) : kk) * 512);
  };
  // Two sets of A registers: k-tile g + 1's fragments load while k-tile g's wgmmas run.
  auto frags = [&](uint4 (&af)[NACC][4], int g) {
    mbar_wait(full + ((u32)g % S) * BSTEP, ((u32)g / S) & 1);
    gg::fence_async_smem();  // the producers' cp.async writes, seen by the tensor cores' reads
    const u32 st = base + ((u32)g % S) * STAGE;
    if constexpr (C8) {  // a chunk's codes (both k-steps) as its two bf16 fragments
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int a = 0; a < NACC; ++a)
          e4m3x16_to_bf16(gg::lds128(st + adst + (TWO ? c * 2 + a : c) * 512), af[a][2 * c], af[a][2 * c + 1]);
    } else if constexpr (F4) {  // a chunk's codes of both matrices, times rows g's and g + 8's scales
      const u32 scs = st + B_BYTES + WARPS * A_WARP + warp * SCW + (lane & 3) / 2 * (F4 == MOE_W_NVFP4 ? 16 : 0) + lane / 4;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint4 q = gg::lds128(st + adst + c * 512);  // matrix 0's k-steps in x, y; matrix 1's in z, w
#pragma unroll
        for (int a = 0; a < NACC; ++a) {
          const u32 at = scs + c * SCC + a * (SCC / 2);  // (MX [c][a][16 rows]; NV [c][a][2 blocks][16 rows])
          const uint2 sp = gg::fp4_scales<F4>(lds_u8(at), lds_u8(at + 8));
          af[a][2 * c] = gg::scale_rows(e2m1x8_to_bf16x8(a ? q.z : q.x), sp);
          af[a][2 * c + 1] = gg::scale_rows(e2m1x8_to_bf16x8(a ? q.w : q.y), sp);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int a = 0; a < NACC; ++a) af[a][kk] = frag_at(st, a, kk);
    }
  };
  // FINE: k-step kk's fragments of the stage at st; k-step 0's of the block's g-th k-tile, once its
  // stage has landed
  auto frag1 = [&](uint4 (&af)[NACC], u32 st, int kk) {
#pragma unroll
    for (int a = 0; a < NACC; ++a) af[a] = frag_at(st, a, kk);
  };
  auto frag1_first = [&](uint4 (&af)[NACC], int g) {
    mbar_wait(full + ((u32)g % S) * BSTEP, ((u32)g / S) & 1);
    gg::fence_async_smem();
    frag1(af, base + ((u32)g % S) * STAGE, 0);
  };
  // k-tile kt of the block, the block's gk-th: one wgmma group; then k-tile gk - 1's stage is
  // released (within the block: the last stage is released after the block's last group) and
  // the next k-tile's fragments loaded
  // FP8: the current 128-wide K block's products (each block's first wgmma overwrites them), and
  // the block scales of this warpgroup's rows: [matrix][E][n_out / 128][K / 128]
  constexpr int TACC = FP8 ? BN / 2 : 1;
  float tmp[NACC][TACC];
  const float* scw = nullptr;
  float scv[NACC];
  auto step = [&](int kt, int g, const uint4 (&cur)[NACC][4], uint4 (&nxt)[NACC][4]) {
    const u32 st = base + ((u32)g % S) * STAGE;
    // B's descriptor at the stage; a k-step's 32 bytes further add 2 to its address field (the
    // stage's shared address plus 96 stays within the field's 18 bits)
    const unsigned long long bd0 = gg::smem_desc(st);
    // the group's accumulators: the sums, or (FP8) the K block's own
    auto& d = [&]() -> float(&)[NACC][BN / 2] {
      if constexpr (FP8) return tmp; else return acc;
    }();
    const bool kb_first = kt % KBT == 0;  // the K block's first k-tile (FP8: its accumulators start)
    if (FP8 && kb_first) {  // this K block's scales, read while its k-tiles run
#pragma unroll
      for (int a = 0; a < NACC; ++a)
        scv[a] = __ldg(scw + (PAIR ? 0 : (size_t)a * experts * (n_out / 128) * (k_dim / 128)) + kt / KBT);
    }
    gg::wg_fence();
#pragma unroll
    for (int a = 0; a < NACC; ++a) gg::fence_regs(d[a]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const unsigned long long bd = bd0 + 2 * kk;
#pragma unroll
      for (int a = 0; a < NACC; ++a) {
        gg::wgmma_bf16_ra(d[a], cur[a][kk], bd, (FP8 ? !kb_first : kt > 0) || kk > 0);
      }
    }
    gg::wg_commit();
    gg::wg_wait<1>();  // group g - 1 is done: its A registers (nxt) and its stage are free
#pragma unroll
    for (int a = 0; a < NACC; ++a) gg::fence_regs(d[a]);
    if (kt > 0) gg::mbar_arrive(empty + ((u32)(g - 1) % S) * BSTEP);  // this thread is done with it
    if (kt + 1 < ktiles) frags(nxt, g + 1);  // the next k-tile's fragments while this group runs
    if constexpr (FP8) {
      if (kt % KBT == KBT - 1) {  // the K block's last k-tile: its products, scaled, into the sums
        gg::wg_wait<0>();
#pragma unroll
        for (int a = 0; a < NACC; ++a) gg::fence_regs(tmp[a]);
#pragma unroll
        for (int a = 0; a < NACC; ++a)
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) acc[a][i] += scv[a] * tmp[a][i];
      }
    }
  };
  int gk = 0;
  bool staged = false;  // STY: this thread's warpgroups have staged a half before
  for (int b = b0; b < blocks; b += grid) {
    const gg::TileRef blk = gg::gemm_tile(b, rbs, tiles, BN);
    const int row0 = blk.row0, rows = blk.rows;
    if (rows <= 0) continue;
    const int it = gg::row_unit(blk.rb, WARPS, wtiles) + warp;  // this warp's 16-row tile (PAIR: row group of two)
    if constexpr (FP8) {  // the block's sums start at zero (each K block's promotion adds to them)
#pragma unroll
      for (int a = 0; a < NACC; ++a)
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[a][i] = 0.0f;
    }
    if constexpr (FP8)  // the 128-row block of this warpgroup's 64 rows (PAIR: 128)
      scw = sc + ((size_t)blk.e * (n_out / 128) + (PAIR ? it / 4 : it / 8)) * (k_dim / 128);
    if constexpr (FINE) {
      // a k-step's fragments at a time (two sets): k-step j's wgmmas are one group, and once group
      // j - 1 is done its set takes k-step j + 1's
      uint4 f0[NACC], f1[NACC];
      frag1_first(f0, gk);
      for (int kt = 0; kt < ktiles; ++kt) {
        const int g = gk + kt;
        const u32 st = base + ((u32)g % S) * STAGE;
        const unsigned long long bd0 = gg::smem_desc(st);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint4 (&cur)[NACC] = kk % 2 ? f1 : f0;
          uint4 (&nxt)[NACC] = kk % 2 ? f0 : f1;
          gg::wg_fence();
#pragma unroll
          for (int a = 0; a < NACC; ++a) gg::fence_regs(acc[a]);
#pragma unroll
          for (int a = 0; a < NACC; ++a) gg::wgmma_bf16_ra(acc[a], cur[a], bd0 + 2 * kk, kt > 0 || kk > 0);
          gg::wg_commit();
          gg::wg_wait<1>();  // k-step j - 1's group is done: its fragment set is free (and at kk 0, the stage before)
#pragma unroll
          for (int a = 0; a < NACC; ++a) gg::fence_regs(acc[a]);
          if (kk == 0 && kt > 0) gg::mbar_arrive(empty + ((u32)(g - 1) % S) * BSTEP);
          if (kk < 3) frag1(nxt, st, kk + 1);
          else if (kt + 1 < ktiles) frag1_first(nxt, g + 1);
        }
      }
    } else {
      uint4 af0[NACC][4], af1[NACC][4];
      frags(af0, gk);
      for (int kt = 0; kt < ktiles; kt += 2) {
        step(kt, gk + kt, af0, af1);
        if (kt + 1 < ktiles) step(kt + 1, gk + kt + 1, af1, af0);
      }
    }
    gg::wg_wait<0>();
#pragma unroll
    for (int a = 0; a < NACC; ++a) gg::fence_regs(acc[a]);
    gk += ktiles;
    gg::mbar_arrive(empty + ((u32)(gk - 1) % S) * BSTEP);
    if constexpr (F4 == MOE_W_NVFP4) {  // the matrices' scale_2 (after the record's row scales)
      const float* s2 = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(sc) +
                                                       ((size_t)blk.e * wtiles + it + 1) * REC - 16);
#pragma unroll
      for (int a = 0; a < NACC; ++a) {
        const float f = __ldg(s2 + a);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[a][i] *= f;
      }
    }
    if constexpr (PT8) {  // the matrices' weight_scale * input_scale, the tile's expert's
      const float* m = sc + (size_t)blk.e * (GATED ? 4 : 2);
#pragma unroll
      for (int a = 0; a < NACC; ++a) {
        const float f = __ldg(m + (GATED ? 2 * a : 0)) * __ldg(m + (GATED ? 2 * a : 0) + 1);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[a][i] *= f;
      }
    }
    // BIAS: this tile's expert's biases
    const float* eb0 = BIAS ? bias0 + (size_t)blk.e * n_out : nullptr;
    const float* eb1 = BIAS && GATED ? bias1 + (size_t)blk.e * n_out : nullptr;
    if constexpr (STY) {  // this warpgroup's half of the Y tile into the stage, then a bulk copy a token row
      const int wg = warp >> 2, wt = tid & 127;
      const int c0 = (it - warp) * 32 + wg * 128;  // the half's first column
      if (wg == 1) asm volatile("bar.sync 2, 256;" ::: "memory");  // warpgroup 0's copies have read the stage
      else if (staged) asm volatile("bar.sync 3, 256;" ::: "memory");  // warpgroup 1's (the block before)
      // Each 8 x 8 piece of a tile's accumulators (8 weight rows = columns of Y, 8 tokens) stored
      // transposed (stmatrix .trans): token row r of the piece gets its 8 columns, 16 bytes. One
      // instruction takes four pieces, (rows 0-7, 8-15) x (tokens 16 p .. + 7, 16 p + 8 .. + 15); lane
      // l gives the address of row l % 8 of piece l / 8.
      const u32 y0 = ystage + ((lane >> 4) * 8 + (lane & 7)) * YS + (2 * (warp & 3) * 16 + 8 * ((lane >> 3) & 1)) * 2;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int i = (2 * it + m) * 16 + (lane >> 2);  // this thread's rows i, i + 8 (BIAS)
        const float b_lo = BIAS && i < n_out ? eb0[i] : 0.0f, b_hi = BIAS && i + 8 < n_out ? eb0[i + 8] : 0.0f;
#pragma unroll
        for (int p = 0; p < BN / 16; ++p) {
          const float* a = acc[m] + 8 * p;  // pieces' values: (row g, tokens 2t, 2t + 1), (row g + 8, ...) of two n8 blocks
          const u32 r0 = pack_bf16x2(a[0] + b_lo, a[1] + b_lo), r1 = pack_bf16x2(a[2] + b_hi, a[3] + b_hi);
          const u32 r2 = pack_bf16x2(a[4] + b_lo, a[5] + b_lo), r3 = pack_bf16x2(a[6] + b_hi, a[7] + b_hi);
          asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], { %1, %2, %3, %4 };"
                       ::"r"(y0 + (u32)(p * 16 * YS + m * 32)), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
        }
      }
      gg::fence_async_smem();  // the stage's writes, seen by the copy engine's reads
      if (wg == 0) asm volatile("bar.sync 4, 128;" ::: "memory");
      else asm volatile("bar.sync 5, 128;" ::: "memory");
      if (wt < rows) {
        bf16_t* dst = static_cast<bf16_t*>(out) + (size_t)(row0 + wt) * n_out + c0;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 256;" ::"l"(dst), "r"(ystage + wt * YS)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // it has read the stage
      }
      if (wg == 0) asm volatile("bar.arrive 2, 256;" ::: "memory");
      else asm volatile("bar.arrive 3, 256;" ::: "memory");
      staged = true;
    } else if constexpr (PAIR) {  // the group's two tiles
      // (past 128 tokens 4-byte words: the 8-byte ones' exchange spilled beside the wider sums)
      prefill_store<false, NACC, BN, true, true, false, BIAS, BN <= 128>(acc, 2 * it, lane, rows, row0, n_out, out, 0,
                                                                       nullptr, eb0);
      prefill_store<false, NACC, BN, true, true, false, BIAS, BN <= 128>(acc, 2 * it + 1, lane, rows, row0, n_out, out, 1,
                                                                       nullptr, eb0);
    } else {
      // (GATHER false: the shared expert's rows, every token in order)
      prefill_store<GATED, NACC, BN, true, GATHER || PT8 || ActRule::SHARED_LIMIT, WOI, BIAS>(acc, it, lane, rows, row0, n_out,
                                                                                       out, 0, wrow, eb0, eb1);
    }
  }
  if constexpr (STY) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // this thread's copies done
    if (staged && (tid >> 7) == 0) asm volatile("bar.sync 3, 256;" ::: "memory");  // warpgroup 1's last arrival
  }
}

// ---- FP8 activations (A8, DeepSeek's recipe): the operands swapped ----
namespace gg {
// d (64 tokens x 128 weight rows, fp32: this thread's 64) (+)= A (64 x 32 e4m3 codes, desc a) *
// B (32 x 128 e4m3 codes, desc b): QGMMA with both operands from shared memory
MOE_DEVICE void wgmma_e4m3_n128(float (&d)[64], unsigned long long a, unsigned long long b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 { %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 }, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])      : "l"(a), "l"(b), "r"(accumulate));
}
// wgmma matrix descriptor of a K-major operand of 8-row x 16-byte core matrices without swizzle:
// `lbo` bytes apart along K, `sbo` bytes apart along the rows
MOE_DEVICE unsigned long long core_desc(u32 addr, u32 lbo, u32 sbo) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}
// One box of a 5-dimensional tensor map (in global memory) to shared memory at coordinates c0..c4
// (innermost first), its bytes completing on the mbarrier
MOE_DEVICE void tensor_copy5(u32 dst, const void* map, int c0, int c1, int c2, int c3, int c4, u32 bar) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5, %6 }], [%7];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}
// One box of a 2-dimensional tensor map (a token rows' codes: K bytes, rows) to shared memory at
// (c0, c1), its bytes completing on the mbarrier; rows past the map's (c1 < 0 too) land as zeros
MOE_DEVICE void tensor_copy2(u32 dst, const void* map, int c0, int c1, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3 }], [%4];"
               ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
MOE_DEVICE float ldsf(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
}  // namespace gg


// The GEMMs on packed weights: the FP8-activation ones (A8: prefill_gemm_a8, its own layout and
// tile) or the others (prefill_gemm_w)
template <bool GATED, int MATS, bool GATHER = GATED, bool FP8 = false, bool A8 = false, bool PAIR = false,
          bool BULK = false, int F4 = 0, bool WOI = false, bool BIAS = false, int BNT = 128, bool PT8 = false,
          bool STY = false, bool XROWS = false, bool IDLE = false>
MOE_DEVICE void prefill_gemm(const void* __restrict__ xp, const int* __restrict__ tok, const uint4* __restrict__ w,
                             const int* __restrict__ tiles, void* __restrict__ out, int n_out, int k_dim,
                             int row_tiles, int experts, int n, int topk, int extra,
                             const float* __restrict__ sc = nullptr, const float* __restrict__ xs = nullptr,
                             const float* __restrict__ wrow = nullptr, const float* __restrict__ bias0 = nullptr,
                             const float* __restrict__ bias1 = nullptr, const void* __restrict__ tmap = nullptr,
                             const void* __restrict__ xmap = nullptr) {
  static_assert(!IDLE || (A8 && GATED), "IDLE: the FP8-activation gate/up GEMMs");
  if constexpr (A8) {
    static_assert(FP8 && BULK && !WOI && !BIAS && !PT8 && !STY && F4 == 0 && (GATED || PAIR) && (BNT == 64 || BNT == 128),
                  "FP8 activations: FP8 block weights, gate/up or the down GEMM on row-group pairs");
    // (BNT 128: the table cut at 128 rows, a block's warpgroups taking a tile's halves)
    static_assert(!A8, "FP8 activations: not rendered for this layer (grouped_args' a8)");
  } else {
    prefill_gemm_w<GATED, MATS, GATHER, FP8, PAIR, BULK, F4, WOI, BIAS, BNT, PT8, STY>(
        xp, tok, w, tiles, out, n_out, k_dim, row_tiles, experts, n, topk, extra, sc, xs, wrow, bias0, bias1);
  }
}


// ---- prefill token grouping (a stable counting sort by expert) and the weighted combine ----
// Entries i = t * top_k + j of the routing ids [n][top_k], in chunks of 1024 (one block each).
// Routed experts only: an id >= E (a zero expert) gets no row; the combine adds its weight * x.
// 1. per chunk, how many entries each expert has: counts[chunk][E]
MOE_DEVICE void prefill_count_body(const int* __restrict__ ids, int entries, int experts, int* __restrict__ counts) {
  __shared__ int cnt[512];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int i = blockIdx.x * 1024 + threadIdx.x;
  if (i < entries && ids[i] < experts) atomicAdd(&cnt[ids[i]], 1);  // integer counts: any order, one result
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[(size_t)blockIdx.x * experts + e] = cnt[e];
}
// Tile r of an expert's c tiles of bm rows (`rows` rows from row0 on, its first tile t0) into the
// tile table, with its group: the equal part of the expert's tiles that holds it, at most gmax
// tiles a part (the first parts a tile more than the others).
MOE_DEVICE void put_tile(int* __restrict__ tiles, int e, int row0, int rows, int bm, int t0, int r, int c, int gmax) {
  const int parts = (c + gmax - 1) / gmax, base = c / parts, big = c % parts, cut = big * (base + 1);
  const int g0 = r < cut ? r - r % (base + 1) : r - (r - cut) % base, size = r < cut ? base + 1 : base;
  int* t = tiles + (size_t)(t0 + r) * gg::TI;
  *reinterpret_cast<int4*>(t) = make_int4(e, row0 + r * bm, min(bm, rows - r * bm), (t0 + g0) | size << 16);
  *reinterpret_cast<int4*>(t + 4) = make_int4(row0 + g0 * bm, min(bm, rows - (g0 + size - 1) * bm), 0, 0);
}
// (entry t of no rows, past the routing's or the tokens' tiles, first row row0: a group of its own)
MOE_DEVICE void put_empty(int* __restrict__ tiles, int t, int row0, int rows) {
  *reinterpret_cast<int4*>(tiles + (size_t)t * gg::TI) = make_int4(0, row0, rows, t | 1 << 16);
  *reinterpret_cast<int4*>(tiles + (size_t)t * gg::TI + 4) = make_int4(row0, rows, 0, 0);
}
// The shared expert's groups (its table's tiles are all one expert's): at most this many tiles. On
// the H200 (2026-12-02, the same bits), DeepSeek-V3-FP8-a8 at N = 8192 (64 tiles): 10690.5 us as
// one group, 10608.6 in groups of 16; at N = 2048 3859.4 and 3853.7.
constexpr int SHARED_GROUP = 16;
// 2. one block: each expert's offset within every chunk (counts becomes that prefix), each
//    expert's first row (in expert order), and the tile table: (expert, first row, rows, group)
//    per tile of bm rows, then entries of no rows and a group of their own up to max_tiles so that
//    the GEMMs' extra blocks return (moegen.prefill.tile_table transcribes it).
// With a shared expert, also its tile table over all n tokens in order, in groups of at most
// SHARED_GROUP tiles: (0, first row, rows, ...), shared_max entries (the rows <= 0 past n).
MOE_DEVICE void prefill_scan_body(int* __restrict__ counts, int chunks, int experts, int bm, int max_tiles,
                                  int* __restrict__ first, int* __restrict__ tiles, int n_shared = 0,
                                  int* __restrict__ shared_tiles = nullptr, int shared_max = 0, int shared_bm = 0) {
  const int sbm = shared_bm ? shared_bm : bm;  // (the shared expert's tile, where its format's differs)
  const int s_used = (n_shared + sbm - 1) / sbm;
  for (int t = threadIdx.x; t < shared_max; t += blockDim.x) {
    if (t < s_used)
      put_tile(shared_tiles, 0, 0, n_shared, sbm, 0, t, s_used, SHARED_GROUP);
    else  // (rows <= 0 past n: their blocks return)
      put_empty(shared_tiles, t, t * sbm, n_shared - t * sbm);
  }
  __shared__ int2 wsum[32];
  __shared__ int tiles_used;
  // A thread an expert (experts <= 512 < blockDim.x): its chunks' counts become their
  // prefix, loaded 8 at a time (a store to counts may not move above the next loads, so one load
  // a trip would make the chunks' round trips serial).
  const int e = threadIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int run = 0;
  if (e < experts) {
    for (int c0 = 0; c0 < chunks; c0 += 8) {
      int v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = c0 + u < chunks ? counts[(size_t)(c0 + u) * experts + e] : 0;
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (c0 + u < chunks) {
          counts[(size_t)(c0 + u) * experts + e] = run;
          run += v[u];
        }
    }
  }
  const int nt = (run + bm - 1) / bm;
  // each expert's first row and first tile: exclusive sums of (run, nt) over the threads in
  // expert order (a warp's by shuffles, then the warps' totals by warp 0)
  int2 inc = make_int2(run, nt);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, inc.x, o), b = __shfl_up_sync(0xffffffffu, inc.y, o);
    if (lane >= o) inc = make_int2(inc.x + a, inc.y + b);
  }
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int2 w = lane < (int)(blockDim.x >> 5) ? wsum[lane] : make_int2(0, 0);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, w.x, o), b = __shfl_up_sync(0xffffffffu, w.y, o);
      if (lane >= o) w = make_int2(w.x + a, w.y + b);
    }
    wsum[lane] = w;  // the warps' inclusive sums
  }
  __syncthreads();
  const int2 base = warp ? wsum[warp - 1] : make_int2(0, 0);
  const int row0 = base.x + inc.x - run, t0 = base.y + inc.y - nt;  // the expert's first row and tile
  if (e < experts) first[e] = row0;
  if (e == experts - 1) {
    first[experts] = base.x + inc.x;
    tiles_used = base.y + inc.y;
  }
  __syncthreads();
  for (int t = tiles_used + threadIdx.x; t < max_tiles; t += blockDim.x) put_empty(tiles, t, 0, 0);
  const int gmax = (tiles_used + experts - 1) / experts + 2;  // (the groups' most tiles: two over the average)
  if (e < experts)
    for (int r = 0; r < nt; ++r) put_tile(tiles, e, row0, run, bm, t0, r, nt, gmax);
}
// 3. each entry's row: its expert's first row, + its expert's entries in earlier chunks, in
//    earlier warps of its chunk, in earlier lanes of its warp. tok[row] = its token, slot[entry] =
//    row (-1 for a zero expert).
// WOI: each row's routing weight too (wrow[row] = wts[entry]), for the gate/up epilogue.
template <bool WOI = false>
MOE_DEVICE void prefill_place_body(const int* __restrict__ ids, int entries, int experts, int top_k,
                                   const int* __restrict__ counts, const int* __restrict__ first,
                                   int* __restrict__ tok, int* __restrict__ slot,
                                   const float* __restrict__ wts = nullptr, float* __restrict__ wrow = nullptr) {
  __shared__ unsigned short wcnt[32][512];
  for (int k = threadIdx.x; k < 32 * experts; k += blockDim.x) wcnt[k / experts][k % experts] = 0;
  __syncthreads();
  const int i = blockIdx.x * 1024 + threadIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = i < entries ? ids[i] : -1;
  const bool routed = e >= 0 && e < experts;
  const unsigned same = __match_any_sync(0xffffffffu, routed ? e : -1);
  const int before_lane = __popc(same & ((1u << lane) - 1u));
  if (routed && before_lane == 0) wcnt[warp][e] = (unsigned short)__popc(same);
  __syncthreads();
  if (i < entries) {
    if (!routed) {
      slot[i] = -1;
      return;
    }
    int row = first[e] + counts[(size_t)blockIdx.x * experts + e] + before_lane;
    for (int w = 0; w < warp; ++w) row += wcnt[w][e];
    tok[row] = i / top_k;
    slot[i] = row;
    if constexpr (WOI) wrow[row] = wts[i];
  }
}
// out[t, c] = sum_j w[t, j] * (Y[slot[t, j], c], or x[t, c] for a zero expert), j in order, fp32,
// then + gate[t] * YS[t, c] with a shared expert (gate null: 1); Y, YS and out bf16. Four columns
// c .. c + 3 of token t a thread. WOI: the routed experts' weights are in Y already (1 here).
MOE_DEVICE void fma_bf16x4(float (&s)[4], float w, const bf16_t* __restrict__ p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  s[0] = fmaf(w, bf16_to_f32((bf16_t)(v.x & 0xffffu)), s[0]);
  s[1] = fmaf(w, bf16_to_f32((bf16_t)(v.x >> 16)), s[1]);
  s[2] = fmaf(w, bf16_to_f32((bf16_t)(v.y & 0xffffu)), s[2]);
  s[3] = fmaf(w, bf16_to_f32((bf16_t)(v.y >> 16)), s[3]);
}
template <bool WOI = false>
MOE_DEVICE void prefill_combine_body(const bf16_t* __restrict__ y, const int* __restrict__ slot,
                                     const float* __restrict__ wts, const bf16_t* __restrict__ x,
                                     bf16_t* __restrict__ out, int hidden, int top_k, int t, int c,
                                     const bf16_t* __restrict__ ys = nullptr, const float* __restrict__ gate = nullptr) {
  if (c >= hidden) return;
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = 0; j < top_k; ++j) {
    const int row = slot[t * top_k + j];
    fma_bf16x4(s, WOI && row >= 0 ? 1.0f : wts[t * top_k + j],
               row >= 0 ? y + (size_t)row * hidden + c : x + (size_t)t * hidden + c);
  }
  if (ys) fma_bf16x4(s, gate ? gate[t] : 1.0f, ys + (size_t)t * hidden + c);
  *reinterpret_cast<uint2*>(out + (size_t)t * hidden + c) = make_uint2(pack_bf16x2(s[0], s[1]), pack_bf16x2(s[2], s[3]));
}
// X' from X [n][hidden]: each 32-wide chunk in the GEMV tiles' K order (moegen.prefill.permute_k):
// position 16s + 8q + 2t + jj holds column 8t + 4s + 2q + jj. A thread moves pairs of columns
// (4-byte words), PERMUTE_UNROLL of them loaded before any is stored, grid-strided over the n x
// hidden / 2 pairs: the grid is a few blocks a multiprocessor, all resident at once, since in a
// layer the kernel waits for the router at its end (Kernel.dep "last") and a block that has done
// its share holds its place until then.
constexpr int PERMUTE_UNROLL = 4;
MOE_DEVICE void prefill_permute_body(const bf16_t* __restrict__ x, bf16_t* __restrict__ xp, int hidden, int n) {
  const unsigned pairs = (unsigned)hidden / 2, total = (unsigned)n * pairs;
  const unsigned stride = gridDim.x * gridDim.y * blockDim.x;
  for (unsigned i0 = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; i0 < total;
       i0 += PERMUTE_UNROLL * stride) {
    u32 v[PERMUTE_UNROLL];
#pragma unroll
    for (int u = 0; u < PERMUTE_UNROLL; ++u) {
      const unsigned i = i0 + u * stride, t = i / pairs, at = 2 * (i % pairs), c = at & 31;
      const unsigned col = (at & ~31u) + 8 * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1);
      if (i < total) v[u] = *reinterpret_cast<const u32*>(x + (size_t)t * hidden + col);
    }
#pragma unroll
    for (int u = 0; u < PERMUTE_UNROLL; ++u) {
      const unsigned i = i0 + u * stride;
      if (i < total) *reinterpret_cast<u32*>(xp + (size_t)(i / pairs) * hidden + 2 * (i % pairs)) = v[u];
    }
  }
}
// FP8 per-tensor weights (PT8): the rows of routed tile `tile` quantized by its expert's static input
// scale (sc[e * stride + 1]: gate's, equal to up's, which the loader checks; down's), e4m3(v / s)
// saturating, held in bf16 exactly: PERM, X' rows from x through tok in the packed K order (as
// prefill_permute_body), dst [rows][k] in row order; otherwise H' rows in place. Columns 2 pair,
// 2 pair + 1 of every row of the tile a thread.
template <bool PERM>
MOE_DEVICE void prefill_quant_tile_body(const bf16_t* src, const int* __restrict__ tok, const int* __restrict__ tiles,
                                        const float* __restrict__ sc, int stride, bf16_t* dst, int k, int tile,
                                        int pair) {
  const int rows = tiles[tile * gg::TI + 2];
  if (2 * pair >= k || rows <= 0) return;
  const int e = tiles[tile * gg::TI], row0 = tiles[tile * gg::TI + 1], at = 2 * pair;
  const float s = __ldg(sc + (size_t)e * stride + 1);
  const int c = at & 31;
  const int col = PERM ? (at & ~31) + 8 * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1) : at;
  for (int r = 0; r < rows; ++r) {
    const int row = row0 + r;
    const u32 v = *reinterpret_cast<const u32*>(src + (size_t)(PERM ? tok[row] : row) * k + col);
    *reinterpret_cast<u32*>(dst + (size_t)row * k + at) = quant_e4m3x2(v, s);
  }
}
// FP8 activations (A8): rows of src (bf16, in column order) as e4m3 codes in A8_ORDER, with their
// scales [k / 128][rows]: s = max(amax, 1e-4) / 448 in fp32 and the codes e4m3(v / s), as the
// decode path quantizes (DeepSeek's act_quant). A warp per (row, 128 channels), grid-strided, QUANT_UNROLL
// of them at once, their loads first (one 8-byte load a lane in flight left the stream at about a
// quarter of the memory's rate); lane l writes the block's logical positions 4l .. 4l + 3: chunk l / 8,
// columns 8 (l % 4) + 4 ((l / 4) % 2) + 0, 2, 1, 3 of it (logical 4t + b is column 8t + (0, 2, 1, 3)[b],
// 16 + 4t + b column 8t + 4 + the same). With slot, each row's codes and scale also go to its choices'
// rows (slot [rows][top_k], -1: none; top_k <= 32, lane j reads choice j's row) of qr and sr.
constexpr int QUANT_UNROLL = 4;
MOE_DEVICE void prefill_quant_rows(const bf16_t* __restrict__ src, unsigned char* __restrict__ q, float* __restrict__ s,
                                   int k, int rows, int first_warp, int warps, const int* __restrict__ slot = nullptr,
                                   unsigned char* __restrict__ qr = nullptr, float* __restrict__ sr = nullptr,
                                   int top_k = 0) {
  const int lane = threadIdx.x & 31, kb_count = k / 128, units = rows * kb_count;
  const int col = (lane >> 3) * 32 + 8 * (lane & 3) + 4 * ((lane >> 2) & 1);
  for (int w0 = first_warp; w0 < units; w0 += QUANT_UNROLL * warps) {
    uint2 v[QUANT_UNROLL];
    int mine[QUANT_UNROLL];  // (the row's choice `lane`'s row of the tile table)
#pragma unroll
    for (int u = 0; u < QUANT_UNROLL; ++u) {  // (w: the same for the warp's lanes)
      const int w = w0 + u * warps, row = w / kb_count, kb = w % kb_count;
      if (w < units) v[u] = *reinterpret_cast<const uint2*>(src + (size_t)row * k + kb * 128 + col);
      mine[u] = w < units && lane < top_k ? __ldg(slot + (size_t)row * top_k + lane) : -1;
    }
#pragma unroll
    for (int u = 0; u < QUANT_UNROLL; ++u) {
      const int w = w0 + u * warps, row = w / kb_count, kb = w % kb_count;
      if (w >= units) break;
      const float sc = group_scale_e4m3(v[u]);
      // (bytes: columns col, col + 2, col + 1, col + 3)
      const u32 codes = prmt(e4m3x2_codes(v[u].x, sc) | (e4m3x2_codes(v[u].y, sc) << 16), 0u, 0x3120u);
      if (q) {
        *reinterpret_cast<u32*>(q + (size_t)row * k + kb * 128 + 4 * lane) = codes;
        if (lane == 0) s[(size_t)kb * rows + row] = sc;  // [k / 128][rows]: a tile's rows side by side
      }
      for (int j = 0; j < top_k; ++j) {
        const int r = __shfl_sync(0xffffffffu, mine[u], j);
        if (r < 0) continue;
        *reinterpret_cast<u32*>(qr + (size_t)r * k + kb * 128 + 4 * lane) = codes;
        if (lane == 0) sr[(size_t)kb * rows * top_k + r] = sc;
      }
    }
  }
}
// FP8 activations with x's codes a row per (token, choice) (XROWS: the routed gate/up GEMM reads
// them in the tile table's order, by tensor copies, rather than gathering each token's row): x's n
// rows as prefill_quant_rows quantizes them, each token's codes and scale written at its choices'
// rows (slot; -1: a choice with no row here), qr [rows][k] and sr [k / 128][n * top_k]; q and s,
// per token, only where a shared expert reads them (q null: none).
MOE_DEVICE void prefill_quant_x_rows_body(const bf16_t* __restrict__ src, unsigned char* __restrict__ q,
                                          float* __restrict__ s, const int* __restrict__ slot,
                                          unsigned char* __restrict__ qr, float* __restrict__ sr, int k, int n,
                                          int top_k) {
  const int first = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), warps = gridDim.x * (blockDim.x >> 5);
  prefill_quant_rows(src, q, s, k, n, first, warps, slot, qr, sr, top_k);
}
// x for the gate/up GEMMs (src2 null), or the routed activations and the shared expert's (src2).
MOE_DEVICE void prefill_quant_body(const bf16_t* __restrict__ src, unsigned char* __restrict__ q, float* __restrict__ s,
                                   int k, int rows, const bf16_t* __restrict__ src2 = nullptr,
                                   unsigned char* __restrict__ q2 = nullptr, float* __restrict__ s2 = nullptr, int k2 = 0,
                                   int rows2 = 0) {
  const int first = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), warps = gridDim.x * (blockDim.x >> 5);
  prefill_quant_rows(src, q, s, k, rows, first, warps);
  if (src2) prefill_quant_rows(src2, q2, s2, k2, rows2, first, warps);
}

// ---- the plan's invariants, re-checked by the compiler ----
static_assert(2048 % 32 == 0, "hidden size: whole 32-wide K chunks and down row groups");
static_assert(768 % 32 == 0, "expert width: whole 16-row tiles and 32-wide K chunks");
static_assert(0 % 32 == 0, "shared expert width: whole tiles and chunks");
static_assert(128 % 16 == 0 && 128 >= 128, "router rows padded to whole tiles");
static_assert((2048 / 32) % 16 == 0 && (2048 / 32) / 16 >= 4, "router K split into whole chunks");
static_assert(8 <= 32, "route: one choice per lane");

// ---- kernels of this layer ----
// The kernels are compiled as 2 programs at once (MOE_PART = 0 .. 1: each
// holds the kernels of its part); without MOE_PART the file compiles every kernel.
// weight packing into the tile layout, matrices side by side or interleaved (runs once, at load)
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(256) moe_pack_tiles_sm_90a(const bf16_t* __restrict__ src0, const bf16_t* __restrict__ src1, uint4* __restrict__ dst, int experts, int rows, int rows_pad, int k, int mats, int interleave) {
  pack_body(src0, src1, dst, experts, rows, rows_pad, k, mats, interleave);
}
#endif
// route: softmax over 128 experts (fp32 logits) -> top-8 -> renormalize; one token per warp, the last block groups the tokens by expert up to N = 415
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(256) moe_route_e128_k8_softmax_scores_renorm_fp32_n16384_g415_sm_90a(const float* __restrict__ logits, int* route_cnt, int* route_done, const float* __restrict__ corr_bias, const float* __restrict__ router_bias, int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ pair_pos, float* __restrict__ gate_s, int* __restrict__ num_slots, int* __restrict__ slot_expert, int* __restrict__ slot_begin, int* __restrict__ slot_token, int n) {
  route_kernel_body<128, 128, 8, 1, 16384, false, 256, 415>(logits, route_cnt, route_done, corr_bias, router_bias, topk_ids, topk_w, pair_pos, gate_s, num_slots, slot_expert, slot_begin, slot_token, n);
}
#endif
// one token in one launch: router (8 tiles x 4 parts), route in every block, gate/up (8 x 48 tiles), down from shared memory (16 rows a block) + weighted sum; tagged words
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(512, 1) moe_single_e128_h2048_i768_k8_ks4_n16384_e128_k8_softmax_scores_renorm_fp32_silu_gated_t2_u3_ov_late_mxfp4_sm_90a(const uint4* __restrict__ wr, const uint4* __restrict__ w13, const uint4* __restrict__ ws13, const uint4* __restrict__ w2, const uint4* __restrict__ ws2, const float* __restrict__ s13, const float* __restrict__ ss13, const float* __restrict__ s2, const float* __restrict__ ss2, const bf16_t* __restrict__ xr, const bf16_t* __restrict__ x, float* logits, unsigned* gbar, const float* __restrict__ corr_bias, const float* __restrict__ router_bias, int* __restrict__ topk_ids, float* __restrict__ topk_w, bf16_t* act, bf16_t* act_s, bf16_t* __restrict__ out, unsigned long long* tl, u32* tact, u32* epoch, unsigned long long* spart, const void* tmaps) {
  single_body<64, 24, 0, 48, 0, 768, 0, 2048, 128, 8, 128, 4, 16384, 2, false, 16, 3, 8, true, MOE_W_MXFP4, true, false, true, 0, 1, false>(wr, w13, ws13, w2, ws2, s13, ss13, s2, ss2, xr, x, logits, gbar, corr_bias, router_bias, topk_ids, topk_w, act, act_s, out, tl, tact, epoch, spart, tmaps);
}
#endif
// router: 128 rows x 2048, K split 16 ways, 8 tokens per pass; the last block routes
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(128) moe_router_r128_h2048_ks16_nt1_n16384_route_e128_k8_softmax_scores_renorm_fp32_bf16_sm_90a(const uint4* __restrict__ wr, const bf16_t* __restrict__ x, float* logits, int* route_done, const float* __restrict__ corr_bias, const float* __restrict__ router_bias, int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ pair_pos, float* __restrict__ gate_s, int* __restrict__ num_slots, int* __restrict__ slot_expert, int* __restrict__ slot_begin, int* __restrict__ slot_token, int n) {
  router_logits_body<64, 1, 4, 8, 16, 128, 16384, true, 128, 8, false>(wr, x, logits, route_done, corr_bias, router_bias, topk_ids, topk_w, pair_pos, gate_s, num_slots, slot_expert, slot_begin, slot_token, n);
}
#endif
// gate/up + silu_gated: expert slots x 48 tiles
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(128) moe_gate_up_e128_h2048_i768_nt1_mxfp4_silu_gated_sm_90a(const uint4* __restrict__ w13, const uint4* __restrict__ ws13, const float* __restrict__ s13, const float* __restrict__ ss13, const bf16_t* __restrict__ x, const int* __restrict__ num_slots, const int* __restrict__ slot_expert, const int* __restrict__ slot_begin, const int* __restrict__ slot_token, bf16_t* __restrict__ act, bf16_t* __restrict__ act_s, int n) {
  gate_up_body<64, 1, 1, 4, 8, 8, 48, 0, 768, 1, MOE_W_MXFP4, MOE_W_BF16, 128>(w13, ws13, s13, ss13, x, num_slots, slot_expert, slot_begin, slot_token, act, act_s, n);
}
#endif
// down: expert slots x 128 tiles of 768; the last block of each tile writes the weighted sum
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(128) moe_down_e128_h2048_i768_k8_nt1_mxfp4_sm_90a(const uint4* __restrict__ w2, const uint4* __restrict__ ws2, const float* __restrict__ s2, const float* __restrict__ ss2, const bf16_t* __restrict__ act, const bf16_t* __restrict__ act_s, const int* __restrict__ num_slots, const int* __restrict__ slot_expert, const int* __restrict__ slot_begin, float* y, float* ys, const float* __restrict__ topk_w, const int* __restrict__ pair_pos, const float* __restrict__ gate_s, int* tile_done, bf16_t* __restrict__ out, int n) {
  down_body<24, 0, 1, 1, 4, 8, 8, 2, 64, 2048, 8, false, MOE_W_MXFP4, MOE_W_BF16, 128, false>(w2, ws2, s2, ss2, act, act_s, num_slots, slot_expert, slot_begin, y, ys, topk_w, pair_pos, gate_s, tile_done, out, n);
}
#endif
// router: 128 rows x 2048, K split 16 ways, 32 tokens per pass; each tile's last block adds its partials
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(128) moe_router_r128_h2048_ks16_nt4_n16384_bf16_sm_90a(const uint4* __restrict__ wr, const bf16_t* __restrict__ x, float* logits, int* route_done, const float* __restrict__ corr_bias, const float* __restrict__ router_bias, int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ pair_pos, float* __restrict__ gate_s, int* __restrict__ num_slots, int* __restrict__ slot_expert, int* __restrict__ slot_begin, int* __restrict__ slot_token, int n) {
  router_logits_body<64, 4, 4, 4, 16, 128, 16384, false, 1, 1, false>(wr, x, logits, route_done, corr_bias, router_bias, topk_ids, topk_w, pair_pos, gate_s, num_slots, slot_expert, slot_begin, slot_token, n);
}
#endif
// gate/up + silu_gated: expert slots x 48 tiles
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(128) moe_gate_up_e128_h2048_i768_nt2_mxfp4_silu_gated_sm_90a(const uint4* __restrict__ w13, const uint4* __restrict__ ws13, const float* __restrict__ s13, const float* __restrict__ ss13, const bf16_t* __restrict__ x, const int* __restrict__ num_slots, const int* __restrict__ slot_expert, const int* __restrict__ slot_begin, const int* __restrict__ slot_token, bf16_t* __restrict__ act, bf16_t* __restrict__ act_s, int n) {
  gate_up_body<64, 2, 2, 4, 7, 7, 48, 0, 768, 1, MOE_W_MXFP4, MOE_W_BF16, 128>(w13, ws13, s13, ss13, x, num_slots, slot_expert, slot_begin, slot_token, act, act_s, n);
}
#endif
// down: expert slots x 128 tiles of 768; the last block of each tile writes the weighted sum
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(128) moe_down_e128_h2048_i768_k8_nt2_mxfp4_sm_90a(const uint4* __restrict__ w2, const uint4* __restrict__ ws2, const float* __restrict__ s2, const float* __restrict__ ss2, const bf16_t* __restrict__ act, const bf16_t* __restrict__ act_s, const int* __restrict__ num_slots, const int* __restrict__ slot_expert, const int* __restrict__ slot_begin, float* y, float* ys, const float* __restrict__ topk_w, const int* __restrict__ pair_pos, const float* __restrict__ gate_s, int* tile_done, bf16_t* __restrict__ out, int n) {
  down_body<24, 0, 2, 2, 4, 7, 7, 2, 64, 2048, 8, false, MOE_W_MXFP4, MOE_W_BF16, 128, false>(w2, ws2, s2, ss2, act, act_s, num_slots, slot_expert, slot_begin, y, ys, topk_w, pair_pos, gate_s, tile_done, out, n);
}
#endif
// gate/up + silu_gated: expert slots x 48 tiles
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(128) moe_gate_up_e128_h2048_i768_nt4_mxfp4_silu_gated_sm_90a(const uint4* __restrict__ w13, const uint4* __restrict__ ws13, const float* __restrict__ s13, const float* __restrict__ ss13, const bf16_t* __restrict__ x, const int* __restrict__ num_slots, const int* __restrict__ slot_expert, const int* __restrict__ slot_begin, const int* __restrict__ slot_token, bf16_t* __restrict__ act, bf16_t* __restrict__ act_s, int n) {
  gate_up_body<64, 4, 4, 4, 4, 4, 48, 0, 768, 1, MOE_W_MXFP4, MOE_W_BF16, 128>(w13, ws13, s13, ss13, x, num_slots, slot_expert, slot_begin, slot_token, act, act_s, n);
}
#endif
// down: expert slots x 128 tiles of 768; the last block of each tile writes the weighted sum
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(128) moe_down_e128_h2048_i768_k8_nt4_mxfp4_sm_90a(const uint4* __restrict__ w2, const uint4* __restrict__ ws2, const float* __restrict__ s2, const float* __restrict__ ss2, const bf16_t* __restrict__ act, const bf16_t* __restrict__ act_s, const int* __restrict__ num_slots, const int* __restrict__ slot_expert, const int* __restrict__ slot_begin, float* y, float* ys, const float* __restrict__ topk_w, const int* __restrict__ pair_pos, const float* __restrict__ gate_s, int* tile_done, bf16_t* __restrict__ out, int n) {
  down_body<24, 0, 4, 4, 4, 4, 4, 2, 64, 2048, 8, false, MOE_W_MXFP4, MOE_W_BF16, 128, false>(w2, ws2, s2, ss2, act, act_s, num_slots, slot_expert, slot_begin, y, ys, topk_w, pair_pos, gate_s, tile_done, out, n);
}
#endif
// prefill: X' (each 32-wide K chunk in the packed tiles' order)
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(256) moe_prefill_permute_h2048_sm_90a(const bf16_t* __restrict__ x, bf16_t* __restrict__ xp, int n) {
  grid_dep_launch();
  prefill_permute_body(x, xp, 2048, n);
  grid_dep_wait();
}
#endif
// prefill: entries per expert in each chunk of 1024 (token, choice) entries
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(1024) moe_prefill_count_e128_k8_sm_90a(const int* __restrict__ ids, int* __restrict__ counts, int n) {
  grid_dep_wait();
  grid_dep_launch();
  prefill_count_body(ids, n * 8, 128, counts);
}
#endif
// prefill: each expert's first row and the tile table (128 token rows a tile)
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(1024) moe_prefill_scan_e128_k8_r128_n16384_sm_90a(int* __restrict__ counts, int* __restrict__ first, int* __restrict__ tiles, int n) {
  grid_dep_wait();
  grid_dep_launch();
  prefill_scan_body(counts, (n * 8 + 1023) / 1024, 128, 128, 1152, first, tiles);
}
#endif
// prefill: each (token, choice) entry's row, grouped by expert in a stable order
#if !defined(MOE_PART) || MOE_PART == 0
extern "C" __global__ void __launch_bounds__(1024) moe_prefill_place_e128_k8_sm_90a(const int* __restrict__ ids, int* __restrict__ counts, int* __restrict__ first, int* __restrict__ tok, int* __restrict__ slot, int n) {
  grid_dep_wait();
  grid_dep_launch();
  prefill_place_body(ids, n * 8, 128, 8, counts, first, tok, slot);
}
#endif
// prefill: H' = silu(X' Wg) * (X' Wu) per expert, wgmma (register A) on the packed tiles, 8 16-row tiles x 128 tokens a block
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(384) moe_prefill_gate_up_e128_k8_h2048_i768_bm128_bn128_s4_ws_bulk_mxfp4_silu_gated_sm_90a(const bf16_t* __restrict__ xp, int* __restrict__ tok, const uint4* __restrict__ w13, int* __restrict__ tiles, bf16_t* __restrict__ h, int n, const float* __restrict__ s13) {
  prefill_gemm<true, 2, true, false, false, false, true, MOE_W_MXFP4>(xp, tok, w13, tiles, h, 768, 2048, 48, 128, n, 8, 128, s13);
}
#endif
// prefill: Y = H' Wd per expert (bf16), 8 16-row tiles x 128 tokens a block
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(384) moe_prefill_down_e128_k8_h2048_i768_bm128_bn128_s4_ws_pair_bulk_sy_m2_mxfp4_sm_90a(const bf16_t* __restrict__ hp, const uint4* __restrict__ w2, int* __restrict__ tiles, bf16_t* __restrict__ y, int n, const float* __restrict__ s2) {
  prefill_gemm<false, 2, false, false, false, true, true, MOE_W_MXFP4, false, false, 128, false, true>(hp, nullptr, w2, tiles, y, 2048, 768, 128, 128, n, 8, 128, s2);
}
#endif
// prefill: out = sum_j w[t, j] * Y[row(t, j)] (zero experts: w * x), choices in order
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(256) moe_prefill_combine_h2048_k8_sm_90a(const bf16_t* __restrict__ y, int* __restrict__ slot, const float* __restrict__ wts, const bf16_t* __restrict__ x, bf16_t* __restrict__ out) {
  prefill_combine_body(y, slot, wts, x, out, 2048, 8, blockIdx.x, (blockIdx.y * 256 + threadIdx.x) * 4);
}
#endif
// router: 128 rows x 2048, K split 1 ways, 32 tokens per pass, 4 row tiles a block
#if !defined(MOE_PART) || MOE_PART == 1
extern "C" __global__ void __launch_bounds__(128) moe_router_r128_h2048_ks1_nt4_rt4_n16384_bf16_sm_90a(const uint4* __restrict__ wr, const bf16_t* __restrict__ x, float* logits, int* route_done, const float* __restrict__ corr_bias, const float* __restrict__ router_bias, int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ pair_pos, float* __restrict__ gate_s, int* __restrict__ num_slots, int* __restrict__ slot_expert, int* __restrict__ slot_begin, int* __restrict__ slot_token, int n) {
  router_logits_body<64, 4, 4, 2, 1, 128, 16384, false, 1, 1, false, 4>(wr, x, logits, route_done, corr_bias, router_bias, topk_ids, topk_w, pair_pos, gate_s, num_slots, slot_expert, slot_begin, slot_token, n);
}
#endif
